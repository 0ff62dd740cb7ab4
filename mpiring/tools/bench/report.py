"""Tables, JSON rows, the progress bar and the plots of the bench (pure; no MPI).

A result row is a plain dict. Every row has the keys of ``ROW_KEYS``:

    collective, algo, backend, ranks, bytes, dtype, time_us, algbw, busbw, wrong

(bandwidths in GB/s = 1e9 bytes/s, as nccl-tests prints them), plus extras such
as count, op, root, iters, vs_native, vs_native_q1, vs_native_q3,
bound_busbw, bound_frac, model_us, model_err, chunks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mpiring.core.costmodel import busbw_factor

ROW_KEYS = ("collective", "algo", "backend", "ranks", "bytes", "dtype", "time_us", "algbw",
            "busbw", "wrong")

BUSBW_FORMULA = {
    "all_reduce": "2(K-1)/K",
    "reduce_scatter": "(K-1)/K",
    "all_gather": "(K-1)/K",
    "broadcast": "1",
    "reduce": "1",
}


def make_row(collective: str, algo: str, backend: str, ranks: int, nbytes: int, dtype: str,
             seconds: float, wrong: int, **extras: Any) -> dict[str, Any]:
    """A result row: algbw = bytes / time, busbw = algbw * nccl-tests' factor."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    row = {"collective": collective, "algo": algo, "backend": backend, "ranks": ranks,
           "bytes": int(nbytes), "dtype": dtype, "time_us": seconds * 1e6,
           "algbw": algbw, "busbw": algbw * busbw_factor(collective, ranks),
           "wrong": int(wrong)}
    row.update(extras)
    return row


def size_sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """nccl-tests' ``-b MIN -e MAX -f FACTOR`` sizes: MIN, MIN*F, ... up to MAX."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 <= -b ({min_bytes}) <= -e ({max_bytes})")
    if factor <= 1 and min_bytes != max_bytes:
        raise ValueError(f"-f {factor}: the size factor must be > 1 (e.g. -f 2)")
    sizes, n = [], float(min_bytes)
    while n <= max_bytes:
        sizes.append(int(n))
        if n == 0 or factor <= 1:
            break
        n *= factor
    return sizes


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill ``vs_native``: each row's busbw over the native row's at the same size."""
    native = {(r["collective"], r["ranks"], r["bytes"], r.get("chunks")): r["busbw"]
              for r in rows if r["algo"] == "native"}
    for r in rows:
        base = native.get((r["collective"], r["ranks"], r["bytes"], r.get("chunks")))
        if base is None:  # S-sweep rows have chunks; compare them with native at that size
            base = native.get((r["collective"], r["ranks"], r["bytes"], None))
        r["vs_native"] = r["busbw"] / base if base else None


def paired_quartiles(native: np.ndarray, times: np.ndarray) -> tuple[float, float]:
    """Quartiles of native_i / times_i over iterations i that took turns.

    ``x native`` is a ratio of medians; this is its spread. Iteration i times
    every algorithm back to back, so the ratio within one iteration is free of
    whatever the machine did a second earlier or later; the interquartile range
    of these per-iteration ratios is how far they scatter. When it spans 1.0
    the two are not told apart by this run; when it does not, that is a hint,
    not proof (two identical calls can miss 1.0 on a shared machine).
    """
    ratios = np.asarray(native, dtype=np.float64) / np.asarray(times, dtype=np.float64)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return float("nan"), float("nan")
    q1, q3 = np.percentile(ratios, [25, 75])
    return float(q1), float(q3)


