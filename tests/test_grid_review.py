"""The process grid and checkpoints across layouts, as a Megatron / DeviceMesh user checks them.

* every rank's tp, dp and pp groups against torch's ``init_device_mesh`` over gloo in
  the same processes (Megatron's ``tp-dp-pp`` order is the mesh ``(pp, dp, tp)``);
* ranks launched with different flags refuse together (none left waiting);
* a checkpoint saved at every layout the world allows (tp, pp, dp with DDP, FSDP,
  ZeRO) loads at its neighbours in the list: the state re-gathered there is the saved bits, the
  tied weight's two copies are equal, and one more step gives the float64 unsplit
  model's loss, parameters and AdamW moments;
* PipeDream's untied last-stage copy survives a resume at its own layout;
* the full state of another model is refused before anything is loaded.

Run at 1-4 ranks; at 3 the odd layouts tp=3 and pp=3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_train_3d import global_batch, job, twin_run
from torch_gloo import gloo_world

from mpiring.backends import control as wire
from mpiring.parallel import checkpoint as ck
from mpiring.parallel.grid import ProcessGrid
from mpiring.tools.models.gpt import GPT
from mpiring.tools.train import reshard
from mpiring.tools.train.checkpointing import Checkpointer
from mpiring.tools.train.grid3d import make_grid
from mpiring.tools.train.loop import train
from mpiring.tools.train.torch_pg import destroy_torch_process_group


def grid_layouts(world: int) -> list[tuple[int, int]]:
    return [(t, p) for p in range(1, world + 1) for t in range(1, world + 1)
            if world % (t * p) == 0]


@pytest.mark.deadline(60)
def test_groups_are_torch_device_mesh_s(world):
    from torch.distributed.device_mesh import init_device_mesh

    dist = gloo_world(world)
    layouts = grid_layouts(world.size)
    # Each mesh is three gloo groups, a second or more each on two cores: the layouts
    # with two axes over one rank tell the axes' order apart, the rest (one axis the
    # whole job) add nothing to that; a prime job size has only those.
    mixed = [(t, p) for t, p in layouts if sum(n > 1 for n in (t, p, world.size // (t * p))) >= 2]
    for tp, pp in mixed or layouts:
        dp = world.size // (tp * pp)
        # Megatron's order, tp fastest: torch's mesh lists the slowest dimension first.
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        for grid in (ProcessGrid(world, tp=tp, pp=pp), make_grid(world, tp, pp)):
            for axis in ("tp", "dp", "pp"):
                group = mesh.get_group(axis)
                ranks = dist.get_process_group_ranks(group)
                sub = getattr(grid, axis)
                assert sub.size == len(ranks) and sub.rank == mesh.get_local_rank(axis), axis
                assert getattr(grid, f"{axis}_rank") == mesh.get_local_rank(axis), axis
                if isinstance(grid, ProcessGrid):  # make_grid's Grid keeps no rank lists
                    assert getattr(grid, f"{axis}_ranks") == ranks, (axis, tp, pp)
                # The same processes in both groups: a rank-dependent sum over each.
                x = torch.tensor([world.rank + 1.0, (world.rank + 1.0) ** 2 + world.rank],
                                 dtype=torch.float64)
                want = x.clone()
                dist.all_reduce(want, group=group)
                got = x.numpy().copy()
                sub.all_reduce(got, op="sum")
                assert got.tolist() == want.tolist(), (axis, tp, pp)
            grid.free()
    # The meshes' gloo groups (a dozen, with their threads and sockets) slowed the
    # tests after this one to a crawl on two cores: torch's process groups go here.
    destroy_torch_process_group(world)


@pytest.mark.deadline(60)
def test_ranks_with_different_flags_refuse_together(world):
    # Rank 0 asks for tp = world (dp = 1), the others for dp = world: a global batch of
    # world + 1 splits over rank 0's one replica only. The others refuse it on the spot;
    # rank 0 must hear of it rather than wait for them in the grid's agreement.
    if world.size < 2:
        pytest.skip("needs two ranks to disagree")
    tp = world.size if world.rank == 0 else 1
    match = "refused the layout.*launch every rank with the same flags" if world.rank == 0 \
        else f"does not split over dp={world.size}"
    with pytest.raises(ValueError, match=match):
        job(world, tp=tp, global_batch=world.size + 1)
    world.barrier()


def layouts(world: int) -> list[dict]:
    """Every (tp, pp) the tiny GPT (4 units) allows, and the sharded data axes where dp > 1
    (FSDP also at dp = 1: its own state code still runs)."""
    grid = [dict(tp=t, pp=p) for t, p in grid_layouts(world) if t <= 4 and p <= 4]
    out = grid + [dict(fsdp=True)]
    if world % 2 == 0:  # the data axis sharded under a pipeline (ZeRO-1: test_train_3d)
        out += [dict(pp=2, fsdp=True), dict(pp=2, optimizer="zero2", schedule="gpipe")]
    else:
        out.append(dict(optimizer="zero1"))
    if world % 3 == 0:
        out.append(dict(tp=3, fsdp=True))
    return out


def twin(steps: int, G: int):  # noqa: N803
    """The unsplit GPT in float64 with torch's AdamW: losses, parameters and AdamW state."""
    losses, model, opt = twin_run(steps, G, double=True)
    named = dict(model.named_parameters())
    return losses, {n: p.detach() for n, p in named.items()}, \
        {n: opt.state[p] for n, p in named.items()}


