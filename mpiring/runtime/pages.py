"""Large host buffers on transparent huge pages.

MPICH moves a large message between two processes of one host with a single
copy: the receiver reads the sender's memory (``process_vm_readv``, "CMA"),
the kernel looking up and pinning the sender's pages as it goes, and the ring's
additions then stream through the same buffers. The page size shows: with 2
MiB pages the kernel looks up and pins 512 times fewer pages per message than
with torch's 4 KiB ones (docs/design-notes.md has the measurement).
NumPy already asks for huge pages for its large arrays (``madvise``); torch's
CPU allocator does not (unless ``THP_MEM_ALLOC_ENABLE=1`` is set).

So the buffers mpiring allocates itself and sends often (the DDP reducer's
buckets, ZeRO's flat parameters and gradients, the parameter server's
buckets) come from :func:`zeros`: an anonymous mapping, aligned to 2 MiB and
advised ``MADV_HUGEPAGE``, seen as a torch tensor. Where the system has no
transparent huge pages (``never``) the advice is a no-op; where Python has no
``MADV_HUGEPAGE`` (not Linux) or the buffer is under one huge page, it is a
plain ``torch.zeros``. ``MPIRING_HUGE_PAGES=0`` turns it off.

Your own tensors can live there too: ``mpiring.runtime.pages.zeros(n, torch.float32)``.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from mpiring.runtime.env import env_switch

#: The huge-page size (x86-64 and most aarch64 kernels).
HUGE_PAGE = 2 << 20


def enabled() -> bool:
    """Whether :func:`zeros` maps huge pages (``MPIRING_HUGE_PAGES``, default on)."""
    return (env_switch("MPIRING_HUGE_PAGES", "use 1 (huge pages, the default) or 0")
            and hasattr(mmap, "MADV_HUGEPAGE"))


def thp_mode() -> str:
    """The system's transparent-huge-page setting ("always", "madvise", "never"), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def describe() -> str:
    """One line for a bench header: whether :func:`zeros` maps huge pages here, and why not."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "4 KiB pages (no MADV_HUGEPAGE on this system)"
    if not enabled():
        return "4 KiB pages (MPIRING_HUGE_PAGES=0)"
    mode = thp_mode()
    if mode == "never":
        return "4 KiB pages (transparent huge pages are off: never)"
    return f"huge pages advised (transparent huge pages: {mode})"


def zeros(numel: int, dtype, device=None):
    """A zero-filled 1-D torch tensor of ``numel`` elements, on huge pages when on the host.

    CUDA tensors and buffers under one huge page are plain ``torch.zeros``. The
    mapping is freed when the last tensor or view of it goes away.
    """
    import torch

    device = torch.device("cpu" if device is None else device)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes < HUGE_PAGE or not enabled():
        return torch.zeros(numel, dtype=dtype, device=device)
    # One huge page more than needed, so that the tensor can start on a 2 MiB
    # boundary (the kernel maps huge pages only on aligned 2 MiB ranges). The
    # slack is never touched, so it costs address space, not memory.
    # Private: a shared anonymous mapping is shmem, which THP leaves alone.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    try:  # whole huge pages only: the last partial one stays 4 KiB pages, not 2 MiB resident
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
    except OSError:  # pragma: no cover - a kernel without THP: ordinary pages
        pass
    # The tensor keeps the NumPy view alive, and the view the mapping.
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc accepts on 64-bit hosts.
MMAP_THRESHOLD_MAX = 32 << 20


def steady_malloc(mmap_threshold: int = MMAP_THRESHOLD_MAX, trim_threshold: int = 256 << 20) -> bool:
    """Let glibc keep freed tensor memory for the next training step; True if it took effect.

    torch's CPU tensors come from ``malloc``. Under glibc's defaults a block of
    128 KiB or more is a fresh ``mmap`` and goes back to the kernel when freed,
    until the first such block is freed: glibc then raises its threshold to
    that block's size. So whether every step's gradients and optimizer
    temporaries page-fault in again (zeroed by the kernel) depends on what the
    process freed before, and step times with it (docs/design-notes.md).

    ``mpiring train``, ``bench-ddp``, ``zero-bench`` and ``hook-curves`` call
    this at start, so that every mode they compare runs with the same
    allocator state. It does nothing when ``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` or ``GLIBC_TUNABLES`` is set (yours win), when
    ``MPIRING_STEADY_MALLOC=0``, or without glibc. The price: up to
    ``trim_threshold`` bytes of freed memory stay mapped.
    """
    env = os.environ
    if not env_switch("MPIRING_STEADY_MALLOC", "use 1 (the default) or 0") or any(
            k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Trim first: setting either one turns glibc's dynamic adjustment off.
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold)
                and mallopt(_M_MMAP_THRESHOLD, mmap_threshold))
