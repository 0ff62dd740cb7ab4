"""Interleaved 1F1B and zero bubble, and looped BFS (several stages per rank) against the
unsplit model, float64, K = 1..4.

Rank r of K holds stages r, r + K, ... of a model cut into v * K stages; the
reference is the unsplit model run by one process on the same micro-batches.
"""

from __future__ import annotations

import copy

import pytest
import test_pipeline_runtime as runtime_tests
import torch
from torch import nn

from mpiring.parallel import clip
from mpiring.parallel.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZeroBubble,
)
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import split_gpt

ROWS = 10  # not a multiple of the micro-batch counts: uneven micro-batches


def mlp(seed: int = 0) -> nn.Sequential:
    # 16 modules: enough for 4 ranks x 3 stages.
    return runtime_tests.mlp(widths=(3, 7, 5, 6, 4, 5, 3, 6, 2), seed=seed)


bounds = runtime_tests.bounds


def data(salt: int = 0, cols=(3, 2)):
    g = torch.Generator().manual_seed(321 + salt)
    return (torch.randn(ROWS, cols[0], generator=g, dtype=torch.float64),
            torch.randn(ROWS, cols[1], generator=g, dtype=torch.float64))


def mse(out, t):
    return ((out - t) ** 2).mean()


def reference(full: nn.Module, x, y, m: int, loss_fn, accumulate: bool = False):
    if not accumulate:
        full.zero_grad()
    losses = [loss_fn(full(a), b) for a, b in zip(torch.tensor_split(x, m),
                                                  torch.tensor_split(y, m))]
    torch.stack(losses).mean().backward()
    return [v.item() for v in losses]


def local_stages(comm, full, v: int):
    """This rank's v stages (copies) of ``full`` cut into v * K, and their slices."""
    n = v * comm.size
    cuts = bounds(len(full), n)
    mine = list(range(comm.rank, n, comm.size))
    parts = [copy.deepcopy(full[slice(*cuts[s])]) for s in mine]
    stages = [PipelineStage(part, s, n, comm) for part, s in zip(parts, mine)]
    return stages, [full[slice(*cuts[s])] for s in mine]


def step(sched, stages, x, y, losses=None, accumulate: bool = False):
    for st in stages:
        if not accumulate:
            st.module.zero_grad(set_to_none=True)
    first, last = stages[0].is_first, stages[-1].is_last
    return sched.step(x if first else None, target=y if last else None,
                      losses=losses if last else None)


def against_the_unsplit_model(sched, stages, refs, full, m: int) -> None:
    """Two steps (the second on the agreed shapes and shared slots) and an eval() of
    ``sched`` on this rank's ``stages``: the unsplit ``full``'s losses, output and each
    slice's (``refs``) gradients; then the schedule and stages freed."""
    for salt in (0, 1):
        x, y = data(salt)
        ref_losses = reference(full, x, y, m, mse)
        losses: list = []
        out = step(sched, stages, x, y, losses)
        if stages[-1].is_last:
            assert [float(t) for t in losses] == pytest.approx(ref_losses, rel=1e-12)
            with torch.no_grad():
                torch.testing.assert_close(out, full(x), rtol=1e-12, atol=1e-12)
        else:
            assert out is None
        for st, ref in zip(stages, refs):
            for a, b in zip(st.module.parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    # eval(): the forwards alone, through every stage in turn.
    x, _ = data(2)
    out = sched.eval(x if stages[0].is_first else None)
    if stages[-1].is_last:
        with torch.no_grad():
            torch.testing.assert_close(out, full(x), rtol=1e-12, atol=1e-12)
    sched.free()
    for st in stages:
        st.free()


INTERLEAVED = (ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleLoopedBFS)


@pytest.mark.parametrize("cls", INTERLEAVED)
@pytest.mark.parametrize("v", (2, 3))
@pytest.mark.parametrize("m", (1, 3, 8))  # fewer, not a multiple, and more than the ranks
def test_interleaved_matches_unsplit_model(comm, cls, v, m):
    full = mlp()
    stages, refs = local_stages(comm, full, v)
    sched = cls(stages, m, mse)
    # The zero-bubble one splits every backward: a W per stage and micro-batch.
    ws = sorted((a.stage, a.mb) for a in sched.actions[comm.rank] if a.kind == "W")
    want = sorted((st.stage_index, k) for st in stages for k in range(m))
    assert ws == (want if cls is ScheduleInterleavedZeroBubble else [])
    against_the_unsplit_model(sched, stages, refs, full, m)


def test_each_stage_runs_its_share_in_megatron_order(comm):
    # The program each rank ran: per stage, every micro-batch's F then its B, and the
    # timeline's spans name the rank's own stages only.
    full, m, v = mlp(), 4, 2
    stages, _ = local_stages(comm, full, v)
    sched = ScheduleInterleaved1F1B(stages, m, mse)
    step(sched, stages, *data())
    mine = {st.stage_index for st in stages}
    assert {s.action.stage for s in sched.timeline} == mine
    for s in mine:
        kinds = [(x.action.kind, x.action.mb) for x in sched.timeline if x.action.stage == s]
        assert sorted(kinds) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
    sched.free()
    for st in stages:
        st.free()


@pytest.mark.parametrize("cls", INTERLEAVED)
def test_interleaved_gpt_with_tied_embedding(comm, cls):
    # The embedding on stage 0 (rank 0) and the output layer on stage 2K - 1 (the last
    # rank): their gradients summed between them, or added on one rank (K = 1).
    v = 2
    n = v * comm.size
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=n - 2 + 1, n_heads=2)
    torch.manual_seed(3)
    full = GPT(cfg).double()
    stages = []
    for s in range(comm.rank, n, comm.size):
        module, tied = split_gpt(full, n, s)
        stages.append(PipelineStage(module, s, n, comm, tied_parameters=tied))
    sched = cls(stages, 3, lm_loss)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randint(0, 11, (7, 5), generator=g), torch.randint(0, 11, (7, 5), generator=g)
    ref_losses = reference(full, x, y, 3, lm_loss)
    losses: list = []
    step(sched, stages, x, y, losses)
    if stages[-1].is_last:
        assert [float(t) for t in losses] == pytest.approx(ref_losses, rel=1e-12)
    for st in stages:
        if st.is_first or st.is_last:
            w = st.module[0].tok.weight if st.is_first else st.module[-1].head.weight
            torch.testing.assert_close(w.grad, full.tok.weight.grad, rtol=1e-10, atol=1e-12)
        assert all(q.grad is not None for q in st.module.parameters())
    # One norm for the whole model, the tied weight counted once: torch's on the unsplit.
    want = torch.nn.utils.clip_grad_norm_(full.parameters(), 0.05)
    got = sched.clip_grad_norm_(0.05)
    assert float(got) == pytest.approx(float(want), rel=1e-10)
    for st in stages:
        if st.is_first:
            torch.testing.assert_close(st.module[0].tok.weight.grad, full.tok.weight.grad,
                                       rtol=1e-10, atol=1e-12)
    assert float(clip.clip_grad_norm_(stages, 1e9)) == pytest.approx(0.05, rel=1e-5)
    sched.free()
    for st in stages:
        st.free()


