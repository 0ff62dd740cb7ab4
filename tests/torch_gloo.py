"""torch.distributed over gloo on the test job's ranks, for differential tests against torch."""

from __future__ import annotations

import socket


def gloo_world(world):
    """Join (once) a gloo process group spanning every rank of the test job; return torch.distributed."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() == world.size:
        return dist
    if dist.is_initialized():
        from mpiring.tools.train.torch_pg import destroy_torch_process_group

        destroy_torch_process_group(world)  # in order, rank 0 (the store's host) last
    port = None
    if world.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.mpi_comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.rank, world_size=world.size)
    return dist
