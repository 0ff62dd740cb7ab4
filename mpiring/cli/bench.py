"""Benchmark the collectives like nccl-tests: ring vs MPI's own vs torch gloo, with the cost model.

Run under mpiexec. Default: a size sweep of all_reduce with every algorithm that
applies (ring, native = the MPI library's own, gloo = torch.distributed), one
nccl-tests-style table per collective.

    mpiexec -n 4 python -m mpiring bench -b 4K -e 64M -f 2 --algo ring,native,gloo
    mpiexec -n 4 python -m mpiring bench --collective all_reduce,broadcast --model --json out.json
    mpiexec -n 4 python -m mpiring bench --sweep-chunks 16M      # pipeline depth S vs the model's S*
    mpiexec -n 4 python -m mpiring bench --ps 16M                # parameter server vs ring AllReduce

--ps and --sweep-chunks run those studies instead of the size sweep.
"""

from __future__ import annotations

import sys

from mpiring.cli import (
    add_backend_arguments,
    check_memory,
    non_negative_int,
    output_file,
    parse_size,
    positive_int,
    size_arg,
)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _factor(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: use a number above 1 (e.g. 2)")
    return value


def add_arguments(p) -> None:
    p.add_argument("--collective", "-c", default="all_reduce", type=_csv,
                   help="comma list of all_reduce, reduce_scatter, all_gather, broadcast, reduce "
                        "(default all_reduce; 'all' for every one)")
    p.add_argument("--algo", "-a", default=None, type=_csv,
                   help="comma list, e.g. ring,native,gloo (default: every algorithm that applies)")
    p.add_argument("-b", "--minbytes", type=size_arg, default="8",
                   help="smallest size in bytes (K/M/G), default 8")
    p.add_argument("-e", "--maxbytes", type=size_arg, default="64M",
                   help="largest size in bytes, default 64M")
    p.add_argument("-f", "--stepfactor", type=_factor, default=2.0, help="size factor, default 2")
    p.add_argument("-n", "--iters", type=positive_int, default=20, help="timed iterations, default 20")
    p.add_argument("-w", "--warmup", type=non_negative_int, default=5,
                   help="untimed warm-up iterations, default 5")
    p.add_argument("-d", "--dtype", default="float32", help="element type, default float32")
    p.add_argument("-o", "--op", default="sum", choices=("sum", "avg", "max", "min", "prod"),
                   help="sum, avg, max, min or prod (default sum)")
    p.add_argument("--root", type=non_negative_int, default=0, help="root of broadcast and reduce, default 0")
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="pipeline chunks S for broadcast/reduce (default: the cost model's S*, from "
                        "the alpha and beta that tune stored, else the built-in ones)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write every row as JSON (one object per "
                   "collective, algo and size)")
    p.add_argument("--plot", metavar="PNG", type=output_file, help="busbw against size, one line per algo "
                   "(with --ps: traffic and time against K)")
    p.add_argument("--model", action="store_true",
                   help="fit the alpha-beta model from a neighbour ping-pong and print its "
                        "prediction beside every ring/pipelined row")
    p.add_argument("--fit", choices=("ring", "pair"), default="ring",
                   help="which fit predicts: 'ring' (every rank exchanges with its neighbours "
                        "at once, as in a ring step; default) or 'pair' (ping-pong r0<->r1 alone)")
    p.add_argument("--ps", metavar="SIZE", type=size_arg, nargs="?", const="16M", default=None,
                   help="parameter server vs ring AllReduce on K = 2..ranks (default 16M per rank)")
    p.add_argument("--sweep-chunks", metavar="SIZE", type=size_arg, nargs="?", const="16M",
                   default=None,
                   help="pipelined Broadcast of SIZE for S = 1, 2, 4, ...: measured best vs "
                        "the model's S* (default 16M)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on rank 0's stderr (auto: when stderr is a terminal)")
    add_backend_arguments(p)


