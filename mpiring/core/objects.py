"""Python objects as bytes without pickle: what the ``*_object`` calls send.

torch.distributed pickles the objects of ``all_gather_object`` and its
siblings, and unpickling runs whatever code the bytes name. Here a closed set
of types is written as tagged JSON and exactly those types are rebuilt, so a
peer's bytes can make values but never run code:

* ``None``, ``bool``, ``int``, ``float`` (nan and inf too), ``str``, ``list``:
  as JSON has them;
* ``tuple``, ``dict`` (keys of any of these types), ``set``, ``frozenset``,
  ``bytes``: tagged, so each comes back as itself (JSON alone would turn a
  tuple into a list and an int key into a string);
* NumPy arrays and scalars of bool, integer, float and complex dtypes, and
  torch tensors (rebuilt on the CPU, or on ``device``, requiring grad where the
  sent leaf did): dtype, shape and raw bytes, so every value and NaN comes back
  bit-for-bit.

Only these exact types: a subclass (an ``OrderedDict``, a namedtuple, an
``IntEnum``, a ``Parameter``) or anything else is refused with where it sits and how to
convert it, before any byte moves.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np

TAG = "~"  # every non-JSON value is {"~": kind, ...}; plain dicts are tagged too
_SCALARS = (type(None), bool, int, float, str)
_NP_KINDS = "biufc"  # bool, signed, unsigned, float, complex: no object or string dtype
# torch dtypes by name, both ways; a peer names one of these or the object is refused.
_TORCH_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                 "float32", "float64", "complex64", "complex128")
TYPES = ("None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, NumPy "
         "arrays and scalars of number dtypes, torch tensors")


def encode(obj: Any, where: str = "obj") -> bytes:
    """``obj`` as bytes that ``decode`` turns back into an equal object.

    Raises:
        TypeError: ``obj`` holds something outside the types above; the message
            says where (``where`` names ``obj`` itself) and how to convert it.
    """
    return json.dumps(_enc(obj, where), separators=(",", ":")).encode()


def decode(data: bytes, device: Any = None) -> Any:
    """The object that ``encode`` wrote; tensors are put on ``device`` (None: the CPU).

    Raises:
        ValueError: the bytes are not such an encoding (nothing is run either way),
            whatever in them is wrong: a tag, a dtype, a length, the nesting.
        DeviceError: ``device`` cannot hold the tensors.
    """
    try:
        return _dec(json.loads(data.decode()), device)
    except DeviceError:
        raise
    except RecursionError:
        raise ValueError("not an encoded object: nested too deeply") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError,
            OverflowError) as exc:
        raise ValueError(f"not an encoded object: {exc}") from None


class DeviceError(RuntimeError):
    """``decode``'s ``device`` cannot take the tensors (the bytes were fine)."""


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _enc(x: Any, where: str) -> Any:
    kind = type(x)
    if kind in _SCALARS:
        return x
    if kind is list:
        return _items(x, where)
    if kind is tuple:
        return {TAG: "tuple", "v": _items(x, where)}
    if kind is dict:
        return {TAG: "dict", "v": [[_enc(k, f"{where} key {k!r}"), _enc(v, f"{where}[{k!r}]")]
                                   for k, v in x.items()]}
    if kind in (set, frozenset):
        # In the set's own order: equal sets compare equal whatever the order.
        return {TAG: kind.__name__, "v": [_enc(v, f"{where} element") for v in x]}
    if kind is bytes:
        return {TAG: "bytes", "v": _b64(x)}
    if kind is np.ndarray or isinstance(x, np.generic):
        if x.dtype.kind not in _NP_KINDS or x.dtype.hasobject:
            raise _refused(x, where, f"a NumPy {x.dtype} value; send numbers, or convert "
                                     "the strings with .tolist()")
        arr = np.asarray(x)  # tobytes() writes C order whatever the strides
        return {TAG: "ndarray" if kind is np.ndarray else "npscalar", "dtype": arr.dtype.str,
                "shape": list(arr.shape), "v": _b64(arr.tobytes())}
    if _is_tensor(x):
        return _enc_tensor(x, where)
    hint = "convert it to those"
    if isinstance(x, tuple) and hasattr(x, "_asdict"):
        hint = "a namedtuple: send x._asdict() or tuple(x)"
    elif isinstance(x, dict):
        hint = "send dict(x)"
    elif isinstance(x, (bool, int, float, str, list, tuple)):
        hint = f"send {kind.__mro__[1].__name__}(x)"
    elif any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in kind.__mro__):
        hint = "send x.detach(), a plain tensor"
    elif hasattr(x, "__dataclass_fields__"):
        hint = "a dataclass: send dataclasses.asdict(x)"
    raise _refused(x, where, hint)


