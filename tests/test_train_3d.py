"""Training on the 3D grid against a one-process twin; checkpoints that move between layouts.

Every layout (dp, tp, pp) that fits the job trains the same tiny GPT on the
same global batches as a plain AdamW loop on one process (the unsplit twin):
the losses agree step by step (float32, relative 1e-5). A run saved at one
layout and resumed at another continues with the uninterrupted run's losses,
and the full parameters and AdamW state it saves again are the saved bits.
Layouts that cannot train are refused on every rank, before any step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpiring.parallel import checkpoint as ck
from mpiring.parallel.data.sampler import DistributedSampler
from mpiring.tools.models.gpt import GPT, lm_loss
from mpiring.tools.train import reshard
from mpiring.tools.train.checkpointing import Checkpointer
from mpiring.tools.train.data import Windows
from mpiring.tools.train.job3d import make_job
from mpiring.tools.train.loop import TrainConfig, fused_adamw_available, train

# A byte pattern with every value in use.
DATA = (np.arange(40_000) * 7919 % 241).astype(np.uint8)


def global_batch(world: int) -> int:
    """Windows a step: 12 divide over 1, 2, 3, 4 and 6 replicas; 10 over 5."""
    return 10 if world % 5 == 0 else 12


G = 12  # the one-rank resume of a 4-rank run
COMMON = dict(preset="tiny", seq_len=16, log_every=1, val_batches=1, lr=3e-3, seed=5)
RTOL = 1e-5


def twin_run(steps: int, G: int = G, clip: float = 0.0, double: bool = False):  # noqa: N803
    """The unsplit GPT with torch's AdamW on the global batches, in one process (each
    step's gradients clipped to the norm ``clip`` by torch, when it is given; in float64
    with ``double``). Returns the losses, the model and the optimizer."""
    cfg = TrainConfig(steps=steps, global_batch=G, **COMMON)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config())
    if double:
        model = model.double()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            fused=None if double else fused_adamw_available("cpu"))
    windows = Windows(DATA, cfg.model_config().seq_len)
    order = DistributedSampler(len(windows), 1, 0, seed=cfg.seed, drop_last=True).shard()
    out = []
    for s in range(steps):
        x, y = windows.batch(order[s * G:(s + 1) * G])
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            # Every step must clip, or the test would not see a wrong norm.
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > 2 * clip
        opt.step()
        out.append(float(loss.detach()))
    return out, model, opt


def twin_losses(steps: int, G: int = G, clip: float = 0.0) -> list[float]:  # noqa: N803
    """The losses of ``twin_run``."""
    return twin_run(steps, G, clip)[0]


def job(comm, tp=1, pp=1, steps=3, **kw):
    cfg = TrainConfig(tp=tp, pp=pp, steps=steps,
                      **{"global_batch": global_batch(comm.size), **COMMON, **kw})
    return make_job(comm, cfg, train_data=DATA, val_data=DATA[:4000])


def run(comm, **kw) -> list[float]:
    j = job(comm, **kw)
    try:
        return train(j).losses
    finally:
        j.close()


def layouts(world: int) -> list[tuple[int, int]]:
    """Every (tp, pp) of the world with tp, pp <= 4 (the tiny GPT has 4 units)."""
    return [(t, p) for t in (1, 2, 3, 4) for p in (1, 2, 3, 4) if world % (t * p) == 0]


@pytest.mark.deadline(120)
def test_every_layout_matches_the_one_process_twin(world):
    want = twin_losses(3, global_batch(world.size))
    for tp, pp in layouts(world.size):
        got = run(world, tp=tp, pp=pp)
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=f"tp={tp} pp={pp}")


CLIP = 0.05


@pytest.mark.deadline(120)
def test_grad_clip_matches_the_twins_at_every_layout(world):
    # One norm for the whole model at every layout: tensor-parallel shards, pipeline
    # stages (the tied embedding once), FSDP shards and ZeRO-2's own clipping.
    want = twin_losses(3, global_batch(world.size), clip=CLIP)
    cases = [dict(tp=t, pp=p) for t, p in layouts(world.size)]
    cases += [dict(tp=1, pp=1, fsdp=True), dict(tp=1, pp=1, optimizer="zero2")]
    if world.size % 2 == 0:
        cases += [dict(tp=1, pp=2, fsdp=True), dict(tp=2, pp=1, fsdp=True),
                  dict(tp=1, pp=2, schedule="zb", microbatches=3)]
    for case in cases:
        got = run(world, grad_clip=CLIP, **case)
        np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=str(case))


def test_grad_clip_refuses_what_cannot_clip_the_whole_model():
    for bad, why in ((dict(grad_clip=-1.0), "give a positive norm"),
                     (dict(grad_clip=1.0, mode="ps"), "parameter server"),
                     (dict(grad_clip=1.0, optimizer="zero1", pp=2), "optimizer adamw"),
                     (dict(grad_clip=1.0, pp=2, schedule="pipedream"), "use 1f1b")):
        with pytest.raises(ValueError, match=why):
            TrainConfig(**bad).validate()


@pytest.mark.deadline(120)
@pytest.mark.parametrize("opts", [{}, dict(fsdp=True), dict(schedule="zb", microbatches=3)],
                         ids=["default", "fsdp", "zb-m3"])
def test_validation_loss_matches_the_one_process_model(world, opts):
    # Before any step every layout holds the seed's model: each replica's validation
    # windows through it (a pipeline's through sched.eval(), micro-batch by
    # micro-batch) give the unsplit model's mean loss on the same windows.
    for tp, pp in layouts(world.size):
        if opts and pp == 1:
            continue  # fsdp and zb: their pipeline form
        j = job(world, tp=tp, pp=pp, **opts)
        try:
            got = j.evaluate(batches=2)
            g, b, val = j.grid, j.cfg.batch_size, j.val_set
            torch.manual_seed(j.cfg.seed)
            full = GPT(j.cfg.model_config())
            total = count = 0.0
            with torch.no_grad():
                for d in range(g.dp_size):
                    order = list(DistributedSampler(len(val), g.dp_size, d, shuffle=False,
                                                    drop_last=True))
                    for k in range(2):
                        x, y = val.batch(order[k * b:(k + 1) * b])
                        total += float(lm_loss(full(x), y)) * len(x)
                        count += len(x)
            assert got == pytest.approx(total / count, rel=RTOL), (tp, pp, opts)
        finally:
            j.close()


def _layout_for(k: int, opts: dict) -> tuple[int, int] | None:
    """(tp, pp) exercising ``opts`` at k ranks: dp > 1 for the data axis, pp > 1 for a schedule."""
    if opts.get("schedule") in ("interleaved", "interleaved-zb", "zbv", "dualpipev",
                                "looped-bfs") or "pp_layers" in opts:
        return (1, 2) if k % 2 == 0 else None
    if "schedule" in opts:
        return (1, 2) if k % 2 == 0 else (1, k) if 1 < k <= 4 else None
    if opts.get("sequence_parallel"):
        return (2, 2 if k % 4 == 0 else 1) if k % 2 == 0 else (k, 1) if k > 1 else None
    if opts.get("fsdp"):
        return (2, 1) if k % 4 == 0 else (1, 1)
    return (1, 2) if k % 4 == 0 else (1, 1)  # zero1: pipeline x data


@pytest.mark.deadline(120)
@pytest.mark.parametrize("opts", [dict(optimizer="zero1"), dict(fsdp=True),
                                  dict(schedule="gpipe"), dict(schedule="zb", microbatches=3),
                                  dict(sequence_parallel=True),
                                  dict(fsdp=True, schedule="1f1b"),
                                  dict(fsdp=True, schedule="gpipe", microbatches=3),
                                  dict(optimizer="zero2", schedule="1f1b"),
                                  dict(optimizer="zero2", schedule="zb", microbatches=3),
                                  dict(schedule="interleaved", vpp=2, microbatches=3),
                                  dict(schedule="1f1b", pp_layers=(2, 0)),
                                  dict(schedule="interleaved", vpp=2, pp_layers=(0, 1, 1, 0)),
                                  dict(schedule="zbv", vpp=2, microbatches=3),
                                  dict(schedule="interleaved-zb", vpp=2, microbatches=3),
                                  dict(schedule="interleaved-zb", vpp=2, microbatches=6),
                                  dict(schedule="dualpipev", vpp=2, microbatches=6),
                                  dict(schedule="looped-bfs", vpp=2, microbatches=3)],
                         ids=["zero1", "fsdp", "gpipe", "zb-m3", "sp", "fsdp-1f1b",
                              "fsdp-gpipe-m3", "zero2-1f1b", "zero2-zb-m3", "interleaved-m3",
                              "uneven-2-0", "interleaved-uneven", "zbv-m3", "interleaved-zb-m3",
                              "interleaved-zb-m6", "dualpipev-m6", "looped-bfs-m3"])
def test_data_axis_and_schedules_match_the_twin(world, opts):
    picked = _layout_for(world.size, opts)
    if picked is None:
        pytest.skip(f"{opts} has no layout at {world.size} ranks")
    tp, pp = picked
    got = run(world, tp=tp, pp=pp, **opts)
    np.testing.assert_allclose(got, twin_losses(3, global_batch(world.size)), rtol=RTOL,
                               err_msg=f"{opts} at tp={tp} pp={pp}")


def _full(path: str):
    state = ck.load_checkpoint(path)
    optim = state["optimizer"]
    if state["extra"]["layout"]["kind"] == "train":
        optim = reshard.by_name(state["extra"]["param_names"], optim)
    return state["model"], optim


def _assert_bits(a: str, b: str) -> None:
    (ma, oa), (mb, ob) = _full(a), _full(b)
    assert list(ma) == list(mb)
    for k in ma:
        assert torch.equal(ma[k], mb[k]), f"parameter {k} changed on the way"
    assert set(oa["state"]) == set(ob["state"]) and oa["state"]
    for n, entry in oa["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][n][key])), (n, key)


def _moves(world: int) -> list[tuple[dict, dict]]:
    """(saved at, resumed at): the job's layouts, each to a different one."""
    got = [dict(tp=t, pp=p) for t, p in layouts(world)]
    plain = dict(global_batch=None, batch_size=global_batch(world) // world)  # TrainJob: plain DDP, no grid
    moves = [(plain, got[-1]), (got[-1], plain)] if world > 1 else [(plain, dict(tp=1))]
    moves += [(a, b) for a, b in zip(got, got[1:] + got[:1]) if a != b][:3]
    if world % 2 == 0:
        moves.append((dict(tp=2, optimizer="zero1"), dict(tp=1, fsdp=True)))
        moves.append((dict(tp=1, fsdp=True), dict(pp=2) if world > 1 else dict(tp=2)))
        # The data axis sharded under a pipeline: FSDP -> ZeRO-2 -> plain DDP.
        moves.append((dict(pp=2, fsdp=True), dict(pp=2, optimizer="zero2", schedule="gpipe")))
        moves.append((dict(pp=2, optimizer="zero2"), plain if world > 2 else dict(tp=2)))
        # Two stages per rank, saved by the full GPT's names: back to one per rank.
        moves.append((dict(pp=2, schedule="interleaved", vpp=2), dict(pp=2)))
        moves.append((dict(pp=2, schedule="zbv", vpp=2), dict(pp=2, schedule="interleaved",
                                                            vpp=2)))
        moves.append((dict(pp=2, pp_layers=(2, 0)), dict(pp=2, pp_layers=(0, 2))))
    return moves


@pytest.mark.deadline(60)
def test_fsdp_pipeline_reduce_scatters_each_unit_once_a_step(world):
    """M micro-batches gather each unit M times but reduce-scatter it once, after the last."""
    if world.size % 2:
        pytest.skip("needs pp=2")
    j = job(world, pp=2, fsdp=True, steps=1, microbatches=3)
    calls = []
    tc = j.fsdp.thread_comm
    inner = tc.reduce_scatter
    tc.reduce_scatter = lambda buf, *a, **k: (calls.append(buf.numel()), inner(buf, *a, **k))[1]
    try:
        x, y = j.next_batch()
        j._update(x, y)
        sizes = sorted(u.flat.numel for u in j.fsdp.units if u.flat.numel)
        assert sorted(calls) == (sizes if world.size // 2 > 1 else [])
    finally:
        j.close()


@pytest.mark.deadline(90)
def test_fsdp_pipeline_kept_gathered_gathers_each_unit_once_a_step(world):
    """With reshard_after_forward=False a unit stays gathered over the micro-batches:
    one AllGather a step instead of one or two per micro-batch, the same losses."""
    if world.size % 2:
        pytest.skip("needs pp=2")
    runs = {}
    for keep in (False, True):
        j = job(world, pp=2, fsdp=True, steps=2, microbatches=3)
        j.fsdp.set_reshard_after_forward(not keep)
        calls = []
        tc = j.fsdp.thread_comm
        inner = tc.all_gather
        tc.all_gather = lambda buf, *a, calls=calls, inner=inner, **k: (
            calls.append(buf.numel()), inner(buf, *a, **k))[1]
        try:
            losses = []
            for _ in range(2):  # train() would add the validation's gathers
                x, y = j.next_batch()
                losses.append(j._update(x, y))
            runs[keep] = losses, calls
            units = sorted(u.flat.numel for u in j.fsdp.units if u.flat.numel)
            assert all(u.status == "sharded" for u in j.fsdp.units)  # freed after each step
        finally:
            j.close()
    (ref, zero3), (got, kept) = runs[False], runs[True]
    np.testing.assert_allclose(got, ref, rtol=1e-6)  # NaN off the last stage, on both
    if world.size // 2 > 1:  # a data axis to gather over
        assert sorted(kept) == sorted(units * 2)  # two steps, each unit once in each
        assert len(zero3) > 3 * len(kept)  # ZeRO-3: again in every micro-batch's backward


@pytest.mark.deadline(150)
def test_saved_at_one_layout_resumes_at_another(world, tmp_path):
    from mpiring.backends import control as wire

    base = wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)
    want = twin_losses(4, global_batch(world.size))
    for i, (a, b) in enumerate(_moves(world.size)):
        saved, again = f"{base}/{i}a", f"{base}/{i}b"
        first = job(world, steps=2, **a)
        train(first, callbacks=[Checkpointer(saved, verbose=False)])
        first.close()
        resume_and_compare(job(world, steps=4, **b), saved, again, want, f"{a} -> {b}",
                           world.rank == 0)
        world.barrier()


def resume_and_compare(second, saved: str, again: str, want, what: str, root: bool) -> None:
    """Load ``saved`` (step 2) into ``second``, save it again at its own layout, train on:
    the losses continue ``want`` and, on ``root``, the re-saved files equal the saved ones."""
    Checkpointer(saved, resume=True, verbose=False).load(second)
    Checkpointer(again, verbose=False).save(second)  # the same step, at the new layout
    got = train(second).losses
    second.close()
    np.testing.assert_allclose(got, want, rtol=RTOL, err_msg=what)
    if root:
        _assert_bits(f"{saved}/{ck.checkpoint_name(2)}", f"{again}/{ck.checkpoint_name(2)}")


@pytest.mark.deadline(90)
def test_saved_on_the_grid_resumes_on_one_rank(world, subcomms, tmp_path):
    from mpiring.backends import control as wire

    if world.size < 4:
        pytest.skip("needs tp=2 x pp=2")
    base = wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)
    sub = subcomms[4]
    if sub is not None:
        first = job(sub, tp=2, pp=2, steps=2)
        train(first, callbacks=[Checkpointer(base, verbose=False)])
        first.close()
    world.barrier()
    if world.rank == 0:
        one = job(subcomms[1], steps=4, global_batch=None, batch_size=G)  # TrainJob, 1 rank
        Checkpointer(base, resume=True, verbose=False).load(one)
        np.testing.assert_allclose(train(one).losses, twin_losses(4), rtol=RTOL)
        one.close()
    world.barrier()