@pytest.mark.parametrize("cls, one", [(ScheduleInterleaved1F1B, Schedule1F1B),
                                      (ScheduleInterleavedZeroBubble, ScheduleZeroBubble)])
def test_one_stage_per_rank_is_1f1b(comm, cls, one):
    # An interleaved schedule with a single stage runs its one-stage schedule's program
    # (1F1B's, ZB-H1's) and numbers.
    full = mlp()
    stages, refs = local_stages(comm, full, 1)
    sched = cls(stages[0], 4, mse)
    plain = one(stages[0], 4, mse)
    assert sched.actions == plain.actions
    x, y = data()
    reference(full, x, y, 4, mse)
    step(sched, stages, x, y)
    for a, b in zip(stages[0].module.parameters(), refs[0].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    for s in (sched, plain):
        s.free()
    stages[0].free()


def test_stages_that_do_not_fit_are_refused_on_every_rank(comm):
    full = mlp()
    n = 2 * comm.size
    cuts = bounds(len(full), n)
    # A stage of the wrong round (rank r's second stage is r + K, not r + 1 + K).
    with pytest.raises(ValueError, match="PipelineStage: .*stage_index"):
        s = comm.rank + comm.size if comm.rank else comm.size - 1 + comm.size
        if comm.size == 1:
            s = 5  # past the last stage
        PipelineStage(copy.deepcopy(full[slice(*cuts[0])]), s, n, comm)
    # A stage count that is not a multiple of the ranks.
    if comm.size > 1:
        with pytest.raises(ValueError, match="num_stages"):
            PipelineStage(copy.deepcopy(full[slice(*cuts[0])]), comm.rank, n + 1, comm)
    # Half of the rank's stages given to the schedule: named, with the ones it holds.
    stages, _ = local_stages(comm, full, 2)
    with pytest.raises(ValueError, match=r"rank \d+ holds stages \[\d+, \d+\]: give all of them"):
        ScheduleInterleaved1F1B(stages[:1], 2, mse)
    with pytest.raises(ValueError, match="give all of them, in that order"):
        ScheduleInterleaved1F1B(stages[::-1], 2, mse)
    with pytest.raises(ValueError, match="one stage per rank, not 2"):
        Schedule1F1B(stages, 2, mse)
    if comm.size > 1:  # one rank's list in the wrong order: every rank raises, naming it
        mine = stages[::-1] if comm.rank == comm.size - 1 else stages
        with pytest.raises(ValueError, match=rf"r{comm.size - 1}: this rank's stages are"):
            ScheduleInterleaved1F1B(mine, 2, mse)
    for st in stages:
        st.free()


def test_tied_parameters_must_match_across_the_ends(comm):
    # Stage 0's tie and stage 2K-1's must be the same shapes, checked on every rank.
    n = 2 * comm.size
    mods = []
    for s in range(comm.rank, n, comm.size):
        lin = nn.Linear(4, 4 if s != n - 1 else 5).double()
        tied = [lin.weight] if s in (0, n - 1) else []
        mods.append(PipelineStage(lin, s, n, comm, tied_parameters=tied))
    with pytest.raises(ValueError, match="tied_parameters differ"):
        ScheduleInterleaved1F1B(mods, 2, mse)
    for st in mods:
        st.free()


def run_against_the_twin(comm, program) -> None:
    """A hand-written 2-stage-per-rank program of 2 micro-batches, two steps (the second
    on receives posted ahead), losses and gradients against the unsplit model."""
    from mpiring.parallel.pipeline.runtime import PipelineSchedule

    full = mlp()
    stages, refs = local_stages(comm, full, 2)
    sched = PipelineSchedule(stages, 2, mse, actions=program)
    for salt in (0, 1):
        x, y = data(salt)
        ref_losses = reference(full, x, y, 2, mse)
        losses: list = []
        step(sched, stages, x, y, losses)
        if stages[-1].is_last:
            assert [float(t) for t in losses] == pytest.approx(ref_losses, rel=1e-12)
        for st, ref in zip(stages, refs):
            for a, b in zip(st.module.parameters(), ref.parameters()):
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    sched.free()
    for st in stages:
        st.free()


def test_messages_between_a_pair_of_ranks_are_kept_apart_per_stage(comm):
    # A hand-written program for 2 ranks x 2 stages where rank 1 takes stage 3's input
    # (sent by rank 0's stage 2) before stage 1's second one (sent by stage 0 earlier):
    # both go rank 0 -> rank 1, so only per-stage-pair tags match them right.
    from mpiring.parallel.pipeline.actions import parse_schedule
    from mpiring.parallel.pipeline.schedules import lower

    if comm.size != 2:
        pytest.skip("a program for two ranks")
    compute = parse_schedule(["0F0 0F1 2F0 2B0 2F1 2B1 0B0 0B1",
                              "1F0 3F0 3B0 1F1 3F1 3B1 1B0 1B1"])
    run_against_the_twin(comm, [lower(row, 4) for row in compute])


def test_a_run_that_sends_late_and_receives_a_header_does_not_hang(comm):
    # Rank 0 lists stage 0's sends late, in the run that also receives stage 2's first
    # input: on the step that agrees shapes the header receives block, so the run's
    # sends must be out first (rank 1 waits for stage 0's header before it sends).
    from mpiring.parallel.pipeline.actions import parse_schedule

    if comm.size != 2:
        pytest.skip("a program for two ranks")
    program = parse_schedule([
        "0F0 0F1 0SEND_F0 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 "
        "2RECV_B0 2B0 2SEND_B0 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3RECV_F1 3F1 "
        "3B0 3SEND_B0 3B1 3SEND_B1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1"])
    run_against_the_twin(comm, program)


def test_stages_of_two_groups_of_processes_are_refused(world):
    # Stages 0, 1 on A = {w0, w1}, {w2, w3} and 2, 3 on B = {w0, w3}, {w2, w1}: the same
    # rank numbers, other processes. Every message would go over A, so stage 2 and 3
    # would be fed by ranks they never agreed with: refused on every rank.
    if world.size != 4:
        pytest.skip("a 4-rank job split two ways")
    a = world.split(world.rank // 2, key=world.rank)
    b = world.split(0 if world.rank in (0, 3) else 1, key=world.rank % 2)
    assert a.rank == b.rank
    st_a = PipelineStage(nn.Linear(2, 2).double(), a.rank, 4, a)
    st_b = PipelineStage(nn.Linear(2, 2).double(), 2 + b.rank, 4, b)
    with pytest.raises(ValueError, match="built on different communicators"):
        ScheduleInterleaved1F1B([st_a, st_b], 2, mse)
    for x in (st_a, st_b, a, b):
        x.free()


def test_interleaved_gpt_stages_split_the_blocks_evenly():
    # build_pipeline's interleaved stages: a block each for 4 blocks on 4 stages, the
    # embeddings with the first and the head with the last (array_split of the 6 units
    # would give 2, 2, 1, 1 units: a 2-block stage setting the pace of the rotation).
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=4, n_heads=2)
    full = GPT(cfg)
    kinds = [[type(u).__name__ for u in split_gpt(full, 4, s, blocks_evenly=True)[0]]
             for s in range(4)]
    assert kinds == [["Embed", "Block"], ["Block"], ["Block"], ["Block", "Head"]]
    assert [len(split_gpt(full, 4, s)[0]) for s in range(4)] == [2, 2, 1, 1]
