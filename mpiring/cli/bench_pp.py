"""Time the pipeline schedules on the project's GPT: bubble measured vs predicted.

Run under mpiexec, one stage per rank. For each m: GPipe (with and without
recomputation), 1F1B, ZB-H1 (also held to 1F1B's measured peak memory,
``zb-cap``) and torch.distributed.pipelining's Schedule1F1B
over gloo on the same stages and micro-batches; the measured bubble beside
the schedule's prediction from the measured F, B and W times, peak activation
memory, and one run drawn as the lecture's diagram.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpiring bench-pp
    mpiexec -n 2 python -m mpiring bench-pp --preset tiny --m 4,8 --draw zb:8
"""

from __future__ import annotations

import sys

from mpiring.cli import add_backend_arguments


def add_arguments(p) -> None:
    p.add_argument("--preset", default="small", help="GPT preset: small (default), tiny, comm")
    p.add_argument("--m", default="4,8,16", help="micro-batch counts, comma list (default 4,8,16)")
    p.add_argument("--modes", default=None,
                   help="comma list of gpipe, gpipe-recompute, 1f1b, 1f1b-autograd (weight "
                        "gradients accumulated by autograd), zb, zb-cap (ZB-H1 held "
                        "to 1F1B's measured peak; after 1f1b), interleaved (2 stages per "
                        "rank), interleaved-zb (the same, the backward split), zbv (ZB-V: 2 "
                        "per rank in a V), dualpipev (DeepSeek's order on the V; its rows "
                        "from m = 2 x ranks), torch-1f1b (default: all, the multi-stage ones "
                        "where the preset has 2 units per rank)")
    p.add_argument("--mb-rows", type=int, default=2, help="windows per micro-batch (default 2)")
    p.add_argument("-n", "--steps", type=int, default=5,
                   help="timed steps, the fastest kept (default 5)")
    p.add_argument("-w", "--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--draw", default="1f1b:8,zb:8", metavar="MODE:M,...",
                   help="runs to draw as the lecture's diagram (default 1f1b:8,zb:8)")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    add_backend_arguments(p)


def run(args) -> int:
    import json

    import mpiring
    from mpiring.tools.bench.pp import (
        MODES,
        MULTI_MODES,
        draw_run,
        format_pp_table,
        interleaved_fits,
        run_pp_bench,
    )

    if args.backend != "mpi":
        raise ValueError("bench-pp runs on the MPI backend (CPU); use --backend mpi")
    ms = [int(t) for t in args.m.split(",") if t.strip()]
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    if args.modes is None:
        modes = list(MODES)
        if not interleaved_fits(args.preset, comm.size):
            modes = [m for m in modes if m not in MULTI_MODES]
            if comm.rank == 0:
                print(f"# bench-pp: no {', '.join(MULTI_MODES)} rows: {comm.size} ranks x 2 "
                      f"stages is more than the {args.preset} GPT's units", file=sys.stderr)
    else:
        modes = [t.strip() for t in args.modes.split(",") if t.strip()]
    rows, drawn = run_pp_bench(comm, preset=args.preset, ms=ms, modes=modes, mb_rows=args.mb_rows,
                               steps=args.steps, warmup=args.warmup)
    if comm.rank == 0:
        print(f"# mpiring bench-pp: {comm.size} stages, preset {args.preset}, "
              f"{args.mb_rows} windows per micro-batch; command: mpiexec -n {comm.size} "
              f"python -m mpiring bench-pp {' '.join(sys.argv[2:])}".rstrip())
        print(format_pp_table(rows))
        for item in filter(None, args.draw.split(",")):
            mode, _, m = item.partition(":")
            if (mode, int(m or 0)) in drawn:
                print(f"\n{mode}, m={m}, measured (fastest step):")
                print(draw_run(drawn[(mode, int(m))]))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
                fh.write("\n")
    return 0
