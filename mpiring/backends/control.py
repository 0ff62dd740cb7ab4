"""The control channel: small values between ranks, without pickle.

Descriptors of a collective's arguments, scalars, shapes, the NCCL id,
checkpoint agreement and benchmark bookkeeping all travel here, and nowhere
else: code above the backends reaches it as ``comm.control`` and never sees
mpi4py.

mpi4py's lowercase methods (``comm.bcast``, ``comm.allgather``,
``comm.allreduce``, ``comm.send``/``recv``...) pickle the object and unpickle
whatever arrives: a peer, or anything that can inject traffic into the job's
network, could then run code in this process. mpiring never uses them.
Everything that crosses ranks is a typed buffer: numbers go as int64 or float64
arrays, text and structured values as bytes (UTF-8 JSON for the latter: JSON
decodes to plain data and nothing else).

Every call is collective over its communicator (every rank calls it, in the
same order) and waits under the communicator's deadline: the watchdog names
the call if a rank never arrives.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np
from mpi4py import MPI

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
#: Seconds between the polls of a sleeping wait.
SLEEP_S = 5e-5
#: Seconds an arrival (``arrive``) polls, giving the core away after each miss, before
#: it sleeps between polls.
YIELD_S = 2e-4


def poll(done, idle: str) -> None:
    """Call ``done()`` until it is true, giving the core away in between.

    ``idle`` (``mpiring.backends.mpi.IDLE_MODES``): "yield" gives the core away
    after each miss; "sleep" sleeps ``SLEEP_S`` between polls.
    """
    # MPICH spins inside MPI_Wait (yielding only every 1000 polls). With more
    # ranks than cores the spinning rank holds a core that the rank it waits for
    # needs; polling and giving the core away lets that rank run. Beside busy
    # compute threads (DDP's communication thread during backward) a yield gave
    # nothing measurable, since the poller stays runnable; sleeping between polls
    # gave a few milliseconds per step.
    pause = (lambda: time.sleep(SLEEP_S)) if idle == "sleep" else os.sched_yield
    while not done():
        pause()


def arrive(done, idle: str) -> None:
    """``poll``, for a wait on ranks that may still be computing (the control
    channel's values, the making of a communicator): "yield" gives the core away
    after each miss for ``YIELD_S``, then sleeps between polls."""
    # Yielding alone does not hand the core over: Linux's fair scheduler lets a rank
    # that yields after every poll run again at once, so a late rank behind three
    # yielding ones got about half a core (docs/reliability.md), and in the test
    # suite ranks waited seconds in such calls for one that was runnable and did not
    # run. The ring's own steps keep ``poll``: their peer is seldom far behind, and
    # a sleep would add itself to every step.
    if idle == "sleep":
        poll(done, idle)
        return
    until = time.perf_counter() + YIELD_S
    while not done():
        if time.perf_counter() < until:
            os.sched_yield()
        else:
            time.sleep(SLEEP_S)


class Control:
    """Small collective exchanges over one MPI communicator, stamped for the watchdog.

    Args:
        mpi: the ``mpi4py.MPI.Comm`` that carries the values.
        activity: the communicator's watchdog record (``runtime.watchdog.Activity``),
            or None for no deadline.
    """

    def __init__(self, mpi: MPI.Comm, activity=None, idle=None):
        self.mpi = mpi
        self.rank = mpi.Get_rank()
        self.size = mpi.Get_size()
        self._act = activity
        #: () -> the owner's waiting mode (``arrive``); None: wait inside MPI.
        self._idle = idle

    def _run(self, what: str, fn, *args):
        act = self._act
        if act is None:
            return fn(*args)
        act.blocked(what, None)
        try:
            return fn(*args)
        finally:
            act.since = 0.0

    def _call(self, what: str, blocking, nonblocking, *args):
        """``blocking(*args)``, or where the owner does not spin, ``nonblocking(*args)``
        completed by ``arrive`` (the values are small: their latency is the arrival's)."""
        idle = self._idle() if self._idle is not None else "spin"
        if idle == "spin":
            return self._run(what, blocking, *args)
        return self._run(what, lambda: arrive(nonblocking(*args).Test, idle))

    def allgather_array(self, values) -> np.ndarray:
        """Every rank's equal-length vector of numbers, as a (size, n) array (int64 or float64)."""
        values = np.asarray(values)
        dtype = np.float64 if values.dtype.kind == "f" else np.int64
        values = np.ascontiguousarray(values, dtype=dtype).reshape(-1)
        out = np.empty((self.size, values.size), dtype=dtype)
        self._call("Allgather", self.mpi.Allgather, self.mpi.Iallgather, values, out)
        return out

    def allreduce_scalar(self, value: float | int | bool, op: str = "sum") -> Any:
        """Reduce one number over every rank: an int stays an int (int64), a float a float.

        Args:
            op: "sum", "max", "min" or "prod".
        """
        if op not in _OPS:
            raise ValueError(f"unknown op {op!r}: use one of {', '.join(_OPS)}")
        is_int = isinstance(value, (bool, int, np.integer))
        buf = np.array([value], dtype=np.int64 if is_int else np.float64)
        self._call("Allreduce", self.mpi.Allreduce, self.mpi.Iallreduce, MPI.IN_PLACE, buf,
                   _OPS[op])
        return int(buf[0]) if is_int else float(buf[0])

    def bcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """The root's bytes on every rank (``data`` is ignored elsewhere)."""
        is_root = self.rank == root
        n = np.array([len(data) if is_root else 0], dtype=np.int64)
        self._call("Bcast", self.mpi.Bcast, self.mpi.Ibcast, n, root)
        buf = np.frombuffer(bytearray(data), dtype=np.uint8) if is_root \
            else np.empty(int(n[0]), dtype=np.uint8)
        self._call("Bcast", self.mpi.Bcast, self.mpi.Ibcast, buf, root)
        return buf.tobytes()

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's byte string, in rank order."""
        lengths = self.allgather_array([len(data)])[:, 0]
        displs = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        out = np.empty(int(lengths.sum()), dtype=np.uint8)
        self._call("Allgatherv", self.mpi.Allgatherv, self.mpi.Iallgatherv,
                   np.frombuffer(bytes(data), dtype=np.uint8),
                   [out, lengths.tolist(), displs.tolist(), MPI.BYTE])
        return [out[d:d + n].tobytes() for d, n in zip(displs, lengths)]

    def bcast_json(self, obj: Any = None, root: int = 0) -> Any:
        """The root's JSON-serialisable value on every rank (tuples come back as lists;
        NumPy scalars and arrays as numbers and lists)."""
        data = _dumps(obj) if self.rank == root else None
        return json.loads(self.bcast_bytes(data, root).decode())

    def allgather_json(self, obj: Any) -> list[Any]:
        """Every rank's JSON-serialisable value, in rank order."""
        return [json.loads(b.decode()) for b in self.allgather_bytes(_dumps(obj))]

    def barrier(self, poll_s: float = 0.0) -> None:
        """Wait until every rank has arrived.

        Args:
            poll_s: 0 waits inside MPI (MPICH spins: the lowest latency). A positive
                value polls a non-blocking barrier and sleeps that long between polls,
                so that a rank waiting for slower ones leaves the core to the threads
                that compute (DDP's buckets, a checkpoint being written).
        """
        if poll_s <= 0:
            self._call("Barrier", self.mpi.Barrier, self.mpi.Ibarrier)
            return
        req = self.mpi.Ibarrier()

        def wait() -> None:
            while not req.Test():
                time.sleep(poll_s)

        self._run("Ibarrier", wait)


def of(comm) -> Control:
    """The control channel of a Communicator, a backend or an ``mpi4py.MPI.Comm``."""
    if isinstance(comm, Control):
        return comm
    control = getattr(comm, "control", None)
    if isinstance(control, Control):
        return control
    return Control(comm)


def _plain(value: Any) -> Any:
    # NumPy scalars and arrays as plain numbers and lists.
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable: send plain numbers, "
                    "strings, lists and dicts")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, default=_plain).encode()


# The same calls as functions of a communicator, for code that holds one.
def allreduce_scalar(comm, value: float | int | bool, op: str = "sum") -> Any:
    """``of(comm).allreduce_scalar(value, op)``."""
    return of(comm).allreduce_scalar(value, op)


def allgather_array(comm, values) -> np.ndarray:
    """``of(comm).allgather_array(values)``."""
    return of(comm).allgather_array(values)


def bcast_bytes(comm, data: bytes | None, root: int = 0) -> bytes:
    """``of(comm).bcast_bytes(data, root)``."""
    return of(comm).bcast_bytes(data, root)


def allgather_bytes(comm, data: bytes) -> list[bytes]:
    """``of(comm).allgather_bytes(data)``."""
    return of(comm).allgather_bytes(data)


def bcast_json(comm, obj: Any = None, root: int = 0) -> Any:
    """``of(comm).bcast_json(obj, root)``."""
    return of(comm).bcast_json(obj, root)


def allgather_json(comm, obj: Any) -> list[Any]:
    """``of(comm).allgather_json(obj)``."""
    return of(comm).allgather_json(obj)
