"""torch.distributed initialised from the MPI ranks (for the ``torch-ddp`` comparison).

Rank 0 picks a free TCP port and broadcasts it (an int, over the project's own
communicator); every rank then joins ``tcp://HOST:PORT`` with its MPI rank and
size. HOST is the loopback address when all ranks share one host, rank 0's host
name otherwise.
"""

from __future__ import annotations

import gc
import socket

import numpy as np
import torch

_HOST_BYTES = 256


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_torch_process_group(comm, device: torch.device, timeout_s: float = 120.0,
                             backend: str | None = None):
    """``torch.distributed.init_process_group`` over ``comm``'s ranks; returns the group.

    The backend is gloo on the CPU and nccl on CUDA devices, unless ``backend``
    names one (gloo also takes CUDA tensors, through host copies).
    """
    import datetime

    import torch.distributed as dist

    port = np.array([free_port() if comm.rank == 0 else 0], dtype=np.int64)
    comm.broadcast(port, root=0)
    if comm.local_size == comm.size:
        host = "127.0.0.1"
    else:
        raw = np.zeros(_HOST_BYTES, dtype=np.uint8)
        if comm.rank == 0:
            name = socket.gethostname().encode()[:_HOST_BYTES]
            raw[:len(name)] = np.frombuffer(name, dtype=np.uint8)
        comm.broadcast(raw, root=0)
        host = raw.tobytes().rstrip(b"\0").decode("ascii", errors="replace")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    destroy_torch_process_group(comm)  # one left from before: torn down in order, rank 0 last
    dist.init_process_group(backend, init_method=f"tcp://{host}:{int(port[0])}",
                            rank=comm.rank, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD


def destroy_torch_process_group(comm) -> None:
    """Tear down torch.distributed on every rank of ``comm``, rank 0 last (collective).

    Rank 0 hosts the TCP store the others talk to: if it went first, a rank still
    tearing down could wait on the store for ever while rank 0 went on into its
    next MPI collective.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    # A wrapper dropped by the caller but kept alive by a reference cycle (torch's
    # DDP has them) would keep using the group: collect it first.
    gc.collect()
    comm.barrier()            # every rank has finished with the group
    if comm.rank != 0:
        dist.destroy_process_group()
    comm.barrier()            # the store's clients are gone
    if comm.rank == 0:
        dist.destroy_process_group()
