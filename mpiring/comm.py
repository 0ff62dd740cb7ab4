"""The Communicator: rank and size, argument checks, and dispatch by algorithm.

Every collective goes through the same three steps:

1. ``_prepare``: validate the buffer and arguments locally (TypeError/ValueError
   naming the fix), then, unless checking is off, exchange a small descriptor
   (collective, count, dtype, op, root, algo, local error) with every rank. If
   any rank rejected its input or the descriptors differ, *every* rank raises
   before a byte of data moves: a bad buffer on one rank can never leave the
   others waiting in a ring step.
2. dispatch to the ring code in ``mpiring.collectives`` or to the backend's
   native collective;
3. return the caller's object (in place), or for ``reduce_scatter`` the view of
   chunk ``rank``.
"""

from __future__ import annotations

import os

import numpy as np

from . import collectives as coll
from .buffers import DTYPES, Buffer, as_buffer
from .chunking import chunk_bounds, default_pipeline_chunks
from .errors import MismatchError
from .ops import OPS, check_op
from .trace import Tracer

ALGOS = {
    "all_reduce": ("ring", "native"),
    "reduce_scatter": ("ring", "native"),
    "all_gather": ("ring", "native"),
    "broadcast": ("ring", "pipelined", "native"),
    "reduce": ("ring", "pipelined", "native"),
}
# Collectives that reduce (and therefore take an op).
REDUCING = ("all_reduce", "reduce_scatter", "reduce")

_COLL_ID = {name: i for i, name in enumerate(ALGOS)}
_ALGO_ID = {"ring": 0, "pipelined": 1, "native": 2, "auto": 3}
_DESC_FIELDS = ("collective", "count", "dtype", "op", "root", "algo", "chunks")


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.lower() not in ("0", "false", "no", "off")


