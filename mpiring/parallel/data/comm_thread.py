"""The communication thread: closures run one at a time, in submission order.

DDP's buckets and FSDP's gathers are reduced on it while the main thread
computes: on MPI a non-blocking request makes no progress while the process
makes no MPI call, so a thread making blocking calls on its own communicator is
what lets communication overlap with backward.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from mpiring.runtime import desync


class CommThread:
    """A daemon thread that runs submitted closures one at a time, in submission order.

    ``wait()`` blocks until everything submitted so far has run and re-raises
    the first exception a closure raised. After an exception the remaining
    closures are skipped (a failed collective leaves the ranks out of step, so
    issuing more could only hang).
    """

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._submitted = 0
        self._done = 0
        self._error: BaseException | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        if self.closed:  # nobody would run it: wait() would block forever
            raise RuntimeError(f"{self._thread.name}: the communication thread was closed; "
                               "build a new model wrapper to communicate again")
        self._submitted += 1
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                if self._error is None:
                    fn()
            except BaseException as exc:  # handed to the main thread in wait()
                self._error = exc
            finally:
                # Drop the closure before waiting for the next: it holds its bucket,
                # which after a rebuild would stay alive beside the new ones.
                fn = None
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()

    def wait(self) -> None:
        with self._cond:
            while self._done < self._submitted:
                self._cond.wait()
        if self._error is not None:
            raise RuntimeError(f"communication thread failed: {self._error}") from self._error

    def stop(self) -> None:
        """Let the thread end after what was submitted, without waiting for it."""
        self.closed = True
        self._queue.put(None)

    def close(self) -> bool:
        """Stop the thread; whether it ended (within 10 s)."""
        self.closed = True
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        return not self._thread.is_alive()


# For the desync detector: a thread in ``wait`` is blocked until the
# communication thread finishes, and that thread in ``_run`` with nothing deeper
# is idle until the next submit.
desync.blocking_code(CommThread.wait)
desync.blocking_code(CommThread._run, idle=True)
