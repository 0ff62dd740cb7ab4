"""The activations and gradients between neighbouring stages: shapes agreed once, buffers kept.

A run of consecutive sends and receives is posted together: a send is an
``isend`` (waited for at the end of the step, so a send never holds its rank
up), the receives are waited for before the next compute action. On NCCL the
run is one ``comm.group()``.

What a message costs beyond its bytes is paid once per input shape, not per
micro-batch:

* the shapes: the first step with a new input shape sends a small int64 header
  (dtype, dims) ahead of each micro-batch's activation (no pickle); later
  steps reuse them;
* the check: that first step's data goes on the pipeline's communicator with
  the argument check on (each message carries a descriptor that the receiver
  compares, so a stage whose output does not match what it announced is a
  ``MismatchError``). Later steps send on a duplicate with the check off: one
  message per tensor instead of two, and no comparison. When a stage's output
  shape can change while the input's does not (data-dependent shapes), every
  rank must call ``sched.renegotiate()`` before such a step;
* the buffers: each micro-batch's receive buffer is allocated on the first step
  and received into again on the next ones;
* the receives: on MPI, once the shapes are known, every receive of the step is
  posted when the step starts (``start_step``), into those buffers, so that a
  message lands whenever it comes and the wait is all that is left between two
  compute actions. Messages between a pair on one tag arrive in the order they
  were sent, and the validator has checked that both ends list them in the
  same order, so posting them all ahead matches each to its micro-batch;
* the posts: on MPI the fast steps send and receive through
  ``comm.prepare_send``/``prepare_recv``, checked once per micro-batch and
  channel, so that posting a send right after the compute that made its
  tensor is the MPI call and little else;
* the runs: what ``exchange`` needs of a run (its remote actions, their keys)
  and what a send through the shared slots needs of a message (the consumer's
  slot, the tag) are worked out once, so that the runtime's steps between two
  compute actions, which run with the caches the compute has just filled, are
  few;
* the library: when every stage runs on one host, the first step's end lays
  out a shared-memory window with a slot per incoming message (``shared``),
  and the fast steps copy each tensor straight into its consumer's slot.

On MPI a stage waits by polling (``wait_all``). A spinning wait would take a
core from the ranks that compute (the bubble lasts whole forwards of the
neighbour); a sleeping one sees the message up to a sleep late, at every
dependency of the schedule. So the wait sleeps between polls through most of
the time the same wait took on the last step, then polls in a tight loop for
``SPIN_S`` around the moment the message is due, then sleeps again. Every wait
starts with ``FIRST_S`` of tight polling: a message that came while the rank
was computing is still in the MPI library's shared-memory queue, and taking it
out needs more than one test (the first finds it, a later one copies it), so a
sleep after the first miss would add itself to a message that is already there.
``MPIRING_IDLE=spin`` keeps the tight loop throughout. After ``POLL_S`` the
communicator's own wait takes over, with its deadline and stall report.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import torch

from mpiring.core.buffers import DTYPES as CARRIED
from mpiring.parallel.pipeline import packing, shared
from mpiring.parallel.pipeline.actions import RECV_B, RECV_F, SEND_F, Action

TAG_ACT, TAG_GRAD, TAG_META = 1, 2, 3
#: Tags per pair of neighbouring stages: stages s and s + 1 use TAG_* + TAGS * s, so
#: a rank holding several stages (interleaved) keeps each pair's messages apart.
TAGS = 3
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
          torch.complex128)
MAX_DIMS = 8
#: The dtypes above that the communicator does not carry as numbers (bool, int16,
#: complex): such an activation travels as its bytes (``_wire``); the header names its
#: dtype.
AS_BYTES = frozenset(d for d in DTYPES if str(d).removeprefix("torch.") not in CARRIED)
#: Seconds a wait polls in a tight loop before it sleeps between polls.
SPIN_S = 1e-3
#: Seconds every wait polls in a tight loop before its first sleep.
FIRST_S = 1e-4
#: Seconds between polls after that (the kernel's timer slack is added to it).
SLEEP_S = 2e-5
#: Seconds of polling before the communicator's blocking wait (deadline, stall report).
POLL_S = 1.0


#: dtype index in a header's first row that marks a packed boundary (``packing``).
PACKED = len(DTYPES)
ROW = 2 + MAX_DIMS
#: int64s in a header: a row for the message, then one per part of a packed one.
HEADER = ROW * (1 + packing.MAX_PARTS)


def header(t: torch.Tensor | packing.Packed) -> np.ndarray:
    """dtype index, number of dims, then the dims (-1 padded): what a receiver allocates
    from; for a packed boundary, (PACKED, 1, bytes, parts), then a row per part."""
    h = np.full(HEADER, -1, dtype=np.int64)
    parts = t.layout if isinstance(t, packing.Packed) else ((t.dtype, tuple(t.shape)),)
    for i, (dtype, shape) in enumerate(parts, start=1 if isinstance(t, packing.Packed) else 0):
        if len(shape) > MAX_DIMS or dtype not in DTYPES:
            raise TypeError(f"activation of shape {tuple(shape)} and dtype {dtype}: a stage "
                            f"may pass up to {MAX_DIMS} dimensions of {', '.join(map(str, DTYPES))}")
        h[i * ROW:i * ROW + 2] = DTYPES.index(dtype), len(shape)
        h[i * ROW + 2:i * ROW + 2 + len(shape)] = shape
    if isinstance(t, packing.Packed):
        h[:4] = PACKED, 1, t.data.numel(), len(t.layout)
    return h


def from_header(h: np.ndarray) -> tuple[tuple[int, ...], torch.dtype, packing.Layout | None]:
    """(shape, dtype) of the message, and the parts' layout of a packed one (else None)."""
    if int(h[0]) == PACKED:
        rows = [h[i * ROW:(i + 1) * ROW] for i in range(1, 1 + int(h[3]))]
        layout = tuple((DTYPES[int(r[0])], tuple(int(v) for v in r[2:2 + int(r[1])]))
                       for r in rows)
        return (int(h[2]),), torch.uint8, layout
    return tuple(int(v) for v in h[2:2 + int(h[1])]), DTYPES[int(h[0])], None


