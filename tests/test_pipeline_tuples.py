"""Stages that hand the next one several tensors (a tuple), several first-stage inputs and
eval(), against the unsplit model.

Every boundary carries a float tensor the next stage computes with, an int64
tensor (no gradient), a bool mask and a float tensor the model never uses (its
gradient is zero), on K = 1..4 stages, over MPI messages and shared memory.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
from test_pipeline_runtime import bounds
from torch import nn

from mpiring.parallel.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    SchedulePipeDream,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
    packing,
    transport,
)
from mpiring.parallel.pipeline.actions import SEND_F, Action

SCHEDULES = {
    "gpipe": lambda st, m, lf: ScheduleGPipe(st, m, lf),
    "gpipe-recompute": lambda st, m, lf: ScheduleGPipe(st, m, lf, recompute=True),
    "1f1b": lambda st, m, lf: Schedule1F1B(st, m, lf),
    "zb": lambda st, m, lf: ScheduleZeroBubble(st, m, lf),
}
ROWS = 10  # does not divide by 3 or 4


class Start(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        ids = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        return torch.tanh(self.lin(x)), ids, x[:, 2] > 0, x * 3  # the last one: never used


class Block(nn.Module):
    def __init__(self, salt: int):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.emb = nn.Embedding(3, 4)
        self.salt = salt

    def forward(self, h, ids, mask, unused):
        new = torch.tanh(self.lin(h)) + self.emb(ids)
        h = torch.where(mask[:, None], new, h * 0.5)
        ids = (ids + self.salt) % 3 if self.salt else ids
        return h, ids, mask if self.salt % 2 else ~mask, unused


class End(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, h, ids, mask, unused):
        return self.lin(h), h.sum(1)  # a tuple for loss_fn and for step()'s merged output


class Chain(nn.Module):
    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, *args):
        for p in self.parts:
            args = p(*args)
            args = args if isinstance(args, tuple) else (args,)
        return args[0] if len(args) == 1 else args


def model() -> list[nn.Module]:
    torch.manual_seed(5)
    return [m.double() for m in (Start(), Block(0), Block(1), Block(2), End())]


def loss_fn(out, target):
    pred, extra = out
    return ((pred - target) ** 2).mean() + 0.1 * extra.pow(2).mean()


def data(salt: int):
    g = torch.Generator().manual_seed(40 + salt)
    return (torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 2, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("path", ["shared", "mpi"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("m", (1, 3, 4))
def test_tuple_boundaries_match_the_unsplit_model(comm, monkeypatch, name, m, path):
    monkeypatch.setenv("MPIRING_PP_SHARED", "1" if path == "shared" else "0")
    mods = model()
    full = Chain(copy.deepcopy(mods))
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    part = Chain(copy.deepcopy(mods[lo:hi]))
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = SCHEDULES[name](stage, m, loss_fn)
    for salt in (0, 1, 2):  # steps 2 and 3: the agreed layouts, over the fast path
        x, y = data(salt)
        full.zero_grad()
        losses = [loss_fn(full(a), b) for a, b in zip(torch.tensor_split(x, m),
                                                      torch.tensor_split(y, m))]
        torch.stack(losses).mean().backward()
        part.zero_grad()
        out = sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        if stage.is_last:
            with torch.no_grad():
                want = full(x)
            assert isinstance(out, tuple) and len(out) == 2
            for got, ref in zip(out, want):
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        ref_params = dict(full.parts[lo:hi].named_parameters())
        for n, p in part.parts.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-10, atol=1e-12)
    sched.close()


def test_one_stage_returns_the_tuple_merged(comm):
    if comm.size > 1:
        pytest.skip("one stage")
    stage = PipelineStage(Chain(model()), 0, 1, comm)
    x, y = data(0)
    out = Schedule1F1B(stage, 3, loss_fn).step(x, target=y)
    want = Chain(model())(x)
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref.detach())


def test_the_header_carries_the_layout():
    parts = (torch.zeros(2, 3), torch.ones(5, dtype=torch.int64), torch.zeros((), dtype=torch.bool),
             torch.zeros(0, 4, dtype=torch.float64))
    p = packing.pack(parts)
    assert p.data.dtype == torch.uint8 and p.data.numel() % packing.ALIGN == 0
    shape, dtype, layout = transport.from_header(transport.header(p))
    assert (shape, dtype) == ((p.data.numel(),), torch.uint8)
    assert layout == tuple((t.dtype, tuple(t.shape)) for t in parts)
    # A plain tensor's header has no layout.
    assert transport.from_header(transport.header(torch.zeros(2, 7)))[1:] == (torch.float32, None)
    back = packing.unpack(p.data, layout)
    for a, b in zip(parts, back):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert [b.data_ptr() % packing.ALIGN for b in back if b.numel()] == [0, 0, 0]


def test_the_parts_are_views_and_the_gradients_are_the_float_parts():
    parts = (torch.arange(6.0).view(2, 3), torch.arange(4), torch.ones(3, dtype=torch.float64))
    p = packing.pack(parts)
    back = packing.unpack(p.data, p.layout)
    back[0][0, 0] = 42.0  # a view of the message, not a copy
    assert packing.unpack(p.data, p.layout)[0][0, 0] == 42.0
    assert packing.grad_layout(p.layout) == ((torch.float32, (2, 3)), (torch.float64, (3,)))
    assert packing.pack(()).data.numel() == 0  # the gradients of a boundary of integers


@pytest.mark.parametrize("parts, why", [
    ((), "an empty tuple"),
    ((torch.zeros(1), 3), "element 1 of the tuple is a int"),
    ((torch.zeros(1),) * 17, "a tuple of 17 tensors; a boundary carries up to 16"),
    ((torch.zeros(1, dtype=torch.uint16),), "element 0 is torch.uint16"),
])
def test_parts_that_cannot_cross_say_why(parts, why):
    assert why in packing.check_parts(parts, transport.DTYPES, transport.MAX_DIMS)


class _NoSlots:
    """Shared slots that must not be written: the layout check comes first."""

    def send(self, *args):
        raise AssertionError("a changed layout reached the peer's slot")


@pytest.mark.parametrize("slots", [False, True], ids=["mpi", "shared"])
def test_a_changed_layout_of_the_same_size_names_renegotiate(comm, slots):
    if comm.size == 1:
        pytest.skip("a send needs a neighbour")
    t = transport.Transport(comm)
    if comm.rank == 0:
        a = Action(0, SEND_F, 2)
        first = packing.pack((torch.zeros(2, 4), torch.zeros(4, 2)))
        t.fresh = False  # a fast step: the first one agreed this layout
        t.sent[transport.key_of(a)] = (1, tuple(first.data.shape), torch.uint8, ("F", 1, 2))
        t.sent_layouts[transport.key_of(a)] = first.layout
        if slots:  # the fast path of stages on one host (its slot would take the bytes)
            t.shared_on, t.shared = True, _NoSlots()
        # The same bytes in other parts: the message alone would fit the receiver's buffer.
        for other in (packing.pack((torch.zeros(4, 2), torch.zeros(2, 4))), torch.zeros(
                first.data.numel(), dtype=torch.uint8)):
            with pytest.raises(ValueError, match=r"not the shape agreed on the first step .*"
                                                 r"agreed a tuple of torch.float32 \(2, 4\), "
                                                 r"torch.float32 \(4, 2\).*renegotiate\(\)"):
                t.send(a, other, [])
    comm.barrier()


class Start2(nn.Module):
    """A first stage of two inputs; the second's width reaches the boundary."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x, w):
        h = torch.tanh(self.lin(x)) * w.sum(1, keepdim=True)
        ids = (x[:, 0] > 0).long()
        return h, ids, x[:, 1] > 0, w  # w: a float part whose width the input decides


def two_input_model() -> list[nn.Module]:
    torch.manual_seed(6)
    return [m.double() for m in (Start2(), Block(1), Block(2), End())]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb"])
def test_several_inputs_and_eval_match_the_unsplit_model(comm, name):
    # step(x, w) splits both along dim 0; a new width of w alone is a new signature
    # (the boundary's layout changes with it). eval() between the steps runs the
    # forwards only: the unsplit model's outputs and losses, no gradient, nothing
    # held, and the training steps around it keep their own agreed shapes.
    mods = two_input_model()
    full = Chain(copy.deepcopy(mods))
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    part = Chain(copy.deepcopy(mods[lo:hi]))
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    m = 3
    sched = SCHEDULES[name](stage, m, loss_fn)
    for salt, width in ((0, 2), (1, 5), (2, 5), (3, 2)):
        x, y = data(salt)
        w = torch.randn(ROWS, width, generator=torch.Generator().manual_seed(salt),
                        dtype=torch.float64)
        full.zero_grad()
        chunks = zip(torch.tensor_split(x, m), torch.tensor_split(w, m), torch.tensor_split(y, m))
        want_losses = [loss_fn(full(a, b), t) for a, b, t in chunks]
        torch.stack(want_losses).mean().backward()
        with torch.no_grad():
            want = full(x, w)
        ins = (x, w) if stage.is_first else ()
        part.zero_grad(set_to_none=True)
        losses: list = []
        got = sched.eval(*ins, target=y if stage.is_last else None,
                         losses=losses if stage.is_last else None)
        assert all(p.grad is None for p in part.parameters())
        assert stage.live_bytes == 0
        if stage.is_last:
            for g, ref in zip(got, want):
                torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
            assert [float(v) for v in losses] == pytest.approx(
                [float(v.detach()) for v in want_losses], rel=1e-12)
            assert sched.eval(*ins) is not None  # no target: outputs, and no loss
        else:
            assert sched.eval(*ins) is None
        out = sched.step(*ins, target=y if stage.is_last else None)
        if stage.is_last:
            torch.testing.assert_close(out[0], want[0], rtol=1e-12, atol=1e-12)
        ref_params = dict(full.parts[lo:hi].named_parameters())
        for n, p in part.parts.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-10, atol=1e-12)
    sched.close()


