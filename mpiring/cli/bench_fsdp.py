"""FSDP (ZeRO-3) against DDP: model-state memory per rank with the ZeRO formula, and step time.

    mpiexec -n 2 python -m mpiring bench-fsdp --memory fsdp     # one setup per launch (RSS)
    mpiexec -n 2 python -m mpiring bench-fsdp --memory ddp
    mpiexec -n 2 python -m mpiring bench-fsdp --memory fsdp,fsdp-noprefetch   # a row each
    mpiexec -n 2 python -m mpiring bench-fsdp --time ddp,fsdp,fsdp-noprefetch,torch-fsdp

``--memory SETUP`` trains a few steps and prints the model state each rank
holds (parameters, gradients, AdamW moments: counted from the tensors), the
ZeRO paper's prediction beside it (16 Psi for DDP, 16 Psi / K for stage 3 with
float32 states), the largest gathered parameters FSDP held at once, and the
peak RSS; for FSDP also the peak during a step (the state plus the gathered
parameters and pending gradients FSDP counted) beside its bound, 16 Psi / K +
8 (Psi_root + Psi_unit), + 8 Psi_unit with prefetch. Several setups print a
row each (their RSS is then the process's, shared). ``--time`` alternates the setups' steps in one process and prints
each median step time and its ratio to the first setup. A torch setup that
cannot be built here (torch's FSDP on the CPU) is reported with its error.
"""

from __future__ import annotations

import json

from mpiring.cli import add_backend_arguments, output_file, refuse

MIB = float(1 << 20)


def add_arguments(p) -> None:
    p.add_argument("--memory", metavar="SETUP", default=None,
                   help="comma list of ddp, fsdp, fsdp-noprefetch: count the model state "
                        "(one setup per launch for a peak RSS of its own)")
    p.add_argument("--time", metavar="LIST", default=None,
                   help="comma list of ddp, fsdp, fsdp-noprefetch, torch-fsdp, torch-zero: "
                        "alternate their steps")
    p.add_argument("--preset", default="comm", help="GPT preset (default comm, 12.8M params)")
    p.add_argument("--steps", type=int, default=6, help="steps per setup (default 6)")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank (default 2)")
    p.add_argument("--algo", default=None,
                   help="FSDP's AllGather/ReduceScatter algorithm (default: FSDP's own)")
    p.add_argument("--json", metavar="FILE", type=output_file, default=None, help="append the result as JSON")
    add_backend_arguments(p)


def _memory_row(comm, name: str, cfg, args) -> dict:
    from mpiring.tools.bench.fsdp import measure_memory

    row = measure_memory(comm, name, cfg, steps=args.steps, batch_size=args.batch_size)
    rows = comm.control.allgather_json(row) if comm.size > 1 else [row]
    keys = ("state_bytes", "gathered_peak", "rss_peak", "rss_before", "unsharded_peak",
            "step_peak")
    out = {**row, **{k: max(r[k] for r in rows) for k in keys if k in row}}
    if comm.rank == 0:
        formula = out["zero3_formula"] if name.startswith("fsdp") else out["ddp_formula"]
        line = (f"bench-fsdp --memory: setup={name} ranks={comm.size} preset={args.preset} "
                f"Psi={out['psi'] / 1e6:.2f}M: model state {out['state_bytes'] / MIB:.1f} MiB/rank "
                f"(formula {formula / MIB:.1f} MiB; DDP 16 Psi = {out['ddp_formula'] / MIB:.1f} "
                f"MiB, ratio {out['state_bytes'] / out['ddp_formula']:.3f})")
        if "step_peak" in out:
            pre = "+ 8 Psi_unit " if name == "fsdp" else ""
            line += (f"; in a step: peak {out['step_peak'] / MIB:.1f} MiB (unsharded "
                     f"{out['unsharded_peak'] / MIB:.1f}) <= bound 16 Psi/K + 8 (Psi_root + "
                     f"Psi_unit) {pre}= {out['step_formula'] / MIB:.1f} MiB "
                     f"[Psi_root={out['psi_root'] / 1e6:.2f}M Psi_unit={out['psi_unit'] / 1e6:.2f}M]"
                     f" {'holds' if out['step_peak'] <= out['step_formula'] else 'EXCEEDED'}")
        line += (f", gathered at once {out['gathered_peak'] / MIB:.1f} MiB, peak RSS "
                 f"{out['rss_peak'] / MIB:.0f} MiB (before {out['rss_before'] / MIB:.0f})")
        print(line, flush=True)
    return out


def run(args) -> int:
    import mpiring
    from mpiring.tools.bench.fsdp import SETUPS, measure_time
    from mpiring.tools.models.gpt import PRESETS

    if (args.memory is None) == (args.time is None):
        return refuse("bench-fsdp: give --memory SETUP or --time LIST")
    names = [n.strip() for n in (args.time or args.memory).split(",") if n.strip()]
    bad = [n for n in names if n not in SETUPS or (args.memory and n.startswith("torch"))]
    if not names or bad:
        return refuse(f"bench-fsdp: unknown setup in {names}: use {', '.join(SETUPS)} "
                      "(--memory: ddp, fsdp, fsdp-noprefetch)")
    if args.preset not in PRESETS:
        return refuse(f"bench-fsdp: --preset {args.preset!r}: use one of {', '.join(PRESETS)}")
    cfg = PRESETS[args.preset]
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    if args.memory:
        out = [_memory_row(comm, name, cfg, args) for name in names]
    else:
        pg = None
        if any(n.startswith("torch") for n in names):
            import torch

            from mpiring.tools.train.torch_pg import init_torch_process_group

            pg = init_torch_process_group(comm, torch.device("cpu"))
        times, errors = measure_time(comm, names, cfg, steps=args.steps,
                                     batch_size=args.batch_size, pg=pg, algo=args.algo)
        out = {"ranks": comm.size, "preset": args.preset, "step_s": times, "errors": errors}
        if comm.rank == 0:
            first = next((n for n in names if n in times), None)
            parts = ", ".join(f"{n} {times[n] * 1e3:.0f} ms ({times[n] / times[first]:.2f}x)"
                              for n in names if n in times)
            print(f"bench-fsdp --time: ranks={comm.size} preset={args.preset}, steps alternated, "
                  f"median step: {parts}", flush=True)
            for n, e in errors.items():
                print(f"bench-fsdp --time: {n} did not run here: {e}", flush=True)
        if pg is not None:
            from mpiring.tools.train.torch_pg import destroy_torch_process_group

            destroy_torch_process_group(comm)
    if comm.rank == 0 and args.json:
        with open(args.json, "a") as f:
            for row in out if isinstance(out, list) else [out]:
                f.write(json.dumps(row) + "\n")
    return 0
