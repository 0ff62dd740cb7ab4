"""What a script ported from torch.distributed.pipelining would do, against the
unsplit model (float64) and torch's own rules: batches the micro-batch count does
not divide (torch.tensor_split's bounds, as torch's microbatch.py), a smaller last
batch, steps without zero_grad, scale_grads, token ids, a stage without
parameters, and the arguments torch takes that mpiring does not."""

from __future__ import annotations

import copy

import pytest
import torch
from test_pipeline_interleaved import bounds
from torch import nn

from mpiring.parallel.pipeline import (
    PipelineError,
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
)

M = 4
ROWS = (10, 7, 10)  # 10 does not divide by 4; then a smaller batch, then the first shape again
# name: (class, extra kwargs, stages per rank, placement)
SCHEDULES = {
    "gpipe": (ScheduleGPipe, {}, 1, "loop"),
    "gpipe-recompute": (ScheduleGPipe, {"recompute": True}, 1, "loop"),
    "1f1b": (Schedule1F1B, {}, 1, "loop"),
    "zb": (ScheduleZeroBubble, {}, 1, "loop"),
    "interleaved": (ScheduleInterleaved1F1B, {}, 2, "loop"),
    "interleaved-zb": (ScheduleInterleavedZeroBubble, {}, 2, "loop"),
    "looped-bfs": (ScheduleLoopedBFS, {}, 2, "loop"),
    "zbv": (ScheduleZBVZeroBubble, {}, 2, "v"),
    "dualpipev": (ScheduleDualPipeV, {}, 2, "v"),
}


def mse(out, t):
    return ((out - t) ** 2).mean()


def model(seed: int = 0) -> nn.Sequential:
    # Token ids in (an embedding), a layer without parameters in the middle, and
    # more modules than the 8 stages of 4 ranks with 2 stages each.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(9, 3), nn.Flatten(), nn.Linear(6, 5), nn.Tanh(),
                         nn.Identity(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 4),
                         nn.Tanh(), nn.Linear(4, 2)).double()


def batch(rows: int, step: int):
    g = torch.Generator().manual_seed(31 * step + rows)
    return (torch.randint(0, 9, (rows, 2), generator=g),
            torch.randn(rows, 2, generator=g, dtype=torch.float64))


def build(comm, name: str, full: nn.Module, scale_grads: bool):
    cls, kw, v, placement = SCHEDULES[name]
    n = v * comm.size
    if placement == "v":
        mine = [comm.rank, n - 1 - comm.rank]
    else:
        mine = list(range(comm.rank, n, comm.size))
    cuts = bounds(len(full), n)
    parts = [copy.deepcopy(full[slice(*cuts[s])]) for s in mine]
    stages = [PipelineStage(part, s, n, comm) for part, s in zip(parts, mine)]
    sched = cls(stages if v > 1 else stages[0], M, mse, scale_grads=scale_grads, **kw)
    return sched, stages, parts, [full[slice(*cuts[s])] for s in mine]


@pytest.mark.parametrize("scale_grads", (True, False))
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_steps_without_zero_grad_and_a_smaller_batch_match_the_unsplit_model(comm, name,
                                                                           scale_grads):
    if name == "dualpipev" and M < 2 * comm.size:
        pytest.skip("DualPipeV needs n_microbatches >= 2 * ranks")
    full = model()
    sched, stages, parts, refs = build(comm, name, full, scale_grads)
    first = any(st.is_first for st in stages)
    last = any(st.is_last for st in stages)
    for step, rows in enumerate(ROWS):
        ids, y = batch(rows, step)
        # torch's microbatch split: tensor_split along dim 0 (10 rows: 3, 3, 2, 2).
        want = [mse(full(a), b) for a, b in zip(torch.tensor_split(ids, M),
                                               torch.tensor_split(y, M))]
        total = torch.stack(want)
        (total.mean() if scale_grads else total.sum()).backward()  # onto the earlier steps'
        with torch.no_grad():
            want_out = full(ids)
        losses: list = []
        out = sched.step(ids if first else None, target=y if last else None,
                         losses=losses if last else None)
        if last:
            assert len(losses) == M
            assert all(v.dtype == torch.float64 and v.dim() == 0 for v in losses)
            torch.testing.assert_close(torch.stack(losses), total.detach(), rtol=1e-12,
                                       atol=1e-14)
            assert out.shape == (rows, 2)
            torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-14)
        else:
            assert out is None
    # Three steps' gradients, accumulated as loss.backward() accumulates them.
    for part, ref in zip(parts, refs):
        for (n, got), want in zip(part.named_parameters(), ref.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12, msg=n)
    sched.free()
    for st in stages:
        st.free()


