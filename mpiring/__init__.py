"""mpiring: ring collectives from first principles, over MPI and NCCL, feeding a DDP reducer.

    import mpiring
    comm = mpiring.init(backend="mpi")
    comm.all_reduce(x, op="sum", algo="ring")
"""

from __future__ import annotations

from . import pages  # huge-page buffers and steady_malloc (no torch needed to import)
from .backends import BACKENDS
from .comm import Communicator
from .errors import BackendUnavailable, MismatchError, MpiringTimeout

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "Communicator",
    "DistributedDataParallel",
    "MismatchError",
    "MpiringTimeout",
    "ZeroRedundancyOptimizer",
    "init",
    "pages",
]


def init(backend: str = "mpi", *, trace: str | None = None, log: str | None = None,
         check: bool | None = None, timeout: float | str | None = None) -> Communicator:
    """Start (or join) the MPI job and return a Communicator over all ranks.

    Args:
        backend: "mpi" (mpi4py) or "nccl" (cupy.cuda.nccl; MPI still launches
            the ranks and carries the NCCL id).
        trace: directory for per-rank JSON-lines step traces (default:
            ``MPIRING_TRACE``).
        log: "steps" to log every ring step to stderr (default: ``MPIRING_LOG``).
        check: compare every collective's arguments across ranks before moving
            data (default on; ``MPIRING_CHECK=0`` turns it off).
        timeout: seconds one blocking wait may last before this rank prints a
            stall report (collective, ring step, peer) and aborts the job
            (default ``MPIRING_TIMEOUT`` or 300; 0 disables). See
            ``mpiring.watchdog``.

    Raises:
        ValueError: unknown backend name.
        BackendUnavailable: the backend cannot run here; the message says why
            and how to fix it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    from mpi4py import MPI

    from .trace import Tracer

    world = MPI.COMM_WORLD
    tracer = Tracer.from_env(world.Get_rank(), trace, log)
    if backend == "mpi":
        from .backends.mpi import MPIBackend

        return Communicator(MPIBackend(world.Dup()), tracer, check=check, timeout=timeout)
    from .backends.nccl import make_backend

    return Communicator(make_backend(world), tracer, check=check, timeout=timeout)


def __getattr__(name: str):
    # torch is optional: import the DDP wrapper only when it is asked for.
    if name == "DistributedDataParallel":
        from .ddp import DistributedDataParallel

        return DistributedDataParallel
    if name == "ZeroRedundancyOptimizer":
        from .zero import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    raise AttributeError(f"module 'mpiring' has no attribute {name!r}")
