"""GPU buffers: CUDA-aware MPI detection, host staging, and the GPU facts for ``info``.

A collective on a CUDA buffer (a CuPy array or a torch CUDA tensor) takes one of
three paths, chosen per call by ``device_plan``:

* **NCCL backend**: the backend enqueues everything (NCCL calls and the ring's
  reductions) on its own CUDA stream; see ``mpiring.backends.nccl``.
* **MPI backend, CUDA-aware MPI**: device pointers go to MPI as they are and the
  ring reduces on the GPU. MPI reads device memory behind the stream's back, so
  the caller's stream is synchronized first and before every message (the MPI
  backend does the latter in ``_bytes``).
* **MPI backend, MPI not CUDA-aware**: the buffer is copied once per collective
  to pinned host memory, the whole collective runs there (reductions included),
  and the result is copied back. Such an MPI never sees a device pointer: it
  would dereference it on the host and crash the job.

Whether the MPI library is CUDA-aware comes from ``MPIX_Query_cuda_support()``
(an extension of Open MPI and MPICH, called through ctypes on the libmpi that
mpi4py loaded; mpi4py has no wrapper for it). ``MPIRING_CUDA_AWARE=1`` or ``0``
overrides the probe, for an MPI that is CUDA-aware but does not say so, or to
force staging. A wrong ``1`` crashes the job at the first message.

Stream rule, for every path: when a collective returns, its result is ready for
work queued afterwards on the caller's current stream (CuPy's current stream,
and for a torch tensor also torch's current stream on its device). The host is
not blocked unless the path needs it (staging and CUDA-aware MPI are blocking;
NCCL is not): read the result from the host through that stream (``x.get()``,
``t.cpu()``) or synchronize it.

Nothing here imports CuPy at module level: the CPU-only installation imports
this module (``python -m mpiring info``) and must not need CuPy.
"""

from __future__ import annotations

import ctypes
import os
import re
import warnings
import weakref
from dataclasses import replace
from typing import Any

import numpy as np

from mpiring.core.buffers import Buffer, bfloat16
from mpiring.runtime.env import FALSE, TRUE

#: Environment variable that overrides the CUDA-awareness probe (1/0, or "auto").
CUDA_AWARE_ENV = "MPIRING_CUDA_AWARE"

GPU_INSTALL_HINT = ('pip install "mpiring[gpu]" (CUDA 12; "mpiring[gpu13]" for CUDA 13), '
                    "or run with --backend mpi")


# --- CuPy, imported lazily and quietly ---------------------------------------------
def import_cupy() -> tuple[Any | None, str | None]:
    """``(cupy, None)``, or ``(None, reason)`` when CuPy cannot be imported."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed"
    except Exception as exc:  # noqa: BLE001 - a broken install must not become a traceback
        return None, f"CuPy failed to import ({_one_line(exc)})"
    return cupy, None


def import_nccl() -> tuple[Any | None, str | None]:
    """``(cupy.cuda.nccl, None)``, or ``(None, reason)`` when NCCL cannot be used."""
    cupy, reason = import_cupy()
    if cupy is None:
        return None, reason
    try:
        # Without libnccl, CuPy still imports the module but warns and leaves
        # only ``available = False`` in it: check that flag, quietly.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001
        return None, f"NCCL library not found ({_one_line(exc)})"
    if not getattr(nccl, "available", False):
        return None, "NCCL library not found (cupy.cuda.nccl.available is False)"
    return nccl, None


def nccl_version_tuple(code: int) -> tuple[int, int, int]:
    """Decode ``ncclGetVersion``: 2.10.3 is 21003 (NCCL >= 2.9), 2.8.4 was 2804."""
    code = int(code)
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


# --- CUDA-aware MPI ----------------------------------------------------------------
def loaded_libmpi_paths(maps: str | None = None) -> list[str]:
    """Paths of the MPI libraries mapped into this process (from /proc/self/maps).

    mpi4py loads libmpi with RTLD_LOCAL, so its symbols are not in the global
    namespace; the library has to be opened again by path.
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as fh:
                maps = fh.read()
        except OSError:
            return []
    found: list[str] = []
    for line in maps.splitlines():
        path = line.split(None, 5)[-1] if line.count(" ") >= 5 else ""
        name = os.path.basename(path)
        # libmpi.so.12 (MPICH), libmpi.so.40 (Open MPI), libmpich.so; not the
        # Fortran/C++ bindings (libmpi_mpifh, libmpi_cxx) nor the ABI shim.
        if re.fullmatch(r"lib(mpi|mpich)\.so(\.\d+)*", name) and path not in found:
            found.append(path)
    return found