class Communicator:
    """A group of ranks and the collectives over them.

    Attributes:
        rank: this process's rank in the communicator.
        size: number of ranks.
        local_rank: rank among the processes of this host (``Split_type(SHARED)``).
        local_size: number of ranks on this host.
        backend: "mpi" or "nccl".
    """

    def __init__(self, be, tracer: Tracer | None = None, *, check: bool | None = None):
        self._be = be
        self.rank: int = be.rank
        self.size: int = be.size
        self.backend: str = be.name
        self.local_rank, self.local_size = be.local_rank()
        self.tracer = tracer if tracer is not None else Tracer.from_env(self.rank)
        self.check = _env_flag("MPIRING_CHECK", True) if check is None else check
        self._calls: dict[str, int] = {}

    # --- helpers --------------------------------------------------------------
    def __repr__(self) -> str:
        return f"Communicator(backend={self.backend!r}, rank={self.rank}, size={self.size})"

    def _next_call(self, collective: str) -> int:
        n = self._calls.get(collective, 0) + 1
        self._calls[collective] = n
        return n

    def _validate(self, collective: str, x, op, algo, root, chunks) -> Buffer:
        buf = as_buffer(x)
        if algo not in ALGOS[collective]:
            raise ValueError(
                f"unknown algo {algo!r} for {collective}: use one of "
                f"{', '.join(ALGOS[collective])}"
            )
        if collective in REDUCING:
            check_op(op, buf.dtype, buf.floating)
        if root is not None and not (isinstance(root, (int, np.integer)) and 0 <= root < self.size):
            raise ValueError(f"root={root!r} out of range: use a rank in 0..{self.size - 1}")
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer))
                                   or chunks < 1):
            raise ValueError(f"chunks={chunks!r}: the pipeline needs a positive integer "
                             "number of chunks (or None for the default)")
        if buf.device == "cuda" and not getattr(self._be, "accepts_cuda", False):
            raise TypeError(
                f"{collective}: got a CUDA buffer but this {self.backend} backend cannot take "
                "device memory: use backend='nccl', or a CUDA-aware MPI"
            )
        if algo == "native":
            self._be.check_native(collective, buf.dtype, op if collective in REDUCING else None)
        return buf

    def _prepare(self, collective: str, x, *, op=None, algo="ring", root=None,
                 chunks=None, check=None) -> tuple[Buffer, int]:
        call = self._next_call(collective)
        error: Exception | None = None
        buf = None
        try:
            buf = self._validate(collective, x, op, algo, root, chunks)
        except (TypeError, ValueError) as exc:
            error = exc
        if not (self.check if check is None else check) or self.size == 1:
            if error is not None:
                raise error
            return buf, call
        desc = np.array([
            _COLL_ID[collective],
            buf.count if buf else -1,
            DTYPES.index(buf.dtype) if buf else -1,
            OPS.index(op) if op in OPS else -1,
            -1 if root is None else int(root) if isinstance(root, (int, np.integer)) else -2,
            _ALGO_ID.get(algo, -1),
            -1 if chunks is None else int(chunks) if isinstance(chunks, (int, np.integer)) else -2,
            0 if error is None else 1,
        ], dtype=np.int64)
        table = self._be.exchange(desc)
        name = f"{collective}#{call}"
        bad = [r for r in range(self.size) if table[r, -1]]
        if bad:
            if error is not None:
                raise error
            raise ValueError(
                f"{name}: rank(s) {', '.join(f'r{r}' for r in bad)} rejected their input, "
                "so no rank ran the collective; see the error printed by those ranks"
            )
        for j, field in enumerate(_DESC_FIELDS):
            column = table[:, j]
            if (column != column[0]).any():
                values = " ".join(f"r{r}={_describe(field, v)}" for r, v in enumerate(column))
                raise MismatchError(f"{name}: {field} differs: {values}")
        return buf, call

    # --- collectives ----------------------------------------------------------
    def all_reduce(self, x, op: str = "sum", algo: str = "ring", *, check: bool | None = None):
        """Reduce ``x`` over all ranks, in place; every rank gets the result.

        Args:
            x: numpy array, torch tensor or cupy array (contiguous, writable).
            op: "sum", "avg", "max", "min" or "prod".
            algo: "ring" (ReduceScatter + AllGather) or "native" (the library's own).
            check: compare the call's arguments across ranks first (default on;
                ``MPIRING_CHECK=0`` turns it off).

        Returns:
            ``x``.
        """
        buf, call = self._prepare("all_reduce", x, op=op, algo=algo, check=check)
        if algo == "native":
            self._be.native_all_reduce(buf.array, op)
        else:
            coll.ring_all_reduce(self._be, buf.array, op, self.tracer.call("all_reduce", call, algo))
        self._be.synchronize()
        return x

    def reduce_scatter(self, x, op: str = "sum", algo: str = "ring", *, check: bool | None = None):
        """Reduce ``x`` in place so that rank r holds chunk r fully reduced.

        Chunks follow numpy.array_split bounds over the flattened buffer. The other
        chunks of ``x`` hold partial sums afterwards.

        Returns:
            The view of chunk ``self.rank`` of ``x`` (same type as ``x``).
        """
        buf, call = self._prepare("reduce_scatter", x, op=op, algo=algo, check=check)
        if algo == "native":
            lo, hi = self._be.native_reduce_scatter(buf.array, op)
        else:
            lo, hi = coll.ring_reduce_scatter(
                self._be, buf.array, op, self.tracer.call("reduce_scatter", call, algo))
        self._be.synchronize()
        return buf.chunk(lo, hi)

    def all_gather(self, x, algo: str = "ring", *, check: bool | None = None):
        """Fill every chunk of ``x`` in place from its owner; rank r provides chunk r.

        Returns:
            ``x``.
        """
        buf, call = self._prepare("all_gather", x, algo=algo, check=check)
        if algo == "native":
            self._be.native_all_gather(buf.array)
        else:
            coll.ring_all_gather(self._be, buf.array, self.tracer.call("all_gather", call, algo))
        self._be.synchronize()
        return x

    def broadcast(self, x, root: int = 0, algo: str = "pipelined", chunks: int | None = None,
                  *, check: bool | None = None):
        """Copy the root's ``x`` into every rank's ``x``.

        Args:
            algo: "ring" (the whole message hop by hop, (K-1)N/B), "pipelined"
                (S chunks, (K-2+S)N/(SB)) or "native".
            chunks: S for "pipelined"; default about 1 MiB a chunk.

        Returns:
            ``x``.
        """
        buf, call = self._prepare("broadcast", x, algo=algo, root=root, chunks=chunks,
                                  check=check)
        if algo == "native":
            self._be.native_broadcast(buf.array, root)
        else:
            s = self._pipeline_chunks(buf, algo, chunks)
            coll.pipelined_broadcast(self._be, buf.array, root, s,
                                     self.tracer.call("broadcast", call, algo))
        self._be.synchronize()
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
        if algo == "native":
            self._be.native_reduce(buf.array, op, root)
        else:
            s = self._pipeline_chunks(buf, algo, chunks)
            coll.pipelined_reduce(self._be, buf.array, op, root, s,
                                  self.tracer.call("reduce", call, algo))
        self._be.synchronize()
        return x

    def _pipeline_chunks(self, buf: Buffer, algo: str, chunks: int | None) -> int:
        if algo == "ring":
            return 1
        if chunks is not None:
            return int(chunks)
        return default_pipeline_chunks(buf.nbytes, self.size)

    # --- communicators and utilities -------------------------------------------
    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """A Communicator over the ranks that passed the same ``color``.

        Ranks order by ``key`` then by rank. A rank that passes ``color=None`` (or a
        negative color) takes part in the split but gets ``None`` back.
        """
        be = self._be.split(color, key)
        if be is None:
            return None
        return Communicator(be, self.tracer, check=self.check)

    def dup(self) -> Communicator:
        """A Communicator over the same ranks with separate message matching."""
        return Communicator(self._be.dup(), self.tracer, check=self.check)

    def barrier(self) -> None:
        self._be.barrier()

    def chunk_bounds(self, n: int) -> list[tuple[int, int]]:
        """The chunk bounds ``reduce_scatter``/``all_gather`` use for ``n`` elements."""
        return chunk_bounds(n, self.size)

    @property
    def mpi_comm(self):
        """The underlying ``mpi4py.MPI.Comm``."""
        return self._be.comm


def _describe(field: str, value: int) -> str:
    value = int(value)
    if value == -1:
        return "-" if field not in ("op",) else "none"
    if field == "collective":
        return list(ALGOS)[value]
    if field == "dtype":
        return DTYPES[value]
    if field == "op":
        return OPS[value]
    if field == "algo":
        return {v: k for k, v in _ALGO_ID.items()}.get(value, "?")
    return str(value)
