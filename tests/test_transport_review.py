"""The pipeline's point-to-point transport as a demanding user drives it: boundaries of
every dtype the transport lists, shapes that change from step to step, and the
shared-memory windows of stages on one host over many steps. Numbers are compared
with the unsplit model in float64, over MPI messages and over shared memory."""

from __future__ import annotations

import copy

import pytest
import torch
from test_pipeline_shared import needs_shared_memory
from torch import nn

from mpiring.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from mpiring.parallel.pipeline import transport as transport_mod


class Cast(nn.Module):
    """A stage whose output (the next stage's input) is ``dtype``: a bool mask or int16
    codes, which carry no gradient, as a tokenizer or a router would hand on."""

    def __init__(self, dtype: torch.dtype, last: bool):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.dtype, self.last = dtype, last

    def forward(self, x):
        y = torch.tanh(self.lin(x.double()))
        if self.last:
            return y
        return y > 0 if self.dtype == torch.bool else torch.round(y * 100).to(self.dtype)


def _unsplit_grads(full: nn.Sequential, x, y, m: int):
    """The loss and gradients of the mean of the m micro-batch losses (torch's
    scale_grads=True), micro-batches as torch.tensor_split makes them."""
    full.zero_grad(set_to_none=True)
    loss = sum(((full(a) - b) ** 2).mean()
               for a, b in zip(torch.tensor_split(x, m), torch.tensor_split(y, m))) / m
    loss.backward()
    return float(loss.detach()), [p.grad for p in full.parameters()]


@pytest.mark.parametrize("via", ["mpi", "shared"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int16])
def test_a_bool_or_int16_boundary_matches_the_unsplit_model(comm, monkeypatch, via, dtype):
    # The transport lists bool and int16 among a boundary's dtypes (a tuple's part of
    # either already worked), but a lone tensor of either went to the communicator as it
    # is, which carries neither: "unsupported dtype bool: mpiring reduces ..." on both
    # ends of the first step. It travels as its bytes now.
    assert {torch.bool, torch.int16} <= set(transport_mod.DTYPES)
    monkeypatch.setenv("MPIRING_PP_SHARED", "1" if via == "shared" else "0")
    torch.manual_seed(4)
    full = nn.Sequential(*[Cast(dtype, k == comm.size - 1) for k in range(comm.size)]).double()
    stage = PipelineStage(copy.deepcopy(full[comm.rank]), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, lambda o, t: ((o - t) ** 2).mean())
    # A new shape at the third step; the second and fourth run the fast path (prepared
    # MPI messages, or the shared slots).
    for step, rows in enumerate((6, 6, 9, 9)):
        g = torch.Generator().manual_seed(10 * step + rows)
        x = torch.randn(rows, 3, generator=g, dtype=torch.float64)
        y = torch.randn(rows, 3, generator=g, dtype=torch.float64)
        stage.module.zero_grad(set_to_none=True)
        losses: list = []
        last = comm.rank == comm.size - 1
        out = sched.step(x if comm.rank == 0 else None, target=y if last else None,
                         losses=losses if last else None)
        want_loss, want = _unsplit_grads(full, x, y, 2)
        mine = [p.grad for p in stage.module.parameters()]
        theirs = want[2 * comm.rank:2 * comm.rank + 2]
        for a, b in zip(mine, theirs, strict=True):
            a = torch.zeros_like(b) if a is None and b is not None else a
            b = torch.zeros_like(a) if b is None and a is not None else b
            assert a is None or torch.allclose(a, b, rtol=0, atol=1e-12), f"step {step}"
        if last:
            assert abs(sum(float(v) for v in losses) / 2 - want_loss) < 1e-12
            torch.testing.assert_close(out, full(x), rtol=0, atol=1e-12)
        with torch.no_grad():
            ev = sched.eval(x if comm.rank == 0 else None)
        if last:
            torch.testing.assert_close(ev, full(x), rtol=0, atol=1e-12)
    assert sched.transport.shared_on == (via == "shared" and comm.size > 1)
    sched.close()


def test_a_growing_shape_holds_no_window_past_its_use(world, monkeypatch):
    comm = world  # the whole job only: at each smaller group it took 5 s more of the suite
    # A sequence-length warm-up: each step's shape larger than the last takes a new
    # window, and the old one was kept mapped until close() in case a tensor still
    # pointed into it. 400 such steps held 164 MB of /dev/shm per rank (one window
    # per shape, 800 mapped regions). A window is freed now once nothing points into it.
    if comm.size == 1:
        pytest.skip("one stage sends nothing")
    monkeypatch.setenv("MPIRING_PP_SHARED", "1")
    needs_shared_memory(comm)
    torch.manual_seed(1)
    full = nn.Sequential(*[nn.Linear(5, 5) for _ in range(comm.size)]).double()
    stage = PipelineStage(copy.deepcopy(full[comm.rank]), comm.rank, comm.size, comm)
    sched = ScheduleGPipe(stage, 2, lambda o, t: ((o - t) ** 2).mean())
    t = sched.transport
    windows, kept = [], None
    for step, rows in enumerate(range(8, 64, 8)):  # each step's slots larger than the last's
        x = torch.randn(rows, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))
        sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
        if step == 0:
            channel = "B" if stage.is_first else "F"
            kept = t.shared.buffer((channel, comm.rank, 0))  # a tensor the user keeps
            first = kept.clone()
        if step < 2:
            windows.append(t.shared.window)
        if 1 <= step <= 5:
            # The window of step 0 stays mapped while ``kept`` points into it (reading
            # it is no segmentation fault), and no other old one is held.
            assert t.retired == [windows[0]], step
        if step == 5:
            torch.testing.assert_close(kept, first, rtol=0, atol=0)  # still its memory
            kept = None  # let go: freed at the next new layout
        if step >= 6:
            assert t.retired == [], step
    assert windows[1] is not windows[0]
    assert windows[0].segments == [] and windows[1].segments == []  # freed, not leaked
    sched.close()


