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
    from mpi4py import MPI

    import mpiring

    levels = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
              MPI.THREAD_SERIALIZED: "SERIALIZED", MPI.THREAD_MULTIPLE: "MULTIPLE"}
    facts = {
        "mpiring": mpiring.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "numpy": _version("numpy"),
        "mpi4py": _version("mpi4py"),
        "MPI library": MPI.Get_library_version().strip().splitlines()[0],
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "torch": _version("torch"),
    }
    try:
        from mpiring.backends.gpu import describe_gpu_stack

        facts.update(describe_gpu_stack())
    except ImportError:
        facts["GPU"] = "GPU support not built in this version"
    return facts