def _items(x: list | tuple, where: str) -> list:
    # Plain values go as they are: a list of a million numbers (gathered predictions)
    # must not build a million path strings that only an error would print.
    return [v if type(v) in _SCALARS else _enc(v, f"{where}[{i}]") for i, v in enumerate(x)]


def _refused(x: Any, where: str, hint: str) -> TypeError:
    kind = type(x)
    return TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}, which mpiring does "
                     f"not send: objects travel without pickle, as {TYPES}; {hint}")


def _is_tensor(x: Any) -> bool:
    kind = type(x)  # exactly torch.Tensor: a Parameter would come back as a plain tensor
    return kind.__module__ == "torch" and kind.__name__ == "Tensor"


def _enc_tensor(t: Any, where: str) -> dict:
    import torch

    name = str(t.dtype).rsplit(".", 1)[-1]
    if name not in _TORCH_DTYPES or t.is_sparse or t.is_quantized:
        raise _refused(t, where, f"a {t.dtype} tensor; send a dense tensor of "
                                 f"{', '.join(_TORCH_DTYPES)}")
    if t.requires_grad and not t.is_leaf:  # torch's pickling refuses it too
        raise _refused(t, where, "a tensor computed from others with grad; send t.detach()")
    if t.device.type == "meta":
        raise _refused(t, where, "a meta tensor has no data; send a real one")
    # A conjugate or negative view holds its bit lazily: the bytes must be the values.
    data = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    # Raw bytes through a 1-byte view: bfloat16 has no NumPy dtype of its own.
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return {TAG: "tensor", "dtype": name, "shape": list(data.shape), "v": _b64(raw),
            "grad": bool(t.requires_grad)}


def _dec(x: Any, device: Any) -> Any:
    if type(x) is list:
        return [_dec(v, device) for v in x]
    if type(x) is not dict:
        return x  # a JSON scalar
    kind, v = x[TAG], x.get("v")
    if kind in ("tuple", "dict", "set", "frozenset") and type(v) is not list:
        raise ValueError(f"a {kind} without its list")
    if kind == "tuple":
        return tuple(_dec(e, device) for e in v)
    if kind == "dict":
        if any(type(e) is not list or len(e) != 2 for e in v):
            raise ValueError("a dict entry that is not a [key, value] pair")
        return {_dec(k, device): _dec(e, device) for k, e in v}
    if kind == "set":
        return {_dec(e, device) for e in v}
    if kind == "frozenset":
        return frozenset(_dec(e, device) for e in v)
    if kind == "bytes":
        return base64.b64decode(v, validate=True)
    if kind in ("ndarray", "npscalar"):
        dtype = np.dtype(x["dtype"])
        if dtype.kind not in _NP_KINDS or dtype.hasobject:
            raise ValueError(f"dtype {dtype} is not a number dtype")
        raw = base64.b64decode(v, validate=True)
        shape = _shape(x["shape"], len(raw), dtype.itemsize)
        if kind == "npscalar" and shape:
            raise ValueError("a NumPy scalar with a shape")
        _bools(raw, dtype.kind == "b")
        arr = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()  # writable, as sent
        return arr if kind == "ndarray" else arr[()]
    if kind == "tensor":
        return _dec_tensor(x, device)
    raise ValueError(f"unknown kind {kind!r}")


def _shape(shape: Any, nbytes: int, itemsize: int) -> list[int]:
    """The sent shape, checked against the bytes that came with it."""
    if type(shape) is not list or any(type(n) is not int or not 0 <= n < 1 << 48
                                      for n in shape):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    count = 1
    for n in shape:
        count *= n
    if count * itemsize != nbytes:
        raise ValueError(f"shape {shape} of {itemsize}-byte elements came with {nbytes} bytes")
    return shape


def _dec_tensor(x: dict, device: Any) -> Any:
    import torch

    name = x["dtype"]
    if name not in _TORCH_DTYPES:
        raise ValueError(f"tensor dtype {name!r} is not one of {', '.join(_TORCH_DTYPES)}")
    dtype = getattr(torch, name)
    raw = bytearray(base64.b64decode(x["v"], validate=True))
    shape = _shape(x["shape"], len(raw), torch.empty(0, dtype=dtype).element_size())
    grad = x.get("grad") is True
    if grad and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"a {name} tensor cannot require grad")
    _bools(raw, dtype is torch.bool)
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if device is not None:
        try:
            t = t.to(device)
        except (RuntimeError, TypeError, ValueError) as exc:  # the caller's device, not the bytes
            raise DeviceError(f"device={device!r}: {exc}") from None
    return t.requires_grad_() if grad else t


def _bools(raw: bytes, is_bool: bool) -> None:
    """A bool is one byte, 0 or 1: any other byte would make a value no bool holds."""
    if is_bool and raw.strip(b"\x00\x01"):
        raise ValueError("a bool byte that is neither 0 nor 1")