def test_inputs_of_different_batch_sizes_are_refused_on_every_rank(comm):
    mods = two_input_model()
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    stage = PipelineStage(Chain(mods[lo:hi]), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, loss_fn)
    x, y = data(0)
    for call in (sched.step, sched.eval):
        with pytest.raises(ValueError, match=r"r0: stage 0: the inputs have \[10, 4\] rows; "
                                             r"each is split .* one batch size"):
            call(*((x, torch.zeros(4, 2, dtype=torch.float64)) if stage.is_first else ()),
                 target=y if stage.is_last else None)


class Pair(NamedTuple):
    pred: torch.Tensor
    extra: torch.Tensor


class NamedEnd(End):
    def forward(self, h, ids, mask, unused):
        return Pair(*super().forward(h, ids, mask, unused))


def test_a_namedtuple_output_comes_back_as_one(comm):
    mods = model()[:-1] + [NamedEnd().double()]
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    stage = PipelineStage(Chain(copy.deepcopy(mods[lo:hi])), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 3, loss_fn)
    x, y = data(0)
    want = Chain(copy.deepcopy(mods))(x)
    for run in (sched.step, sched.eval):
        out = run(*((x,) if stage.is_first else ()), target=y if stage.is_last else None)
        if stage.is_last:
            assert isinstance(out, Pair)
            torch.testing.assert_close(out.pred, want.pred.detach())
            torch.testing.assert_close(out.extra, want.extra.detach())


class Grow(nn.Module):
    """Its output's width is set from outside (a data-dependent shape)."""

    width = 2

    def forward(self, x):
        return x[:, :1].repeat(1, Grow.width)


def test_eval_after_renegotiate_and_close(comm, monkeypatch):
    # A first stage that hands its input on unchanged (it requires grad: eval must
    # detach it), a shape that changes with the input's unchanged (renegotiate() on
    # every rank reaches eval's transport too), and an eval() made after close() lays
    # out no shared window.
    if comm.size != 2:
        pytest.skip("two stages")
    monkeypatch.setattr(Grow, "width", 2)
    part = nn.Identity() if comm.rank == 0 else Grow()
    stage = PipelineStage(part, comm.rank, 2, comm)
    sched = Schedule1F1B(stage, 2, lambda out, t: out.sum())
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ins = (x,) if stage.is_first else ()
    sched.close()
    out = sched.eval(*ins)
    assert not sched._eval.transport.use_shared and sched._eval.transport.shared is None
    Grow.width = 5
    sched.renegotiate()
    out = sched.eval(*ins)
    if stage.is_last:
        assert out.shape == (4, 5)
    sched.step(*ins, target=torch.zeros(4) if stage.is_last else None)
    if stage.is_first:
        assert x.grad is not None


def test_eval_leaves_the_steps_counts_and_timeline(comm):
    mods = model()
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    stage = PipelineStage(Chain(copy.deepcopy(mods[lo:hi])), comm.rank, comm.size, comm,
                          count_activations=True)
    sched = ScheduleZeroBubble(stage, 3, loss_fn)
    x, y = data(0)
    ins = (x,) if stage.is_first else ()
    sched.step(*ins, target=y if stage.is_last else None)
    peak, spans = stage.peak_activation_bytes, list(sched.timeline)
    sched.eval(*ins)
    assert stage.peak_activation_bytes == peak > 0 and sched.timeline == spans
    assert [s.action.kind for s in sched.eval_timeline] == ["F"] * 3