def query_cuda_support(lib: Any) -> bool | None:
    """Call ``MPIX_Query_cuda_support()`` in ``lib``: True/False, or None if it lacks it."""
    fn = getattr(lib, "MPIX_Query_cuda_support", None)
    if fn is None:
        return None
    try:
        fn.restype = ctypes.c_int
        fn.argtypes = []
    except (AttributeError, TypeError):  # a plain Python callable (tests)
        pass
    return bool(fn())


def probe_cuda_aware(libs: list[Any] | None = None) -> tuple[bool | None, str]:
    """Ask the loaded MPI library whether it is CUDA-aware.

    Returns:
        ``(answer, how)``: answer is None when the library has no
        ``MPIX_Query_cuda_support`` (then it is treated as not CUDA-aware).
    """
    if libs is None:
        from mpi4py import MPI  # noqa: F401 - make sure libmpi is loaded and initialized

        libs = []
        for path in loaded_libmpi_paths():
            try:
                libs.append(ctypes.CDLL(path))
            except OSError:
                continue
        try:
            libs.append(ctypes.CDLL(None))  # an MPI linked into the executable
        except OSError:
            pass
    for lib in libs:
        answer = query_cuda_support(lib)
        if answer is not None:
            return answer, "MPIX_Query_cuda_support()"
    return None, "the MPI library has no MPIX_Query_cuda_support()"


_AWARE: tuple[bool, str] | None = None


def cuda_aware_mpi(refresh: bool = False) -> tuple[bool, str]:
    """Whether device pointers may be given to this MPI, and why we think so.

    ``MPIRING_CUDA_AWARE`` = 1/0 decides; unset or "auto" asks the library
    (cached after the first call). A library that cannot answer is treated as
    not CUDA-aware: staging is slower, a wrong guess segfaults.
    """
    global _AWARE
    value = os.environ.get(CUDA_AWARE_ENV, "").strip().lower()
    if value in TRUE:
        return True, f"{CUDA_AWARE_ENV}={value}"
    if value in FALSE:
        return False, f"{CUDA_AWARE_ENV}={value}"
    if value not in ("", "auto"):
        raise ValueError(f"{CUDA_AWARE_ENV}={value!r}: use 1, 0 or auto")
    if _AWARE is None or refresh:
        answer, how = probe_cuda_aware()
        _AWARE = (bool(answer), how)
    return _AWARE


# --- per-collective plans for device buffers -----------------------------------------
class _Plan:
    """What a collective does around its dispatch: ``enter`` before, ``leave`` after."""

    path = "host"

    def enter(self, buf: Buffer) -> Buffer:
        return buf

    def leave(self) -> None:
        pass

    def abandon(self) -> None:
        """The collective raised midway: undo ``enter`` without ``leave``'s work."""


class _BackendPlan(_Plan):
    """The NCCL backend: it switches to its stream and back (``begin``/``end``)."""

    path = "nccl"

    def __init__(self, be):
        self.be = be

    def enter(self, buf: Buffer) -> Buffer:
        self.be.begin(buf)
        return buf

    def leave(self) -> None:
        self.be.end()

    def abandon(self) -> None:
        self.be.abandon()


class _PassThrough(_Plan):
    """CUDA-aware MPI: device pointers go to MPI; the host waits for the GPU."""

    path = "cuda-aware"

    def enter(self, buf: Buffer) -> Buffer:
        # MPI reads device memory without looking at any stream: the kernels
        # that produced the buffer must have finished.
        cuda_ops().current_stream().synchronize()
        return buf

    def leave(self) -> None:
        # The ring's reductions (and avg's division) are queued on the current
        # stream; finishing them here makes the result safe for any stream.
        cuda_ops().current_stream().synchronize()


class _Staged(_Plan):
    """Non-CUDA-aware MPI: one copy to pinned host memory and one back per collective."""

    path = "staged"

    def __init__(self, pinned: _PinnedBuffer):
        self.pinned = pinned
        self.buf: Buffer | None = None
        self.stream = None

    def enter(self, buf: Buffer) -> Buffer:
        ops = cuda_ops()
        self.buf = buf
        host = self.pinned.take(buf.nbytes).view(host_dtype(buf.dtype))
        if buf.nbytes:
            self.stream = ops.current_stream()
            ops.copy(host.ctypes.data, device_pointer(buf.array), buf.nbytes, "d2h", self.stream)
            self.stream.synchronize()  # MPI reads the host copy next
        return replace(buf, array=host, device="cpu")

    def abandon(self) -> None:
        # No copy back: the host copy holds a half-finished reduction, and the
        # caller's buffer keeps its own bytes.
        self.buf = None

    def leave(self) -> None:
        buf, self.buf = self.buf, None
        if buf is None or not buf.nbytes:
            return
        ops = cuda_ops()
        host = self.pinned.array
        ops.copy(device_pointer(buf.array), host.ctypes.data, buf.nbytes, "h2d", self.stream)
        # Ordered on the caller's stream; the pinned buffer may be refilled only
        # once this copy has read it (``take`` waits for the event).
        self.pinned.event = ops.record(self.stream)
        if buf.kind == "torch":
            ops.torch_wait(buf.obj, self.pinned.event)


