"""Array adapters: NumPy arrays, torch tensors (CPU or CUDA) and CuPy arrays.

Every collective works on one flat, contiguous view of the caller's memory,
obtained without a copy:

* NumPy arrays are used as they are (``reshape(-1)`` of a contiguous array is a
  view).
* torch CPU tensors go through DLPack to NumPy (``numpy.from_dlpack``). NumPy
  has no bfloat16, and DLPack refuses to export one to NumPy, so a bfloat16
  tensor is exported as int16 and viewed as ``ml_dtypes.bfloat16``: same bytes,
  and NumPy ufuncs then add them as bfloat16.
* CuPy arrays are used as they are; torch CUDA tensors go through DLPack to
  CuPy (``cupy.from_dlpack``), also zero-copy.

All validation happens here, before any byte moves, so a bad buffer raises the
same error on the rank that has it; the communicator then makes every rank
agree (see ``Communicator._agree``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_BFLOAT16: np.dtype | None = None


def bfloat16() -> np.dtype:
    """NumPy's bfloat16 (``ml_dtypes.bfloat16``), imported on first use.

    Not at import: loading ml_dtypes is most of the package's import time, paid
    by every rank of every launch, and only a bfloat16 buffer needs it.

    Raises:
        TypeError: ml_dtypes is not installed (it is a default dependency).
    """
    global _BFLOAT16
    if _BFLOAT16 is None:
        try:
            import ml_dtypes
        except ImportError as exc:  # pragma: no cover - a default dependency
            raise TypeError("bfloat16 on the CPU needs ml_dtypes: pip install ml_dtypes") from exc
        _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
    return _BFLOAT16


def __getattr__(name: str):
    # ``BFLOAT16``, as a constant, for the code that imports it: loaded when asked for.
    if name == "BFLOAT16":
        try:
            return bfloat16()
        except TypeError:  # pragma: no cover
            return None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a microsecond per collective
class Buffer:
    """A flat contiguous view of a caller's buffer.

    Attributes:
        obj: what the caller passed.
        array: flat NumPy or CuPy array over the same memory.
        dtype: canonical dtype name, one of ``DTYPES``.
        device: "cpu" or "cuda".
        kind: "numpy", "torch" or "cupy": what ``obj`` is.
    """

    obj: Any
    array: Any
    dtype: str
    device: str
    kind: str

    @property
    def count(self) -> int:
        return self.array.size  # a Python int for NumPy and CuPy

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def floating(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def chunk(self, start: int, stop: int):
        """Elements ``[start, stop)`` of the flattened buffer, as the caller's type."""
        return self.obj.reshape(-1)[start:stop]


def _dtype_error(name: str) -> TypeError:
    return TypeError(
        f"unsupported dtype {name}: mpiring reduces {', '.join(DTYPES)}; "
        "cast the buffer to one of them (e.g. x.astype(numpy.float32))"
    )


_CANONICAL: dict[Any, str] = {}


def _canonical(dtype) -> str:
    name = _CANONICAL.get(dtype)  # every collective asks: one lookup after the first
    if name is None:
        # ml_dtypes' bfloat16 is named "bfloat16"; an array of it means ml_dtypes is loaded.
        name = np.dtype(dtype).name
        _CANONICAL[dtype] = name
    return name


def _layout_error(x: np.ndarray) -> ValueError | None:
    """Why the bytes of ``x`` cannot travel as they are (None: they can)."""
    # A byte-swapped array would be summed as native numbers: a silent wrong
    # result on the ring, a BufferError inside MPI on the native path.
    if not x.dtype.isnative:
        return ValueError(
            f"buffer has non-native byte order ({x.dtype.str}): the ring would add its "
            'bytes as native numbers; pass x.astype(x.dtype.newbyteorder("=")) and read '
            "the result from that array")
    # MPI's typed collectives cannot map an unaligned view (a float32 at a byte
    # offset), and the ring's element loads on it are slow on some CPUs.
    if not x.flags.aligned:
        return ValueError(
            "buffer is not aligned to its dtype (a view at a byte offset): pass x.copy() "
            "(an aligned copy) and read the result from that array")
    return None


def _from_numpy(x: np.ndarray) -> Buffer:
    name = _canonical(x.dtype)
    if name not in DTYPES:
        raise _dtype_error(name)
    flags = x.flags  # one flags object for the three tests (each access makes one)
    if not (flags.aligned and x.dtype.isnative):
        raise _layout_error(x)
    if not flags.c_contiguous:
        raise ValueError(
            "buffer is not contiguous: collectives work in place on contiguous memory; "
            "pass numpy.ascontiguousarray(x) and read the result from that array"
        )
    if not flags.writeable:
        raise ValueError(
            "buffer is read-only: collectives write their result in place; pass a "
            "writable array (x.copy(), or x.setflags(write=True) if you own the memory)"
        )
    return Buffer(x, x.reshape(-1), name, "cpu", "numpy")


