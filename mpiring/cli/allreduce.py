"""Run one AllReduce (ring by default), check it against MPI's own, print time and bandwidth."""

from __future__ import annotations

import time

import numpy as np

from mpiring.cli import add_backend_arguments, check_memory, parse_size, positive_int, size_arg


def add_arguments(p) -> None:
    from mpiring.comm.communicator import ALGOS
    from mpiring.core.buffers import DTYPES
    from mpiring.core.ops import OPS

    p.add_argument("--size", type=size_arg, default="64M",
                   help="message size in bytes (K/M/G suffixes), default 64M")
    p.add_argument("--algo", choices=ALGOS["all_reduce"], default="ring",
                   help="the algorithm (default ring)")
    p.add_argument("--op", choices=OPS, default="sum",
                   help="sum, avg, max, min, prod, or for integer dtypes band, bor, bxor")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type, default float32")
    p.add_argument("--iters", type=positive_int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the buffer lives: cpu (NumPy) or cuda (CuPy, GPU local_rank %% "
                        "count); default cuda for --backend nccl, cpu for mpi")
    add_backend_arguments(p)


def run(args) -> int:
    import mpiring
    from mpiring.core.buffers import bfloat16
    from mpiring.runtime.trace import fmt_bytes

    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    to_dev, to_host, sync = _placement(args, comm)
    dtype = bfloat16() if args.dtype == "bfloat16" else np.dtype(args.dtype)
    n = max(parse_size(args.size) // dtype.itemsize, 0)
    if n == 0:  # a 0-element call times nothing, yet would print a time and "OK"
        raise ValueError(f"--size {args.size} B is less than one {args.dtype} element "
                         f"({dtype.itemsize} B): give at least {dtype.itemsize}")
    # int64 indices while building the data, then the buffer, the reference and a copy.
    check_memory(n * (8 + 3 * dtype.itemsize), comm.local_size, f"--size {args.size}")
    # Rank- and index-dependent small integers: exact in every dtype, so the ring
    # and the native result must agree bit for bit.
    base = ((np.arange(n, dtype=np.int64) * 5 + comm.rank * 3) % 7).astype(dtype)
    x = to_dev(base)
    comm.all_reduce(x, op=args.op, algo=args.algo)  # the traced/logged call
    expected = to_dev(base)
    ref_algo = "native" if args.dtype != "bfloat16" else "ring"
    comm.all_reduce(expected, op=args.op, algo=ref_algo)
    ok = bool(np.array_equal(to_host(x), to_host(expected)))
    wrong = comm.control.allreduce_scalar(0 if ok else 1)
    comm.tracer.close()

    times = []
    quiet = mpiring.init(backend=args.backend, trace="", log="none", check=False)
    for _ in range(args.iters):
        y = to_dev(base)
        sync()
        quiet.barrier()
        t0 = time.perf_counter()
        quiet.all_reduce(y, op=args.op, algo=args.algo)
        sync()  # NCCL returns before the GPU has finished
        times.append(comm.control.allreduce_scalar(time.perf_counter() - t0, "max"))
    t = float(np.median(times)) if times else 0.0
    nbytes = n * dtype.itemsize
    algbw = nbytes / t / 1e9 if t else 0.0
    busbw = algbw * 2 * (comm.size - 1) / comm.size
    if comm.rank == 0:
        print(f"all_reduce algo={args.algo} op={args.op} dtype={args.dtype} size={fmt_bytes(nbytes)} "
              f"ranks={comm.size}: {t * 1e3:.2f} ms (median of {args.iters}), algbw {algbw:.2f} GB/s, "
              f"busbw {busbw:.2f} GB/s; check against {ref_algo}: "
              f"{'OK' if not wrong else f'WRONG on {wrong} rank(s)'}")
    return 0 if not wrong else 1


def _placement(args, comm):
    """(to_device, to_host, synchronize) for --device; CuPy only when the GPU is asked for."""
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if device == "cpu":
        return (lambda a: a.copy()), (lambda a: a), (lambda: None)
    from mpiring.backends.gpu import synchronize_device, to_device, to_host, use_device

    if args.backend == "mpi":  # NCCL picked its GPU already
        use_device(comm.local_rank)
    return to_device, to_host, synchronize_device
