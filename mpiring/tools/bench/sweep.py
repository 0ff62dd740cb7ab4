"""The nccl-tests-style sweep: every collective and algorithm, checked and timed, size by size.

For each collective and each size, every algorithm runs on the same buffer:

1. a checked call (argument exchange on) on rank- and index-dependent data,
   compared element by element with the native result (native itself is
   compared with a NumPy reference computed locally); the wrong elements of all
   ranks are summed into ``#wrong``;
2. ``warmup`` untimed and ``iters`` timed calls with ``check=False``, the
   algorithms taking turns (iteration i runs each once), so that load from
   elsewhere on a shared machine hits them alike; the time of an iteration is
   the slowest rank's, the reported time the median.

Algorithms come from ``mpiring.comm.communicator.ALGOS`` (so new ones show up here without a
change) plus ``gloo``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiring.comm import communicator as comm_module
from mpiring.core.buffers import bfloat16
from mpiring.core.chunking import chunk_bounds
from mpiring.core.costmodel import AlphaBeta, MemoryBound, membw_busbw_bound, model_fields, predict
from mpiring.core.ops import finish, reducer
from mpiring.tools.bench.measure import batch_for, time_interleaved
from mpiring.tools.bench.report import make_row, paired_quartiles

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
ROOTED = ("broadcast", "reduce")
REDUCING = ("all_reduce", "reduce_scatter", "reduce")
# Collectives whose buffer is cut into K equal pieces by the baselines (gloo needs
# equal chunks): sizes are rounded down to a multiple of K elements, as nccl-tests does.
CHUNKED = ("reduce_scatter", "all_gather")
PERIOD = 49  # the test data repeats every 49 elements (never a power-of-two chunk size)


def algos_for(collective: str, gloo: bool = True) -> tuple[str, ...]:
    """The algorithms the bench can run for ``collective``: the Communicator's plus gloo."""
    algos = tuple(comm_module.ALGOS[collective])
    return algos + ("gloo",) if gloo else algos


def resolve_algos(collectives: Sequence[str], requested: Sequence[str] | None,
                  gloo: bool) -> dict[str, list[str]]:
    """Which algorithms to run per collective.

    Args:
        collectives: selected collectives.
        requested: ``--algo`` list, or None for every algorithm that applies
            (gloo only when torch is importable).
        gloo: whether torch's gloo can be used here.

    Raises:
        ValueError: an unknown collective, or an algorithm that applies to none of
            the selected collectives (the message lists the valid ones).
    """
    for c in collectives:
        if c not in COLLECTIVES:
            raise ValueError(f"unknown collective {c!r}: use one of {', '.join(COLLECTIVES)}")
    if requested is None:
        return {c: list(algos_for(c, gloo)) for c in collectives}
    known = sorted({a for c in collectives for a in algos_for(c)})
    for a in requested:
        if a not in known:
            raise ValueError(f"unknown algo {a!r} for {', '.join(collectives)}: use one of "
                             f"{', '.join(known)}")
    return {c: [a for a in requested if a in algos_for(c)] for c in collectives}


def element_count(collective: str, nbytes: int, itemsize: int, k: int) -> int:
    """Elements in a buffer of about ``nbytes``: rounded down to a multiple of K when chunked."""
    count = nbytes // itemsize
    if collective in CHUNKED:
        count -= count % k
    return count