def _from_torch(x) -> Buffer:
    import torch

    name = str(x.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise _dtype_error(name)
    if x.requires_grad:
        raise ValueError(
            "tensor requires grad: a collective writes in place, which autograd cannot "
            "track; pass x.detach() (or reduce x.grad instead of the parameter)"
        )
    if not x.is_contiguous():  # a sparse tensor lands here too: name its real problem
        if x.layout != torch.strided:
            # A sparse tensor has no flat run of values to reduce in place; its
            # values and indices differ in length across ranks.
            raise ValueError(
                f"tensor is sparse ({x.layout}): collectives reduce dense memory in place; "
                "pass x.to_dense() and read the result from that tensor")
        raise ValueError(
            "tensor is not contiguous: collectives work in place on contiguous memory; "
            "pass x.contiguous() and read the result from that tensor"
        )
    flat = x.reshape(-1)
    if x.device.type == "cpu":
        if name == "bfloat16":
            array = np.from_dlpack(flat.view(torch.int16)).view(bfloat16())
        else:
            array = np.from_dlpack(flat)
        return Buffer(x, array, name, "cpu", "torch")
    if x.device.type == "cuda":
        cupy = _import_cupy()
        try:
            array = _cuda_from_dlpack(torch, cupy, flat)
        except (TypeError, NotImplementedError) as exc:
            # Only what CuPy raises for a dtype it cannot map (NotImplementedError
            # from CuPy 13/14, TypeError before): a BufferError is torch refusing
            # the export, which is no matter of CuPy's version.
            if name != "bfloat16":
                raise
            raise TypeError(
                "this CuPy cannot take a bfloat16 CUDA tensor through DLPack: upgrade to "
                "CuPy >= 14 with ml_dtypes installed, or cast the tensor to float16/float32"
            ) from exc
        return Buffer(x, array, name, "cuda", "torch")
    raise TypeError(f"tensors on device {x.device} are not supported: use a CPU or CUDA tensor")


def _cuda_from_dlpack(torch, cupy, flat):
    """``cupy.from_dlpack(flat)``, with torch's current device made ``flat``'s first.

    torch's ``__dlpack__`` refuses a tensor that is not on torch's current device
    ("Can't export tensors on a different CUDA device index", torch/_tensor.py),
    and synchronizes that device's current stream with CuPy's. CuPy sets the
    CUDA runtime's device before asking, but torch's current device can differ
    from the runtime's: after a device guard it keeps a lazily-set target index
    when the old device has no context (``MaybeSetDevice``, c10/cuda), so a tensor
    on cuda:1 in a process that never called ``torch.cuda.set_device(1)`` would
    be refused.
    """
    if torch.cuda.current_device() == flat.device.index:
        return cupy.from_dlpack(flat)
    with torch.cuda.device(flat.device):
        return cupy.from_dlpack(flat)


def _import_cupy():
    try:
        import cupy
    except ImportError as exc:
        raise TypeError(
            'CUDA buffers need CuPy: pip install "mpiring[gpu]"'
        ) from exc
    return cupy


def _from_cupy(x) -> Buffer:
    name = _canonical(x.dtype)
    if name not in DTYPES:
        raise _dtype_error(name)
    if not x.flags.c_contiguous:
        raise ValueError(
            "buffer is not contiguous: collectives work in place on contiguous memory; "
            "pass cupy.ascontiguousarray(x) and read the result from that array"
        )
    return Buffer(x, x.reshape(-1), name, "cuda", "cupy")


def as_buffer(x: Any) -> Buffer:
    """Wrap ``x`` as a flat contiguous view, or raise TypeError/ValueError naming the fix."""
    if isinstance(x, np.ndarray):
        return _from_numpy(x)
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return _from_torch(x)
    if module == "cupy":
        return _from_cupy(x)
    if hasattr(type(x), "__cuda_array_interface__"):
        # Another library's GPU array (Numba, JAX...): CuPy wraps it without a copy.
        raise TypeError(
            f"unsupported GPU array type {type(x).__name__}: pass a cupy array or a torch "
            "CUDA tensor; cupy.asarray(x) wraps this one without a copy"
        )
    raise TypeError(
        f"unsupported buffer type {type(x).__name__}: pass a numpy array, a torch "
        "tensor or a cupy array"
    )