def _fmt(value: Any, spec: str, none: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    return format(value, spec)


def format_table(rows: Sequence[dict[str, Any]], *, title: str = "",
                 notes: Iterable[str] = (), model: bool = False) -> str:
    """One nccl-tests-style table: a block per algorithm, one line per size.

    Columns: size, count, type, redop, root, time (us), algbw, busbw (GB/s),
    #wrong, busbw as a multiple of native's (``x native``) and the interquartile
    range of that ratio over iterations (``IQR``, see ``paired_quartiles``),
    busbw as a share of the memory-bandwidth bound (``%bound``), and with
    ``model`` the alpha-beta prediction and its error.
    """
    out = []
    if title:
        out.append(f"# {title}")
    out.extend(f"# {n}" for n in notes)
    head = (f"#{'size':>11} {'count':>11} {'type':>9} {'redop':>6} {'root':>5} {'time':>11} "
            f"{'algbw':>7} {'busbw':>7} {'#wrong':>7} {'x native':>9} {'IQR':>10} {'%bound':>7}")
    units = (f"#{'(B)':>11} {'(elements)':>11} {'':>9} {'':>6} {'':>5} {'(us)':>11} "
             f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>7} {'(busbw)':>9} {'(paired)':>10} {'':>7}")
    if model:
        head += f" {'model':>11} {'error':>7}"
        units += f" {'(us)':>11} {'':>7}"
    out += ["#", head, units]
    algos: list[str] = []
    for r in rows:
        if r["algo"] not in algos:
            algos.append(r["algo"])
    for algo in algos:
        block = [r for r in rows if r["algo"] == algo]
        extra = ""
        if block and block[0].get("chunks_label"):
            extra = f" ({block[0]['chunks_label']})"
        out.append(f"# -- {algo}{extra}")
        for r in block:
            line = (f"{r['bytes']:>12} {r.get('count', 0):>11} {r['dtype']:>9} "
                    f"{r.get('op') or 'none':>6} {_fmt(r.get('root'), 'd', '-1'):>5} "
                    f"{r['time_us']:>11.1f} {r['algbw']:>7.3f} {r['busbw']:>7.3f} "
                    f"{_fmt(r['wrong'], 'd', 'n/a'):>7} {_fmt(r.get('vs_native'), '.2f'):>9} "
                    f"{_span(r.get('vs_native_q1'), r.get('vs_native_q3')):>10} "
                    f"{_pct(r.get('bound_frac')):>7}")
            if model:
                err = r.get("model_err")
                line += f" {_fmt(r.get('model_us'), '.1f'):>11} {_pct(err, '+.0f'):>7}"
            out.append(line)
    return "\n".join(out)


def _span(lo: float | None, hi: float | None) -> str:
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return "-"
    return f"{lo:.2f}-{hi:.2f}"


def _pct(frac: float | None, spec: str = ".0f") -> str:
    return "-" if frac is None else f"{format(frac * 100, spec)}%"


def progress_line(done: int, total: int, label: str = "", width: int = 28) -> str:
    """``[#######.....]  12/45 all_reduce ring 4 MiB``: the bar rank 0 draws on stderr."""
    total = max(total, 1)
    filled = min(width, round(width * done / total))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total} {label}"


class Progress:
    """A one-line progress bar redrawn in place on a terminal (rank 0 only)."""

    def __init__(self, total: int, stream=None, enabled: bool = True):
        import sys

        self.total = total
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._width = 0

    def update(self, label: str, step: int = 1) -> None:
        self.done += step
        self.show(label)

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        line = progress_line(self.done, self.total, label)
        self.stream.write("\r" + line.ljust(self._width))
        self._width = len(line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


def write_json(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Write the rows as one JSON array (one object per collective, algo and size)."""
    missing = [k for r in rows for k in ROW_KEYS if k not in r]
    if missing:
        raise ValueError(f"rows lack keys {sorted(set(missing))}")
    with open(path, "w") as fh:
        json.dump(list(rows), fh, indent=1, default=float)
        fh.write("\n")


def _size_label(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}"
        n /= 1024
    return str(n)


def plot_busbw(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """busbw against size, one line per algorithm, one panel per collective.

    The memory-bandwidth bound (when the rows carry it) is drawn dashed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collectives = list(dict.fromkeys(r["collective"] for r in rows))
    ncols = min(3, len(collectives))
    nrows = -(-len(collectives) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat[len(collectives):]:
        ax.set_visible(False)
    for ax, coll in zip(axes.flat, collectives):
        sub = [r for r in rows if r["collective"] == coll]
        for algo in dict.fromkeys(r["algo"] for r in sub):
            pts = sorted((r["bytes"], r["busbw"]) for r in sub if r["algo"] == algo)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=algo)
        bounds = [r["bound_busbw"] for r in sub if r.get("bound_busbw")]
        if bounds:
            ax.axhline(bounds[0], ls="--", color="grey", lw=1, label="memory bound")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["bytes"] for r in sub if r["bytes"] > 0})
        if ticks:
            step = -(-len(ticks) // 8)  # at most 8 labels
            ax.set_xticks(ticks[::step], [_size_label(t) for t in ticks[::step]])
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        k = sub[0]["ranks"] if sub else 0
        ax.set_title(f"{coll}, {k} ranks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