def _backing_file(address: int) -> str | None:
    """The file mapped at ``address`` in this process ('' for anonymous memory), or None
    where /proc/self/maps cannot tell."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if start <= address < end:
            return fields[5] if len(fields) > 5 else ""
    return None


def test_a_killed_job_leaves_no_window_behind(comm, monkeypatch):
    # A job killed mid-step (SIGKILL, MPI_Abort) runs no cleanup: only a window whose
    # file is already unlinked while the job runs leaves nothing in /dev/shm. Every
    # rank's part of the slots' window must be such memory, as the library maps it.
    if comm.size == 1:
        pytest.skip("one stage sends nothing")
    monkeypatch.setenv("MPIRING_PP_SHARED", "1")
    needs_shared_memory(comm)
    stage = PipelineStage(nn.Linear(3, 3).double(), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, lambda o, t: ((o - t) ** 2).mean())
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    for _ in range(2):
        sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
    segments = [s for s in sched.transport.shared.window.segments if len(s)]
    where = [_backing_file(s.ctypes.data) for s in segments]
    if None in where:
        pytest.skip("no /proc/self/maps here")
    named = [w for w in where if w and not w.endswith("(deleted)")]
    assert not named, f"the window is a named file a killed job would leave behind: {named}"
    sched.close()


class Rotate(nn.Module):
    """A stage whose boundary is complex: each row's four numbers as two complex ones
    (a rotary or spectral layer's hand-off), alone or in a tuple with a float part;
    the gradient comes back complex."""

    def __init__(self, first: bool, last: bool, pair: bool):
        super().__init__()
        self.first, self.last, self.pair = first, last, pair
        self.lin = nn.Linear(5 if pair else 4, 4)

    def forward(self, *xs):
        if len(xs) == 1 and isinstance(xs[0], tuple):  # nn.Sequential hands on the tuple
            xs = xs[0]
        z, *rest = xs
        x = z if self.first else torch.view_as_real(z).reshape(z.shape[0], 4)
        if self.pair and not self.first:
            x = torch.cat([x, rest[0]], dim=1)
        y = torch.tanh(self.lin(x))
        if self.last:
            return y
        out = torch.view_as_complex(y.reshape(y.shape[0], 2, 2).contiguous())
        return (out, y[:, :1] * 2) if self.pair else out


@pytest.mark.parametrize("via", ["mpi", "shared"])
@pytest.mark.parametrize("pair", [False, True], ids=["alone", "in-a-tuple"])
def test_a_complex_boundary_matches_the_unsplit_model(comm, monkeypatch, via, pair):
    # A complex activation was refused at the sender's first step ("a stage may pass
    # ... of float32, ..."), alone on its rank: the receiver waited for it until the
    # deadline. It travels as its bytes now, and its gradient (complex) comes back.
    monkeypatch.setenv("MPIRING_PP_SHARED", "1" if via == "shared" else "0")
    torch.manual_seed(5)
    k = comm.size
    full = nn.Sequential(*[Rotate(s == 0, s == k - 1, pair) for s in range(k)]).double()
    stage = PipelineStage(copy.deepcopy(full[comm.rank]), comm.rank, k, comm)
    sched = Schedule1F1B(stage, 2, lambda o, t: ((o - t) ** 2).mean())
    width = 5 if pair else 4
    for step, rows in enumerate((6, 6, 8)):
        g = torch.Generator().manual_seed(10 * step + rows)
        x = torch.randn(rows, width, generator=g, dtype=torch.float64)
        y = torch.randn(rows, 4, generator=g, dtype=torch.float64)
        stage.module.zero_grad(set_to_none=True)
        losses: list = []
        last = comm.rank == k - 1
        out = sched.step(x if comm.rank == 0 else None, target=y if last else None,
                         losses=losses if last else None)
        want_loss, want = _unsplit_grads(full, x, y, 2)
        mine = [p.grad for p in stage.module.parameters()]
        for a, b in zip(mine, want[2 * comm.rank:2 * comm.rank + 2], strict=True):
            assert a is not None and torch.allclose(a, b, rtol=0, atol=1e-12), f"step {step}"
        if last:
            assert abs(sum(float(v) for v in losses) / 2 - want_loss) < 1e-12
            torch.testing.assert_close(out, full(x), rtol=0, atol=1e-12)
    sched.close()
