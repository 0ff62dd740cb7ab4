"""MPI backend over mpi4py: point-to-point for the ring, MPI's own collectives as ``native``."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
import time
from contextlib import nullcontext, suppress

import numpy as np
from mpi4py import MPI

from mpiring.backends import MAX_TAG, P2P_TAG0, TAG  # noqa: F401 - MAX_TAG: the tags' bound
from mpiring.backends.control import Control, arrive
from mpiring.backends.control import poll as _poll
from mpiring.backends.gpu import device_ready, empty_like_device
from mpiring.core.chunking import chunk_bounds
from mpiring.core.ops import finish
from mpiring.runtime.trace import flush_all
from mpiring.runtime.watchdog import REPORT_GRACE, Activity

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD,
           "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}


def _bytes(a):
    """``a`` as a message of raw bytes.

    Point-to-point moves raw bytes: every dtype (bfloat16 included, which has no
    MPI datatype) travels the same way and mpi4py needs no type lookup. A host
    array goes as the buffer spec ``[a, MPI.BYTE]``, not as a uint8 view of it:
    making a view is a new array object per message, which the ring would pay
    twice a step.
    """
    if isinstance(a, np.ndarray):
        return [a, MPI.BYTE]
    if isinstance(a, MPI.buffer):  # raw host memory (``MPIBackend.host_buffer``)
        return [a, MPI.BYTE]
    return _byte_view(a)


def _byte_view(a):
    """``a`` as an array of bytes (for the vector collectives' specs, and GPU arrays)."""
    if not isinstance(a, np.ndarray):
        # A device array on a CUDA-aware MPI: a reduction into it may still be
        # queued on the GPU, and MPI reads device memory without a stream.
        device_ready(a)
    return a.view(np.uint8)


#: How a rank waits for a message (``MPIBackend.idle``):
#: "spin": inside MPI's blocking calls (MPICH busy-polls: lowest latency);
#: "yield": poll, and give the core away after each miss (more ranks than cores);
#: "sleep": poll every ``control.SLEEP_S`` (a communication thread beside busy compute
#: threads). The control channel and the making of communicators wait by
#: ``control.arrive`` where the mode is not "spin".
IDLE_MODES = ("spin", "yield", "sleep")


def _idle_wait(req, idle: str, status=None) -> None:
    _poll(req.Test if status is None else (lambda: req.Test(status)), idle)


def _idle_wait_all(reqs, idle: str) -> None:
    _poll(lambda: MPI.Request.Testall(reqs), idle)


def _oversubscribed(local_size: int) -> bool:
    """More ranks on this host than cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return local_size > cores


def check_idle_mode(mode: str, name: str = "idle") -> str:
    """``mode`` if it is one of ``IDLE_MODES``, else ValueError naming ``name`` and the modes."""
    if mode not in IDLE_MODES:
        raise ValueError(f"{name}={mode!r}: use one of {', '.join(IDLE_MODES)}")
    return mode


def _idle_mode(local_size: int) -> str:
    """How this rank waits: ``MPIRING_IDLE`` if set, else "yield" when oversubscribed."""
    mode = os.environ.get("MPIRING_IDLE", "").strip().lower()
    if mode:
        return check_idle_mode(mode, "MPIRING_IDLE")
    return "yield" if _oversubscribed(local_size) else "spin"


def forget_shared_memory() -> None:
    """Unlink the shared-memory segments MPICH mapped at init (``/dev/shm/mpich_shm_*``),
    before an abort: MPICH removes them at MPI_Finalize only, so every aborted job
    left a few MiB of the host's memory behind in /dev/shm until reboot. Mapped
    memory stays valid after the unlink; the first rank to get here unlinks, the
    others find the name gone. Linux only; anything unexpected is ignored."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split(maxsplit=5)[-1].strip() for line in fh if "/mpich_shm_" in line}
    except OSError:
        return
    for path in paths:
        if path.startswith("/dev/shm/mpich_shm_") and not path.endswith("(deleted)"):
            with suppress(OSError):
                os.unlink(path)


def abort_world(code: int = 1) -> None:
    """End every rank of the job (MPI_Abort on the world), trace files and output flushed
    first, and the launcher given ``REPORT_GRACE`` to forward that output."""
    # The whole job, not just this communicator: a stalled sub-communicator
    # must not leave the other ranks of the job waiting.
    flush_all()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):  # a closed or broken stream must not stop the abort
            stream.flush()
    # What a failing rank printed last (mpiring.run's traceback) is still in the
    # launcher's pipe, and an abort at once can lose it.
    time.sleep(REPORT_GRACE)
    forget_shared_memory()
    MPI.COMM_WORLD.Abort(code)