class _PinnedBuffer:
    """A growing page-locked host buffer, reused by every staged collective of a backend."""

    def __init__(self):
        self.array = np.empty(0, dtype=np.uint8)
        self.event = None

    def take(self, nbytes: int) -> np.ndarray:
        if self.event is not None:  # the last copy back may still be reading it
            self.event.synchronize()
            self.event = None
        if self.array.size < nbytes:
            self.array = cuda_ops().alloc_pinned(max(nbytes, 2 * self.array.size))
        return self.array[:nbytes]


_PINNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def device_plan(be, buf: Buffer, collective: str, algo: str, op: str | None) -> _Plan:
    """Choose how a collective handles ``buf`` on backend ``be``; raise TypeError if it cannot.

    Called by the Communicator while it validates a call (before any data
    moves) for every CUDA buffer, and for every buffer on a backend that
    takes device memory (NCCL).
    """
    if getattr(be, "accepts_cuda", False):
        be.check_buffer(buf, collective, algo, op)
        return _BackendPlan(be)
    if buf.device != "cuda":
        return _Plan()
    # Load the CUDA calls now, while every rank can still agree to stop: failing
    # in enter(), after the argument check, would leave the other ranks waiting.
    try:
        cuda_ops()
    except ImportError as exc:
        raise TypeError(f"{collective}: a CUDA buffer on the MPI backend needs CuPy: "
                        f"{GPU_INSTALL_HINT}") from exc
    aware, _ = cuda_aware_mpi()
    if aware:
        return _PassThrough()
    pinned = _PINNED.get(be)
    if pinned is None:
        pinned = _PINNED[be] = _PinnedBuffer()
    return _Staged(pinned)


def host_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a canonical dtype name (bfloat16 through ml_dtypes)."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def device_pointer(a) -> int:
    """The device address of a CUDA array (``__cuda_array_interface__``)."""
    return int(a.__cuda_array_interface__["data"][0])


def device_ready(a) -> None:
    """Block until the current stream's work is done, before MPI touches device array ``a``.

    Used by the MPI backend when a CUDA-aware MPI gets a device buffer: the
    ring's last reduction into it may still be queued.
    """
    if hasattr(a, "__cuda_array_interface__"):
        cuda_ops().current_stream().synchronize()


def empty_like_device(like, n: int):
    """An uninitialized device array of ``n`` elements of ``like``'s dtype (CuPy)."""
    cupy, reason = import_cupy()
    if cupy is None:  # pragma: no cover - a CUDA buffer implies CuPy
        raise TypeError(f"{reason}: {GPU_INSTALL_HINT}")
    return cupy.empty(n, dtype=like.dtype)


class _CupyOps:
    """The few CUDA runtime calls staging makes, in one place (tests replace it)."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        rt = cupy.cuda.runtime
        self._kinds = {"d2h": rt.memcpyDeviceToHost, "h2d": rt.memcpyHostToDevice}

    def current_stream(self):
        return self.cupy.cuda.get_current_stream()

    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def copy(self, dst: int, src: int, nbytes: int, kind: str, stream) -> None:
        self.cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, self._kinds[kind], stream.ptr)

    def record(self, stream):
        return stream.record()

    def torch_wait(self, tensor, event) -> None:
        """Make torch's current stream on ``tensor``'s device wait for ``event``."""
        import torch

        ts = torch.cuda.current_stream(tensor.device)
        if ts.cuda_stream != self.current_stream().ptr:
            # By the stream's handle: CuPy 14 deprecates ExternalStream (a
            # DeprecationWarning on every staged collective on a torch tensor).
            self.cupy.cuda.runtime.streamWaitEvent(ts.cuda_stream, event.ptr)


_OPS: Any = None


def cuda_ops():
    """The CUDA calls used by staging (``_CupyOps``), created on first use."""
    global _OPS
    if _OPS is None:
        _OPS = _CupyOps()
    return _OPS


# --- facts for `python -m mpiring info` ------------------------------------------------
def describe_gpu_stack() -> dict[str, str]:
    """CuPy, CUDA, GPUs, NCCL and CUDA-aware MPI, as human-readable lines; never raises."""
    facts: dict[str, str] = {}
    cupy, reason = import_cupy()
    if cupy is None:
        facts["CuPy"] = f"{reason} (GPU buffers and --backend nccl need it: {GPU_INSTALL_HINT})"
    else:
        facts["CuPy"] = getattr(cupy, "__version__", "installed")
        facts.update(_describe_devices(cupy))
    facts["NCCL"] = _describe_nccl(cupy)
    try:
        aware, how = cuda_aware_mpi()
        facts["CUDA-aware MPI"] = (
            f"yes ({how}): device buffers go to MPI directly" if aware else
            f"no ({how}): CUDA buffers on --backend mpi are staged through pinned host "
            f"memory; {CUDA_AWARE_ENV}=1 overrides")
    except Exception as exc:  # noqa: BLE001 - report, never fail
        facts["CUDA-aware MPI"] = f"unknown ({_one_line(exc)})"
    return facts


def _describe_devices(cupy) -> dict[str, str]:
    facts = {}
    try:
        rt = cupy.cuda.runtime
        facts["CUDA runtime"] = _cuda_version(rt.runtimeGetVersion())
        facts["CUDA driver"] = _cuda_version(rt.driverGetVersion())
    except Exception as exc:  # noqa: BLE001
        facts["CUDA runtime"] = f"unavailable ({_one_line(exc)})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        names = []
        for i in range(n):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props.get("name", b"?")
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            names.append(f"{i}: {name}, {props.get('totalGlobalMem', 0) / 2**30:.0f} GiB")
        facts["GPUs"] = f"{n} ({'; '.join(names)})" if n else "none"
    except Exception as exc:  # noqa: BLE001
        facts["GPUs"] = f"none usable ({_one_line(exc)})"
    return facts


def _cuda_version(code: int) -> str:
    return f"{code // 1000}.{code % 1000 // 10}"


def _describe_nccl(cupy) -> str:
    if cupy is None:
        wheel = _dist_version(("nvidia-nccl-cu13", "nvidia-nccl-cu12"))
        return f"{wheel}, unusable without CuPy" if wheel else "not available (needs CuPy)"
    nccl, reason = import_nccl()
    if nccl is None:
        return f"{reason}: pip install nvidia-nccl-cu12 (or -cu13), or use --backend mpi"
    try:
        major, minor, patch = nccl_version_tuple(nccl.get_version())
    except Exception as exc:  # noqa: BLE001
        return f"loaded, version unknown ({_one_line(exc)})"
    text = f"{major}.{minor}.{patch}"
    if (major, minor) >= (2, 30):
        text += "; 2 ranks per GPU allowed with NCCL_MULTI_RANK_GPU_ENABLE=1"
    else:
        text += "; one rank per GPU (NCCL >= 2.30 allows 2 with NCCL_MULTI_RANK_GPU_ENABLE=1)"
    return text


def _dist_version(names) -> str | None:
    from importlib import metadata

    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None



def to_host(a) -> np.ndarray:
    """A host copy of device array ``a``, complete on return (point-to-point staging)."""
    cuda_ops().current_stream().synchronize()  # the kernels that produced ``a`` first
    return a.get()


def from_host(a, host: np.ndarray) -> None:
    """Copy ``host`` into device array ``a``, complete on return (point-to-point staging)."""
    a.set(host)
    cuda_ops().current_stream().synchronize()


# --- the GPU of a rank, for the command-line tools ---------------------------------------
def usable_devices() -> tuple[int, str | None]:
    """``(number of CUDA devices, None)``, or ``(0, reason)`` without CuPy or a device;
    never raises."""
    cupy, reason = import_cupy()
    if cupy is None:
        return 0, reason
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - a missing driver is an answer, not a crash
        return 0, f"no usable CUDA device ({type(exc).__name__})"
    return (n, None) if n > 0 else (0, "no CUDA device")


def use_device(local_rank: int) -> int:
    """Make GPU ``local_rank % count`` CuPy's current device (one GPU per rank of a host,
    round robin); returns its index."""
    cupy = _cupy_or_raise()
    index = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(index).use()
    return index


def synchronize_device() -> None:
    """Block until the current device has finished everything queued on it."""
    _cupy_or_raise().cuda.Device().synchronize()


def to_device(host: np.ndarray):
    """A CuPy copy of ``host`` on the current device."""
    return _cupy_or_raise().array(host)


def _cupy_or_raise():
    cupy, reason = import_cupy()
    if cupy is None:
        raise TypeError(f"{reason}: {GPU_INSTALL_HINT}")
    return cupy