def _refused(world, match: str, **kw) -> None:
    with pytest.raises(ValueError, match=match):
        job(world, **kw)


@pytest.mark.deadline(60)
def test_bad_layouts_are_refused_on_every_rank(world):
    k = world.size
    _refused(world, f"pp={k + 1} = {k + 1} does not divide the world of {k}", pp=k + 1)
    _refused(world, "fsdp with --schedule zb.*use --schedule 1f1b or gpipe", pp=2, fsdp=True,
             schedule="zb")
    _refused(world, "use it with pp > 1", microbatches=2)
    if k % 2 == 0:
        _refused(world, r"pp_layers=\[1, 2\]: give 2 block counts .* summing to the model's 2",
                 pp=2, pp_layers=(1, 2))
    _refused(world, "pp_layers=.* use it with pp > 1", pp_layers=(2,))
    _refused(world, "several stages per rank run with --schedule interleaved", pp=2, vpp=2)
    _refused(world, "interleaved runs on pp > 1 with DDP on the data axis", pp=2, vpp=2,
             schedule="interleaved", fsdp=True)
    _refused(world, "--schedule zbv: the V holds 2 stages per rank", pp=2, vpp=3, schedule="zbv")
    _refused(world, r"vpp=1 with --schedule zbv: .*\(TrainConfig: vpp=2\)", pp=2,
             schedule="zbv")
    _refused(world, "--schedule dualpipev: the V holds 2 stages per rank", pp=2, vpp=3,
             schedule="dualpipev")
    if k % 2 == 0:
        # The 12 windows over dp = k / 2 replicas (6 on 4 ranks, 12 on 2): the counts
        # offered are those from 2 pp = 4 up that divide them.
        per = 12 // (k // 2)
        counts = " or ".join(str(c) for c in range(4, per + 1) if per % c == 0)
        _refused(world, r"dualpipev runs at least one micro-batch per stage, 2 pp = 4, in "
                 rf"equal micro-batches of the {per} windows per replica, not 3: give "
                 rf"--microbatches {counts}, or use zbv", pp=2, vpp=2, microbatches=3,
                 schedule="dualpipev")
    if k % 2 == 0:
        _refused(world, r"pp=6 stages for a GPT of 4 units.*\(pp=2 x vpp=3\)", pp=2,
                 vpp=3, schedule="interleaved")
    if k % 4 == 0:
        _refused(world, "pp=4 stages for a GPT of 3 units", pp=4, n_layers=1)
    if k > 1:
        _refused(world, f"global_batch=7 does not split over dp={k}", global_batch=7)
    if k % 2 == 0:
        _refused(world, "do not split into 5 equal micro-batches", pp=2, microbatches=5)
    if k >= 4 and k % 2 == 0:
        _refused(world, "pipedream steps each stage after every micro-batch", pp=2,
                 schedule="pipedream")
    world.barrier()  # every rank refused, none went on to train