@pytest.mark.parametrize("loss_fn, said", [
    (lambda out, t: (out - t) ** 2, r"loss_fn returned a tensor of shape \(3, 2\)"),
    (lambda out, t: float(((out - t) ** 2).mean()), "loss_fn returned a float"),
])
def test_a_loss_that_is_not_one_element_is_named_at_its_forward(comm, loss_fn, said):
    # One stage: the error is on the last stage's rank alone (the others stop at the
    # deadline), so a single rank shows it without a wait.
    if comm.size != 1:
        pytest.skip("the error is raised on the last stage's rank")
    full = model()
    stage = PipelineStage(copy.deepcopy(full), 0, 1, comm)
    sched = Schedule1F1B(stage, M, loss_fn)
    ids, y = batch(10, 0)
    with pytest.raises(PipelineError, match=rf"in 0F0 \(TypeError: {said}; .*\.mean\(\)"):
        sched.step(ids, target=y)
    # A one-element loss of shape (1,) is a loss: it trains as the 0-dim one.
    sched = Schedule1F1B(stage, M, lambda out, t: mse(out, t).reshape(1))
    stage.module.zero_grad()
    sched.step(ids, target=y)
    torch.stack([mse(full(a), b) for a, b in zip(torch.tensor_split(ids, M),
                                                 torch.tensor_split(y, M))]).mean().backward()
    for got, want in zip(stage.module.parameters(), full.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-12)


def test_torchs_device_argument_names_the_communicator(comm):
    # torch: PipelineStage(submodule, stage_index, num_stages, device). Every rank of a
    # ported script passes the device there: every rank raises, before any message.
    with pytest.raises(TypeError, match=r"comm is a device, not an mpiring Communicator.*"
                                        r"submodule\.to\(device\)"):
        PipelineStage(nn.Linear(2, 2), comm.rank, comm.size, torch.device("cpu"))


def test_torchs_shape_hints_and_attribute_names(comm):
    # torch's input_args / output_args (example tensors) are taken, and not needed: the
    # first step agrees the shapes, here other than the hints say. torch's submod,
    # group_rank and group_size name the layers and the stage's place.
    part = nn.Linear(3, 3).double()
    stage = PipelineStage(part, comm.rank, comm.size, comm,
                          input_args=torch.zeros(1, 3), output_args=(torch.zeros(1, 3),))
    assert stage.submod is part
    assert (stage.group_rank, stage.group_size) == (comm.rank, comm.size)
    sched = Schedule1F1B(stage, 2, mse)
    x = torch.ones(4, 3, dtype=torch.float64)
    out = sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
    if stage.is_last:
        assert out.shape == (4, 3)
    sched.free()
    stage.free()


@pytest.mark.parametrize("bad", ["bool", "float", "object", "float-stages"])
def test_sizes_that_are_not_integers_are_refused_on_every_rank(comm, bad):
    # False == 0 and 1.0 == 1 compared equal to the rank and passed; an object failed
    # to serialise on its rank alone, leaving the others in the layout's exchange.
    index, stages = comm.rank, comm.size
    if bad == "bool" and comm.rank == 0:
        index = False
    elif bad == "float" and comm.rank == comm.size - 1:
        index = float(comm.rank)
    elif bad == "object" and comm.rank == comm.size - 1:
        index = object()
    elif bad == "float-stages":
        stages = float(comm.size)
    key = "num_stages" if bad == "float-stages" else "stage_index"
    with pytest.raises(ValueError, match=rf"PipelineStage: r\d+ gave {key}=.*, not an integer"):
        PipelineStage(nn.Linear(2, 2), index, stages, comm)
    PipelineStage(nn.Linear(2, 2), comm.rank, comm.size, comm).free()  # the comm still works


def one_stage_each(comm):
    full = model()
    cuts = bounds(len(full), comm.size)
    part = copy.deepcopy(full[slice(*cuts[comm.rank])])
    return full, PipelineStage(part, comm.rank, comm.size, comm)


def test_losses_return_outputs_and_loss_kwargs_as_torchs_step(comm):
    full, stage = one_stage_each(comm)
    sched = Schedule1F1B(stage, M, mse)
    first, last = stage.is_first, stage.is_last
    losses: list = [torch.tensor(9.0)]  # torch's step() clears the list: a reused one too
    for step in range(2):
        ids, y = batch(10, step)
        out = sched.step(ids if first else None, target=y if last else None,
                         losses=losses if last else None, return_outputs=step == 0)
        if last:
            want = [mse(full(a), b) for a, b in zip(torch.tensor_split(ids, M),
                                                    torch.tensor_split(y, M))]
            torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach())
            assert (out is None) == (step == 1)
        else:
            assert out is None
    with pytest.raises(ValueError, match=r"loss_kwargs=\{'w': 2\}: bind them into loss_fn "
                                         r"instead \(functools\.partial"):
        ids, y = batch(10, 0)
        sched.step(ids if first else None, target=y if last else None,
                   loss_kwargs={"w": 2} if last else None)
    sched.free()
    stage.free()


def test_a_bad_micro_batch_count_on_one_rank_is_refused_on_every_rank(comm):
    # Raised before the schedule's exchange, on the bad rank alone, it left the others
    # waiting there until the deadline.
    _, stage = one_stage_each(comm)
    bad = 0 if comm.rank == comm.size - 1 else M
    with pytest.raises(ValueError, match=rf"Schedule1F1B: r{comm.size - 1}: .*n_microbatches"):
        Schedule1F1B(stage, bad, mse)
    with pytest.raises(ValueError, match=r"give loss_fn on the last stage \(for forwards "
                                         r"alone.*eval\(\)"):
        Schedule1F1B(stage, M)
    stage.free()
