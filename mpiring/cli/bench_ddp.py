"""Time a DDP training step by parts: ddp vs naive vs ps vs torch-ddp vs compute alone.

Run under mpiexec. Every mode trains the project's GPT on the same data and
ranks; each step is split into forward, backward compute, exposed
communication, optimizer and the rest, with the overlap fraction of the
bucket AllReduces and the slowdown over compute alone (no communication).

    mpiexec -n 4 python -m mpiring bench-ddp                          # preset comm: d=512, 4 layers, 64 tokens
    mpiexec -n 4 python -m mpiring bench-ddp --bucket-sweep 1,4,16,64 --plot ddp.png
    mpiexec -n 2 python -m mpiring bench-ddp --preset small --modes compute,ddp,naive
"""

from __future__ import annotations

import sys

from mpiring.cli import add_backend_arguments, output_file


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def add_arguments(p) -> None:
    from mpiring.comm.communicator import ALGOS
    from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO
    from mpiring.tools.bench.memory import SETUPS

    p.add_argument("--preset", default="comm",
                   help="GPT preset: comm (d=512, 4 layers, 64 tokens, 12.8M params; default), "
                        "small, tiny")
    p.add_argument("--modes", default="compute,ddp,naive,flat-mpi,ps,torch-ddp",
                   help="comma list of compute, ddp, naive, flat-mpi (backward, then one "
                        "MPI_Allreduce of all gradients), ps, torch-ddp (default all)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per rank per step (default 8)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per window (default: the preset's)")
    p.add_argument("-n", "--steps", type=int, default=8, help="timed steps per mode (default 8)")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB (default 25)")
    p.add_argument("--bucket-sweep", type=_floats, default=[],
                   help="also run ddp with these bucket caps in MiB, e.g. 1,4,16,64")
    p.add_argument("--algo", choices=ALGOS["all_reduce"], default=DEFAULT_BUCKET_ALGO,
                   help="bucket AllReduce: the lecture's ring in 1 MiB segments (ring-seg, the "
                        "default), the lecture's loop as written (ring), another of mpiring's "
                        "algorithms (auto, ...), or native (the MPI library's own)")
    p.add_argument("--grad-as-bucket-view", action="store_true",
                   help="each .grad a view into its bucket (ddp, naive and torch-ddp alike)")
    p.add_argument("--max-data-mb", type=float, default=2.0, help="corpus size (default 2)")
    p.add_argument("--no-fused-adamw", action="store_true",
                   help="the plain AdamW in every mode instead of torch's fused kernel")
    p.add_argument("--memory", metavar="SETUP", default=None,
                   choices=SETUPS,
                   help="instead of timing: train --steps steps in this one setup and report "
                        "peak RSS (one setup per launch; scripts/ddp_memory.sh runs them all; "
                        "--json appends the line)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write the rows as JSON")
    p.add_argument("--plot", metavar="PNG", type=output_file, help="step-time bars, one per mode and bucket size")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on rank 0's stderr (auto: when stderr is a terminal)")
    add_backend_arguments(p)


def run(args) -> int:
    # A failure on one rank aborts the whole job: see mpiring.cli.main.
    import datetime
    import json

    import mpiring
    from mpiring.runtime.pages import describe as describe_pages
    from mpiring.runtime.pages import steady_malloc
    from mpiring.tools.bench.ddp import DDPBenchConfig, format_ddp_table, plot_ddp, run_ddp_bench
    from mpiring.tools.bench.report import Progress
    from mpiring.tools.train.loop import fused_adamw_available

    if args.backend != "mpi":
        raise ValueError("bench-ddp runs on the MPI backend (CPU); use --backend mpi")
    cfg = DDPBenchConfig(preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len,
                         steps=args.steps, warmup=args.warmup,
                         modes=[m.strip() for m in args.modes.split(",") if m.strip()],
                         bucket_mb=args.bucket_mb, bucket_sweep=args.bucket_sweep,
                         algo=args.algo, max_data_mb=args.max_data_mb,
                         grad_as_bucket_view=args.grad_as_bucket_view,
                         fused_adamw=not args.no_fused_adamw)
    cfg.validate()
    # Every mode, the memory setups too, with the same allocator state (see there).
    steady = steady_malloc()
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    if args.memory:
        return _memory(comm, args)
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    if comm.rank == 0:
        print(f"# mpiring bench-ddp, {now}: {comm.size} rank(s); command: mpiexec -n "
              f"{comm.size} python -m mpiring bench-ddp {' '.join(sys.argv[2:])}".rstrip())
        print("# malloc: " + ("glibc's thresholds fixed (mpiring.runtime.pages.steady_malloc)" if steady
                              else "as the environment left it (MALLOC_*, GLIBC_TUNABLES or "
                                   "MPIRING_STEADY_MALLOC=0, or not glibc)")
              + f"; DDP buckets: {describe_pages()}; optimizer: AdamW"
              + (" (fused)" if cfg.fused_adamw and fused_adamw_available("cpu") else ""))
    on = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    bar = Progress(cfg.warmup + cfg.steps, enabled=on and comm.rank == 0)
    try:
        rows = run_ddp_bench(comm, cfg, progress=bar)
    finally:
        bar.close()
    if comm.rank == 0:
        print(format_ddp_table(rows))
        for note in cfg.notes:
            print(f"# note: {note}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
                fh.write("\n")
        if args.plot:
            plot_ddp(rows, args.plot, title=f"mpiring bench-ddp, {now}, {comm.size} ranks, "
                                            f"preset {cfg.preset}")
    return 0


def _memory(comm, args) -> int:
    import json

    from mpiring.tools.bench.memory import format_memory_line, measure_setup

    row = measure_setup(comm, args.memory, preset=args.preset, batch_size=args.batch_size,
                        steps=args.steps, bucket_mb=args.bucket_mb, algo=args.algo,
                        max_data_mb=args.max_data_mb)
    rows = comm.control.allgather_json(row) if comm.size > 1 else [row]
    if comm.rank == 0:
        worst = max(rows, key=lambda r: r["growth"])
        row = {**worst, "rss_peak": max(r["rss_peak"] for r in rows)}
        print(format_memory_line(row), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return 0