def _file(path: str):
    state = ck.load_checkpoint(path)
    optim = state["optimizer"]
    if state["extra"]["layout"]["kind"] == "train":
        optim = reshard.by_name(state["extra"]["param_names"], optim)
    return state["model"], optim


def _assert_same_bits(j, model, optim, what: str) -> None:
    """What ``j`` holds (re-gathered from its layout) is ``model``/``optim`` to the bit,
    and the last stage's copy of the tied weight is the first stage's, moments too."""
    got_m, got_o = reshard.grid_full_state(j)  # collective
    for k, v in model.items():
        assert torch.equal(got_m[k], v), (what, k)
    for n, entry in optim["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(got_o["state"][n][key]), torch.as_tensor(v)), \
                (what, n, key)
    if j.fsdp is None and getattr(j.model, "last", False) and not j.model.first:
        cut = j.tp_model.shard
        head = j.model.head.weight
        assert torch.equal(head, cut("tok.weight", model["tok.weight"])), what
        if j.cfg.optimizer != "adamw":
            return  # ZeRO holds its own slices of the moments, not one per parameter
        mine = j.optimizer.state[head]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[key], cut("tok.weight", optim["state"]["tok.weight"][key])), \
                (what, key)


@pytest.mark.deadline(150)
def test_every_layout_resumes_its_neighbours_checkpoints(world, tmp_path):
    base = wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)
    G = global_batch(world.size)  # noqa: N806
    losses, params, state = twin(2, G)
    all_ = layouts(world.size)
    for i, a in enumerate(all_):  # one step, saved at every layout
        j = job(world, steps=1, **a)
        train(j, callbacks=[Checkpointer(f"{base}/{i}", verbose=False)])
        j.close()
    files = [_file(f"{base}/{i}/{ck.checkpoint_name(1)}") for i in range(len(all_))]
    for k, b in enumerate(all_):
        j = job(world, steps=2, **b)
        try:
            # The saved bits, re-gathered at b, from b itself and its two neighbours in the
            # list (every layout is a source and a target; all pairs took a minute more).
            for i in sorted({(k - 1) % len(all_), k, (k + 1) % len(all_)}):
                Checkpointer(f"{base}/{i}", resume=True, verbose=False).load(j)
                _assert_same_bits(j, *files[i], f"{all_[i]} -> {b}")
            # One step on from the previous layout's checkpoint: the unsplit model's.
            src = (k - 1) % len(all_)
            what = f"{all_[src]} -> {b}"
            Checkpointer(f"{base}/{src}", resume=True, verbose=False).load(j)
            got = train(j).losses
            np.testing.assert_allclose(got, losses, rtol=1e-5, err_msg=what)
            full, optim = reshard.grid_full_state(j)
            _assert_tied_copies_equal(j, full)
        finally:
            j.close()
        for n, want in params.items():
            # Adam's first steps move each weight by about lr = 3e-3 either way: a wrong
            # gradient's sign would show 2 lr; float32 rounding stays near 1e-4.
            assert float((full[n].double() - want).abs().max()) < 1e-3, (what, n)
            for key in ("exp_avg", "exp_avg_sq"):
                ref = state[n][key]
                err = float((optim["state"][n][key].double() - ref).abs().max())
                # float32 steps off the float64 path: 3e-4 of the largest moment seen; a
                # moment lost, zeroed or placed in another slice is off by the whole.
                assert err <= 2e-3 * float(ref.abs().max()), (what, n, key, err)
            assert float(optim["state"][n]["step"]) == 2.0, (what, n)


