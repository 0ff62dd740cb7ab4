"""Data parallelism on mpiring's collectives: bucketed DDP, a parameter server, a sampler.

    from mpiring.parallel.data import DistributedDataParallel, ParameterServer, DistributedSampler

``bucketing`` is pure Python; the rest needs torch, imported on first use.
"""

from __future__ import annotations

__all__ = ["DistributedDataParallel", "DistributedSampler", "ParameterServer", "Reducer"]

_WHERE = {
    "DistributedDataParallel": "distributed",
    "DistributedSampler": "sampler",
    "ParameterServer": "ps",
    "Reducer": "reducer",
}


def __getattr__(name: str):
    # torch is optional for the rest of mpiring: import it only when asked.
    if name in _WHERE:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
