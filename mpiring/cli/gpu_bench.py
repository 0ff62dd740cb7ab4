"""Short GPU benchmark: NCCL native vs ring, MPI on GPU buffers (staged or CUDA-aware) vs host.

Run under mpiexec on a machine with a GPU; every rank uses GPU local_rank % count.

    mpiexec -n 2 python -m mpiring gpu-bench --sizes 1M,64M

Rows (AllReduce, float32, sum):

* ``nccl native`` / ``nccl ring``: ncclAllReduce vs the lecture's ring over
  NCCL send/recv (skipped, with the reason, when NCCL cannot start here);
* ``mpi staged`` or ``mpi cuda-aware``: CuPy buffers on the MPI backend, ring
  and native (a non-CUDA-aware MPI is staged through pinned host memory);
* ``mpi host``: the same collectives on NumPy arrays, the staging baseline.

Time per call: each iteration starts after a barrier and ends when the slowest
rank's GPU has finished (device synchronize, then MPI max); the median of
``--iters`` is reported with algbw = bytes/time and busbw = algbw x 2(K-1)/K.
"""

from __future__ import annotations

import json
import time

import numpy as np

from mpiring.cli import output_file, parse_size


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="1M,64M",
                   help="comma list of message sizes in bytes (K/M/G), default 1M,64M")
    p.add_argument("--iters", type=int, default=10, help="timed iterations, default 10")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations, default 3")
    p.add_argument("--backends", default="nccl,mpi", help="comma list of nccl, mpi")
    p.add_argument("--json", metavar="FILE", type=output_file, help="write the rows as JSON (rank 0)")


def run(args) -> int:
    import mpiring
    from mpiring.backends.gpu import (
        cuda_aware_mpi,
        synchronize_device,
        to_device,
        usable_devices,
        use_device,
    )

    # The job's ranks, for the barriers and the max of the times (quiet: no trace, no check).
    world = mpiring.init(backend="mpi", trace="", log="none", check=False)
    control = world.control
    rank = world.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    ndev, reason = usable_devices()
    if control.allreduce_scalar(0 if ndev else 1, "max"):
        say(f"gpu-bench: no GPU on some rank ({reason}); nothing to measure")
        return 1
    use_device(world.local_rank)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    rows: list[dict] = []
    k = world.size
    say(f"gpu-bench: {k} rank(s), AllReduce float32 sum, median of {args.iters} "
        f"(after {args.warmup} warm-up)")
    say(f"{'backend':<8} {'path':<11} {'algo':<7} {'bytes':>10} {'time_us':>10} "
        f"{'algbw_GB/s':>11} {'busbw_GB/s':>11}")

    def bench(comm, path, algo, make):
        for nbytes in sizes:
            x = make(nbytes // 4)
            times = []
            for i in range(args.warmup + args.iters):
                control.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(x, algo=algo, check=False)
                if path != "host":
                    synchronize_device()
                dt = control.allreduce_scalar(time.perf_counter() - t0, "max")
                if i >= args.warmup:
                    times.append(dt)
            t = float(np.median(times))
            algbw = nbytes / t / 1e9
            busbw = algbw * 2 * (k - 1) / k
            row = {"backend": comm.backend, "path": path, "algo": algo, "bytes": nbytes,
                   "ranks": k, "time_us": t * 1e6, "algbw": algbw, "busbw": busbw}
            rows.append(row)
            say(f"{comm.backend:<8} {path:<11} {algo:<7} {nbytes:>10} {t * 1e6:>10.1f} "
                f"{algbw:>11.2f} {busbw:>11.2f}")

    def on_gpu(n):
        return to_device(np.ones(n, dtype=np.float32))

    if "nccl" in backends:
        try:
            comm = mpiring.init(backend="nccl")
        except mpiring.BackendUnavailable as exc:
            say(f"nccl     skipped: {str(exc).splitlines()[1].strip()}")
        else:
            for algo in ("native", "ring"):
                bench(comm, "device", algo, on_gpu)
    if "mpi" in backends:
        comm = mpiring.init(backend="mpi")
        aware, how = cuda_aware_mpi()
        path = "cuda-aware" if aware else "staged"
        if not aware:
            say(f"mpi      CUDA-aware MPI not available ({how}): GPU buffers are staged")
        for algo in ("native", "ring"):
            bench(comm, path, algo, on_gpu)
        for algo in ("native", "ring"):
            bench(comm, "host", algo, lambda n: np.ones(n, dtype=np.float32))
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0