def _describe(what) -> str:
    """A layout (or a description already) in an error message."""
    if isinstance(what, str):
        return what
    if what is None:
        return "one tensor (not a tuple)"
    return "a tuple of " + ", ".join(f"{d} {tuple(s)}" for d, s in what)


def _timer_slack(ns: int | None) -> int | None:
    """Set this thread's timer slack (Linux ``prctl``); returns the old value, or None."""
    if _PRCTL is None:
        return None
    old = _PRCTL(30, 0, 0, 0, 0)  # PR_GET_TIMERSLACK
    if ns is not None and old >= 0:
        _PRCTL(29, ns, 0, 0, 0)  # PR_SET_TIMERSLACK
    return old if old >= 0 else None


def _load_prctl():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl if os.uname().sysname == "Linux" else None
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None


_PRCTL = _load_prctl()


def wait_all(reqs: list, spin_s: float = SPIN_S, sleep_s: float | None = SLEEP_S,
             expect_s: float = 0.0) -> float:
    """Complete ``reqs``: poll (tight, sleeping, tight, sleeping), then the communicator's wait.

    The first ``FIRST_S`` polls tightly. ``expect_s``: how long this wait took
    last time; up to 80% of it passes in sleeping polls, then the loop polls
    tightly for ``spin_s``; a message that comes early is seen at the next
    sleeping poll. Returns the seconds waited.
    """
    pending = [r for r in reqs if not r.test()]
    if not pending:
        return 0.0
    start = now = time.perf_counter()
    spin_from = start + 0.8 * expect_s if sleep_s is not None else start
    spin_until, poll_until = spin_from + spin_s, start + POLL_S
    first_until = start + FIRST_S
    slack = None
    try:
        while pending and now < poll_until:
            if sleep_s is not None and now >= first_until and not spin_from <= now < spin_until:
                if slack is None:
                    # Sleeps end on time only with a fine timer slack (the default adds
                    # 50 us to each); this thread's own setting, put back when the wait ends.
                    slack = _timer_slack(1000) or 0
                time.sleep(sleep_s)
            pending = [r for r in pending if not r.test()]
            now = time.perf_counter()
    finally:
        if slack:
            _timer_slack(slack)
    for r in pending:  # still not there: wait under the deadline (stall report, abort)
        r.wait()
    return time.perf_counter() - start


