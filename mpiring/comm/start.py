"""Starting mpiring: the Communicator over every rank of the job (``mpiring.init``)."""

from __future__ import annotations

from mpiring.backends import BACKENDS
from mpiring.comm.communicator import Communicator


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
    from mpiring.runtime.desync import probe_seconds

    probe_seconds()  # a bad MPIRING_DESYNC fails here, on every rank, before any byte moves
    from mpiring.backends.mpi import world_backend, world_rank
    from mpiring.runtime.trace import Tracer

    tracer = Tracer.from_env(world_rank(), trace, log)
    # A rank that raises or exits while the others wait for it ends the job in
    # seconds instead of at the deadline (collective the first time; then free).
    from mpiring.backends.lifecycle import install

    install()
    if backend == "mpi":
        return Communicator(world_backend(), tracer, check=check, timeout=timeout)
    from mpiring.backends.nccl import make_backend

    return Communicator(make_backend(), tracer, check=check, timeout=timeout)
