"""Argument agreement: every rank checks that all ranks called the same collective.

Before any data moves, each rank describes its call as a few int64s
(collective, count, dtype, op, root, algo, chunks, segment size, call number, the
caller's line as a code, and whether its own input was refused) and the ranks exchange the descriptors over
the control channel. If any rank refused its input, or the descriptors differ,
*every* rank raises, so a bad buffer on one rank can never leave the others
waiting in a ring step. The usual case, all equal, costs one small Allgather
and one list comparison.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

from mpiring.comm.callsite import site_name
from mpiring.core.buffers import DTYPES, Buffer
from mpiring.core.errors import MismatchError
from mpiring.core.ops import OPS

# "call": the call number of this collective on this communicator; it differs
# when a rank made more or fewer calls than the others (one unchecked). "site":
# the caller's line (mpiring.comm.callsite); it differs when a rank skipped a
# call that the others made from another line, where the counts cannot see it
# until the end of the sequence and same-shaped calls would mix silently.
#: Calls other than the collectives that agree before they start (``Communicator.agree_call``),
#: so that a rank in one of them can name it when another rank is elsewhere.
CALLS = ("DistributedDataParallel", "ParameterServer", "FullyShardedDataParallel",
         "ZeroRedundancyOptimizer")

_DESC_FIELDS = ("collective", "count", "dtype", "op", "root", "algo", "chunks",
                "segment_bytes", "call", "site")


def agree(be, collective: str, call: int, buf: Buffer | None, op, algo, root, chunks,
          segment, error: Exception | None, site: int = 0) -> None:
    """Exchange this call's descriptor with every rank; raise on every rank unless all agree.

    Raises:
        the local ``error``, on the rank that had it; ValueError quoting it on
        the others; MismatchError listing each rank's value where the calls differ.
    """
    table = be.exchange(_descriptor(collective, buf, op, algo, root, chunks, segment,
                                    call, site, error))
    rows = table.tolist()
    if rows[0][-1] == 0 and rows.count(rows[0]) == len(rows):
        # Every rank described the same call and none failed: the usual case,
        # settled with one list comparison (the column-by-column report below
        # costs more than the exchange itself).
        return
    name = f"{collective}#{call}"
    bad = [r for r in range(be.size) if table[r, -1]]
    if bad:
        # Every rank knows that some rank failed, so all can take part in one
        # more exchange: each error's text as bytes (never pickle), so that
        # every rank's message says what went wrong where.
        texts = _peer_errors(be, error)
        if error is not None:
            raise error
        raise ValueError(f"{name}: no rank ran the collective because " + "; ".join(
            f"r{r} rejected its input ({texts[r]})" if texts else f"r{r} rejected its input"
            for r in bad))
    differs = []
    for j, field in enumerate(_DESC_FIELDS):
        column = table[:, j]
        if (column != column[0]).any():
            if field == "site":  # each rank knows only its own line's name: exchange them
                names = _site_names(be, site)
                values = " ".join(f"r{r}={names[r]}" for r in range(len(column)))
                differs.append(f"call site differs: {values} (the ranks are in different "
                               f"calls: a rank skipped or added a call of {collective}, or "
                               "makes this one from another line)")
                continue
            values = " ".join(f"r{r}={_describe(field, v)}" for r, v in enumerate(column))
            differs.append(f"{field} differs: {values}")
            if field == "collective":  # the other fields then mean different things
                break
            if field == "call":
                differs[-1] += (f" (a rank made more or fewer {collective} calls on this "
                                "communicator than the others)")
    if differs:
        raise MismatchError(f"{name}: " + "; ".join(differs))


def agree_ok(be, name: str, error: Exception | None) -> None:
    """Every rank learns whether any rank refused its arguments to ``name``; all raise if so.

    For calls without a data descriptor (``split``): one exchange of a flag, and
    of the error texts only when some rank failed.

    Raises:
        the local ``error`` on the rank that had it; ValueError quoting it on the others.
    """
    flags = be.exchange(np.array([0 if error is None else 1], dtype=np.int64))[:, 0]
    if not flags.any():
        return
    texts = _peer_errors(be, error)
    if error is not None:
        raise error
    bad = [r for r in range(be.size) if flags[r]]
    raise ValueError(f"{name}: no rank ran it because " + "; ".join(
        f"r{r} rejected its arguments ({texts[r]})" if texts else f"r{r} rejected its arguments"
        for r in bad))


@functools.lru_cache(maxsize=256)
def _crc(name: str) -> int:
    return zlib.crc32(name.encode())


def _name_code(name: Any) -> int:
    # Names travel as CRC-32 codes, so collectives or algorithms added to ALGOS
    # later are compared correctly without a table kept in step with it.
    return _crc(name) if isinstance(name, str) else -2


def _index(options: tuple[str, ...], value: Any) -> int:
    if value is None:
        return -1
    return options.index(value) if isinstance(value, str) and value in options else -2


def _int_or(value: Any) -> int:
    if value is None:
        return -1
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return -2


def _descriptor(collective: str, buf: Buffer | None, op, algo, root, chunks, segment,
                call: int, site: int, error: Exception | None) -> np.ndarray:
    """The call as int64s, in ``_DESC_FIELDS`` order plus an error flag; never raises."""
    return np.array([
        _name_code(collective),
        buf.count if buf is not None else -1,
        DTYPES.index(buf.dtype) if buf is not None else -1,
        _index(OPS, op),
        _int_or(root),
        _name_code(algo),
        _int_or(chunks),
        _int_or(segment),
        call,
        site,
        0 if error is None else 1,
    ], dtype=np.int64)


def _peer_errors(be, error: Exception | None, limit: int = 400) -> list[str]:
    """Every rank's error text (empty where none), exchanged as bytes."""
    exchange = getattr(be, "exchange_bytes", None)
    if exchange is None:
        return []
    text = "" if error is None else f"{type(error).__name__}: {error}"
    raw = exchange(text.encode("utf-8", errors="replace")[:limit])
    return [r.decode("utf-8", errors="replace") for r in raw]


def _site_names(be, site: int) -> list[str]:
    """Every rank's ``file:line`` for its call site (codes, where texts cannot travel)."""
    exchange = getattr(be, "exchange_bytes", None)
    if exchange is None:
        return [site_name(int(v)) for v in be.exchange(np.array([site], np.int64))[:, 0]]
    return [r.decode("utf-8", errors="replace") for r in exchange(site_name(site).encode())]


def _describe(field: str, value: int) -> str:
    value = int(value)
    if value == -1:
        return "none" if field == "op" else "-"
    if value == -2:
        return "invalid"
    if field in ("collective", "algo"):
        names = [*_algos(), *CALLS] if field == "collective" else \
            list(dict.fromkeys(a for algos in _algos().values() for a in (*algos, "auto")))
        return next((n for n in names if _name_code(n) == value), "?")
    if field == "dtype":
        return DTYPES[value]
    if field == "op":
        return OPS[value]
    return str(value)


def _algos() -> dict[str, tuple[str, ...]]:
    from mpiring.comm.algos import ALGOS  # the names, to print a code back as text

    return ALGOS