def world_rank() -> int:
    """This process's rank in the whole job."""
    return MPI.COMM_WORLD.Get_rank()


def world_size() -> int:
    """The number of ranks in the whole job."""
    return MPI.COMM_WORLD.Get_size()


def world_backend() -> MPIBackend:
    """A backend over every rank of the job, on a communicator of its own (collective)."""
    return MPIBackend(MPI.COMM_WORLD.Dup())


class _Msg:
    """A public message in flight: its MPI requests and the receiver's descriptor check.

    ``settled``: ``done`` saw it complete with nothing left to check, so ``complete``
    has nothing to do (the cheap path of a receive that is polled until it lands).
    ``error``: what refused the message (a failed check, a longer message), raised
    again by every later ``done`` or ``complete``: MPI frees a request once it has
    reported its error, so a second wait would otherwise return the buffer as if
    nothing had happened.
    """

    __slots__ = ("reqs", "check", "peer", "tag", "settled", "error")
    #: False: every request of the message was posted with it, from a known sender.
    late = False

    def __init__(self, reqs: list, check, peer: int | None, tag: int):
        self.reqs, self.check, self.peer, self.tag = reqs, check, peer, tag
        self.settled, self.error = False, None


class _LateMsg(_Msg):
    """A receive settled after its post: one from any source, or (check on) one from a
    known sender queued behind a receive from any source of the same tag.

    ``peer``: None until the sender is known (its descriptor, or with the check off
    its data, arrived). ``spec``: the data buffer while its receive is not posted yet
    (None once it is). ``status``: where MPI writes an any-source message's sender.
    """

    __slots__ = ("spec", "status", "nbytes")
    late = True

    def __init__(self, reqs: list, check, peer: int | None, tag: int, spec, status,
                 nbytes: int = 0):
        super().__init__(reqs, check, peer, tag)
        self.spec, self.status, self.nbytes = spec, status, nbytes

    def longer(self) -> bool:
        """Whether the any-source message that completed (check off) was longer than the
        buffer: MPICH's MPI_Test with a status can report a truncated receive as a
        success, its status counting the bytes sent."""
        return self.status.Get_count(MPI.BYTE) > self.nbytes


def _reserve(segment: np.ndarray) -> bool:
    """Fault in the pages of ``segment`` for writing without writing them
    (``MADV_POPULATE_WRITE``, Linux 5.14); False when the system has no room for them.

    Where the call does not exist (an older kernel, not Linux) the pages stay
    unreserved and True is returned: the free-space check is all there is.
    """
    if segment.nbytes == 0 or _MADVISE is None:
        return True
    page = mmap.PAGESIZE
    start = segment.ctypes.data // page * page  # a rank's part need not start on a page
    length = segment.ctypes.data + segment.nbytes - start
    if _MADVISE(ctypes.c_void_p(start), ctypes.c_size_t(length), 23) == 0:  # POPULATE_WRITE
        return True
    return ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS)  # not supported here: unknown


def _load_madvise():
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - no libc madvise
        return None


_MADVISE = _load_madvise()


