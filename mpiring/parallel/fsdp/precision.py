"""Mixed precision for FSDP: compute copies of the full-precision shards in another dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype`` (gathered copies of full-precision shards).

    Args:
        param_dtype: dtype of the gathered parameters (torch.bfloat16 or float16).
        reduce_dtype: dtype the gradients are reduce-scattered in (default
            ``param_dtype``; torch.float32 sums more exactly).
        cast_forward_inputs: cast floating-point inputs of the model to
            ``param_dtype``.
    """

    param_dtype: torch.dtype = torch.bfloat16
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
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj
