"""Facts about this installation: versions, MPI library, thread level, GPU stack."""

from __future__ import annotations

import platform
import sys


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", "installed")
    except Exception as exc:  # noqa: BLE001 - report, never fail
        return f"not available ({type(exc).__name__}: {exc})".splitlines()[0][:120]


def collect() -> dict[str, str]:
    """A dict of human-readable facts; every probe is guarded so this never raises."""
    import mpiring
    from mpiring.backends.mpi import describe_mpi

    facts = {
        "mpiring": mpiring.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "numpy": _version("numpy"),
        **describe_mpi(),  # mpi4py, MPI library, MPI standard, thread level
        "torch": _version("torch"),
    }
    try:
        from mpiring.backends.gpu import describe_gpu_stack

        facts.update(describe_gpu_stack())
    except ImportError:
        facts["GPU"] = "GPU support not built in this version"
    return facts