def _assert_tied_copies_equal(j, full) -> None:
    """After a step the last stage's copy of the tied weight is still the first stage's."""
    if j.fsdp is None and getattr(j.model, "last", False) and not j.model.first:
        assert torch.equal(j.model.head.weight, j.tp_model.shard("tok.weight", full["tok.weight"]))


@pytest.mark.deadline(90)
def test_pipedream_resumes_its_own_last_stage_copy(world, tmp_path):
    # PipeDream unties the embedding from the output layer (each stage steps alone):
    # a resume at its own layout must restore the last stage's copy and its moments,
    # or it continues from the first stage's copy (losses 3e-3 off at the next step).
    if world.size % 2:
        pytest.skip("pp = 2, dp = 1")
    base = wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)
    kw = dict(pp=2, tp=world.size // 2, schedule="pipedream")
    ref = job(world, steps=3, **kw)
    want = train(ref).losses
    ref.close()
    first = job(world, steps=1, **kw)
    train(first, callbacks=[Checkpointer(base, verbose=False)])
    first.close()
    model, optim = _file(f"{base}/{ck.checkpoint_name(1)}")
    # The one-rank state keeps the first stage's tied weight; the copy travels beside it.
    assert model["head.weight"] is model["tok.weight"] or torch.equal(model["head.weight"],
                                                                      model["tok.weight"])
    assert not torch.equal(optim[reshard.UNTIED]["weight"], model["tok.weight"])
    again = job(world, steps=3, **kw)
    try:
        Checkpointer(base, resume=True, verbose=False).load(again)
        got = train(again).losses
    finally:
        again.close()
    np.testing.assert_allclose(got, want, rtol=1e-7)


@pytest.mark.deadline(60)
def test_another_model_s_state_is_refused_before_loading(world):
    j = job(world, tp=2 if world.size % 2 == 0 else 1, pp=1, steps=1)
    try:
        before = {n: p.detach().clone() for n, p in j.model.named_parameters()}
        cfg = j.cfg.model_config()
        for change, match in ((dict(n_layers=cfg.n_layers + 1), "unexpected blocks.2"),
                              (dict(n_layers=1), "missing blocks.1"),
                              (dict(d_model=32, n_heads=2), r"shapes tok.weight \(256, 32\)")):
            torch.manual_seed(1)
            other = GPT(cfg.with_(**change)).state_dict()
            with pytest.raises(ValueError, match=match + ".*resume with the model flags"):
                reshard.load_grid_full_state(j, other, None)
            for n, p in j.model.named_parameters():
                assert torch.equal(p, before[n]), (change, n)  # nothing loaded
    finally:
        j.close()
