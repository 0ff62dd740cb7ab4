"""ZB-V and DualPipeV (two stages per rank in a V) against the unsplit model, float64,
K = 1..4.

Rank r of K holds stages r and 2K-1-r of a model cut into 2K stages: the
activations turn round on rank K-1 without a message, and rank 0 holds both
ends. The reference is the unsplit model run by one process on the same
micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import test_pipeline_interleaved as il
import torch

from mpiring.parallel.pipeline import (
    PipelineSchedule,
    PipelineStage,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
    build,
    dump_csv,
    load_csv,
)
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import split_gpt


def v_stages(comm, full):
    """This rank's two stages (copies) of ``full`` cut into 2K, and their slices."""
    n = 2 * comm.size
    cuts = il.bounds(len(full), n)
    mine = [comm.rank, n - 1 - comm.rank]
    parts = [copy.deepcopy(full[slice(*cuts[s])]) for s in mine]
    stages = [PipelineStage(part, s, n, comm) for part, s in zip(parts, mine)]
    return stages, [full[slice(*cuts[s])] for s in mine]


def _free_stages(stages) -> None:
    for st in stages:
        st.free()


def _free(sched, stages) -> None:
    sched.free()
    _free_stages(stages)


@pytest.mark.parametrize("m", (1, 3, 8))  # fewer than the ranks, odd, and more than 2K
def test_zbv_matches_unsplit_model(comm, m):
    full = il.mlp()
    stages, refs = v_stages(comm, full)
    # Rank 0 holds both ends: the input, the loss and the merged output.
    assert (stages[0].is_first, stages[-1].is_last) == (comm.rank == 0, comm.rank == 0)
    sched = ScheduleZBVZeroBubble(stages, m, il.mse)
    assert {a.kind for a in sched.actions[comm.rank]} >= {"F", "B", "W"}
    il.against_the_unsplit_model(sched, stages, refs, full, m)


@pytest.mark.parametrize("extra", (0, 1))  # m = 2K, the least it runs, and 2K + 1 (odd)
def test_dualpipev_matches_unsplit_model(comm, extra):
    m = 2 * comm.size + extra
    full = il.mlp()
    stages, refs = v_stages(comm, full)
    sched = ScheduleDualPipeV(stages, m, il.mse)
    # Split backwards in the warm-up and the cool-down, full ones in the steady state
    # (K = 1: no warm-up split, and one pair of the cool-down's): both kinds run here.
    prog = sched.actions[comm.rank]
    split = {(a.stage, a.mb) for a in prog if a.kind == "W"}
    full_b = [a for a in prog if a.kind == "B" and (a.stage, a.mb) not in split]
    assert split and full_b
    il.against_the_unsplit_model(sched, stages, refs, full, m)


def test_dualpipev_needs_2k_micro_batches_on_every_rank(comm):
    full = il.mlp()
    stages, _ = v_stages(comm, full)
    m = 2 * comm.size - 1
    with pytest.raises(ValueError, match=rf"DualPipeV needs at least one micro-batch per stage, "
                                         rf"2p = {2 * comm.size}, not n_microbatches={m}: give "
                                         "more micro-batches, or use zbv"):
        ScheduleDualPipeV(stages, m, il.mse)
    _free_stages(stages)


@pytest.mark.parametrize("cls", (ScheduleZBVZeroBubble, ScheduleDualPipeV))
def test_zbv_gpt_with_tied_embedding_and_clip(comm, cls):
    # The embedding (stage 0) and the head (stage 2K - 1) are both on rank 0: their
    # gradients are added there, with no pair to make; the clip counts the tie once.
    n = 2 * comm.size
    m = 4 if cls is ScheduleZBVZeroBubble else n
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=n - 1, n_heads=2)
    torch.manual_seed(3)
    full = GPT(cfg).double()
    stages = []
    for s in (comm.rank, n - 1 - comm.rank):
        module, tied = split_gpt(full, n, s)
        stages.append(PipelineStage(module, s, n, comm, tied_parameters=tied))
    sched = cls(stages, m, lm_loss)
    g = torch.Generator().manual_seed(9)
    for step in range(2):  # the second adds to the first (no zero_grad), on both models
        x, y = (torch.randint(0, 11, (9, 5), generator=g),
                torch.randint(0, 11, (9, 5), generator=g))
        ref_losses = il.reference(full, x, y, m, lm_loss, accumulate=step > 0)
        losses: list = []
        il.step(sched, stages, x, y, losses, accumulate=step > 0)
        if comm.rank == 0:
            assert [float(t) for t in losses] == pytest.approx(ref_losses, rel=1e-12)
            for w in (stages[0].module[0].tok.weight, stages[1].module[-1].head.weight):
                torch.testing.assert_close(w.grad, full.tok.weight.grad, rtol=1e-10, atol=1e-12,
                                           msg=lambda msg, s=step: f"after step {s + 1}: {msg}")
    want = torch.nn.utils.clip_grad_norm_(full.parameters(), 0.05)
    assert float(sched.clip_grad_norm_(0.05)) == pytest.approx(float(want), rel=1e-10)
    _free(sched, stages)


def test_a_loop_placement_is_refused_by_zbv_and_a_v_by_interleaved(comm):
    if comm.size == 1:
        pytest.skip("one rank: the loop and the V are the same stages, 0 and 1")
    full = il.mlp()
    loop, _ = il.local_stages(comm, full, 2)
    with pytest.raises(ValueError, match=r"rank \d holds stages \[\d, \d\]: give all of them"):
        ScheduleZBVZeroBubble(loop, 4, il.mse)
    _free_stages(loop)
    vee, _ = v_stages(comm, full)
    with pytest.raises(ValueError, match=r"rank \d holds stages \[\d, \d\]: give all of them"):
        ScheduleInterleaved1F1B(vee, 4, il.mse)
    _free_stages(vee)


def test_a_schedule_without_a_program_names_the_fix(comm):
    # torch's base class names map to PipelineSchedule (get_schedule_class): it runs
    # what it is given, and says so when it is given nothing.
    from mpiring.parallel.pipeline import get_schedule_class

    full = il.mlp()
    stages, _ = v_stages(comm, full)
    with pytest.raises(ValueError, match=r"PipelineSchedule runs the program it is given: pass "
                                         r"actions= \(schedules.build, load_csv"):
        get_schedule_class("PipelineScheduleMulti")(stages, 4, il.mse, placement="v")
    _free_stages(stages)


def test_a_zbv_program_from_csv_runs_with_its_placement(comm, tmp_path):
    # A ZB-V program written out and read back (torch's CSV) runs as a custom schedule
    # once told its placement; with the default (the loop) the V's stages are refused.
    path = tmp_path / f"zbv{comm.rank}.csv"  # one file per rank: no rank reads a half-written one
    dump_csv(build("zbv", comm.size, 3, 2), path)
    full = il.mlp()
    stages, refs = v_stages(comm, full)
    sched = PipelineSchedule(stages, 3, il.mse, actions=load_csv(path), placement="v")
    il.against_the_unsplit_model(sched, stages, refs, full, 3)
    if comm.size > 1:
        stages, _ = v_stages(comm, full)
        with pytest.raises(ValueError, match=r"holds stages \[\d, \d\]: give all of them"):
            PipelineSchedule(stages, 3, il.mse, actions=load_csv(path))
        _free_stages(stages)
    with pytest.raises(ValueError, match="placement='x': use 'loop' or 'v'"):
        PipelineSchedule(stages, 3, il.mse, actions=load_csv(path), placement="x")
