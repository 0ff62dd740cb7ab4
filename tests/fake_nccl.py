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

    def __init__(self, comm):
        self.comm = comm
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


def fake_backend(mpi_comm, version=(2, 30, 0)):
    """An ``NCCLBackend`` over ``mpi_comm`` whose NCCL and GPU are the fakes above."""
    from mpiring.backends.mpi import MPIBackend
    from mpiring.backends.nccl import NCCLBackend

    def make(mpi):
        fake = FakeNccl(mpi.comm.Dup())
        return NCCLBackend(mpi, fake, fake, HostDevice(), version, make)

    return make(MPIBackend(mpi_comm.Dup()))
