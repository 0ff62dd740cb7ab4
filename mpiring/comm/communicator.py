"""The Communicator: rank and size, argument checks, and dispatch by algorithm.

Every collective goes through the same three steps:

1. ``_prepare``: validate the buffer and arguments locally (TypeError/ValueError
   naming the fix), then, unless checking is off, exchange a small descriptor
   (collective, count, dtype, op, root, algo, local error) with every rank
   (``mpiring.comm.agreement``). If any rank rejected its input or the
   descriptors differ, *every* rank raises before a byte of data moves: a bad
   buffer on one rank can never leave the others waiting in a ring step.
2. dispatch to the ring code in ``mpiring.collectives`` or to the backend's
   native collective;
3. return the caller's object (in place), or for ``reduce_scatter`` the view of
   chunk ``rank``.
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np

from mpiring import collectives as coll
from mpiring.collectives.ring_segmented import SEGMENT_BYTES
from mpiring.comm.agreement import agree, agree_ok
from mpiring.comm.algos import ALGOS, REDUCING, SEGMENTED  # noqa: F401 - the public names
from mpiring.comm.auto import AutoChoice
from mpiring.comm.p2p import PointToPoint
from mpiring.comm.prepare import Preparation, _is_int
from mpiring.core.chunking import chunk_bounds
from mpiring.runtime import desync
from mpiring.runtime.env import env_flag
from mpiring.runtime.trace import Tracer
from mpiring.runtime.watchdog import Activity, parse_timeout

#: Seconds between polls in ``wait_until`` (a flag in shared memory costs nothing to read;
#: the sleep gives the core to the rank being waited for).
WAIT_SLEEP_S = 2e-5


class Communicator(Preparation, AutoChoice, PointToPoint):
    """A group of ranks and the collectives over them.

    Attributes:
        rank: this process's rank in the communicator.
        size: number of ranks.
        local_rank: rank among the processes of this host (``Split_type(SHARED)``).
        local_size: number of ranks on this host.
        backend: "mpi" or "nccl".
    """

    _plan = None  # what the current collective does with a GPU buffer (mpiring.backends.gpu)
    _auto_table = None  # algo="auto"'s decision table, agreed at the first auto call (autotune)

    def __init__(self, be, tracer: Tracer | None = None, *, check: bool | None = None,
                 timeout: float | str | None = None):
        self._be = be
        self.rank: int = be.rank
        self.size: int = be.size
        self.backend: str = be.name
        # The watchdog's record of what this communicator is doing (the backend
        # stamps it around blocking calls; see mpiring.runtime.watchdog).
        self._act: Activity = getattr(be, "activity", None) or Activity(
            be.rank, be.size, watch=False)
        self._act.timeout = parse_timeout(timeout)
        if self._act.name is None:  # a root (init); dup and split name their children
            self._act.name = _root_name(self._act)
        self.local_rank, self.local_size = be.local_rank()
        self.tracer = tracer if tracer is not None else Tracer.from_env(self.rank)
        self.check = env_flag("MPIRING_CHECK", True) if check is None else check
        self._calls: dict[str, int] = {}
        self._groups_made: dict[tuple[int, ...], int] = {}  # create_group's, per list
        # Held from the start of a collective to its end: a second thread calling
        # in meanwhile would interleave its messages with ours (wrong sums or a
        # hang), so it is refused, naming both threads.
        self._busy = threading.Lock()
        self._owner = 0
        self._owner_call = ""
        # What the current table said, remembered (a training loop repeats its sizes):
        # (collective, bytes, dtype, op) -> the algo auto chose; bytes -> pipeline S.
        self._auto_seen: dict[tuple, str] = {}
        self._chunks_seen: dict[int, int] = {}
        self._segment_bytes = SEGMENT_BYTES

    def __repr__(self) -> str:
        return f"Communicator(backend={self.backend!r}, rank={self.rank}, size={self.size})"

    @property
    def name(self) -> str:
        """This communicator's name, the same on every rank of it: ``world`` for the
        first ``mpiring.init()``, ``world.dup1`` for its first ``dup()``,
        ``world.split1.0`` for colour 0 of its first ``split``. The watchdog's
        desync report names communicators by it."""
        return self._act.name

    @property
    def world_ranks(self) -> tuple[int, ...]:
        """The world ranks of this communicator's ranks, in rank order."""
        act = self._act
        return tuple(act.world_ranks) if act.world_ranks is not None else tuple(range(act.size))

    @property
    def timeout(self) -> float:
        """Seconds one blocking wait may last before the job is aborted with a stall
        report (0: no deadline). Set per communicator; default ``MPIRING_TIMEOUT``
        or 300."""
        return self._act.timeout

    @timeout.setter
    def timeout(self, seconds: float | str | None) -> None:
        self._act.timeout = parse_timeout(seconds)

    @property
    def idle(self) -> str | None:
        """How this rank waits for a peer on MPI: "spin", "yield" or "sleep"
        (``mpiring.backends.mpi.IDLE_MODES``); None on NCCL, where the GPU waits.
        Default: ``MPIRING_IDLE``, else "yield" with more ranks than cores on the
        host, else "spin". DDP's communication thread sets "sleep" on its own
        communicator so that it does not take cores from backward."""
        return getattr(self._be, "idle", None)

    @idle.setter
    def idle(self, mode: str) -> None:
        from mpiring.backends.mpi import check_idle_mode

        if not hasattr(self._be, "idle"):
            raise ValueError(f"idle: the {self.backend} backend has no waiting mode to set")
        self._be.idle = check_idle_mode(mode)

    @property
    def segment_bytes(self) -> int:
        """The segment size of ``algo="ring-seg"`` (also when ``auto`` picks it), in bytes.

        Default ``mpiring.collectives.ring_segmented.SEGMENT_BYTES`` (4 MiB). The
        segmented ring receives into ``WINDOW`` (2) segments, so this also bounds
        its receive buffer; DDP's buckets use 1 MiB. Set it to the same value on
        every rank: the argument check compares it, and a call on ranks that
        disagree raises ``MismatchError`` on all of them.
        """
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, nbytes: int) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 1:
            raise ValueError(f"segment_bytes={nbytes!r}: give a positive number of bytes "
                             "(for instance 1 << 20)")
        self._segment_bytes = int(nbytes)

    def all_reduce(self, x, op: str = "sum", algo: str = "auto", *, check: bool | None = None):
        """Reduce ``x`` over all ranks, in place; every rank gets the result.

        Args:
            x: numpy array, torch tensor or cupy array (contiguous, writable).
            op: "sum", "avg", "max", "min", "prod", or for integers "band", "bor", "bxor".
            algo: "auto" (the default: the fastest of mpiring's own algorithms for
                this size, from ``mpiring.comm.autotune``'s table; never "native"),
                "ring" (the lecture's ReduceScatter + AllGather), "ring-seg" (the
                same ring cut into pipelined segments), "recursive-doubling"
                (log2 K steps, for small messages), "halving-doubling" (the ring's
                bytes in 2 log2 K steps) or "native" (the library's own).
            check: compare the call's arguments across ranks first (default on;
                ``MPIRING_CHECK=0`` turns it off): count, dtype, op, root, algo,
                chunks, segment size, call number and the caller's line, plus
                whether any rank refused its input. The price of ``check=False``
                (here, on any collective, or through the variable): a rank's bad
                buffer raises on that rank only while the others wait for it
                until the deadline, and calls whose dtypes, ops, roots or order
                differ across ranks are not detected; they give a wrong result
                or a stall, not an error. It saves one small Allgather per call.

        Returns:
            ``x``.
        """
        buf, call = self._prepare("all_reduce", x, op=op, algo=algo, check=check)
        try:
            if algo == "auto":
                algo = self._auto_algo("all_reduce", buf, op)
            if algo == "native":
                self._be.native_all_reduce(buf.array, op)
            elif algo == "ring-seg":
                coll.segmented_all_reduce(self._be, buf.array, op,
                                          self._steps("all_reduce", call, algo),
                                          segment_bytes=self._segment_bytes)
            elif algo == "recursive-doubling":
                coll.recursive_doubling_all_reduce(self._be, buf.array, op,
                                                   self._steps("all_reduce", call, algo))
            elif algo == "halving-doubling":
                coll.halving_doubling_all_reduce(self._be, buf.array, op,
                                                 self._steps("all_reduce", call, algo))
            else:
                coll.ring_all_reduce(self._be, buf.array, op, self._steps("all_reduce", call, algo))
        except BaseException:
            self._abandon()
            raise
        self._finish()
        return x

    def reduce_scatter(self, x, op: str = "sum", algo: str = "auto", *,
                       check: bool | None = None):
        """Reduce ``x`` in place so that rank r holds chunk r fully reduced.

        Chunks follow numpy.array_split bounds over the flattened buffer. The other
        chunks of ``x`` hold partial sums afterwards. ``algo``: "auto", "ring",
        "ring-seg" or "native" (as for ``all_reduce``).

        Returns:
            The view of chunk ``self.rank`` of ``x`` (same type as ``x``).
        """
        buf, call = self._prepare("reduce_scatter", x, op=op, algo=algo, check=check)
        try:
            if algo == "auto":
                algo = self._auto_algo("reduce_scatter", buf, op)
            if algo == "native":
                lo, hi = self._be.native_reduce_scatter(buf.array, op)
            elif algo == "ring-seg":
                lo, hi = coll.segmented_reduce_scatter(
                    self._be, buf.array, op, self._steps("reduce_scatter", call, algo),
                    segment_bytes=self._segment_bytes)
            else:
                lo, hi = coll.ring_reduce_scatter(
                    self._be, buf.array, op, self._steps("reduce_scatter", call, algo))
        except BaseException:
            self._abandon()
            raise
        self._finish()
        return buf.chunk(lo, hi)

    def all_gather(self, x, algo: str = "auto", *, check: bool | None = None):
        """Fill every chunk of ``x`` in place from its owner; rank r provides chunk r.

        ``algo``: "auto", "ring", "ring-seg" or "native" (as for ``all_reduce``).

        Returns:
            ``x``.
        """
        buf, call = self._prepare("all_gather", x, algo=algo, check=check)
        try:
            if algo == "auto":
                algo = self._auto_algo("all_gather", buf, None)
            if algo == "native":
                self._be.native_all_gather(buf.array)
            elif algo == "ring-seg":
                coll.segmented_all_gather(self._be, buf.array, self._steps("all_gather", call, algo),
                                          segment_bytes=self._segment_bytes)
            else:
                coll.ring_all_gather(self._be, buf.array, self._steps("all_gather", call, algo))
        except BaseException:
            self._abandon()
            raise
        self._finish()
        return x

    def broadcast(self, x, root: int = 0, algo: str = "pipelined", chunks: int | None = None,
                  *, check: bool | None = None):
        """Copy the root's ``x`` into every rank's ``x``.

        Args:
            algo: "ring" (the whole message hop by hop, (K-1)N/B), "pipelined"
                (S chunks, (K-2+S)N/(SB)) or "native".
            chunks: S for "pipelined"; default: the cost model's best S for this
                size (``mpiring.core.chunking.default_pipeline_chunks``; ``python -m
                mpiring tune`` refits its alpha and beta).

        Returns:
            ``x``.
        """
        buf, call = self._prepare("broadcast", x, algo=algo, root=root, chunks=chunks,
                                  check=check)
        try:
            if algo == "native":
                self._be.native_broadcast(buf.array, root)
            else:
                s = self._pipeline_chunks(buf, algo, chunks)
                coll.pipelined_broadcast(self._be, buf.array, root, s,
                                         self._steps("broadcast", call, algo))
        except BaseException:
            self._abandon()
            raise
        self._finish()
        return x

    def reduce(self, x, root: int = 0, op: str = "sum", algo: str = "ring",
               chunks: int | None = None, *, check: bool | None = None):
        """Reduce ``x`` over all ranks into the root's ``x``; other ranks' ``x`` is unchanged.

        Args:
            algo: "ring" (one message along the ring), "pipelined" (S chunks) or
                "native".

        Returns:
            ``x``.
        """
        buf, call = self._prepare("reduce", x, op=op, algo=algo, root=root, chunks=chunks,
                                  check=check)
        try:
            if algo == "native":
                self._be.native_reduce(buf.array, op, root)
            else:
                s = self._pipeline_chunks(buf, algo, chunks)
                coll.pipelined_reduce(self._be, buf.array, op, root, s,
                                      self._steps("reduce", call, algo))
        except BaseException:
            self._abandon()
            raise
        self._finish()
        return x

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """A Communicator over the ranks that passed the same ``color``.

        Ranks order by ``key`` then by rank. A rank that passes ``color=None`` (or a
        negative color) takes part in the split but gets ``None`` back.

        Raises:
            ValueError: on every rank, before the split, when any rank passed a
                color or key that is not an integer (None allowed for color).
        """
        call = self._next_call("split")
        self._act.begin("split", call, None)
        error = None
        if not (color is None or _is_int(color)):
            error = ValueError(f"split: color={color!r}: use an integer (the group's "
                               "number), or None to take part without joining a group")
        elif not _is_int(key):
            error = ValueError(f"split: key={key!r}: use an integer (the rank's order "
                               "in its group)")
        if self.size > 1:  # a bad color on one rank must not leave the others in Comm_split
            agree_ok(self._be, f"split#{call}", error)
        elif error is not None:
            raise error
        be = self._be.split(None if color is None else int(color), int(key))
        if be is None:
            return None
        return self._child(be, f"split{call}.{int(color)}")

    def create_group(self, ranks: list[int]) -> Communicator:
        """A Communicator over ``ranks`` (ranks of this one, in that order), made by those
        ranks alone: the others do not call it (MPI_Comm_create_group; torch's
        ``new_group(..., use_local_synchronization=True)``). Each member passes the same
        list; a member that never comes leaves the others to the deadline's report.

        Raises:
            ValueError: this rank is not in ``ranks``, or they repeat or are out of range
                (on this rank alone: there is no one else to tell yet); on every member
                when the members' lists differ.
        """
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"create_group: ranks={ranks}: give distinct ranks of this "
                             f"{self.size}-rank communicator")
        if self.rank not in ranks:
            raise ValueError(f"create_group: rank {self.rank} is not in ranks={ranks}: only "
                             "the members call it")
        # Counted per list, not per call: the members of one group share only its calls.
        made = self._groups_made[tuple(ranks)] = self._groups_made.get(tuple(ranks), 0) + 1
        self._act.begin("create_group", made, None)
        # MPI's tag keeps apart groups made at once by overlapping ranks.
        tag = zlib.crc32(repr(ranks).encode()) % 32768
        sub = self._child(self._be.create_group(ranks, tag),
                          f"group{'-'.join(map(str, ranks))}.{made}")
        seen = sub.control.allgather_json(ranks)
        if any(other != ranks for other in seen):
            sub.free()
            raise ValueError("create_group: the members' lists differ: " + ", ".join(
                f"r{ranks[i]} gave {other}" for i, other in enumerate(seen)))
        return sub

    def dup(self) -> Communicator:
        """A Communicator over the same ranks with separate message matching.

        Give each thread that runs collectives its own ``dup()``: MPI matches
        messages per communicator, and the stall watchdog keeps one record per
        communicator.
        """
        call = self._next_call("dup")
        self._act.begin("dup", call, None)
        return self._child(self._be.dup(), f"dup{call}")

    def free(self) -> None:
        """Collective: release this communicator; any later call on it raises.

        MPI has a few thousand communicators per process (each ``dup`` and
        ``split`` takes one), so what builds one for a while (a schedule, a
        job, a grid) frees it when done. Freeing twice is a no-op.
        """
        if isinstance(self._be, _Freed):
            return
        if not self._busy.acquire(False):
            self._other_thread("free")  # another thread is inside a collective on it
        try:
            be, self._be = self._be, _Freed(self.name)
            be.free()
        finally:
            self._owner = 0
            self._busy.release()

    def _child(self, be, suffix: str) -> Communicator:
        # Named after the parent and the call that made it (a collective, so its
        # number is the same on every rank): the same name on every rank.
        act = getattr(be, "activity", None)
        if act is not None and act.name is None:
            act.name = f"{self.name}.{suffix}"
        return Communicator(be, self.tracer, check=self.check, timeout=self.timeout)

    def agree_call(self, name: str) -> None:
        """Check that every rank is making the call ``name`` now (collective).

        For a multi-step call that is not a collective (DDP's construction): a
        rank that is in a collective meanwhile, or in another such call, gets a
        MismatchError naming what each rank is doing, instead of the control
        messages of the two calls mixing ("message truncated") or waiting.

        Raises:
            MismatchError: on every rank, when some rank is in a different call.
        """
        if self.size == 1:
            return
        call = self._next_call(name)
        self._act.begin(name, call, None)
        try:
            agree(self._be, name, call, None, None, None, None, None, None, None)
        except BaseException:
            self._calls[name] = call - 1  # refused on every rank: the counts stay in step
            raise

    def barrier(self) -> None:
        self._act.begin("barrier", self._next_call("barrier"), None)
        self._be.barrier()

    def shared_window(self, nbytes: int):
        """Collective: ``nbytes`` per rank of memory every rank can read and write.

        Returns an object with ``segments[r]`` (rank r's bytes, a NumPy uint8
        array), ``sync()`` (a memory barrier) and ``free()`` (collective), or None
        on every rank when the ranks are not all on one host or the backend has
        no shared memory (NCCL).
        """
        call = self._next_call("shared_window")
        self._act.begin("shared_window", call, None)
        error = None
        if not _is_int(nbytes) or nbytes < 0:
            error = ValueError(f"shared_window: nbytes={nbytes!r}: give this rank's size in "
                               "bytes, an integer >= 0 (0: none, while the others have some)")
        if self.size > 1:
            agree_ok(self._be, f"shared_window#{call}", error)
        elif error is not None:
            raise error
        make = getattr(self._be, "shared_window", None)
        if make is None or getattr(self._be, "accepts_cuda", False):
            return None
        return make(int(nbytes))

    def wait_until(self, done, what: str, peer: int | None, kind: str = "recv") -> None:
        """Poll ``done()`` until it is true, under this communicator's deadline.

        For a wait that is not an MPI request (a flag in shared memory): the stall
        report names ``what`` and ``peer``, and the desync detector sees the wait,
        as a ``kind`` ("recv": a message from ``peer``).
        """
        act = self._act
        act.begin(kind, self._p2p_calls + 1, None)
        act.blocked(what, peer)
        try:
            while not done():
                time.sleep(WAIT_SLEEP_S)
        finally:
            act.since = 0.0

    def abort(self, code: int = 1) -> None:
        """End the whole job now, every rank, with exit status ``code`` (traces flushed).

        For a failure that the other ranks cannot learn about otherwise: they may
        be waiting for this rank in their next call.
        """
        self._be.abort(code)

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """The chunk bounds ``reduce_scatter``/``all_gather`` use for ``n`` elements."""
        return list(chunk_bounds(n, self.size))

    @property
    def control(self):
        """The control channel (``mpiring.backends.control.Control``): small values
        between the ranks of this communicator, without pickle, under its deadline."""
        return self._be.control

    @property
    def mpi_comm(self):
        """The underlying ``mpi4py.MPI.Comm``."""
        return self._be.comm


_roots: dict[tuple[int, ...], int] = {}


def _root_name(act: Activity) -> str:
    # Every rank creates its root communicators (init) in the same order, so a
    # count per member set gives each the same name everywhere.
    members = tuple(act.world_ranks) if act.world_ranks is not None else tuple(range(act.size))
    n = _roots[members] = _roots.get(members, 0) + 1
    base = "world" if members == tuple(range(len(members))) else \
        "comm[" + ",".join(map(str, members[:8])) + (",..." if len(members) > 8 else "") + "]"
    return base if n == 1 else f"{base}{n}"


#: Most sizes a Communicator remembers auto's choice and the pipeline's S for
#: (a training loop repeats a handful; a sweep over many sizes just stops adding).


# For the desync detector: a thread in ``wait_until`` waits, it does not compute.
desync.blocking_code(Communicator.wait_until)


class _Freed:
    """What a freed Communicator calls into: every use names the fix."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        raise RuntimeError(f"communicator {self._name} was freed (free()): build a new one "
                           "(comm.dup() or comm.split()) for more calls")
