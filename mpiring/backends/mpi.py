"""MPI backend over mpi4py: point-to-point for the ring, MPI's own collectives as ``native``."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
from mpi4py import MPI

from ..chunking import chunk_bounds
from ..ops import finish

# One tag for all ring traffic: collectives on a communicator are issued in the
# same order on every rank and MPI never overtakes messages between two ranks
# with the same tag, so the steps cannot be confused.
TAG = 7

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def _bytes(a):
    # Point-to-point moves raw bytes: every dtype (bfloat16 included, which has no
    # MPI datatype) travels the same way and mpi4py needs no type lookup.
    return a.view(np.uint8)


class MPIBackend:
    """Point-to-point and native collectives on one ``MPI.Comm``."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._scratch: dict = {}

    # --- point-to-point, as in the lecture's pseudocode ---------------------
    def irecv(self, buf, src: int):
        return self.comm.Irecv(_bytes(buf), source=src, tag=TAG)

    def send(self, buf, dst: int) -> None:
        self.comm.Send(_bytes(buf), dest=dst, tag=TAG)

    def wait(self, req) -> None:
        req.Wait()

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int) -> None:
        self.comm.Sendrecv(_bytes(sendbuf), dst, TAG, _bytes(recvbuf), src, TAG)

    def group(self):
        return nullcontext()

    def synchronize(self) -> None:
        pass

    def scratch(self, like, n: int):
        """A receive buffer of ``n`` elements of ``like``'s dtype, reused across calls."""
        key = like.dtype
        buf = self._scratch.get(key)
        if buf is None or buf.size < n:
            buf = np.empty(max(n, 1), dtype=like.dtype)
            self._scratch[key] = buf
        return buf[:n]

    def exchange(self, values: np.ndarray) -> np.ndarray:
        """Allgather a small int64 vector from every rank: a (size, len) array."""
        out = np.empty((self.size, values.size), dtype=np.int64)
        self.comm.Allgather(values, out)
        return out

    def exchange_bytes(self, data: bytes) -> list[bytes]:
        """Allgather variable-length byte strings (no pickle)."""
        lengths = self.exchange(np.array([len(data)], dtype=np.int64))[:, 0]
        out = np.empty(int(lengths.sum()), dtype=np.uint8)
        displs = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        self.comm.Allgatherv(np.frombuffer(data, dtype=np.uint8),
                             [out, lengths.tolist(), displs.tolist(), MPI.BYTE])
        return [out[d:d + n].tobytes() for d, n in zip(displs, lengths)]

    def barrier(self) -> None:
        self.comm.Barrier()

    # --- the MPI library's own collectives ----------------------------------
    def check_native(self, collective: str, dtype: str, op: str | None) -> None:
        if dtype == "bfloat16" and op is not None:
            raise TypeError(
                f"algo='native' {collective} cannot reduce bfloat16: MPI has no bfloat16 "
                "type; use algo='ring' (mpiring reduces bfloat16 itself)"
            )

    def native_all_reduce(self, x, op: str):
        self.comm.Allreduce(MPI.IN_PLACE, x, MPI_OPS[op])
        finish(op, x, self.size)
        return x

    def native_reduce_scatter(self, x, op: str):
        bounds = chunk_bounds(x.size, self.size)
        counts = [b - a for a, b in bounds]
        lo, hi = bounds[self.rank]
        recv = self.scratch(x, counts[self.rank])
        self.comm.Reduce_scatter(x, recv, counts, MPI_OPS[op])
        x[lo:hi] = recv
        finish(op, x[lo:hi], self.size)
        return lo, hi

    def native_all_gather(self, x):
        bounds = chunk_bounds(x.size, self.size)
        counts = [(b - a) * x.itemsize for a, b in bounds]
        displs = [a * x.itemsize for a, _ in bounds]
        self.comm.Allgatherv(MPI.IN_PLACE, [_bytes(x), counts, displs, MPI.BYTE])
        return x

    def native_broadcast(self, x, root: int):
        self.comm.Bcast(_bytes(x), root=root)
        return x

    def native_reduce(self, x, op: str, root: int):
        if self.rank == root:
            self.comm.Reduce(MPI.IN_PLACE, x, MPI_OPS[op], root=root)
            finish(op, x, self.size)
        else:
            self.comm.Reduce(x, None, MPI_OPS[op], root=root)
        return x

    # --- communicators --------------------------------------------------------
    def split(self, color: int, key: int):
        sub = self.comm.Split(MPI.UNDEFINED if color is None or color < 0 else color, key)
        return None if sub == MPI.COMM_NULL else MPIBackend(sub)

    def dup(self):
        return MPIBackend(self.comm.Dup())

    def local_rank(self) -> tuple[int, int]:
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return node.Get_rank(), node.Get_size()
        finally:
            node.Free()

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)
