"""torch DDP's arguments, checked against what one process per device can honour.

``DistributedDataParallel`` takes torch's signature; this file decides what each
argument means here: which communicator (``process_group``, the old positional
``comm``, or the default one), and which device (``device_ids``,
``output_device``), refusing on every rank what cannot be honoured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_comm(x: Any) -> bool:
    """True for a Communicator (or a stand-in with collectives, rank and size)."""
    # A Communicator (or a stand-in): has collectives and a size. A list of device
    # ids, a torch.device or an int has neither.
    return hasattr(x, "all_reduce") and hasattr(x, "size") and hasattr(x, "rank")


def same_comm(a, b):
    """The one communicator of ``a`` and ``b`` (either may be None); two different ones: error."""
    if a is not None and b is not None and a is not b:
        raise ValueError("DistributedDataParallel: comm and process_group name different "
                         "communicators: pass one of them")
    return a if a is not None else b


def resolve_comm(comm):
    """``comm`` checked to be a Communicator, or the default one."""
    from mpiring.comm.default import resolve

    if comm is not None and not is_comm(comm):
        raise TypeError(f"DistributedDataParallel: process_group={comm!r} is not a "
                        "mpiring.Communicator: pass the one mpiring.init() or comm.split() "
                        "returned, or None for the default from mpiring.init_process_group()")
    return resolve(comm, "DistributedDataParallel")


def check_devices(comm, module: nn.Module, device_ids, output_device, dim,
                  problem: str | None = None) -> torch.device:
    """The module's one device; refuses, on every rank, device arguments that contradict it
    (or the caller's own ``problem`` with the other arguments, found on this rank)."""
    devices = {t.device for t in list(module.parameters()) + list(module.buffers())}
    device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
    if problem is not None:
        pass
    elif len(devices) > 1:
        problem = (f"the module's tensors are on {sorted(map(str, devices))}: move the whole "
                   "module to one device (one process per device)")
    elif device_ids is not None:
        ids = list(device_ids) if isinstance(device_ids, (list, tuple)) else None
        if device.type != "cuda":
            problem = (f"device_ids={device_ids!r} for a module on {device}: on the CPU pass "
                       "device_ids=None")
        elif ids is None or len(ids) != 1 or torch.device("cuda", _index(ids[0])) != device:
            problem = (f"device_ids={device_ids!r} for a module on {device}: pass "
                       f"[{device.index}] (one device per process: [local_rank], after "
                       "module.to(local_rank))")
    if problem is None and output_device is not None and (
            device.type != "cuda" or torch.device("cuda", _index(output_device)) != device):
        problem = (f"output_device={output_device!r} for a module on {device}: pass None (or "
                   "the module's own device); pass bucket_cap_mb= and the other options by "
                   "keyword")
    if problem is None and not isinstance(dim, int):
        problem = f"dim={dim!r}: pass an int (it is not used with one device per process)"
    flags = comm.control.allgather_json(problem) if comm.size > 1 else [problem]
    bad = [(r, p) for r, p in enumerate(flags) if p]
    if bad:
        raise ValueError("DistributedDataParallel: " + "; ".join(f"r{r}: {p}" for r, p in bad))
    return device


def _index(d) -> int | None:
    if isinstance(d, torch.device):
        return d.index if d.type == "cuda" else -1
    if isinstance(d, int):
        return d
    if isinstance(d, str):
        return _index(torch.device(d))
    return -1


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside tuples, lists and dicts moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(to_device(o, device) for o in obj)
    if isinstance(obj, list):
        return [to_device(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
