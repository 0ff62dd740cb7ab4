"""mpiring: ring collectives from first principles, over MPI and NCCL, feeding a DDP reducer.

    import mpiring
    comm = mpiring.init(backend="mpi")
    comm.all_reduce(x, op="sum", algo="ring")
"""

from __future__ import annotations

from mpiring.backends import BACKENDS
from mpiring.comm.communicator import Communicator
from mpiring.core.errors import BackendUnavailable, MismatchError, MpiringTimeout
from mpiring.runtime import pages  # huge-page buffers and steady_malloc (no torch needed to import)

__version__ = "0.1.0"

# Public names that need torch (or a heavier import) live in their layer and are
# imported on first use: ``import mpiring`` stays cheap and torch stays optional.
_LAZY = {
    "DistributedDataParallel": "mpiring.parallel.data",
    "DistributedSampler": "mpiring.parallel.data",
    "ZeroRedundancyOptimizer": "mpiring.parallel.zero",
    "FullyShardedDataParallel": "mpiring.parallel.fsdp",
    "ProcessGrid": "mpiring.parallel.grid",
    "ColumnParallelLinear": "mpiring.parallel.tensor",
    "RowParallelLinear": "mpiring.parallel.tensor",
    "VocabParallelEmbedding": "mpiring.parallel.tensor",
    "vocab_parallel_cross_entropy": "mpiring.parallel.tensor",
    "PipelineStage": "mpiring.parallel.pipeline",
    "ScheduleGPipe": "mpiring.parallel.pipeline",
    "Schedule1F1B": "mpiring.parallel.pipeline",
    "ScheduleZeroBubble": "mpiring.parallel.pipeline",
    "SchedulePipeDream": "mpiring.parallel.pipeline",
    "init_process_group": "mpiring.comm.default",
    "destroy_process_group": "mpiring.comm.default",
    "is_initialized": "mpiring.comm.default",
    "get_rank": "mpiring.comm.default",
    "get_world_size": "mpiring.comm.default",
    "checkpoint": "mpiring.parallel",
}

__all__ = ["BACKENDS", "BackendUnavailable", "Communicator", "MismatchError", "MpiringTimeout",
           "init", "pages", *_LAZY]


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
            ``mpiring.runtime.watchdog``.

    Raises:
        ValueError: unknown backend name.
        BackendUnavailable: the backend cannot run here; the message says why
            and how to fix it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    from mpiring.backends.mpi import world_backend, world_rank
    from mpiring.runtime.trace import Tracer

    tracer = Tracer.from_env(world_rank(), trace, log)
    if backend == "mpi":
        return Communicator(world_backend(), tracer, check=check, timeout=timeout)
    from mpiring.backends.nccl import make_backend

    return Communicator(make_backend(), tracer, check=check, timeout=timeout)


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'mpiring' has no attribute {name!r}")
    from importlib import import_module

    module = import_module(where)
    value = getattr(module, name, None) or import_module(f"{where}.{name}")  # a name or a module
    globals()[name] = value  # later lookups skip this function
    return value
