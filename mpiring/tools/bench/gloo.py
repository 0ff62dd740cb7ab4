"""torch.distributed's gloo backend, started from the MPI job: the baseline users would pick.

Rank 0 picks a free TCP port and sends it over the communicator's control
channel; every rank then calls ``init_process_group("gloo",
init_method="tcp://HOST:PORT")`` with its rank and size in that communicator;
no MASTER_ADDR/MASTER_PORT or torchrun is needed. HOST is the loopback address
when all ranks share one host, else rank 0's host name.

The gloo calls run on the bench's own NumPy buffers through ``torch.from_numpy``
(zero-copy), so gloo, MPI and the ring see the same memory.
"""

from __future__ import annotations

import os
import socket

import numpy as np

_TORCH_OPS = {"sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN", "prod": "PRODUCT"}


def available() -> bool:
    """True when torch (with torch.distributed and gloo) can be imported."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gloo:
    """A gloo process group over the ranks of a Communicator (one per process)."""

    def __init__(self, comm, timeout_s: float = 120.0):
        """Start the process group; every rank of ``comm`` must call this.

        Raises:
            TypeError: torch is not installed (install the ``torch`` extra).
        """
        if not available():
            raise TypeError("algo 'gloo' needs torch with torch.distributed: "
                            'pip install "mpiring[torch]", or leave gloo out of --algo')
        import datetime

        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size = comm.rank, comm.size
        one_host = comm.local_size == self.size
        port = _free_port() if self.rank == 0 else 0
        host = "127.0.0.1" if one_host else socket.gethostname()
        port, host = comm.control.bcast_json((port, host), root=0)
        if one_host:
            # gloo binds to the interface its host name resolves to; pin it to the
            # loopback so that a machine without a resolvable name still works.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if dist.is_initialized():
            raise ValueError("a torch.distributed process group already exists in this "
                             "process: the bench starts its own gloo group")
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.size,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # --- the five collectives on NumPy buffers --------------------------------
    def _op(self, op: str):
        return getattr(self.dist.ReduceOp, _TORCH_OPS[op])

    @staticmethod
    def tensor(a: np.ndarray):
        """A torch view of a NumPy array (bfloat16 through an int16 view)."""
        import torch

        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def all_reduce(self, t, op: str) -> None:
        self.dist.all_reduce(t, op=self._op(op))

    def reduce_scatter(self, out, inp, op: str) -> None:
        fn = getattr(self.dist, "reduce_scatter_single", None) or self.dist.reduce_scatter_tensor
        fn(out, inp, op=self._op(op))

    def all_gather(self, out, inp) -> None:
        fn = getattr(self.dist, "all_gather_single", None) or self.dist.all_gather_into_tensor
        fn(out, inp)

    def broadcast(self, t, root: int) -> None:
        self.dist.broadcast(t, src=root)

    def reduce(self, t, root: int, op: str) -> None:
        self.dist.reduce(t, dst=root, op=self._op(op))
