r"""The pipeline depth S of the ring Broadcast: the model's S* against the measured optimum.

The lecture's pipelined Broadcast costs (K-2+S)(alpha + N/(S beta)): more chunks
keep more links busy (the N/beta term shrinks towards N/beta * (K-2+S)/S) but pay
one more latency alpha each. This study times the pipelined Broadcast of one N
for S = 1, 2, 4, ... and puts beside it the model's time and the model's
optimum S* = sqrt((K-2)N/(alpha beta)).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpiring.core.costmodel import AlphaBeta, best_chunks, model_fields, pipelined_broadcast
from mpiring.tools.bench.measure import time_interleaved
from mpiring.tools.bench.report import make_row
from mpiring.tools.bench.sweep import count_wrong, rank_data, reference


def chunk_counts(count: int, s_star: int | None = None, max_chunks: int = 1024) -> list[int]:
    """S = 1, 2, 4, ... up to ``max_chunks`` (and no more chunks than elements), plus S*."""
    limit = max(1, min(max_chunks, count))
    values, s = [], 1
    while s <= limit:
        values.append(s)
        s *= 2
    if s_star is not None and 1 <= s_star <= limit and s_star not in values:
        values.append(s_star)
    return sorted(values)


def chunks_study(comm, nbytes: int, *, dtype: np.dtype | None = None, root: int = 0,
                 iters: int = 10, warmup: int = 2, model: AlphaBeta | None = None,
                 max_chunks: int = 1024, progress=None) -> list[dict[str, Any]]:
    """Time the pipelined Broadcast of ``nbytes`` for a range of S (rows on every rank).

    Each row carries ``chunks`` (S), ``model_us`` and ``model_err`` (when a model
    is given) and ``model_best`` (S* from the model).
    """
    k = comm.size
    dtype = np.dtype(dtype if dtype is not None else np.float32)
    count = max(1, nbytes // dtype.itemsize)
    nbytes = count * dtype.itemsize
    s_star = best_chunks(nbytes, k, model, max_chunks=min(max_chunks, count)) if model else None
    src = rank_data(comm.rank, count, dtype, "sum")
    ref = reference("broadcast", count, k, comm.rank, root, "sum", dtype)
    x = src.copy()
    rows = []
    plan = [("native", None)] + [("pipelined", s) for s in chunk_counts(count, s_star, max_chunks)]
    checked = []
    for algo, s in plan:  # 1. check each S once
        kwargs = {"root": root, "algo": algo}
        if s is not None:
            kwargs["chunks"] = s
        np.copyto(x, src)
        comm.broadcast(x, **kwargs)
        checked.append((algo, s, kwargs, comm.control.allreduce_scalar(count_wrong(x, ref, "sum"))))
    # 2. timed in turns (iteration i runs every S once), so that load from elsewhere
    # on a shared machine cannot favour one S over another
    if progress:
        progress.show(f"broadcast of {nbytes} B: timing {len(checked)} settings")
    times = time_interleaved(
        comm, [lambda kw=kw: comm.broadcast(x, check=False, **kw) for _, _, kw, _ in checked],
        [lambda: np.copyto(x, src)] * len(checked), iters=iters, warmup=warmup)
    for (algo, s, _, wrong), t in zip(checked, times):
        seconds = float(np.median(t))
        row = make_row("broadcast", algo, comm.backend, k, nbytes, dtype.name, seconds, wrong,
                       count=count, root=root, chunks=s, iters=iters, warmup=warmup,
                       model_best=s_star)
        if model is not None and s is not None:
            pred = pipelined_broadcast(nbytes, k, s, model)
            row.update(model_fields(seconds, pred))
        rows.append(row)
        if progress:
            progress.update(f"broadcast S={s or algo}")
    return rows


def format_chunks_table(rows: list[dict[str, Any]]) -> str:
    """S, measured time, model time and error; the measured best and the model's S* marked."""
    if not rows:
        return ""
    r0 = rows[0]
    piped = [r for r in rows if r["algo"] == "pipelined"]
    native = [r for r in rows if r["algo"] == "native"]
    best = min(piped, key=lambda r: r["time_us"]) if piped else None
    s_star = r0.get("model_best")
    out = [f"# pipelined ring Broadcast of N = {r0['bytes']} B on {r0['ranks']} ranks, root "
           f"{r0.get('root', 0)}: time against the number of chunks S",
           "# model: (K-2+S)(alpha + N/(S beta)), best S* = sqrt((K-2) N / (alpha beta))"]
    if native:
        out.append(f"# native (MPI_Bcast): {native[0]['time_us']:.1f} us, "
                   f"busbw {native[0]['busbw']:.3f} GB/s")
    out += ["#", f"#{'S':>6} {'time(us)':>11} {'busbw':>7} {'model(us)':>11} {'error':>7} "
                 f"{'#wrong':>7}"]
    for r in piped:
        marks = []
        if best is not None and r is best:
            marks.append("<- measured best")
        if s_star is not None and r["chunks"] == s_star:
            marks.append("<- model S*")
        model = f"{r['model_us']:.1f}" if r.get("model_us") is not None else "-"
        err = f"{r['model_err'] * 100:+.0f}%" if r.get("model_err") is not None else "-"
        out.append(f"{r['chunks']:>7} {r['time_us']:>11.1f} {r['busbw']:>7.3f} {model:>11} "
                   f"{err:>7} {r['wrong']:>7}  {' '.join(marks)}")
    if best is not None:
        tail = f"# measured optimum S = {best['chunks']}"
        if s_star is not None:
            at_star = next((r for r in piped if r["chunks"] == s_star), None)
            tail += f"; model S* = {s_star}"
            if at_star is not None:
                tail += (f" (measured there: {at_star['time_us']:.1f} us, "
                         f"{at_star['time_us'] / best['time_us']:.2f}x the best)")
        out.append(tail)
    return "\n".join(out)
