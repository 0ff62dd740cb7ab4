"""How fast a late rank computes while the others wait for it, by how they wait.

    mpiexec -n 4 python scripts/late_rank.py [steps]

Each step, one rank (in turn) computes 100 short bursts of Python, with a 20 us
sleep between them (as a rank does between its own polls), while the others
wait for it in an Allgather: inside MPI's blocking call ("block"), polling a
non-blocking one and yielding the core after each miss ("yield"), or as
mpiring's control channel waits (``control.arrive``, "arrive": yielding for a
moment, then sleeping).
The modes take turns within one launch; each line is a mode's median step. On
a host with more ranks than cores the late rank shares its core with a waiter,
so what matters is whether the waiter gives the core back.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

from mpiring.backends.control import arrive


def burst() -> int:
    s = 0
    for i in range(20000):
        s += i * i
    return s


def wait(mode: str, req) -> None:
    if mode == "block":
        req.Wait()
    elif mode == "yield":
        while not req.Test():
            os.sched_yield()
    else:
        arrive(req.Test, "yield")


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    modes = ("block", "yield", "arrive")
    times: dict[str, list[float]] = {m: [] for m in modes}
    mine, out = np.array([rank], dtype=np.int64), np.empty(size, dtype=np.int64)
    for step in range(steps * len(modes)):
        mode = modes[step % len(modes)]
        world.Barrier()
        t0 = time.perf_counter()
        if rank == (step // len(modes)) % size:
            for _ in range(100):
                burst()
                time.sleep(2e-5)
        wait(mode, world.Iallgather(mine, out))
        times[mode].append(time.perf_counter() - t0)
    if rank == 0:
        cores = len(os.sched_getaffinity(0))
        print(f"# {size} ranks on {cores} cores, {steps} steps per mode")
        base = float(np.median(times["arrive"]))
        for m in modes:
            med = float(np.median(times[m]))
            print(f"{m:6s} step median {med * 1e3:7.1f} ms  x arrive {med / base:5.2f}")


if __name__ == "__main__":
    main()
