"""Stand-ins for cupy.cuda.nccl and a GPU, over MPI on host memory.

``FakeNccl`` takes the same raw-pointer calls as ``NcclCommunicator`` plus the
module's ``groupStart``/``groupEnd``, and performs them with MPI on the host
memory the pointers address. It is strict where NCCL is strict:

* A send completes only once the peer has posted the matching receive
  (``Issend``), however small the message: a ring whose send and receive are
  not in one group deadlocks here as it would on GPUs (the test's deadline
  then ends the job), instead of passing thanks to MPI's eager protocol.
* Every call outside a group runs alone and to completion, in call order, as
  on a CUDA stream.
* Reduce ignores the receive buffer on ranks other than the root.
* Every call is checked against ``NcclCommunicator``'s real signature
  (cupy_backends/cuda/libs/nccl.pyx: ``allReduce(sendbuf, recvbuf, count,
  datatype, op, stream)``, ``reduce(..., op, root, stream)``, ``bcast(buff,
  count, datatype, root, stream)``, ``reduceScatter(sendbuf, recvbuf,
  recvcount, ...)``, ``allGather(sendbuf, recvbuf, count, datatype, stream)``,
  ``send/recv(buf, count, datatype, peer, stream)``): integer pointers, counts
  in elements, a known ``ncclDataType_t`` and ``ncclRedOp_t`` (bfloat16 and avg
  only from NCCL 2.10), peers and roots in range, and NCCL's in-place rule (a
  buffer pair is either the exact in-place layout or disjoint: anything in
  between is undefined on a GPU, while the fake, which copies first, would
  still compute the right answer).

Collectives are computed independently of mpiring: gather every rank's bytes,
reduce them with NumPy in rank order.

``HostDevice`` replaces ``CupyDevice``: NumPy arrays, pointers from
``ctypes.data``, a stream that is a number, and a log of enter/leave.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from mpiring.core.buffers import BFLOAT16

NP_DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
             6: np.float16, 7: np.float32, 8: np.float64, 9: BFLOAT16}
UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
CALLER_STREAM, BACKEND_STREAM = 1000, 2000
TAG = 99


def memory(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of ``nbytes`` of host memory at ``ptr``."""
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(ptr))


class FakeNccl:
    """Module-level group calls and one communicator's calls, over an MPI communicator."""

    def __init__(self, comm, version=(2, 30, 0)):
        self.comm = comm
        self.version = tuple(version)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.depth = 0
        self.queue: list[tuple] = []
        self.groups: list[list[tuple]] = []  # every issued group: [(kind, peer), ...]
        self.streams: set[int] = set()
        self.destroyed = False

    def destroy(self):
        """``NcclCommunicator.destroy``: nothing queued may be left behind."""
        assert not self.queue, "destroyed with calls still queued in a group"
        self.destroyed = True
        self.comm.Free()

    # module functions
    def groupStart(self):  # noqa: N802 - NCCL's names
        self.depth += 1

    def groupEnd(self):  # noqa: N802
        self.depth -= 1
        if self.depth == 0:
            queue, self.queue = self.queue, []
            if queue:
                self._run(queue)

    # communicator calls
    def send(self, ptr, count, dtype, peer, stream):
        self._call(("send", ptr, count, dtype, peer, stream))

    def recv(self, ptr, count, dtype, peer, stream):
        self._call(("recv", ptr, count, dtype, peer, stream))

    def allReduce(self, send, recv, count, dtype, op, stream):  # noqa: N802
        self._call(("allReduce", send, recv, count, dtype, op, stream))

    def reduceScatter(self, send, recv, count, dtype, op, stream):  # noqa: N802
        self._call(("reduceScatter", send, recv, count, dtype, op, stream))

    def allGather(self, send, recv, count, dtype, stream):  # noqa: N802
        self._call(("allGather", send, recv, count, dtype, stream))

    def bcast(self, ptr, count, dtype, root, stream):
        self._call(("bcast", ptr, count, dtype, root, stream))

    def reduce(self, send, recv, count, dtype, op, root, stream):
        self._call(("reduce", send, recv, count, dtype, op, root, stream))

    def abort(self):
        pass

    def _call(self, op):
        check_call(op, self.rank, self.size, self.version)
        self.streams.add(op[-1])
        if self.depth:
            self.queue.append(op)
        else:
            self._run([op])

    def _run(self, ops):
        self.groups.append([(op[0], op[4]) if op[0] in ("send", "recv") else (op[0],)
                            for op in ops])
        p2p = [op for op in ops if op[0] in ("send", "recv")]
        others = [op for op in ops if op[0] not in ("send", "recv")]
        assert not (p2p and others), "the backend never mixes p2p and collectives in a group"
        reqs = []
        for kind, ptr, count, dtype, peer, _ in p2p:
            buf = memory(ptr, count * np.dtype(NP_DTYPES[dtype]).itemsize)
            if kind == "send":
                reqs.append(self.comm.Issend(buf, dest=peer, tag=TAG))
            else:
                reqs.append(self.comm.Irecv(buf, source=peer, tag=TAG))
        if reqs:
            from mpi4py import MPI

            MPI.Request.Waitall(reqs)
        for op in others:  # grouped collectives run one after the other, in order
            getattr(self, "_" + op[0])(*op[1:-1])

    def _gather(self, ptr, count, dtype):
        item = np.dtype(NP_DTYPES[dtype]).itemsize
        mine = memory(ptr, count * item).copy()
        every = np.empty((self.size, mine.size), dtype=np.uint8)
        self.comm.Allgather(mine, every)
        return every.view(NP_DTYPES[dtype])

    def _reduced(self, ptr, count, dtype, op):
        rows = self._gather(ptr, count, dtype)
        out = functools.reduce(lambda a, b: UFUNCS[op](a, b), list(rows))
        if op == 4:  # avg
            out = (out.astype(np.float64) / self.size).astype(rows.dtype)
        return out

    def _allReduce(self, send, recv, count, dtype, op):  # noqa: N802
        out = self._reduced(send, count, dtype, op)
        memory(recv, out.nbytes)[:] = out.view(np.uint8)

    def _reduceScatter(self, send, recv, count, dtype, op):  # noqa: N802
        out = self._reduced(send, count * self.size, dtype, op)
        mine = out[self.rank * count:(self.rank + 1) * count]
        memory(recv, mine.nbytes)[:] = mine.view(np.uint8)

    def _allGather(self, send, recv, count, dtype):  # noqa: N802
        rows = self._gather(send, count, dtype)
        memory(recv, rows.nbytes)[:] = rows.reshape(-1).view(np.uint8)

    def _bcast(self, ptr, count, dtype, root):
        self.comm.Bcast(memory(ptr, count * np.dtype(NP_DTYPES[dtype]).itemsize), root=root)

    def _reduce(self, send, recv, count, dtype, op, root):
        out = self._reduced(send, count, dtype, op)
        if self.rank == root:
            memory(recv, out.nbytes)[:] = out.view(np.uint8)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _span(ptr, count, dtype, times=1):
    return ptr, ptr + count * times * np.dtype(NP_DTYPES[dtype]).itemsize


