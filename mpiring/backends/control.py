"""Small values between ranks without pickle.

mpi4py's lowercase methods (``comm.bcast``, ``comm.allgather``,
``comm.allreduce``, ``comm.gather``, ``comm.send``/``recv``...) pickle the object
and unpickle whatever arrives: a peer, or anything that can inject traffic into
the job's network, could then run code in this process. mpiring never uses
them. Everything that crosses ranks is a typed buffer: numbers go as int64 or
float64 arrays, text and structured values as bytes (UTF-8 JSON for the
latter: JSON decodes to plain data and nothing else).

Every function takes an ``mpi4py.MPI.Comm`` or an ``mpiring.Communicator`` and
is collective: every rank of the communicator calls it, in the same order.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from mpi4py import MPI

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def _mpi(comm) -> MPI.Comm:
    return getattr(comm, "mpi_comm", comm)


def allreduce_scalar(comm, value: float | int | bool, op: str = "sum") -> Any:
    """Reduce one number over every rank: an int stays an int (int64), a float a float.

    Args:
        op: "sum", "max", "min" or "prod".
    """
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}: use one of {', '.join(_OPS)}")
    is_int = isinstance(value, (bool, int, np.integer))
    buf = np.array([value], dtype=np.int64 if is_int else np.float64)
    _mpi(comm).Allreduce(MPI.IN_PLACE, buf, _OPS[op])
    return int(buf[0]) if is_int else float(buf[0])


def allgather_array(comm, values) -> np.ndarray:
    """Every rank's equal-length vector of numbers, as a (size, n) array (int64 or float64)."""
    values = np.asarray(values)
    dtype = np.float64 if values.dtype.kind == "f" else np.int64
    values = np.ascontiguousarray(values, dtype=dtype).reshape(-1)
    mpi = _mpi(comm)
    out = np.empty((mpi.Get_size(), values.size), dtype=dtype)
    mpi.Allgather(values, out)
    return out


def bcast_bytes(comm, data: bytes | None, root: int = 0) -> bytes:
    """The root's bytes on every rank (``data`` is ignored elsewhere)."""
    mpi = _mpi(comm)
    is_root = mpi.Get_rank() == root
    n = np.array([len(data) if is_root else 0], dtype=np.int64)
    mpi.Bcast(n, root=root)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8) if is_root \
        else np.empty(int(n[0]), dtype=np.uint8)
    mpi.Bcast(buf, root=root)
    return buf.tobytes()


def allgather_bytes(comm, data: bytes) -> list[bytes]:
    """Every rank's byte string, in rank order."""
    mpi = _mpi(comm)
    lengths = allgather_array(mpi, [len(data)])[:, 0]
    displs = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    mpi.Allgatherv(np.frombuffer(bytes(data), dtype=np.uint8),
                   [out, lengths.tolist(), displs.tolist(), MPI.BYTE])
    return [out[d:d + n].tobytes() for d, n in zip(displs, lengths)]


def _plain(value: Any) -> Any:
    # NumPy scalars and arrays as plain numbers and lists.
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable: send plain numbers, "
                    "strings, lists and dicts")


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, default=_plain).encode()


def bcast_json(comm, obj: Any = None, root: int = 0) -> Any:
    """The root's JSON-serialisable value on every rank (tuples come back as lists;
    NumPy scalars and arrays as numbers and lists)."""
    mpi = _mpi(comm)
    data = _dumps(obj) if mpi.Get_rank() == root else None
    return json.loads(bcast_bytes(mpi, data, root).decode())


def allgather_json(comm, obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable value, in rank order."""
    return [json.loads(b.decode()) for b in allgather_bytes(comm, _dumps(obj))]
