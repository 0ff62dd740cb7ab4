"""Before a collective moves data: validate locally, agree across ranks, stage GPU buffers.

Every collective goes through ``_prepare``: the buffer and arguments are checked
on this rank (TypeError/ValueError naming the fix), then, unless checking is
off, the call's descriptor is exchanged with every rank (``comm.agreement``), so
that a bad buffer on one rank can never leave the others waiting in a ring step.
A communicator serves one thread at a time: a second thread is refused, naming
both.
"""

from __future__ import annotations

import threading
from threading import get_ident as _get_ident

import numpy as np

from mpiring.backends.gpu import device_plan
from mpiring.comm.agreement import agree
from mpiring.comm.algos import ALGOS, REDUCING, SEGMENTED
from mpiring.comm.callsite import site_code
from mpiring.core.buffers import Buffer, as_buffer
from mpiring.core.ops import check_op


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class Preparation:
    """The Communicator's preparation of a call (a mixin of ``Communicator``)."""

    def _steps(self, collective: str, call: int, algo: str):
        # The ring code reports each finished step to the watchdog's record,
        # which forwards it to the tracer when tracing is on.
        trace = self.tracer.call(collective, call, algo)
        if trace.enabled:  # name the group (its job ranks) only when recording
            trace = trace.on(self)
        return self._act.steps_to(trace)

    def _next_call(self, collective: str) -> int:
        n = self._calls.get(collective, 0) + 1
        self._calls[collective] = n
        return n

    def _enter(self, buf: Buffer) -> Buffer:
        # After every rank agreed, before any byte moves: stage a GPU buffer
        # through host memory, or switch to the NCCL stream.
        return buf if self._plan is None else self._plan.enter(buf)

    def _abandon(self) -> None:
        # A collective raised midway (a deadline, a GPU error): the caller gets its
        # own stream back and nothing the call queued is issued by the next one.
        # The lock stays with this thread (see ``_other_thread``).
        plan, self._plan = self._plan, None
        if plan is not None:
            plan.abandon()

    def _finish(self) -> None:
        plan, self._plan = self._plan, None
        if plan is not None:
            plan.leave()  # copy a staged result back, or hand the stream back
        self._be.synchronize()
        self._owner = 0  # before the release: no thread may read a stale owner as its own
        self._busy.release()

    def _other_thread(self, name: str) -> None:
        # The lock is held: by another thread inside a collective (refused), or by
        # this one after a collective that failed midway (carry on).
        me = _get_ident()
        if self._owner == me:
            return
        names = {t.ident: t.name for t in threading.enumerate()}
        inside = f"{self._owner_call}#{self._calls.get(self._owner_call, 0)}"
        raise RuntimeError(
            f"{name}: thread {names.get(me, me)!r} called a collective on this "
            f"communicator while thread {names.get(self._owner, self._owner)!r} is "
            f"inside {inside}: their messages would mix. Give each thread "
            "its own communicator: comm.dup() (collective, on every rank)")

    def _validate(self, collective: str, x, op, algo, root, chunks) -> Buffer:
        self._plan = None
        buf = as_buffer(x)
        if algo not in ALGOS[collective]:
            raise ValueError(
                f"unknown algo {algo!r} for {collective}: use one of "
                f"{', '.join(ALGOS[collective])}"
            )
        if collective in REDUCING:
            check_op(op, buf.dtype, buf.floating)
        if root is not None and (not _is_int(root) or not 0 <= root < self.size):
            raise ValueError(f"root={root!r} out of range: use a rank in 0..{self.size - 1}")
        if chunks is not None and (not _is_int(chunks) or chunks < 1):
            raise ValueError(f"chunks={chunks!r}: the pipeline needs a positive integer "
                             "number of chunks (or None for the default)")
        # GPU buffers (and any buffer on a backend that takes device memory): host
        # staging, CUDA-aware pass-through or the NCCL stream; see mpiring.backends.gpu.
        if buf.device == "cuda" or getattr(self._be, "accepts_cuda", False):
            self._plan = device_plan(self._be, buf, collective, algo, op)
        if algo == "native":
            self._be.check_native(collective, buf.dtype, op if collective in REDUCING else None)
        return buf

    def _prepare(self, collective: str, x, *, op=None, algo="ring", root=None,
                 chunks=None, check=None, error: Exception | None = None) -> tuple[Buffer, int]:
        if not self._busy.acquire(False):
            self._other_thread(collective)
        self._owner = _get_ident()
        self._owner_call = collective
        call = self._next_call(collective)
        try:
            return self._checked(collective, call, x, op, algo, root, chunks, check, error)
        except BaseException:
            # A call refused before any data moved does not count: every rank
            # refused it, so the call numbers stay in step across ranks.
            self._calls[collective] = call - 1
            self._owner = 0
            self._busy.release()
            raise

    def refuse(self, collective: str, error: Exception) -> None:
        """Take part in the coming ``collective`` only to refuse it: raises ``error``
        here and a ValueError quoting it on every other rank, before any data moves.

        For a layer that finds, before the call, that this rank's own input is wrong
        (a shape only it sees): the other ranks are about to enter ``collective``,
        and its argument check carries the error to them. With the check off
        (``check=False``, ``MPIRING_CHECK=0``) there is no such exchange: ``error``
        is raised here only.
        """
        self._prepare(collective, None, error=error)  # raises: the call's own refusal path
        raise error  # pragma: no cover

    def _checked(self, collective: str, call: int, x, op, algo, root, chunks,
                 check, error: Exception | None = None) -> tuple[Buffer, int]:
        """``error``: refused before the call (``refuse``), nothing to validate."""
        self._act.begin(collective, call, algo if isinstance(algo, str) else None)
        buf = None
        if error is None:
            try:
                buf = self._validate(collective, x, op, algo, root, chunks)
            except Exception as exc:  # noqa: BLE001 - any local failure must reach the other ranks
                error = exc
        if not (self.check if check is None else check) or self.size == 1:
            if error is not None:
                raise error
            return self._enter(buf), call
        segment = self._segment_bytes if collective in SEGMENTED else None
        agree(self._be, collective, call, buf, op, algo, root, chunks, segment, error,
              site_code(2))  # from all_reduce/...: the first frame outside mpiring
        return self._enter(buf), call