def _disjoint(a, b) -> bool:
    return a[0] == a[1] or b[0] == b[1] or a[1] <= b[0] or b[1] <= a[0]


def check_call(op, rank: int, size: int, version) -> None:
    """Refuse what the real ``NcclCommunicator`` call would refuse or leave undefined."""
    kind, args = op[0], op[1:]
    arity = {"send": 5, "recv": 5, "allReduce": 6, "reduceScatter": 6, "allGather": 5,
             "bcast": 5, "reduce": 7}[kind]
    assert len(args) == arity, f"{kind} takes {arity} arguments, got {len(args)}"
    assert all(_is_int(a) for a in args), f"{kind}: every argument is an int: {args}"
    # (count, datatype): after one pointer for send/recv/bcast, after two otherwise
    count, dtype = args[1:3] if kind in ("send", "recv", "bcast") else args[2:4]
    assert count >= 0, f"{kind}: count {count} (size_t)"
    assert dtype in NP_DTYPES, f"{kind}: no ncclDataType_t {dtype}"
    if dtype == 9:
        assert version >= (2, 10), f"{kind}: ncclBfloat16 needs NCCL 2.10"
    if kind in ("allReduce", "reduceScatter", "reduce"):
        assert args[4] in UFUNCS, f"{kind}: no ncclRedOp_t {args[4]}"
        assert args[4] != 4 or version >= (2, 10), f"{kind}: ncclAvg needs NCCL 2.10"
    if kind in ("send", "recv"):
        assert 0 <= args[3] < size, f"{kind}: peer {args[3]} of {size}"
    if kind in ("bcast", "reduce"):
        assert 0 <= args[-2] < size, f"{kind}: root {args[-2]} of {size}"
    if kind in ("allReduce", "reduce"):
        send, recv = _span(args[0], count, dtype), _span(args[1], count, dtype)
        assert send == recv or _disjoint(send, recv), f"{kind}: partly overlapping buffers"
    if kind == "reduceScatter":  # in place: recvbuff == sendbuff + rank * recvcount
        send, recv = _span(args[0], count, dtype, size), _span(args[1], count, dtype)
        in_place = recv[0] == send[0] + (recv[1] - recv[0]) * rank
        assert in_place or _disjoint(send, recv), f"{kind}: not in place and overlapping"
    if kind == "allGather":  # in place: sendbuff == recvbuff + rank * sendcount
        send, recv = _span(args[0], count, dtype), _span(args[1], count, dtype, size)
        in_place = send[0] == recv[0] + (send[1] - send[0]) * rank
        assert in_place or _disjoint(send, recv), f"{kind}: not in place and overlapping"


class HostDevice:
    """``CupyDevice`` on the host: NumPy arrays, a numbered stream, enter/leave logged."""

    device_id = 0

    def __init__(self):
        self.current = CALLER_STREAM
        self.log: list[str] = []

    def check_buffer(self, buf):
        if buf.device != "cpu":
            raise TypeError("HostDevice takes host arrays")

    def pointer(self, a) -> int:
        return int(a.ctypes.data)

    def stream_ptr(self) -> int:
        return self.current

    def empty(self, n, dtype):
        return np.empty(n, dtype=dtype)

    def enter(self, buf):
        self.log.append("enter")
        self.current = BACKEND_STREAM

    def leave(self):
        self.log.append("leave")
        self.current = CALLER_STREAM

    def synchronize(self):
        pass

    def torch_event(self, buf):
        return None  # host arrays: no torch stream to follow


def fake_backend(mpi_comm, version=(2, 30, 0)):
    """An ``NCCLBackend`` over ``mpi_comm`` whose NCCL and GPU are the fakes above."""
    from mpiring.backends.mpi import MPIBackend
    from mpiring.backends.nccl import NCCLBackend

    def make(mpi):
        fake = FakeNccl(mpi.comm.Dup(), version)
        return NCCLBackend(mpi, fake, fake, HostDevice(), version, make)

    return make(MPIBackend(mpi_comm.Dup()))