def test_pp_layers_places_the_blocks():
    from mpiring.tools.train.grid3d import stage_bounds, stage_of

    # Units: 0 embeddings, 1..4 blocks, 5 head. Three blocks first, one with the head.
    assert stage_bounds(4, 2, (3, 1)) == [(0, 4), (4, 6)]
    assert stage_bounds(4, 3, (0, 4, 0)) == [(0, 1), (1, 5), (5, 6)]
    assert stage_bounds(4, 2) == [(0, 3), (3, 6)]  # array_split of the 6 units
    assert [stage_of(f"blocks.{i}.ln1.weight", 4, 2, layers=(3, 1)) for i in range(4)] == \
        [0, 0, 0, 1]
    assert stage_of("ln_f.weight", 4, 2, layers=(3, 1)) == 1
    # Interleaved: 4 stages on 2 ranks, stage s on rank s % 2.
    assert [stage_of(f"blocks.{i}.ln1.weight", 4, 2, 2, (1, 1, 1, 1)) for i in range(4)] == \
        [0, 1, 0, 1]


@pytest.mark.deadline(60)
def test_the_job_holds_the_blocks_pp_layers_gives_it(world):
    if world.size % 2:
        pytest.skip("pp = 2")
    j = job(world, pp=2, pp_layers=(2, 0), steps=1)
    try:
        held = sorted(j.model.blocks.keys())
        assert held == (["0", "1"] if j.grid.pp_rank == 0 else [])
    finally:
        j.close()


@pytest.mark.deadline(60)
def test_an_interleaved_job_reports_and_closes_every_stage_s_ddp(world):
    # Two stages per rank, each its own DDP over the data axis: the step's exposed
    # communication is the two waits together, and close() stops both threads and
    # frees both bucket communicators (the job's own wrapper is neither).
    from mpiring.comm.communicator import _Freed

    if world.size % 4:
        pytest.skip("pp = 2 with dp = 2")
    j = job(world, pp=2, schedule="interleaved", vpp=2, microbatches=3, steps=1)
    train(j)
    ddps = [st.ddp for st in j.sched.stages]
    assert len(ddps) == 2 and all(d is not None for d in ddps)
    assert j.exposed_comm == [sum(d.reducer.exposed_comm_s for d in ddps)]
    j.close()
    for d in ddps:
        assert isinstance(d.reducer._bucket_comm._be, _Freed)
        assert not d.reducer._thread._thread.is_alive()
