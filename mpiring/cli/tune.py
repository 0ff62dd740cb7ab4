"""Fit algo="auto" to this machine: time every algorithm per size, store the decision table.

Run under mpiexec with the ranks and hosts you will train on; the table is
stored per backend, world size and host layout (see mpiring.comm.autotune):

    mpiexec -n 4 python -m mpiring tune                   # K=4, 8 B .. 256 MiB
    mpiexec -n 4 python -m mpiring tune --world-sizes 2,3,4 --max-size 64M
    mpiexec -n 2 python -m mpiring tune --dry-run         # print, do not store

Every algorithm runs at every size, interleaved with the others (so a burst of
load hits all alike); the medians are fitted to a decision table. Until you
run this, algo="auto" uses built-in tables.
"""

from __future__ import annotations

import time

import numpy as np

from mpiring.cli import parse_size


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_arguments(p) -> None:
    p.add_argument("--collective", "-c", default="all_reduce,reduce_scatter,all_gather,broadcast",
                   help="comma list of all_reduce, reduce_scatter, all_gather (auto's tables) and "
                        "broadcast (the pipeline model's alpha and beta; 3 ranks or more); "
                        "default: all four")
    p.add_argument("--min-size", default="8", help="smallest message in bytes, default 8")
    p.add_argument("--max-size", default="256M", help="largest message in bytes, default 256M")
    p.add_argument("--factor", type=int, default=4, help="size step factor, default 4")
    p.add_argument("--reps", type=int, default=7, help="timed rounds per size (median), default 7")
    p.add_argument("--world-sizes", type=_ints, default=None,
                   help="also fit sub-communicators of these sizes on the first ranks "
                        "(e.g. 2,3,4); default: the job's size only")
    p.add_argument("--margin", type=float, default=None,
                   help="keep native unless another algorithm is this much faster (default: "
                        "mpiring.comm.autotune.MARGIN, 0.05)")
    p.add_argument("--cache", default=None,
                   help="JSON file to store into (default $MPIRING_CACHE/tune.json or "
                        "~/.cache/mpiring/tune.json)")
    p.add_argument("--dry-run", action="store_true", help="print the tables, store nothing")


def run(args) -> int:
    # A failure on one rank aborts the whole job: see mpiring.cli.main.
    import mpiring
    from mpiring.comm import autotune
    from mpiring.tools.bench.measure import QUIET_POLL_S

    collectives = [c.strip() for c in args.collective.split(",") if c.strip()]
    for c in collectives:
        if c not in autotune.CANDIDATES and c != "broadcast":
            raise ValueError(f"tune knows {', '.join(autotune.CANDIDATES)}, broadcast; not {c!r}")
    if args.reps < 1 or args.factor < 2:
        raise ValueError("--reps must be >= 1 and --factor >= 2")
    sizes = _sizes(parse_size(args.min_size), parse_size(args.max_size), args.factor)
    comm = mpiring.init(backend="mpi", trace="", log="none", check=False)
    ks = sorted(set(args.world_sizes or [comm.size]))
    if any(k < 1 or k > comm.size for k in ks):
        raise ValueError(f"--world-sizes must lie in 1..{comm.size}")
    margin = autotune.MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 1:  # nan compares false: every size would silently keep native
        raise ValueError(f"--margin {args.margin}: give a fraction in [0, 1), e.g. 0.03")
    out = comm.rank == 0
    for k in ks:
        sub = comm if k == comm.size else comm.split(0 if comm.rank < k else None, comm.rank)
        if sub is not None:
            table = tune_communicator(sub, collectives, sizes, args.reps, margin)
            if "broadcast" in collectives and sub.size >= 3:
                table.pipeline, text = tune_pipeline(sub, sizes[-1], args.reps)
                if sub.rank == 0:
                    print(text, flush=True)
            if sub.rank == 0:
                print(format_table(table), flush=True)
                if not args.dry_run:
                    path = autotune.write_cache(table, args.cache)
                    print(f"# stored under '{table.key}' in {path}", flush=True)
        # Ranks outside the sub-communicator sleep rather than spin: on a machine
        # with fewer cores than ranks a spinning rank would skew the timings.
        comm.control.barrier(poll_s=QUIET_POLL_S)
    if out and args.dry_run:
        print("# dry run: nothing stored")
    return 0


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    if lo < 1 or hi < lo:
        raise ValueError("need 1 <= --min-size <= --max-size")
    sizes, n = [], lo
    while n <= hi:
        sizes.append(n)
        n *= factor
    return sizes


def tune_communicator(comm, collectives, sizes, reps: int, margin: float):
    """Time every candidate of every collective on ``comm``; return the fitted AutoTable.

    Collective over ``comm``; every rank returns the same table.
    """
    from mpiring.comm import autotune

    hosts = autotune.host_layout(comm)
    key = autotune.layout_key(comm.backend, comm.size, hosts)
    measured = {}
    for coll in collectives:
        if coll not in autotune.CANDIDATES:
            continue
        algos = autotune.CANDIDATES[coll]
        measured[coll] = {a: [] for a in algos}
        for nbytes in sizes:
            med = time_algos(comm, coll, algos, nbytes, reps)
            for a in algos:
                measured[coll][a].append(med[a])
    return autotune.fit_table(key, sizes, measured, margin)


