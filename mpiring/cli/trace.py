"""Merge, plot or explain a recorded trace directory (--trace DIR / MPIRING_TRACE=DIR).

    python -m mpiring trace merge DIR -o trace.json     # Chrome trace: Perfetto or chrome://tracing
    python -m mpiring trace plot DIR -o timeline.png    # the same timeline as a PNG
    python -m mpiring trace explain DIR                 # the lecture's step diagram for a ring call
    python -m mpiring trace explain DIR --collective all_reduce --call 2
    python -m mpiring trace explain DIR --collective all_reduce --call 1 --nth 2   # "(2nd)"
    python -m mpiring trace explain DIR --list          # the traced calls
    python -m mpiring trace explain DIR --call 1 --rank 2   # the group of job rank 2 (TP/DP groups)

No MPI needed: these read the files the ranks wrote.
"""

from __future__ import annotations

import json
import sys
import warnings


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = sub.add_parser("merge", help="one Chrome trace (JSON) with a row per rank")
    m.add_argument("dir", help="trace directory (one rank*.jsonl per rank)")
    m.add_argument("-o", "--output", default="trace.json", help="output file, default trace.json")
    pl = sub.add_parser("plot", help="the timeline as a PNG (needs matplotlib)")
    pl.add_argument("dir", help="trace directory")
    pl.add_argument("-o", "--output", default="timeline.png", help="output PNG, default timeline.png")
    pl.add_argument("--title", default="", help="plot title")
    pl.add_argument("--window", default=None, metavar="FROM:TO",
                    help="draw only this stretch, in ms since the trace's start (e.g. 9000:)")
    e = sub.add_parser("explain", help="after each ring step: which chunks each rank holds, "
                                       "and whose contributions each contains")
    e.add_argument("dir", help="trace directory")
    e.add_argument("--collective", default=None, help="which collective (default: the first call)")
    e.add_argument("--call", type=int, default=None, help="call number (all_reduce#3 -> 3)")
    e.add_argument("--nth", type=int, default=None, metavar="N",
                   help="the N-th call of that name, as --list shows it (all_reduce#1 (2nd) -> "
                        "--call 1 --nth 2): another communicator's call with the same number")
    e.add_argument("--rank", type=int, default=None, metavar="R",
                   help="for a call made by several groups (each tensor- or data-parallel "
                        "group's all_reduce#1, as --list shows them): the group holding job "
                        "rank R (default: the group of the lowest rank)")
    e.add_argument("--list", action="store_true", help="list the traced calls and exit")


def run(args) -> int:
    from mpiring.tools import timeline

    try:
        with warnings.catch_warnings(record=True) as caught:  # a cut-short file: say so plainly
            warnings.simplefilter("always")
            files = timeline.load(args.dir)
        for w in caught:
            print(f"mpiring trace {args.action}: warning: {w.message}", file=sys.stderr)
        if args.action == "merge":
            doc = timeline.chrome_trace(files)
            with open(args.output, "w") as fh:
                # allow_nan=False: a browser's JSON.parse rejects NaN (chrome_trace
                # already wrote them as strings; this makes sure).
                json.dump(doc, fh, allow_nan=False)
            n = sum(1 for e in doc["traceEvents"] if e["ph"] == "X")
            print(f"wrote {args.output}: {n} spans from {len(files)} file(s); open it in "
                  "Perfetto (ui.perfetto.dev) or chrome://tracing")
        elif args.action == "plot":
            window = _window(args.window, files) if args.window else None
            timeline.plot(files, args.output, title=args.title, window=window)
            print(f"wrote {args.output}")
        elif args.list:
            sizes = timeline.group_sizes(files)
            recorded = timeline.call_groups(files)
            job = timeline.job_ranks(files)
            for coll, num, algo, nth, nranks in timeline.list_calls(files):
                ident = (coll, num, algo, nth)
                k, groups = sizes.get(ident), recorded.get(ident, [])
                # Several sub-communicators' calls share a name: say so, not "on 4 ranks".
                where = (f"on {nranks} rank(s)" if k is None else
                         f"on {nranks} rank(s) in groups of {k} (one call per group)")
                if len(groups) == 1 and sorted(groups[0]) != job:
                    where = f"on ranks {', '.join(map(str, groups[0]))}"
                print(f"{timeline.call_name(coll, num, nth)} ({algo}) {where}")
                if len(groups) > 1:  # each group's, with the option that explains it
                    for g in groups:
                        print(f"  ranks {', '.join(map(str, g))}: --rank {min(g)}")
        else:
            print(timeline.explain(files, args.collective, args.call, args.nth, args.rank))
    except ValueError as exc:  # bad input: a message, not a traceback
        print(f"mpiring trace {args.action}: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # -o into a missing folder, an unreadable trace file...
        print(f"mpiring trace {args.action}: {exc.strerror or exc}: {exc.filename}",
              file=sys.stderr)
        return 2
    return 0


def _window(text: str, files) -> tuple[float, float]:
    """'FROM:TO' in ms; an empty end means the trace's end."""
    from mpiring.tools import timeline

    try:
        lo, _, hi = text.partition(":")
        start = float(lo) if lo.strip() else 0.0
        end = float(hi) if hi.strip() else max(s["end"] for s in timeline.tracks(files)) * 1e3
    except ValueError:
        raise ValueError(f"--window {text!r}: use FROM:TO in milliseconds, e.g. 9000:9500") from None
    if end <= start:
        raise ValueError(f"--window {text!r}: TO must be after FROM")
    return start, end
