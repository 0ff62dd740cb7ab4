"""Print versions, the MPI library and thread level, GPU/NCCL availability and the rank layout."""

from __future__ import annotations

import platform

import numpy as np

from mpiring.tools.info import collect


def add_arguments(p) -> None:
    p.add_argument("--all-ranks", action="store_true",
                   help="gather and print every rank's host and local rank (needs mpiexec)")


def run(args) -> int:
    import mpiring

    facts = collect()
    world = mpiring.init(backend="mpi", trace="", log="none")  # no trace file from info
    # Fixed-size records through the control channel: nothing from a peer is unpickled.
    record = np.zeros(3 + 64, dtype=np.int64)
    record[:3] = (world.rank, world.local_rank, world.local_size)
    name = platform.node().encode()[:64]
    record[3:3 + len(name)] = list(name)
    table = world.control.allgather_array(record)
    layout = [(int(r[0]), bytes(int(c) for c in r[3:] if c).decode(errors="replace"),
               int(r[1]), int(r[2])) for r in table]
    if world.rank == 0:
        width = max(len(k) for k in facts)
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
        print(f"{'ranks':<{width}}  {world.size}")
        for rank, host, local, nlocal in layout:
            print(f"  r{rank}: host {host}, local rank {local} of {nlocal}")
    return 0