class KwStart(nn.Module):
    """A first stage with keyword inputs: a row mask (split into the micro-batches), a
    0-dim scale and a float (both passed to every micro-batch as they are), rows inside
    a dict of lists (split too, as torch flattens), and an int that sets the width of
    what it hands on (another value: the stages agree the shapes again)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x, *, mask=None, scale=None, shift=0.0, extra=None, reps=1):
        h = torch.tanh(self.lin(x))
        if mask is not None:
            h = h * mask[:, None]
        h = h * (1.0 if scale is None else scale) + shift
        if extra is not None:
            h = h + 0.1 * extra["bias"][0][:, None]
        return h.repeat(1, reps)


class Fold(nn.Module):
    def forward(self, h):
        return h.reshape(h.shape[0], -1, 4).mean(1)


class KwChain(nn.Module):
    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x, **kwargs):
        if kwargs and not isinstance(self.parts[0], KwStart):
            raise TypeError(f"keyword inputs {sorted(kwargs)} reached a later stage")
        for p in self.parts:
            x = p(x, **kwargs) if isinstance(p, KwStart) else p(x)
        return x


def kw_model() -> list[nn.Module]:
    torch.manual_seed(6)
    # The fold comes late: on 2-4 stages the first stage hands on reps x 4 columns.
    return [m.double() for m in (KwStart(), nn.Tanh(), nn.Tanh(), nn.Tanh(), Fold(),
                                 nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))]


def mse(out, t):
    return ((out - t) ** 2).mean()


def kw_inputs(reps: int) -> dict:
    rows = torch.arange(ROWS, dtype=torch.float64)
    return {"mask": (rows % 3 != 1).double(), "scale": torch.tensor(0.5, dtype=torch.float64),
            "shift": 0.25, "extra": {"bias": [rows / ROWS]}, "reps": reps}


def kw_reference(full, x, y, m: int, kw: dict):
    """The unsplit model, micro-batch by micro-batch, each with its rows of every tensor."""
    def mine(i):
        return {**kw, "mask": torch.tensor_split(kw["mask"], m)[i],
                "extra": {"bias": [torch.tensor_split(kw["extra"]["bias"][0], m)[i]]}}
    full.zero_grad()
    losses = [mse(full(a, **mine(i)), b) for i, (a, b) in
              enumerate(zip(torch.tensor_split(x, m), torch.tensor_split(y, m)))]
    torch.stack(losses).mean().backward()
    with torch.no_grad():
        want = full(x, **kw)
    return [float(v.detach()) for v in losses], want


def free(sched, stages) -> None:
    """Give back the communicators a schedule and its stages made (MPI has a few
    thousand per process, and the suite makes many)."""
    sched.free()
    for st in stages:
        st.free()


KW_SCHEDULES = {**SCHEDULES,
                "interleaved": lambda st, m, lf: ScheduleInterleaved1F1B(st, m, lf),
                "zbv": lambda st, m, lf: ScheduleZBVZeroBubble(st, m, lf)}


@pytest.mark.parametrize("name", sorted(KW_SCHEDULES))
@pytest.mark.parametrize("m", (1, 3, 4))
def test_keyword_inputs_of_the_first_stage_match_the_unsplit_model(comm, name, m):
    # step(x, mask=..., ...): each tensor with rows split along dim 0 as the input is,
    # anything else to every micro-batch; recomputation replays them; only stage 0 gets
    # them (rank 0's second stage too would raise); a new reps agrees the shapes again.
    mods = kw_model()
    full = KwChain(copy.deepcopy(mods))
    v = 2 if name in ("interleaved", "zbv") else 1
    if v > 1 and m % comm.size:
        pytest.skip("the interleaved schedule takes a multiple of the ranks")
    n = v * comm.size
    mine = ([comm.rank, n - 1 - comm.rank] if name == "zbv" else
            list(range(comm.rank, n, comm.size)))
    cuts = bounds(len(mods), n)
    parts = [KwChain(copy.deepcopy(mods[slice(*cuts[i])])) for i in mine]
    stages = [PipelineStage(p, i, n, comm) for p, i in zip(parts, mine)]
    sched = KW_SCHEDULES[name](stages if v > 1 else stages[0], m, mse)
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    x, y = data(0)
    for reps in (1, 3):
        kw = kw_inputs(reps)
        want_losses, want = kw_reference(full, x, y, m, kw)
        got: list = []
        for part in parts:
            part.zero_grad()
        out = sched.step(*((x,) if first else ()), target=y if last else None,
                         losses=got if last else None, **(kw if first else {}))
        if last:
            assert [float(v) for v in got] == pytest.approx(want_losses, rel=1e-12)
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        for part, i in zip(parts, mine):
            ref = dict(full.parts[slice(*cuts[i])].named_parameters())
            for k, p in part.parts.named_parameters():
                torch.testing.assert_close(p.grad, ref[k].grad, rtol=1e-10, atol=1e-12)
        evaluated = sched.eval(*((x,) if first else ()), **(kw if first else {}))
        if last:
            torch.testing.assert_close(evaluated, want, rtol=1e-12, atol=1e-12)
    free(sched, stages)


def test_keyword_inputs_reach_pipedreams_stashed_forward(comm):
    # PipeDream runs each forward on its stashed weights (functional_call): with lr 0
    # the weights stay, so the losses are the unsplit model's.
    mods = kw_model()
    full = KwChain(copy.deepcopy(mods))
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    part = KwChain(copy.deepcopy(mods[lo:hi]))
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    # A stage of Tanh alone has no parameters: an optimizer over a zero it never moves.
    params = list(part.parameters()) or [nn.Parameter(torch.zeros(1))]
    sched = SchedulePipeDream(stage, 3, mse, optimizer=torch.optim.SGD(params, lr=0.0))
    x, y = data(0)
    kw = kw_inputs(2)
    want_losses, _ = kw_reference(full, x, y, 3, kw)
    got: list = []
    sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None,
               losses=got if stage.is_last else None, **(kw if stage.is_first else {}))
    if stage.is_last:
        assert [float(v) for v in got] == pytest.approx(want_losses, rel=1e-12)
    free(sched, [stage])


class StrictChain(KwChain):
    """KwChain with the keyword inputs spelled out: a signature to check calls against."""

    def forward(self, x, *, mask=None, scale=None, shift=0.0, extra=None, reps=1):
        return super().forward(x, mask=mask, scale=scale, shift=shift, extra=extra, reps=reps)


def test_a_keyword_the_first_stage_does_not_take_is_refused_on_every_rank(comm):
    # Misspelled: refused before anything moves, not a TypeError on rank 0 alone in the
    # middle of the schedule, with the other ranks waiting for it until the deadline.
    mods = kw_model()
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    part = (StrictChain if comm.rank == 0 else KwChain)(copy.deepcopy(mods[lo:hi]))
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, mse)
    x, y = data(0)
    for call in (sched.step, sched.eval):
        with pytest.raises(ValueError, match=r"r0: stage 0: StrictChain.forward does not take "
                                             r"these inputs \(got an unexpected keyword "
                                             r"argument 'maks'\)"):
            call(*((x,) if stage.is_first else ()), target=y if stage.is_last else None,
                 **({"maks": x[:, 0]} if stage.is_first else {}))
    sched.step(*((x,) if stage.is_first else ()), target=y if stage.is_last else None,
               **(kw_inputs(1) if stage.is_first else {}))
    free(sched, [stage])


def test_keyword_inputs_off_the_first_stage_or_of_other_rows_are_refused(comm):
    mods = kw_model()
    lo, hi = bounds(len(mods), comm.size)[comm.rank]
    stage = PipelineStage(KwChain(copy.deepcopy(mods[lo:hi])), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, mse)
    x, y = data(0)
    ins = (x,) if stage.is_first else ()
    tgt = y if stage.is_last else None
    if comm.size > 1:  # the last stage's rank also gives one: refused on every rank
        with pytest.raises(ValueError, match=rf"r{comm.size - 1}: stage {comm.size - 1}: "
                                             r"keyword inputs \['mask'\]: they go to the first"):
            sched.step(*ins, target=tgt, mask=torch.ones(ROWS, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"r0: stage 0: keyword inputs \{'mask': 7\} \(rows\)"):
        sched.step(*ins, target=tgt,
                   **({"mask": torch.ones(7, dtype=torch.float64)} if stage.is_first else {}))
    free(sched, [stage])
    x, y = data(0)
    # A target of many dimensions is the loss's business, not the agreement's.
    from mpiring.parallel.pipeline.runtime import _arg_error
    deep = torch.zeros((2,) + (1,) * 9)
    if stage.is_last:
        assert _arg_error(f"stage {stage.stage_index}", stage.is_first, True, stage.num_stages,
                          2, x if stage.is_first else None, deep, None) == ""
