"""What tracing costs when it is off: the hooks one all_reduce runs, times their unit cost.

    mpiexec -n 2 python scripts/trace_cost.py          # 4 KiB and 64 MiB; auto, ring, ring-seg

A difference of 1-2% between two timed runs is below the noise of a shared
machine, so this counts instead: one call of each algorithm runs with counters
on the hooks that stay when tracing is off (the per-call trace setup, each
step's record handed to the stall watchdog, the clock reads of the step
records), the unit cost of each hook comes from ``timeit``, and the sum is set
against the call's median time (rank 0 prints one line per case).
"""

from __future__ import annotations

import time
import timeit

import numpy as np

import mpiring
import mpiring.collectives.all_gather as all_gather_mod
import mpiring.collectives.halving_doubling as halving_doubling_mod
import mpiring.collectives.recursive_doubling as recursive_doubling_mod
import mpiring.collectives.reduce_scatter as reduce_scatter_mod
import mpiring.collectives.ring_segmented as ring_segmented_mod
from mpiring.runtime import trace as trace_mod
from mpiring.runtime import watchdog

# Those that read the clock (auto runs the doublings or ring-seg, by size).
MODULES = (reduce_scatter_mod, all_gather_mod, ring_segmented_mod, recursive_doubling_mod,
           halving_doubling_mod)


def unit_costs(comm, n: int = 200_000) -> dict[str, float]:
    """Seconds per hook call, without the cost of the timing loop itself."""
    rec = watchdog.Activity(0, 2, world_ranks=[0, 1], abort=lambda code: None)
    rec = rec.steps_to(trace_mod.NULL_CALL)

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=n, repeat=5)) / n

    base = best(lambda: None)
    return {
        # The literal ring hands each step's chunks on; the others only phase and step.
        "chunk_step": best(lambda: rec.chunk_step("reduce-scatter", 1, 3, 1, 0, 0.0, 0.0)) - base,
        "step": best(lambda: rec.step("reduce-scatter", 1, 3)) - base,
        "clock": best(trace_mod.clock),
        "setup": best(lambda: comm._act.steps_to(comm.tracer.call("all_reduce", 1, "ring"))) - base,
    }


def count_hooks(comm, x, algo: str) -> dict[str, int]:
    """Run one all_reduce with counters on the hooks; how often each ran."""
    counts = {"setup": 0, "step": 0, "chunk_step": 0, "clock": 0}
    clock, call = trace_mod.clock, trace_mod.Tracer.call
    step, chunk_step = watchdog.Activity.step, watchdog.Activity.chunk_step

    def counting_clock():
        counts["clock"] += 1
        return clock()

    def counting_step(self, *args, **kwargs):
        counts["step"] += 1
        return step(self, *args, **kwargs)

    def counting_chunk_step(self, *args, **kwargs):
        counts["chunk_step"] += 1
        return chunk_step(self, *args, **kwargs)

    def counting_call(self, *args):
        counts["setup"] += 1
        return call(self, *args)

    for m in MODULES:
        m.clock = counting_clock
    watchdog.Activity.step, trace_mod.Tracer.call = counting_step, counting_call
    watchdog.Activity.chunk_step = counting_chunk_step
    try:
        comm.all_reduce(x, algo=algo, check=False)
    finally:
        for m in MODULES:
            m.clock = clock
        watchdog.Activity.step, trace_mod.Tracer.call = step, call
        watchdog.Activity.chunk_step = chunk_step
    return counts


def main() -> None:
    comm = mpiring.init()
    if comm.tracer.enabled:
        raise SystemExit("trace_cost.py measures tracing OFF: unset MPIRING_TRACE and MPIRING_LOG")
    unit = unit_costs(comm)
    for size in (4096, 64 << 20):
        x = np.ones(size // 4, np.float32)
        for algo in ("auto", "ring", "ring-seg"):
            counts = count_hooks(comm, x, algo)
            times = []
            for _ in range(7 if size > (1 << 20) else 1000):
                x[:] = 1
                comm.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(x, algo=algo, check=False)
                times.append(time.perf_counter() - t0)
            t = float(np.median(times))
            hooks = sum(counts[h] * unit[h] for h in ("setup", "step", "chunk_step", "clock"))
            if comm.rank == 0:
                print(f"K={comm.size} {size:>9} B {algo:9s} call {t * 1e6:9.1f} us; hooks: "
                      f"{counts['setup']} setup, {counts['step'] + counts['chunk_step']} steps, {counts['clock']} clock "
                      f"reads = {hooks * 1e6:.2f} us = {hooks / t * 100:.2f}%", flush=True)


if __name__ == "__main__":
    main()