def tag_of(a: Action) -> int:
    """The tag of send or receive ``a``: its kind's, on the tags of its pair of stages."""
    base = TAG_ACT if a.channel == "F" else TAG_GRAD
    return base + TAGS * min(a.stage, a.peer)


def key_of(a: Action) -> tuple[str, int, int]:
    """(channel, stage, mb) of send or receive ``a``, at its own stage: the runtime's
    and the transport's name for the message at this end."""
    return a.channel, a.stage, a.mb


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes to the communicator for ``t`` (contiguous): ``t``, or for a dtype it does
    not carry (``AS_BYTES``: bool, int16, complex, which it refuses) a uint8 view of its
    memory."""
    if t.dtype not in AS_BYTES:
        return t
    return t.view(torch.uint8) if t.element_size() == 1 else t.reshape(-1).view(torch.uint8)


class _BytesSend:
    """A prepared send of a dtype in ``AS_BYTES``: each tensor posted as its bytes (chosen
    when the send is prepared, so that other dtypes' posts pay nothing for it; the
    agreed dtype is checked before the post)."""

    __slots__ = ("_prepared",)

    def __init__(self, prepared):
        self._prepared = prepared

    def post(self, t: torch.Tensor):
        return self._prepared.post(_wire(t))


def _reused(buf: torch.Tensor) -> torch.Tensor:
    """A kept receive buffer, ready for this step's message: out of last step's graph."""
    if buf.grad is not None:  # last step's input gradient must not accumulate
        buf.grad = None
    return buf.detach_() if buf.requires_grad else buf


class Transport:
    """One stage's point-to-point traffic. ``comm``: the stage's own (duplicated) communicator.

    ``comm.dup()`` is collective: every stage of the pipeline builds its Transport
    at the same point (a schedule's constructor, and its first ``eval()``).
    """

    def __init__(self, comm, ranks: list[int] | None = None):
        self.checked = comm
        self.size, self.me = comm.size, comm.rank
        # Stage s's rank: s % size (one stage per rank: s; interleaved: r, r + size, ...),
        # or ``ranks[s]`` (``schedules.stage_ranks``: ZB-V's V).
        self.rank_of = (lambda s: s % self.size) if ranks is None else list(ranks).__getitem__
        self.fast = comm.dup()
        self.fast.check = False  # shapes agreed by the header: the descriptors only repeat them
        self.mpi = comm.backend == "mpi"
        # The tight loop only where the user asked for spinning waits.
        spin = os.environ.get("MPIRING_IDLE", "").strip().lower() == "spin"
        self.sleep_s = None if spin else SLEEP_S
        # Stages on one host: messages through a shared window (``shared``), once the
        # first step has agreed the shapes.
        use = self.mpi and comm.size > 1 and shared.enabled()
        # Agreed: the layout's collectives must run on every rank or none (a launch may
        # give the ranks different environments).
        self.use_shared = use and comm.control.allreduce_scalar(float(use), "min") >= 1
        self.shared: shared.SharedSlots | None = None
        self.retired: list = []  # earlier windows: tensors the user kept may point into them
        self.steps = 0  # this transport's steps, the same on every rank (the slots' flags)
        self.renegotiate()

    def close(self) -> None:
        """Collective: free the shared-memory windows; later steps go over MPI.

        A tensor over a window (a stage input kept past its step) must not be used
        after this.
        """
        windows = ([self.shared.window] if self.shared is not None else []) + self.retired
        self.shared, self.shared_on, self.retired, self.use_shared = None, False, [], False
        for window in windows:
            window.free()
        self.renegotiate()

    def free(self) -> None:
        """Collective: ``close()``, then give back the fast steps' communicator (no step
        after this)."""
        self.close()
        self.fast.free()

    def renegotiate(self) -> None:
        """Agree the shapes again (and check them) on the next step; call it on every rank."""
        # Messages are named (channel, stage, mb) at each end (``key_of``).
        self.meta: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> a received header
        self.meta_sent: set[tuple[int, int]] = set()
        self.fresh = True
        self.bufs: dict[tuple[str, int, int], torch.Tensor] = {}
        # The fast steps' sends and receives, checked once (``comm.prepare_send``).
        self.prepared_sends: dict[tuple[str, int, int], object] = {}
        self.prepared_recvs: dict[tuple[str, int, int], object] = {}
        # Send action -> (the consumer's key, its rank, tag, agreed layout): shared slots.
        self.routes: dict[Action, tuple] = {}
        # id(run) -> (run, its remote actions' (action, key, is a receive), any receive,
        # the key its wait is timed under): ``exchange``'s work per run, done once.
        self.runs: dict[int, tuple] = {}
        self.posted: dict[tuple[str, int, int], tuple] = {}
        self.waited: dict[tuple[str, int, int], float] = {}  # a group's wait, last step
        # The first step's sends, key -> (peer rank, shape, dtype, the consumer's key):
        # what the shared slots are laid out for, at that step's end (the old window is
        # reused or retired there, both collectively; renegotiate() touches no window).
        self.sent: dict[tuple[str, int, int], tuple] = {}
        self.sent_layouts: dict[tuple[str, int, int], packing.Layout | None] = {}
        self.shared_on = False

    def start_step(self, program: list[Action]) -> None:
        """Number the step; post every receive of this rank's program ahead (MPI, shapes
        known), or its slots' arrivals (shared memory)."""
        self.posted = {}
        self.steps += 1  # the same on every rank: every step() comes here once
        program = [a for a in program if a.is_comm and self.remote(a)]
        if self.shared_on:
            for a in program:
                if a.kind in (RECV_F, RECV_B):
                    # A new tensor over the slot each step: last step's one is a leaf of
                    # last step's graph, and a view cannot be detached in place.
                    key = key_of(a)
                    buf = self.shared.buffer(key).detach()
                    self.posted[key] = (buf, self.shared.arrival(
                        key, self.rank_of(a.peer), self.steps, tag_of(a)))
            return
        if self.fresh or not self.mpi:
            return
        recvs = [a for a in program if a.kind in (RECV_F, RECV_B)]
        if any(key_of(a) not in self.bufs for a in recvs):
            # A step that stopped early left a buffer out. MPI matches receives of
            # one source and tag in the order they were posted, so posting the
            # others ahead of it would hand its message to a later micro-batch:
            # this step posts every receive in its group instead.
            return
        for a in recvs:
            key = key_of(a)
            buf = _reused(self.bufs[key])
            prepared = self.prepared_recvs.get(key)
            # A message as bytes is received into a view of ``buf`` (its ``_base``).
            if prepared is None or (prepared.buffer is not buf and
                                    prepared.buffer._base is not buf):
                prepared = self.prepared_recvs[key] = self.fast.prepare_recv(
                    _wire(buf), self.rank_of(a.peer), tag_of(a))
            self.posted[key] = (buf, prepared.post())

    def remote(self, a: Action) -> bool:
        """Whether send or receive ``a`` crosses to another rank (else the runtime hands
        the tensor over between two of this rank's stages)."""
        return self.rank_of(a.peer) != self.me

    def end_step(self) -> None:
        if self.fresh and self.use_shared:  # every rank, after the same first step
            incoming = {key: (tuple(b.shape), b.dtype) for key, b in self.bufs.items()}
            outgoing = {theirs: (peer, shape, dtype)
                        for peer, shape, dtype, theirs in self.sent.values()}
            old = self.shared
            self.shared = shared.SharedSlots.create(self.fast, incoming, outgoing, old=old)
            if old is not None and (self.shared is None or self.shared.window is not old.window):
                self.retired.append(old.window)  # not unmapped yet: see ``close``
            # Only the old slots' own views point into it now, unless the user kept a
            # tensor: once they are gone, a window nothing points into is freed here, so
            # that a shape that keeps growing (a sequence-length warm-up) does not hold
            # one window per shape in /dev/shm until close().
            del old
            self.retired = shared.release(self.fast, self.retired)
            self.shared_on = self.shared is not None
            if self.shared_on:  # the slots are the receive buffers now
                self.bufs, self.prepared_recvs = {}, {}
        self.fresh = False

    def layout(self, stage: int, mb: int) -> packing.Layout | None:
        """The parts of micro-batch ``mb``'s activation received by ``stage``, if its
        boundary is packed."""
        meta = self.meta.get((stage, mb))
        return None if meta is None else meta[2]

    def _buffer(self, key: tuple[str, int, int], shape, dtype) -> torch.Tensor:
        buf = self.bufs.get(key)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            buf = self.bufs[key] = torch.empty(shape, dtype=dtype)
        return _reused(buf)

    def send(self, a: Action, t: torch.Tensor | packing.Packed, sends: list) -> None:
        """Post the send ``a`` of ``t`` (a header first on a step that agrees shapes)."""
        if self.shared_on:
            # The fast steps' common case, with what it needs worked out once per message:
            # it runs right after the compute that made ``t``, when every lookup is cold.
            route = self.routes.get(a)
            if route is None:
                key = key_of(a)
                route = self.routes[a] = ((a.channel, a.peer, a.mb), self.rank_of(a.peer),
                                          tag_of(a), self.sent_layouts.get(key))
            theirs, peer, tag, agreed_layout = route
            if type(t) is packing.Packed or agreed_layout is not None:
                layout = t.layout if isinstance(t, packing.Packed) else None
                if layout != agreed_layout:
                    raise self._changed(a, ValueError(
                        f"got {_describe(layout)}, agreed {_describe(agreed_layout)}"))
                t = t.data if layout is not None else t
            try:  # the slot checks the shape and dtype (the agreed ones: its layout's)
                self.shared.send(theirs, peer, t, self.steps, tag)
            except ValueError as exc:
                raise self._changed(a, exc) from None
            return
        tag, peer = tag_of(a), self.rank_of(a.peer)
        layout = t.layout if isinstance(t, packing.Packed) else None
        message = t.data if layout is not None else t
        key = key_of(a)
        if self.fresh:
            self.sent[key] = (peer, tuple(message.shape), message.dtype,
                              (a.channel, a.peer, a.mb))
            self.sent_layouts[key] = layout
        elif (agreed := self.sent.get(key)) is not None and (
                message.shape != agreed[1] or message.dtype != agreed[2] or
                layout != self.sent_layouts.get(key)):
            # The unchecked messages carry bytes only: a new shape of the same size
            # would land in the old one's buffer, reinterpreted, without an error.
            agreed_layout = self.sent_layouts.get(key)
            got, want = ((layout, agreed_layout) if layout or agreed_layout else
                         (f"{message.dtype} of shape {tuple(message.shape)}",
                          f"{agreed[2]} of shape {agreed[1]}"))
            raise self._changed(a, ValueError(f"got {_describe(got)}, agreed {_describe(want)}"))
        t = message
        if not self.fresh and self.mpi:
            # Checked once per micro-batch and channel: right after a compute action,
            # wrapping a tensor for MPI runs cold and costs more than the message.
            prepared = self.prepared_sends.get(key)
            if prepared is None:
                prepared = self.prepared_sends[key] = (
                    self.fast.prepare_send(t, peer, tag) if t.dtype not in AS_BYTES else
                    _BytesSend(self.fast.prepare_send(_wire(t), peer, tag)))
            try:
                sends.append(prepared.post(t))
            except ValueError as exc:
                raise self._changed(a, exc) from None
            return
        comm = self.checked if self.fresh else self.fast
        if a.kind == SEND_F and (a.stage, a.mb) not in self.meta_sent:
            h = header(packing.Packed(t, layout) if layout is not None else t)
            sends.append(self.checked.isend(h, peer, tag - TAG_ACT + TAG_META))
            self.meta_sent.add((a.stage, a.mb))
        sends.append(comm.isend(_wire(t), peer, tag))

    @staticmethod
    def _changed(a: Action, exc: Exception) -> ValueError:
        """The agreed shape changed without a new input shape."""
        return ValueError(f"{a}: this micro-batch's tensor is not the shape agreed on the first "
                          f"step ({exc}); when a stage's output shape depends on the data, call "
                          "sched.renegotiate() on every rank before such a step")

    def exchange(self, run: list[Action], outgoing: dict, incoming: dict, grad_like,
                 sends: list) -> None:
        """Post one run of sends and receives; return once the receives have arrived.

        Args:
            outgoing: ("F" | "B", stage, mb) -> tensor to send (popped); a send
                whose tensor is not there was posted already (``send``).
            incoming: filled with ("F" | "B", stage, mb) -> received tensor.
            grad_like: (stage, mb) -> that stage's output (the gradient's shape and
                dtype).
            sends: the send requests, waited for by the caller at the end of the step.
        """
        ops = self.runs.get(id(run))
        if ops is None or ops[0] is not run:
            # Per run, once: its remote actions, their keys, and which are receives.
            remote = [a for a in run if self.remote(a)]
            ops = self.runs[id(run)] = (run, tuple(
                (a, key_of(a), a.kind in (RECV_F, RECV_B)) for a in remote),
                any(a.kind in (RECV_F, RECV_B) for a in remote),
                None if not remote else (remote[0].kind, remote[0].stage, remote[0].mb))
        _, items, receives, wait_key = ops
        if not items:  # hand-overs between this rank's own stages only
            return
        posted = self.posted
        if self.mpi and not self.fresh and (posted or not receives):
            # The fast steps: every receive was posted when the step started (start_step
            # posts all or none), so a run is its sends, then waiting for its receives.
            for a, key, is_recv in items:
                if not is_recv and key in outgoing:
                    self.send(a, outgoing.pop(key), sends)
            if receives:
                recvs = []
                for _, key, is_recv in items:
                    if is_recv:
                        buf, req = posted.pop(key)
                        incoming[key] = buf
                        recvs.append(req)
                self.waited[wait_key] = wait_all(recvs, sleep_s=self.sleep_s,
                                                 expect_s=self.waited.get(wait_key, 0.0))
            return
        run = [a for a, _, _ in items]
        comm = self.checked if self.fresh else self.fast
        recvs = []
        if self.mpi:
            # The run's sends first: an isend never blocks, and on a step that agrees
            # shapes the header receives below do. With several stages per rank two
            # ranks send each other activations (0 -> 1 for stage 1, 1 -> 0 for stage
            # 2), so a header may come only once the peer has this run's send.
            for a in run:
                if a.kind not in (RECV_F, RECV_B) and (key := key_of(a)) in outgoing:
                    self.send(a, outgoing.pop(key), sends)
        for a in run:  # headers first (first step only), so a group holds only the data
            if a.kind == RECV_F and (a.stage, a.mb) not in self.meta:
                h = self.checked.recv(np.empty(HEADER, dtype=np.int64), self.rank_of(a.peer),
                                      tag_of(a) - TAG_ACT + TAG_META)
                self.meta[(a.stage, a.mb)] = from_header(h)
        grouped = comm.group() if comm.backend == "nccl" else contextlib.nullcontext()
        with grouped:
            for a in run:
                key = key_of(a)
                if a.kind in (RECV_F, RECV_B) and key in self.posted:
                    buf, req = self.posted.pop(key)
                    incoming[key] = buf
                    recvs.append(req)
                elif a.kind == RECV_F:
                    buf = incoming[key] = self._buffer(key, *self.meta[(a.stage, a.mb)][:2])
                    recvs.append(comm.irecv(_wire(buf), self.rank_of(a.peer), tag_of(a)))
                elif a.kind == RECV_B:
                    out = grad_like(a.stage, a.mb)
                    buf = incoming[key] = self._buffer(key, out.shape, out.dtype)
                    recvs.append(comm.irecv(_wire(buf), self.rank_of(a.peer), tag_of(a)))
                elif key in outgoing:
                    self.send(a, outgoing.pop(key), sends)
        if self.mpi:
            key = (run[0].kind, run[0].stage, run[0].mb)
            self.waited[key] = wait_all(recvs, sleep_s=self.sleep_s,
                                        expect_s=self.waited.get(key, 0.0))
        else:
            for req in recvs:
                req.wait()
