"""A compact view of ``bench --json`` files: each algorithm's busbw as a multiple of native's.

    python scripts/speed_summary.py out/perf/speed-2.json out/perf/speed-3.json
    python scripts/speed_summary.py --from 1M out/perf/speed-*.json

One block per file and collective (a file is one run, one rank count), a row per
size: the native call's time, then every other algorithm's ratio with the IQR
of the paired per-iteration ratios. A ``<`` marks a ratio under the speed
goals' bars: all_reduce's ``ring`` and ``ring-seg`` 1.0 from 1 MiB up and
``auto`` 0.95 at every size, broadcast's ``pipelined`` 1.0 from 1 MiB up (the
naive ring broadcast has no bar). The last line of a block counts the marks
and names the lowest ratio that has a bar; ``--brief`` prints only that line.
"""

from __future__ import annotations

import argparse
import json
import sys

from mpiring.cli import parse_size  # the bench's own -b/-e syntax

MIB = 1 << 20
#: (bar, smallest size it applies to) per (collective, algorithm); others go unmarked.
BARS = {("all_reduce", "ring"): (1.0, MIB), ("all_reduce", "ring-seg"): (1.0, MIB),
        ("all_reduce", "auto"): (0.95, 0), ("broadcast", "pipelined"): (1.0, MIB)}


def size_label(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def summarize(path: str, rows: list[dict], smallest: int, brief: bool = False) -> list[str]:
    lines: list[str] = []
    for coll in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == coll and r["bytes"] >= smallest]
        algos = [a for a in dict.fromkeys(r["algo"] for r in mine) if a != "native"]
        if not mine or not algos:
            continue
        ranks = mine[0]["ranks"]
        block = [f"{coll}, {ranks} ranks ({path}): busbw x native (IQR); native's time",
                 f"{'size':>9} {'native us':>10} " + " ".join(f"{a:>20}" for a in algos)]
        marks = 0
        lowest: tuple[float, str, int] | None = None
        for size in sorted({r["bytes"] for r in mine}):
            at = {r["algo"]: r for r in mine if r["bytes"] == size}
            native = at.get("native")
            cells = []
            for a in algos:
                r = at.get(a)
                ratio = None if r is None else r.get("vs_native")
                if ratio is None:
                    cells.append(f"{'-':>20}")
                    continue
                bar, floor = BARS.get((coll, a), (None, 0))
                low = bar is not None and size >= floor and ratio < bar
                marks += low
                if bar is not None and size >= floor and (lowest is None or ratio < lowest[0]):
                    lowest = (ratio, a, size)
                iqr = f"({r.get('vs_native_q1', ratio):.2f}-{r.get('vs_native_q3', ratio):.2f})"
                cells.append(f"{ratio:>6.2f}{'<' if low else ' '}{iqr:>13}")
            t = f"{native['time_us']:10.1f}" if native else f"{'-':>10}"
            block.append(f"{size_label(size):>9} {t} " + " ".join(cells))
        low = "" if lowest is None else \
            f"; lowest {lowest[1]} {lowest[0]:.2f} at {size_label(lowest[2])}"
        from_ = f" from {size_label(smallest)}" if smallest else ""
        tail = f"# {coll}, {ranks} ranks{from_}: {marks} ratio(s) under the goals' bars{low}"
        lines += [tail] if brief else block + [tail, ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="JSON files written by `bench --json`")
    p.add_argument("--from", dest="smallest", type=parse_size, default=0,
                   help="leave out sizes under this (e.g. 1M)")
    p.add_argument("--brief", action="store_true", help="only each block's last line")
    args = p.parse_args(argv)
    for path in args.files:
        try:
            with open(path) as fh:
                rows = json.load(fh)
        except (OSError, ValueError) as exc:
            print(f"{path}: cannot read it ({exc})", file=sys.stderr)
            return 2
        print("\n".join(summarize(path, rows, args.smallest, args.brief)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
