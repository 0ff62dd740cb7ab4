"""Time tensor parallelism: an MLP block and a GPT layer on 1 rank, mpiring's TP and torch's TP.

Run under mpiexec with one thread per rank, e.g.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpiring bench-tp
    OMP_NUM_THREADS=1 mpiexec -n 2 python -m mpiring bench-tp --widths 2048 --blocks mlp -n 10

Every row is forward plus backward of one block on the same tokens and the same
full weights: the full block on rank 0 alone, mpiring's column/row layers over
all ranks, and torch.distributed.tensor.parallel (ColwiseParallel /
RowwiseParallel) over gloo, in one run; with mpiring's communication share and
the weight memory per rank.
"""

from __future__ import annotations

import sys

from mpiring.cli import add_backend_arguments, output_file, refuse


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(p) -> None:
    from mpiring.comm.communicator import ALGOS

    p.add_argument("--widths", type=_ints, default=[512, 1024, 2048, 4096],
                   help="model widths d (default 512,1024,2048,4096)")
    p.add_argument("--blocks", type=_names, default=["mlp", "layer"],
                   help="comma list of mlp (d -> 4d -> d) and layer (one GPT block)")
    p.add_argument("--modes", type=_names, default=["single", "mpiring", "torch"],
                   help="comma list of single (1 rank), mpiring, torch (torch TP over gloo)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per step (default 256)")
    p.add_argument("-n", "--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("-w", "--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--algo", choices=ALGOS["all_reduce"], default="ring",
                   help="mpiring's collective algorithm (default ring)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the blocks run (default cpu; cuda: each rank on its local "
                        "GPU, mpiring over MPI, torch's TP still over gloo)")
    p.add_argument("--json", metavar="FILE", type=output_file, help="also write the rows as JSON")
    add_backend_arguments(p)


def run(args) -> int:
    import json
    import os

    import torch

    import mpiring
    from mpiring.tools.bench.tp import (
        BLOCKS,
        MODES,
        TPBenchConfig,
        format_table,
        measure,
        torch_can_split,
    )

    bad = [b for b in args.blocks if b not in BLOCKS] + [m for m in args.modes if m not in MODES]
    if bad or args.steps < 1 or args.tokens < 64 or min(args.widths, default=0) < 64:
        return refuse(f"mpiring bench-tp: bad choice {bad or ''}: blocks from {BLOCKS}, modes "
                      f"from {MODES}, steps >= 1, tokens >= 64, widths >= 64")
    if args.backend != "mpi":
        return refuse("mpiring bench-tp: runs on the MPI backend (CUDA-aware or host-staged "
                      "on a GPU): use --backend mpi")
    if args.device == "cuda" and not torch.cuda.is_available():
        return refuse("mpiring bench-tp: --device cuda needs a GPU that torch can see: use "
                      "--device cpu")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # one thread per rank everywhere, the 1-rank row included
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    cfg = TPBenchConfig(widths=args.widths, blocks=args.blocks, modes=args.modes,
                        tokens=args.tokens, steps=args.steps, warmup=args.warmup, algo=args.algo,
                        device=args.device)
    gloo = None
    if "torch" in cfg.modes:
        from mpiring.tools.train.torch_pg import init_torch_process_group

        # gloo on either device: the baseline (and two ranks can share one GPU).
        gloo = init_torch_process_group(comm, torch.device(cfg.device), backend="gloo")
    rows = []
    try:
        for block in cfg.blocks:
            for d in cfg.widths:
                for mode in cfg.modes:
                    if mode == "torch" and not torch_can_split(block, d, comm.size):
                        continue  # its row shows "-"
                    row = measure(comm, cfg, block, mode, d)
                    if row is not None and comm.rank == 0:
                        rows.append(row)
                        print(f"bench-tp: {block} d={d} {mode}: {row['step_ms']:.1f} ms",
                              file=sys.stderr, flush=True)
    finally:
        if gloo is not None:
            from mpiring.tools.train.torch_pg import destroy_torch_process_group

            destroy_torch_process_group(comm)
    if comm.rank == 0:
        print(f"bench-tp: {comm.size} ranks on {cfg.device}, "
              f"{torch.get_num_threads()} thread(s) per rank, "
              f"{cfg.tokens} tokens, fp32, median of {cfg.steps} steps, algo {cfg.algo}")
        print(format_table(rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    return 0