def run(args) -> int:
    # A failure on one rank aborts the whole job: see mpiring.cli.main.
    import datetime

    import mpiring
    from mpiring.core.costmodel import MemoryBound
    from mpiring.tools.bench import measure, report
    from mpiring.tools.bench import sweep as sw

    collectives = list(sw.COLLECTIVES) if args.collective == ["all"] else args.collective
    if args.backend != "mpi":
        raise ValueError("bench runs on the MPI backend: the NCCL bench is not written yet; "
                         "use --backend mpi")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("-n must be >= 1 and -w >= 0")
    dtype = sw.np_dtype(args.dtype)
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    rank, k = comm.rank, comm.size
    out = sys.stdout if rank == 0 else None
    studies = args.ps is not None or args.sweep_chunks is not None

    # Validate everything before any measurement (same on every rank).
    from mpiring.tools.bench import gloo as gloo_mod

    gloo_ok = gloo_mod.available()
    algos = sw.resolve_algos(collectives, args.algo, gloo_ok)
    wants_gloo = not studies and any("gloo" in a for a in algos.values())
    if wants_gloo and not gloo_ok:
        raise TypeError("algo 'gloo' needs torch: pip install \"mpiring[torch]\"")
    sizes = report.size_sweep(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    if args.root >= k:
        raise ValueError(f"--root {args.root}: the job has ranks 0..{k - 1}")
    # The largest buffer a rank holds at once: the input, the buffer, the reference
    # and native's result (plus gloo's), about five copies of the largest size.
    biggest = max([*sizes, parse_size(args.ps or 0), parse_size(args.sweep_chunks or 0)])
    check_memory(5 * biggest, comm.local_size, f"-e/--ps/--sweep-chunks {biggest} B")

    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    if out:
        print(f"# mpiring bench, {now}: {k} rank(s), {comm.local_size} on this host, "
              f"backend {comm.backend}; command: mpiexec -n {k} python -m mpiring bench "
              f"{' '.join(sys.argv[2:]) if sys.argv[1:2] == ['bench'] else ''}".rstrip(), file=out)

    bound = measure.memory_bandwidth(comm)
    fits, failures = {}, {}
    if args.model or args.sweep_chunks is not None or args.ps is not None:
        fits, failures = measure.fit_pingpong(
            comm, max_bytes=max(1 << 20, min(sizes[-1], 16 << 20)))
    ab = fits.get(args.fit)
    if out:
        print(f"# memory: {bound.describe()} (docs/benchmarks.md: the memory-bandwidth bound)",
              file=out)
        for name, fit in fits.items():
            what = ("ping-pong r0<->r1, other ranks idle" if name == "pair" else
                    "ring exchange, every rank sends right and receives from the left at once")
            used = " <- used for the model" if name == args.fit else ""
            print(f"# alpha-beta fit, {what}: {fit.describe()}{used}", file=out)
        for name, why in failures.items():
            print(f"# alpha-beta fit ({name}) failed, no model from it: {why}", file=out)

    rows: list[dict] = []
    progress_on = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    if args.sweep_chunks is not None:
        from mpiring.tools.bench.pipeline import chunks_study, format_chunks_table

        bar = report.Progress(0, enabled=progress_on and rank == 0)
        study = chunks_study(comm, parse_size(args.sweep_chunks), dtype=dtype, root=args.root,
                             iters=args.iters, warmup=args.warmup, model=ab, progress=bar)
        bar.close()
        rows += study
        if out:
            print("\n" + format_chunks_table(study), file=out)
    if args.ps is not None:
        from mpiring.tools.bench.ps import METHODS, format_ps_table, plot_ps, ps_study

        bar = report.Progress(len(METHODS) * max(0, k - 1), enabled=progress_on and rank == 0)
        study = ps_study(comm, parse_size(args.ps), iters=args.iters, warmup=args.warmup,
                         dtype=dtype, op=args.op, model=ab, progress=bar)
        bar.close()
        rows += study
        if out:
            print("\n" + format_ps_table(study), file=out)
        if args.plot and rank == 0 and study:
            plot_ps(study, args.plot)
    if not studies:
        gloo = gloo_mod.Gloo(comm) if wants_gloo else None
        cfg = sw.SweepConfig(collectives, algos, sizes, iters=args.iters, warmup=args.warmup,
                             dtype=args.dtype, op=args.op, root=args.root, chunks=args.chunks,
                             model=ab)
        total = sum(len(a) for a in algos.values()) * len(sizes)
        bar = report.Progress(total, enabled=progress_on and rank == 0)
        try:
            rows = sw.run_sweep(comm, cfg, gloo=gloo, progress=bar)
        finally:
            bar.close()
            if gloo is not None:
                gloo.close()
        # Measure the memory again and keep the best of both: the bound is what the
        # machine can do, and other work on a shared machine only ever lowers it.
        again = measure.memory_bandwidth(comm)
        bound = MemoryBound(max(bound.copy_bw, again.copy_bw), max(bound.reduce_bw, again.reduce_bw),
                            bound.cores)
        sw.add_bound(rows, bound)
        report.add_ratios(rows)
        if out:
            print(f"# memory, measured again after the sweep: {again.describe()}; the bound "
                  "uses the better of the two", file=out)
            _print_tables(rows, cfg, k, out, bound, ab)
        if args.plot and rank == 0 and rows:
            report.plot_busbw(rows, args.plot, title=f"mpiring bench, {now}, {k} ranks")
    if args.json and rank == 0:
        report.write_json(args.json, rows)
    wrong = sum(r["wrong"] or 0 for r in rows)
    if out and wrong:
        print(f"# {wrong} wrong element(s) in total: see #wrong", file=out)
    return 1 if wrong else 0


def _print_tables(rows, cfg, k, out, bound, ab) -> None:
    from mpiring.core.costmodel import membw_busbw_bound
    from mpiring.tools.bench import report

    for coll in cfg.collectives:
        sub = [r for r in rows if r["collective"] == coll]
        if not sub:
            continue
        b = membw_busbw_bound(coll, k, bound)
        notes = [f"time: median over {cfg.iters} samples of the slowest rank "
                 f"({cfg.warmup} warm-up); below 4 MiB a sample is min(64, 4 MiB / size) "
                 f"calls back to back; busbw = algbw * {report.BUSBW_FORMULA[coll]}",
                 "x native: busbw / native's busbw at the same size; "
                 "#wrong: elements that differ from native's result, all ranks"]
        if b:
            notes.append(f"%bound: busbw / {b / 1e9:.2f} GB/s, the memory-bandwidth bound for "
                         f"{coll} on {k} ranks sharing {bound.cores} core(s)")
        if ab is not None:
            notes.append(f"model: alpha-beta prediction ({ab.source} fit); error = "
                         "(measured - model) / model")
        print("\n" + report.format_table(sub, title=f"{coll} on {k} ranks", notes=notes,
                                         model=ab is not None), file=out)
    for note in cfg.notes:
        print(f"# note: {note}", file=out)