def time_algos(comm, collective: str, algos, nbytes: int, reps: int) -> dict[str, float]:
    """Median seconds per algorithm for one size (the slowest rank's time each round)."""
    n = max(1, nbytes // 4)
    x = np.empty(n, dtype=np.float32)
    x.fill(0.0)  # real pages (not the lazily mapped zero page); sums stay 0, no denormals
    method = getattr(comm, collective)
    kwargs = {"op": "sum"} if collective != "all_gather" else {}
    # Small messages: several calls per timing, so the timer and the barrier do not dominate.
    inner = int(min(50, max(1, (1 << 20) // max(nbytes, 1))))
    control = comm.control
    for a in algos:  # warm-up: scratch buffers, pages, the MPI library's paths
        method(x, algo=a, check=False, **kwargs)
    times = {a: [] for a in algos}
    for _ in range(reps):
        for a in algos:
            control.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                method(x, algo=a, check=False, **kwargs)
            local = (time.perf_counter() - t0) / inner
            times[a].append(control.allreduce_scalar(local, "max"))
    return {a: float(np.median(t)) for a, t in times.items()}


PIPELINE_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
PIPELINE_CHUNKS = (1, 2, 4, 8, 16)


def tune_pipeline(comm, max_bytes: int, reps: int):
    """Fit the pipelined Broadcast's (alpha, beta) on ``comm``; returns (fit or None, report).

    Times the Broadcast from rank 0 for N in 1..64 MiB (up to ``max_bytes``) and
    S in 1..16, interleaved with MPI_Bcast, and fits (K-2+S)(alpha + N/(S beta)).
    """
    from mpiring.comm import autotune
    from mpiring.core.chunking import default_pipeline_chunks
    from mpiring.runtime.trace import fmt_bytes

    sizes = [n for n in PIPELINE_SIZES if n <= max_bytes] or [min(PIPELINE_SIZES)]
    samples, lines = [], []
    native = {}
    for n in sizes:
        plan = [("native", None)] + [("pipelined", s) for s in PIPELINE_CHUNKS]
        med = _time_broadcast(comm, n, plan, reps)
        native[n] = med[("native", None)]
        samples += [(n, s, med[("pipelined", s)]) for s in PIPELINE_CHUNKS]
        lines.append(f"{fmt_bytes(n):>10} {native[n] * 1e3:>9.2f} " + " ".join(
            f"{med[('pipelined', s)] * 1e3:>8.2f}" for s in PIPELINE_CHUNKS))
    fit = autotune.fit_pipeline(comm.size, samples)
    head = [f"\nbroadcast, pipelined ring vs MPI_Bcast: median ms per call, K={comm.size}",
            f"{'size':>10} {'native':>9} " + " ".join(f"{'S=' + str(s):>8}" for s in PIPELINE_CHUNKS)]
    if fit is None:
        tail = ["pipeline model: fit failed (noisy timings); the built-in alpha and beta stay"]
    else:
        alpha, beta = fit
        best = ", ".join(f"{fmt_bytes(n)}: S={default_pipeline_chunks(n, comm.size, alpha, beta)}"
                         for n in sizes)
        tail = [f"pipeline model: alpha = {alpha * 1e6:.0f} us, beta = {beta / 1e9:.2f} GB/s; "
                f"model's best S: {best}"]
    return fit, "\n".join(head + lines + tail)


def _time_broadcast(comm, nbytes: int, plan, reps: int) -> dict:
    x = np.empty(max(1, nbytes // 4), dtype=np.float32)
    x.fill(1.0)
    control = comm.control
    for algo, s in plan:
        comm.broadcast(x, algo=algo, chunks=s, check=False)
    times = {p: [] for p in plan}
    for _ in range(reps):
        for algo, s in plan:
            control.barrier()
            t0 = time.perf_counter()
            comm.broadcast(x, algo=algo, chunks=s, check=False)
            times[(algo, s)].append(control.allreduce_scalar(time.perf_counter() - t0, "max"))
    return {p: float(np.median(t)) for p, t in times.items()}


def format_table(table) -> str:
    """Medians (busbw-free: plain times) and the decision, as text."""
    from mpiring.runtime.trace import fmt_bytes

    lines = [f"# auto decision table for {table.key}"]
    sizes = table.measured.get("sizes", [])
    for coll, per_algo in table.measured.get("seconds", {}).items():
        algos = list(per_algo)
        lines.append(f"\n{coll}: median time per call (us), * = chosen")
        lines.append(f"{'size':>10} " + " ".join(f"{a:>19}" for a in algos))
        for i, s in enumerate(sizes):
            pick = table.choose(coll, s)
            cells = [f"{per_algo[a][i] * 1e6:>18.1f}{'*' if a == pick else ' '}" for a in algos]
            lines.append(f"{fmt_bytes(s):>10} " + " ".join(cells))
        lines.append("decision: " + ", ".join(
            f"<= {fmt_bytes(u)} {a}" if u is not None else f"above {a}"
            for u, a in table.best[coll].intervals))
    return "\n".join(lines)