# --- data and the reference result -----------------------------------------------
def pattern(rank: int, dtype: np.dtype, op: str) -> np.ndarray:
    """One period of rank ``rank``'s data: small integers, exact in every dtype.

    Values 0..6 (1..3 for prod) depend on rank and index; the period is 49, so a
    chunk put at the wrong offset (chunk bounds of power-of-two buffers are never
    multiples of 49) shows up as wrong elements.
    """
    idx = np.arange(PERIOD, dtype=np.int64)
    mix = idx * 5 + rank * 3 + (idx // 7) * 2
    vals = mix % 3 + 1 if op == "prod" else mix % 7
    return vals.astype(np.float64).astype(dtype)


def rank_data(rank: int, n: int, dtype: np.dtype, op: str) -> np.ndarray:
    """Rank ``rank``'s n-element input (the pattern tiled)."""
    return np.resize(pattern(rank, dtype, op), n)


def reference(collective: str, n: int, k: int, rank: int, root: int, op: str,
              dtype: np.dtype) -> np.ndarray:
    """What ``rank`` must hold after the collective, computed locally with NumPy.

    For reduce_scatter, chunk ``rank`` only; for reduce, the root's buffer (other
    ranks: an empty array, nothing to check).
    """
    if collective in REDUCING:
        acc = pattern(0, dtype, op).copy()
        apply = reducer(op)
        for r in range(1, k):
            apply(acc, pattern(r, dtype, op))
        finish(op, acc, k)
        full = np.resize(acc, n)
        if collective == "reduce_scatter":
            lo, hi = chunk_bounds(n, k)[rank]
            return full[lo:hi]
        if collective == "reduce" and rank != root:
            return full[:0]
        return full
    if collective == "broadcast":
        return rank_data(root, n, dtype, op)
    out = np.empty(n, dtype=dtype)  # all_gather: chunk c comes from rank c
    for c, (lo, hi) in enumerate(chunk_bounds(n, k)):
        out[lo:hi] = rank_data(c, hi, dtype, op)[lo:hi]
    return out


def count_wrong(got: np.ndarray, expected: np.ndarray, op: str) -> int:
    """Elements that differ (``avg`` divides, so there a relative tolerance applies)."""
    if got.shape != expected.shape:
        return max(got.size, expected.size)
    if op == "avg":
        tol = 1e-2 if got.dtype.itemsize <= 2 else 1e-5
        ok = np.isclose(got.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)
        return int(got.size - np.count_nonzero(ok))
    return int(np.count_nonzero(got != expected))


# --- one algorithm on one buffer --------------------------------------------------
@dataclass
class Case:
    """How to run, reset and read back one (collective, algo) on the shared buffer."""

    call: Callable[[], Any]
    checked: Callable[[], Any]
    reset: Callable[[], Any]
    result: Callable[[], np.ndarray]
    chunks: int | None = None


def make_case(comm, gloo, collective: str, algo: str, buf: np.ndarray, src: np.ndarray,
              op: str, root: int, chunks: int | None) -> Case:
    """Bind the collective to ``buf`` (reset from ``src`` before every call)."""
    rank, k = comm.rank, comm.size

    def reset():
        np.copyto(buf, src)

    if algo == "gloo":
        return _gloo_case(gloo, collective, buf, src, op, root, rank, k, reset)
    method = getattr(comm, collective)
    kwargs: dict[str, Any] = {"algo": algo}
    if collective in REDUCING:
        kwargs["op"] = op
    if collective in ROOTED:
        kwargs["root"] = root
        if algo != "native" and chunks is not None:
            kwargs["chunks"] = chunks
    lo, hi = chunk_bounds(buf.size, k)[rank]

    def result():
        if collective == "reduce_scatter":
            return buf[lo:hi]
        if collective == "reduce" and rank != root:
            return buf[:0]
        return buf

    s = None
    if algo == "pipelined" and collective in ROOTED:
        # What the Communicator will use: the tuned alpha and beta if `tune` stored
        # them for this layout, else the built-in ones (the first lookup is
        # collective; every rank builds its cases in the same order).
        s = chunks if chunks is not None else comm.pipeline_chunks(buf.nbytes)
    elif algo == "ring" and collective in ROOTED:
        s = 1
    return Case(call=lambda: method(buf, check=False, **kwargs),
                checked=lambda: method(buf, **kwargs), reset=reset, result=result, chunks=s)


def _gloo_case(gloo, collective, buf, src, op, root, rank, k, reset) -> Case:
    t = gloo.tensor(buf)
    if collective == "all_reduce":
        call = lambda: gloo.all_reduce(t, op)  # noqa: E731
        result = lambda: buf  # noqa: E731
    elif collective == "reduce_scatter":
        out = np.empty(buf.size // k, dtype=buf.dtype)
        tout = gloo.tensor(out)
        call = lambda: gloo.reduce_scatter(tout, t, op)  # noqa: E731
        result = lambda: out  # noqa: E731
    elif collective == "all_gather":
        lo, hi = chunk_bounds(buf.size, k)[rank]
        mine = src[lo:hi].copy()  # gloo gathers from a separate input
        tin = gloo.tensor(mine)
        call = lambda: gloo.all_gather(t, tin)  # noqa: E731
        result = lambda: buf  # noqa: E731
    elif collective == "broadcast":
        call = lambda: gloo.broadcast(t, root)  # noqa: E731
        result = lambda: buf  # noqa: E731
    else:
        call = lambda: gloo.reduce(t, root, op)  # noqa: E731
        result = lambda: buf if rank == root else buf[:0]  # noqa: E731
    return Case(call=call, checked=call, reset=reset, result=result)


# --- the sweep --------------------------------------------------------------------
@dataclass
class SweepConfig:
    """What ``python -m mpiring bench`` was asked to run."""

    collectives: Sequence[str]
    algos: dict[str, list[str]]
    sizes: Sequence[int]
    iters: int = 20
    warmup: int = 5
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    chunks: int | None = None
    model: AlphaBeta | None = None
    bound: MemoryBound | None = None
    notes: list[str] = field(default_factory=list)


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a bench dtype name (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        return bfloat16()
    try:
        return np.dtype(name)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {name!r}: use float32, float16, bfloat16, float64, "
                         "int8, int32, int64 or uint8") from exc


def run_sweep(comm, cfg: SweepConfig, *, gloo=None, progress=None) -> list[dict[str, Any]]:
    """Run every (collective, algo, size) of ``cfg``; return the result rows (same on all ranks).

    Rows of an algorithm that the Communicator refuses for this dtype/op (for
    example native bfloat16 reductions, which MPI cannot do) are left out and
    noted in ``cfg.notes``; such a refusal is raised on every rank alike.
    """
    dtype = np_dtype(cfg.dtype)
    k, rank = comm.size, comm.rank
    rows: list[dict[str, Any]] = []
    skipped: set[tuple[str, str]] = set()
    for coll in cfg.collectives:
        algos = cfg.algos[coll]
        if not algos:
            continue
        # native first: its result is what every other algorithm is checked against
        order = sorted(algos, key=lambda a: a != "native")
        counts = list(dict.fromkeys(element_count(coll, n, dtype.itemsize, k) for n in cfg.sizes))
        for count in counts:
            if count <= 0:
                if progress:
                    progress.update(f"{coll} (size 0 skipped)", len(order))
                continue
            src = rank_data(rank, count, dtype, cfg.op)
            buf = src.copy()
            ref = reference(coll, count, k, rank, cfg.root, cfg.op, dtype)
            expected = ref
            checked: list[tuple[str, Case, int]] = []
            for algo in order:  # 1. check every algorithm once, native first
                if progress:
                    progress.show(f"{coll} {algo} {count * dtype.itemsize} B: check")
                if (coll, algo) in skipped:
                    if progress:
                        progress.update(f"{coll} {algo}")
                    continue
                case = make_case(comm, gloo, coll, algo, buf, src, cfg.op, cfg.root, cfg.chunks)
                case.reset()
                try:
                    case.checked()
                except (TypeError, ValueError) as exc:  # raised on every rank alike
                    skipped.add((coll, algo))
                    cfg.notes.append(f"{coll} {algo}: skipped: {exc}")
                    if progress:
                        progress.update(f"{coll} {algo}")
                    continue
                got = case.result()
                wrong = count_wrong(got, expected, cfg.op)
                if algo == "native":
                    wrong = count_wrong(got, ref, cfg.op)
                    expected = got.copy()
                checked.append((algo, case, comm.control.allreduce_scalar(int(wrong))))
            if not checked:
                continue
            # 2. time them interleaved: iteration i runs every algorithm once, so a
            # burst of load from elsewhere hits all of them alike and ratios hold.
            if progress:
                progress.show(f"{coll} {count * dtype.itemsize} B: timing "
                              f"{', '.join(a for a, _, _ in checked)}")
            nbytes = count * dtype.itemsize
            batch = batch_for(nbytes)
            times = time_interleaved(comm, [c.call for _, c, _ in checked],
                                     [c.reset for _, c, _ in checked],
                                     iters=cfg.iters, warmup=cfg.warmup, batch=batch)
            native_t = next((t for (a, _, _), t in zip(checked, times) if a == "native"), None)
            for (algo, case, wrong), t in zip(checked, times):
                seconds = float(np.median(t)) if t.size else 0.0
                extras: dict[str, Any] = {
                    "count": count, "op": cfg.op if coll in REDUCING else None,
                    "root": cfg.root if coll in ROOTED else None, "iters": cfg.iters,
                    "batch": batch,
                    "warmup": cfg.warmup, "chunks": case.chunks,
                    "time_min_us": float(t.min()) * 1e6 if t.size else 0.0,
                }
                if native_t is not None and t.size:
                    extras["vs_native_q1"], extras["vs_native_q3"] = paired_quartiles(native_t, t)
                row = make_row(coll, algo, comm.backend if algo != "gloo" else "gloo", k,
                               nbytes, cfg.dtype, seconds, wrong, **extras)
                if cfg.model is not None:
                    pred = predict(coll, algo, nbytes, k, cfg.model, chunks=case.chunks)
                    row.update(model_fields(seconds, pred))
                rows.append(row)
                if progress:
                    progress.update(f"{coll} {algo} {nbytes} B")
    if cfg.bound is not None:
        add_bound(rows, cfg.bound)
    return rows


def add_bound(rows: list[dict[str, Any]], bound: MemoryBound) -> None:
    """Fill ``bound_busbw`` (GB/s) and ``bound_frac`` (busbw / bound) of every row."""
    for row in rows:
        b = membw_busbw_bound(row["collective"], row["ranks"], bound)
        row["bound_busbw"] = b / 1e9 if b else None
        row["bound_frac"] = row["busbw"] * 1e9 / b if b else None
