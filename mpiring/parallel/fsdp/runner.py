"""The communication thread: FSDP's collectives, one at a time, in the order submitted.

Every rank submits the same collectives in the same order (units are gathered
and reduced in the model's order, which is the same everywhere), so one worker
thread running them strictly in order keeps the ranks matched, while the main
thread computes the current unit. Each task gets a Future, so waiting for one
unit's gather does not wait for the reductions queued behind it.

Why a thread rather than non-blocking requests: on the MPI backend a request
makes no progress while the process makes no MPI call, so a prefetch posted
before a unit's forward would sit idle until the forward ends (the same reason
as DDP's, see ``mpiring.parallel.data.reducer``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

#: How many submitted tasks are kept before the finished ones are dropped.
PRUNE_AT = 256


class CommRunner:
    """Runs closures on one thread (or inline, ``threaded=False``), in submission order.

    After a closure raises, the ones behind it are skipped: a failed collective
    leaves the ranks out of step, and issuing more could only hang.
    """

    def __init__(self, name: str, threaded: bool = True):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name) if threaded else None
        self._pending: list[Future] = []
        self._error: BaseException | None = None

    def _guarded(self, fn: Callable[[], None]) -> None:
        if self._error is not None:
            raise RuntimeError("skipped: an earlier collective on this thread failed")
        try:
            fn()
        except BaseException as exc:
            self._error = exc
            raise

    def submit(self, fn: Callable[[], None]) -> Future:
        """Queue ``fn``; returns its Future (already done when not threaded)."""
        if self._pool is None:
            fut: Future = Future()
            try:
                self._guarded(fn)
                fut.set_result(None)
            except BaseException as exc:
                fut.set_exception(exc)
        else:
            fut = self._pool.submit(self._guarded, fn)
        self._pending.append(fut)
        if len(self._pending) > PRUNE_AT:
            # A forward without backward never calls wait_all: drop what has
            # finished, now and then, not at every submit (each check takes the
            # future's lock, which the thread contends). Keep the failed ones:
            # wait_all must still raise their errors.
            self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        return fut

    @staticmethod
    def result(fut: Future) -> None:
        """Wait for one task; its exception is raised here, naming the thread."""
        try:
            fut.result()
        except BaseException as exc:
            raise RuntimeError(f"FullyShardedDataParallel: communication failed: {exc}") from exc

    def wait_all(self) -> None:
        """Wait for everything submitted so far."""
        pending, self._pending = self._pending, []
        for fut in pending:
            self.result(fut)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
