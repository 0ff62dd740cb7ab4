"""Print versions, the MPI library and thread level, GPU/NCCL availability and the rank layout."""

from __future__ import annotations

import platform

import numpy as np

from mpiring.tools.info import collect


def add_arguments(p) -> None:
    p.add_argument("--all-ranks", action="store_true",
                   help="gather and print every rank's host and local rank (needs mpiexec)")


def run(args) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    facts = collect()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    # Fixed-size records through a plain Allgather: nothing from a peer is unpickled.
    record = np.zeros(3 + 64, dtype=np.int64)
    record[:3] = (world.Get_rank(), node.Get_rank(), node.Get_size())
    name = platform.node().encode()[:64]
    record[3:3 + len(name)] = list(name)
    table = np.empty((world.Get_size(), record.size), dtype=np.int64)
    world.Allgather(record, table)
    layout = [(int(r[0]), bytes(int(c) for c in r[3:] if c).decode(errors="replace"),
               int(r[1]), int(r[2])) for r in table]
    if world.Get_rank() == 0:
        width = max(len(k) for k in facts)
        for key, value in facts.items():
            print(f"{key:<{width}}  {value}")
        print(f"{'ranks':<{width}}  {world.Get_size()}")
        for rank, host, local, nlocal in layout:
            print(f"  r{rank}: host {host}, local rank {local} of {nlocal}")
    return 0