def _shm_room() -> int | None:
    """Bytes free in /dev/shm, where MPICH and Open MPI map shared windows (None: no such)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SharedWindow:
    """Memory every rank of a communicator on one host can read and write.

    ``segments[r]``: rank r's bytes (a NumPy uint8 array over the shared memory).
    ``sync()``: a memory barrier, between writing data and the flag that announces
    it, and between seeing the flag and reading the data. ``free()``: collective.
    """

    def __init__(self, be, win, segments):
        self._be, self._win, self.segments = be, win, segments

    def sync(self) -> None:
        if self._win is not None:
            self._win.Sync()

    def free(self) -> None:
        if self._win is None:
            return
        win, self._win, self.segments = self._win, None, []
        win.Unlock_all()
        self._be._collective("Win_free", win.Free, meet_first=True)


class MPIBackend:
    """Point-to-point and native collectives on one ``MPI.Comm``.

    Every blocking call stamps ``self.activity`` (what, peer, since) so that the
    watchdog can report and abort a wait that outlives the deadline; see
    ``mpiring.runtime.watchdog``.
    """

    name = "mpi"
    #: Receives from any source (``post_recv(buf, None, ...)``; NCCL has none).
    any_source = True
    #: How to wait (see ``IDLE_MODES``): "yield" when this host has more ranks
    #: than cores (set by ``local_rank``), else "spin"; the DDP reducer sets
    #: "sleep" on its communication thread's communicator.
    idle = "spin"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._scratch: dict = {}
        #: tag -> receives of that tag (check on) whose data receive is not posted yet,
        #: in post order: the oldest is from any source and waits for its descriptor to
        #: name the sender (see ``_post_late``). Empty unless such a receive is pending.
        self._queues: dict[int, list[_LateMsg]] = {}
        world = comm.Get_group().Translate_ranks(list(range(self.size)),
                                                 MPI.COMM_WORLD.Get_group())
        self.activity = Activity(self.rank, self.size, world_ranks=list(world),
                                 abort=abort_world)
        #: Small values (descriptors, scalars, JSON) without pickle, under the deadline.
        self.control = Control(comm, self.activity, idle=lambda: self.idle)

    # --- point-to-point, as in the lecture's pseudocode ---------------------
    def irecv(self, buf, src: int):
        self.activity.recv_peer = src  # what the next wait() waits for
        return self.comm.Irecv(_bytes(buf), source=src, tag=TAG)

    def send(self, buf, dst: int) -> None:
        act = self.activity
        act.blocked("Send", dst)
        try:
            if self.idle != "spin":
                _idle_wait(self.comm.Isend(_bytes(buf), dest=dst, tag=TAG), self.idle)
            else:
                self.comm.Send(_bytes(buf), dest=dst, tag=TAG)
        finally:
            act.since = 0.0

    def wait(self, req) -> None:
        act = self.activity
        act.blocked("Wait", act.recv_peer)
        try:
            _idle_wait(req, self.idle) if self.idle != "spin" else req.Wait()
        finally:
            act.since = 0.0

    def isend(self, buf, dst: int):
        """Start sending ``buf`` (the segmented ring keeps several in flight)."""
        return self.comm.Isend(_bytes(buf), dest=dst, tag=TAG)

    def test(self, req) -> bool:
        """Whether a request from ``isend`` or ``irecv`` has completed (does not block)."""
        return req.Test()

    def wait_send(self, req, dst: int) -> None:
        act = self.activity
        act.blocked("Wait(Isend)", dst)
        try:
            _idle_wait(req, self.idle) if self.idle != "spin" else req.Wait()
        finally:
            act.since = 0.0

    def wait_sends(self, reqs, dst: int) -> None:
        act = self.activity
        act.blocked("Waitall(Isend)", dst)
        try:
            _idle_wait_all(reqs, self.idle) if self.idle != "spin" else MPI.Request.Waitall(reqs)
        finally:
            act.since = 0.0

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int) -> None:
        act = self.activity
        act.blocked("Sendrecv", src)
        try:
            if self.idle != "spin":
                _idle_wait_all([self.comm.Irecv(_bytes(recvbuf), source=src, tag=TAG),
                                self.comm.Isend(_bytes(sendbuf), dest=dst, tag=TAG)], self.idle)
            else:
                self.comm.Sendrecv(_bytes(sendbuf), dst, TAG, _bytes(recvbuf), src, TAG)
        finally:
            act.since = 0.0

    # --- the public point-to-point calls (Communicator.send/recv/isend/irecv) --
    def post_send(self, buf, dst: int, tag: int, header: np.ndarray | None) -> _Msg:
        """Start sending ``header`` (if any), then ``buf``, to ``dst``."""
        if self._queues:  # a receive from any source is pending: see ``_post_late``
            self._progress()
        reqs = [] if header is None else [self.comm.Isend(header, dest=dst, tag=P2P_TAG0 + 2 * tag)]
        reqs.append(self.comm.Isend(_bytes(buf), dest=dst, tag=P2P_TAG0 + 2 * tag + 1))
        return _Msg(reqs, None, dst, tag)

    def post_recv(self, buf, src: int | None, tag: int, header: np.ndarray | None,
                  check=None) -> _Msg:
        """Post the receives of ``src``'s descriptor (into ``header``) and data (into ``buf``).

        ``src=None``: from any source (the message's ``peer`` names the sender once
        it is known). ``check()`` runs once the descriptor has arrived and raises to
        refuse the message; the data is then drained, so that the sender is not left
        waiting.
        """
        # One test for the path of a known sender: nothing from any source pending.
        if src is None or self._queues:
            self._progress()
            if src is None or (header is not None and tag in self._queues):
                return self._post_late(buf, src, tag, header, check)
        reqs = [] if header is None else [self.comm.Irecv(header, source=src,
                                                          tag=P2P_TAG0 + 2 * tag)]
        reqs.append(self.comm.Irecv(_bytes(buf), source=src, tag=P2P_TAG0 + 2 * tag + 1))
        return _Msg(reqs, check, src, tag)

    def _post_late(self, buf, src: int | None, tag: int, header: np.ndarray | None,
                   check) -> _LateMsg:
        """A receive from any source, or one from ``src`` queued behind one (check on).

        Check off, a message is one MPI message: one receive from ANY_SOURCE, and
        MPI keeps each sender's messages in order. Check on, it is two (descriptor,
        then data), and the data must come from the sender of the descriptor: the
        descriptor's receive is posted now from ANY_SOURCE, the data's only once
        that descriptor has named its sender. MPI gives one sender's descriptors to
        the receives of a tag in the order they were posted, so the data receives
        must be posted in that same order too: a receive of the tag posted after an
        any-source one, even from a known sender, queues its data receive behind it
        (else it would take the data that goes with the any-source descriptor).
        """
        status = MPI.Status() if src is None else None
        source = MPI.ANY_SOURCE if src is None else src
        if header is None:
            req = self.comm.Irecv(_bytes(buf), source=source, tag=P2P_TAG0 + 2 * tag + 1)
            return _LateMsg([req], check, src, tag, None, status, buf.nbytes)
        req = self.comm.Irecv(header, source=source, tag=P2P_TAG0 + 2 * tag)
        msg = _LateMsg([req], check, src, tag, _bytes(buf), status)
        self._queues.setdefault(tag, []).append(msg)
        return msg

    def _progress(self) -> None:
        """Post every queued data receive whose turn has come (never blocks): those at
        the head of a queue, and any-source ones whose descriptor has arrived."""
        for tag, queue in list(self._queues.items()):
            while queue:
                head = queue[0]
                if head.peer is None:
                    # Test frees a completed request: read its sender now, once.
                    if not head.reqs[0].Test(head.status):
                        break
                    head.peer = head.status.Get_source()
                head.reqs.append(self.comm.Irecv(head.spec, source=head.peer,
                                                 tag=P2P_TAG0 + 2 * tag + 1))
                head.spec = None
                queue.pop(0)
            if not queue:
                del self._queues[tag]

    def _settle(self, msg: _LateMsg, what: str) -> None:
        """Wait (under the deadline) until ``msg``'s data receive is posted, or for a
        receive from any source with the check off, until its message is in."""
        if msg.spec is None and msg.peer is not None:
            return
        if msg.spec is None:  # check off, from any source: one message, its sender in status
            self._wait_p2p(msg.reqs, what, None, msg.status)
            msg.peer = msg.status.Get_source()
            if msg.longer():
                raise ValueError(f"{what}: the message from r{msg.peer} is longer than the "
                                 "receive buffer")
            return
        act = self.activity
        # An any-source wait names no rank: every other rank could end it.
        act.blocked(what, msg.peer)
        try:
            # Other queues move on too: a sender of another tag may wait for its
            # data receive (a large message) before it sends what this one waits for.
            _poll(lambda: self._progress() or msg.spec is None, self.idle)
        finally:
            act.since = 0.0

    @staticmethod
    def host_buffer(address: int, nbytes: int):
        """``nbytes`` of host memory at ``address``, as a message buffer for ``post_send``.

        What a prepared send posts a torch tensor as: its data pointer, without the
        NumPy view and DLPack export that cost more than the message right after
        the compute that made the tensor.
        """
        return MPI.buffer.fromaddress(address, nbytes)

    def complete(self, msg: _Msg, what: str, peer: int) -> None:
        """Wait for a message under the deadline; raise what its check raises.

        Raises:
            ValueError: the data that arrived is longer than the receive buffer.
        """
        if msg.settled:
            return
        if msg.error is not None:
            raise msg.error
        try:
            if msg.late:
                self._settle(msg, what)
                peer = msg.peer
            if msg.check is not None:
                self._wait_p2p(msg.reqs[:1], what, peer)
                check, msg.check = msg.check, None
                try:
                    check()
                except Exception:
                    try:
                        self._wait_p2p(msg.reqs[1:], what, peer)
                    except ValueError:
                        pass  # a longer message, refused anyway: the check's error says why
                    raise
            self._wait_p2p(msg.reqs, what, peer)
        except Exception as exc:
            msg.error = exc
            raise

    def _wait_p2p(self, reqs, what: str, peer: int | None, status=None) -> None:
        """Wait for ``reqs`` in order; ``peer`` None: from any source (``status`` gets
        the sender)."""
        act = self.activity
        act.blocked(what, peer)
        try:
            for req in reqs:  # one at a time: Waitall would hide a truncation in a status
                if self._queues:
                    # A receive from any source is pending: its data receive must be
                    # posted while we wait, or its sender may never get to ours.
                    _poll(lambda req=req: self._progress() or req.Test(status), self.idle)
                elif self.idle != "spin":
                    _idle_wait(req, self.idle, status)
                else:
                    req.Wait(status)
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            if peer is None and status is not None:
                peer = status.Get_source()
            raise ValueError(f"{what}: the message from r{peer} is longer than the "
                             "receive buffer") from None
        finally:
            act.since = 0.0

    def done(self, msg: _Msg) -> bool:
        """Whether the message has arrived or left (does not block).

        Raises:
            ValueError: the data that arrived is longer than the receive buffer.
        """
        if msg.settled:
            return True
        if msg.error is not None:
            raise msg.error
        if self._queues:
            self._progress()
        if msg.late and not self._done_late(msg):
            return False
        if msg.check is not None:
            # Descriptor and data both in: ``complete`` compares the descriptor. A
            # longer message fails its data request here; ``complete`` then names the
            # sizes that differ (MismatchError), which says more than a truncation.
            if not msg.reqs[0].Test():
                return False
            try:
                return msg.reqs[1].Test()
            except MPI.Exception as exc:
                if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                return True
        try:
            msg.settled = all(req.Test() for req in msg.reqs)  # in order; a done one stays done
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            msg.error = ValueError(f"recv from r{msg.peer} tag {msg.tag}: the message from "
                                   f"r{msg.peer} is longer than the receive buffer")
            raise msg.error from None
        return msg.settled

    def _done_late(self, msg: _LateMsg) -> bool:
        """Whether ``msg`` has got as far as a message of a known sender: its data
        receive posted, or (check off, from any source) its message in."""
        if msg.spec is not None:  # queued: ``_progress`` has just posted what it could
            return False
        if msg.peer is not None:
            return True
        try:
            if not msg.reqs[0].Test(msg.status):
                return False
            longer = msg.longer()
        except MPI.Exception as exc:
            if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            longer = True
        msg.peer = msg.status.Get_source()
        if longer:
            msg.error = ValueError(f"recv from any source tag {msg.tag}: the message from "
                                   f"r{msg.peer} is longer than the receive buffer")
            raise msg.error from None
        msg.settled = True  # the only request, and it completed
        return True

    def flush(self) -> None:
        """Issue what is posted but not yet issued: nothing, MPI issues at once."""

    def _collective(self, what: str, fn, *args, meet_first: bool = False):
        """Run a blocking MPI collective under the watchdog (waits for every rank).

        ``meet_first``: a call over every rank of this communicator that MPI has in
        blocking form only (making or freeing a communicator or a window). Where
        this rank does not spin, the ranks first meet in an ``Ibarrier`` completed
        by ``control.arrive``, so that the ones that come early do not spin inside
        MPI on the cores of the ones still computing.
        """
        act = self.activity
        act.blocked(what, None)
        try:
            if meet_first and self.idle != "spin":
                arrive(self.comm.Ibarrier().Test, self.idle)
            return fn(*args)
        finally:
            act.since = 0.0

    def group(self):
        return nullcontext()

    def synchronize(self) -> None:
        pass

    def scratch(self, like, n: int):
        """A receive buffer of ``n`` elements of ``like``'s dtype, reused across calls."""
        device = not isinstance(like, np.ndarray)  # CUDA-aware MPI: receive on the GPU
        key = (like.dtype, device)
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            buf = (empty_like_device(like, max(n, 1)) if device
                   else np.empty(max(n, 1), dtype=like.dtype))
            self._scratch[key] = buf
        return buf[:n]

    def exchange(self, values: np.ndarray) -> np.ndarray:
        """Allgather a small int64 vector from every rank: a (size, len) array."""
        return self.control.allgather_array(values)

    def exchange_bytes(self, data: bytes) -> list[bytes]:
        """Allgather variable-length byte strings (no pickle)."""
        return self.control.allgather_bytes(data)

    def barrier(self) -> None:
        self.control.barrier()

    # --- the MPI library's own collectives ----------------------------------
    def check_native(self, collective: str, dtype: str, op: str | None) -> None:
        if dtype == "bfloat16" and op is not None:
            raise TypeError(
                f"algo='native' {collective} cannot reduce bfloat16: MPI has no bfloat16 "
                "type; use algo='ring' (mpiring reduces bfloat16 itself)"
            )

    def native_all_reduce(self, x, op: str):
        self._collective("MPI_Allreduce", self.comm.Allreduce, MPI.IN_PLACE, x, MPI_OPS[op])
        finish(op, x, self.size)
        return x

    def native_reduce_scatter(self, x, op: str):
        bounds = chunk_bounds(x.size, self.size)
        counts = [b - a for a, b in bounds]
        lo, hi = bounds[self.rank]
        recv = self.scratch(x, counts[self.rank])
        self._collective("MPI_Reduce_scatter", self.comm.Reduce_scatter, x, recv, counts,
                         MPI_OPS[op])
        x[lo:hi] = recv
        finish(op, x[lo:hi], self.size)
        return lo, hi

    def native_all_gather(self, x):
        bounds = chunk_bounds(x.size, self.size)
        counts = [(b - a) * x.itemsize for a, b in bounds]
        displs = [a * x.itemsize for a, _ in bounds]
        self._collective("MPI_Allgatherv", self.comm.Allgatherv, MPI.IN_PLACE,
                         [_byte_view(x), counts, displs, MPI.BYTE])
        return x

    def native_broadcast(self, x, root: int):
        self._collective("MPI_Bcast", self.comm.Bcast, _bytes(x), root)
        return x

    def native_reduce(self, x, op: str, root: int):
        if self.rank == root:
            self._collective("MPI_Reduce", self.comm.Reduce, MPI.IN_PLACE, x, MPI_OPS[op], root)
            finish(op, x, self.size)
        else:
            self._collective("MPI_Reduce", self.comm.Reduce, x, None, MPI_OPS[op], root)
        return x

    # --- communicators --------------------------------------------------------
    def split(self, color: int, key: int):
        sub = self._collective("Comm_split", self.comm.Split,
                               MPI.UNDEFINED if color is None or color < 0 else color, key,
                               meet_first=True)
        return None if sub == MPI.COMM_NULL else MPIBackend(sub)

    def dup(self):
        return MPIBackend(self._collective("Comm_dup", self.comm.Dup, meet_first=True))

    def create_group(self, ranks: list[int], tag: int):
        """A communicator over ``ranks``, made by them alone (MPI_Comm_create_group: the
        other ranks do not call it)."""
        group = self.comm.Get_group().Incl(ranks)
        try:
            return MPIBackend(self._collective("Comm_create_group", self.comm.Create_group,
                                               group, tag))
        finally:
            group.Free()

    def free(self) -> None:
        """Collective: give the communicator (its context id) back to MPI."""
        self._collective("Comm_free", self.comm.Free, meet_first=True)

    def shared_window(self, nbytes: int):
        """Collective: ``nbytes`` of memory per rank that every rank of this communicator
        can read and write (an MPI-3 shared-memory window), or None on every rank when
        the ranks are not all on one host."""
        node = self._collective("Comm_split_type", self.comm.Split_type,
                                MPI.COMM_TYPE_SHARED, self.rank, meet_first=True)
        together = node.Get_size() == self.size
        # Room for every rank's part in the host's shared-memory file system: a window
        # larger than /dev/shm is mapped all the same and dies of SIGBUS at its first touch.
        total = self.control.allreduce_scalar(float(nbytes), "sum")
        room = _shm_room()
        fits = together and (room is None or total <= room / 2)
        if self.control.allreduce_scalar(float(fits), "min") < 1:
            node.Free()
            return None
        win = self._collective("Win_allocate_shared", MPI.Win.Allocate_shared, max(nbytes, 0),
                               1, MPI.INFO_NULL, node, meet_first=True)
        # The window keeps its own group: the node communicator (and the context id it
        # holds, of which MPI has a few thousand) can go now.
        node.Free()
        # One passive epoch for the window's whole life: Win_sync (the memory barrier
        # between a write and the flag that announces it) is allowed only inside one.
        win.Lock_all(MPI.MODE_NOCHECK)
        # Split_type kept this communicator's order (key = rank): node rank r is rank r.
        segments = [np.frombuffer(win.Shared_query(r)[0], dtype=np.uint8) for r in range(self.size)]
        window = SharedWindow(self, win, segments)
        # The window is a sparse file: free space drops only as pages are touched, so other
        # windows mapped at the same moment passed the same check. Reserving this rank's
        # pages now turns "no room" into an error here instead of a SIGBUS later.
        if self.control.allreduce_scalar(float(_reserve(segments[self.rank])), "min") < 1:
            window.free()
            return None
        return window

    def local_rank(self) -> tuple[int, int]:
        node = self._collective("Comm_split_type", self.comm.Split_type,
                                MPI.COMM_TYPE_SHARED, self.rank)
        try:
            local = node.Get_rank(), node.Get_size()
        finally:
            node.Free()
        self.idle = _idle_mode(local[1])
        return local

    def abort(self, code: int = 1) -> None:
        abort_world(code)


_THREAD_LEVELS = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
                  MPI.THREAD_SERIALIZED: "SERIALIZED", MPI.THREAD_MULTIPLE: "MULTIPLE"}


def describe_mpi() -> dict[str, str]:
    """mpi4py's version, the MPI library, the standard it implements and the thread level.

    Human-readable lines for ``python -m mpiring info``; local (not collective).
    """
    import mpi4py

    level = MPI.Query_thread()
    return {
        "mpi4py": getattr(mpi4py, "__version__", "installed"),
        "MPI library": MPI.Get_library_version().strip().splitlines()[0],
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": _THREAD_LEVELS.get(level, str(level)),
    }
