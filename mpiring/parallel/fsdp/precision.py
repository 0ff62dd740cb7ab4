"""Mixed precision for FSDP: compute copies of the full-precision shards in another dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype`` (gathered copies of full-precision shards).

    Args:
        param_dtype: dtype of the gathered parameters (torch.bfloat16 or float16;
            None: the parameters' own, as torch's ``MixedPrecisionPolicy`` and
            ``MixedPrecision``, so that ``MixedPrecision(reduce_dtype=...)`` alone
            changes only the reduction).
        reduce_dtype: dtype the gradients are reduce-scattered in (default
            ``param_dtype``; torch.float32 sums more exactly).
        cast_forward_inputs: cast floating-point inputs of the model and of every
            unit to ``param_dtype`` (torch FSDP2's per-module cast: an activation
            that a float32 buffer promoted on the way reaches a unit in its dtype).
    """

    # None, not bfloat16: torch's policies default to no cast, and a port that names
    # only reduce_dtype must not start computing in bfloat16 without a word.
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def _mixed(mp) -> MixedPrecision | None:
    if mp is None or isinstance(mp, MixedPrecision):
        return mp
    if isinstance(mp, torch.dtype):
        return MixedPrecision(param_dtype=mp)
    raise TypeError(f"mixed_precision={mp!r}: pass a torch dtype (torch.bfloat16) or "
                    "mpiring.parallel.fsdp.MixedPrecision(param_dtype=..., reduce_dtype=...)")


def _cast(obj, dtype):
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes its fields apart
        return type(obj)(*(_cast(o, dtype) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj
