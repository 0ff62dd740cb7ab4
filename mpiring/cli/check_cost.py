"""Measure what the safety nets cost: the cross-rank argument check and the stall watchdog.

Times a ring all_reduce with the check on and off, interleaved in one run (the
order alternates every iteration so that drift hits both alike), the check by
itself (``_prepare`` with and without the exchange), and the watchdog's stamp
around one blocking call. Example::

    mpiexec -n 4 python -m mpiring check-cost --sizes 4K,64M
"""

from __future__ import annotations

import time

import numpy as np

from mpiring.cli import non_negative_int, sizes_arg


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="4K,64M", type=sizes_arg, help="comma-separated message sizes (default 4K,64M)")
    p.add_argument("--iters", type=non_negative_int, default=0,
                   help="timed calls per variant (default 0: 300 below 1 MiB, 8 above)")


def _median_us(samples: list[float]) -> float:
    return float(np.median(samples)) * 1e6 if samples else 0.0


def run(args) -> int:
    import mpiring
    from mpiring.runtime.trace import fmt_bytes
    from mpiring.runtime.watchdog import Activity

    comm = mpiring.init(trace="", log="none")
    rows = []
    for nbytes in args.sizes:  # parsed and checked by sizes_arg
        n = max(nbytes // 4, 1)
        base = ((np.arange(n, dtype=np.int64) * 5 + comm.rank * 3) % 7).astype(np.float32)
        iters = args.iters or (300 if nbytes < (1 << 20) else 8)
        y = base.copy()
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(iters + 2):
            for check in ((True, False) if i % 2 == 0 else (False, True)):
                np.copyto(y, base)
                comm.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(y, algo="ring", check=check)
                t = comm.control.allreduce_scalar(time.perf_counter() - t0, "max")
                if i >= 2:  # two warm-up rounds
                    times[check].append(t)
        # The check alone: validation + descriptor exchange + comparison.
        alone: dict[bool, list[float]] = {True: [], False: []}
        for i in range(200):
            for check in ((True, False) if i % 2 == 0 else (False, True)):
                t0 = time.perf_counter()
                comm._prepare("all_reduce", y, op="sum", algo="ring", check=check)
                alone[check].append(time.perf_counter() - t0)
        on, off = _median_us(times[True]), _median_us(times[False])
        rows.append((fmt_bytes(n * 4), on, off, _median_us(alone[True]) - _median_us(alone[False]),
                     iters))
    # The watchdog's hot-path cost: stamping one blocking call (before and after).
    act = Activity(0, 2, watch=False)
    reps = 200_000
    t0 = time.perf_counter()
    for _ in range(reps):
        act.blocked("Send", 1)
        act.since = 0.0
    stamp_ns = (time.perf_counter() - t0) / reps * 1e9
    if comm.rank == 0:
        print(f"ranks={comm.size}; ring all_reduce of float32, median of N calls per variant, "
              "check on/off interleaved in one run")
        print(f"{'size':>10} {'check on':>12} {'check off':>12} {'on-off':>10} {'ratio':>7} "
              f"{'check alone':>12} {'N':>5}")
        for size, on, off, alone_us, iters in rows:
            print(f"{size:>10} {on:>10.1f}us {off:>10.1f}us {on - off:>8.1f}us "
                  f"{on / off if off else 0:>7.3f} {alone_us:>10.1f}us {iters:>5}")
        per_call = 3 * (comm.size - 1)  # send + wait per reduce-scatter step, sendrecv per all-gather step
        print(f"watchdog stamp: {stamp_ns:.0f} ns per blocking call; a ring all_reduce on "
              f"{comm.size} ranks makes {per_call} blocking calls: "
              f"{stamp_ns * per_call / 1e3:.2f} us per call")
    return 0
