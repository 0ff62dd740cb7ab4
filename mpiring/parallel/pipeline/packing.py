"""Several tensors across one stage boundary: one message, unpacked as views.

A stage may hand the next one a tuple of tensors (hidden states and a mask,
say), as in ``torch.distributed.pipelining``; the next stage's forward takes
them as positional arguments. The runtime sends them as one message, so a
boundary costs one send and one receive whatever it carries, and the
validator's one-message-per-action programs stay as they are: the parts are
copied into one byte buffer, each at an offset aligned to ``ALIGN``, and the
receiver takes views of its buffer (no copy). The layout (each part's dtype
and shape) travels in the first step's header (``transport.header``), like a
single tensor's shape.

The gradients go back the same way: one message holding the gradient of each
floating-point or complex part, in order (integer and bool parts take none); both ends
know that layout from the forward's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpiring.parallel.pipeline import shared

#: Byte alignment of each part: the shared slots', a cache line, so that the views
#: are as aligned as a fresh tensor's data for the kernels that read them.
ALIGN = shared.ALIGN

#: The most tensors one boundary may carry (the first step's header has a row for each).
MAX_PARTS = 16

Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


class Packed(NamedTuple):
    """A packed boundary: ``data`` (uint8, 1-D) holds the parts described by ``layout``."""

    data: torch.Tensor
    layout: Layout


def spans(layout: Layout) -> tuple[list[tuple[int, int]], int]:
    """Each part's (offset, bytes) in the message, and the message's bytes."""
    out, offset = [], 0
    for dtype, shape in layout:
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append((offset, n))
        offset += shared._round(n)
    return out, offset


def differentiable(dtype: torch.dtype) -> bool:
    """Whether a part of ``dtype`` takes a gradient: floating point and complex, as
    autograd's rule is; integers and bool do not."""
    return dtype.is_floating_point or dtype.is_complex


def grad_layout(layout: Layout) -> Layout:
    """The layout of the gradients sent back: the parts that take one, in order."""
    return tuple((d, s) for d, s in layout if differentiable(d))


def check_parts(parts, dtypes, max_dims: int) -> str:
    """Why ``parts`` cannot cross a boundary ('' when they can)."""
    if len(parts) == 0:
        return "an empty tuple: a stage hands at least one tensor to the next"
    if len(parts) > MAX_PARTS:
        return (f"a tuple of {len(parts)} tensors; a boundary carries up to {MAX_PARTS}: "
                "stack some into one")
    for i, p in enumerate(parts):
        if isinstance(p, (tuple, list, dict)):
            return (f"element {i} of the tuple is a {type(p).__name__}; a boundary carries a "
                    "flat tuple of tensors: return the nested tensors in the outer tuple")
        if not isinstance(p, torch.Tensor):
            return (f"element {i} of the tuple is a {type(p).__name__}; a boundary carries "
                    "tensors only: pass other values as module attributes")
        if p.dtype not in dtypes or p.dim() > max_dims:
            return (f"element {i} is {p.dtype} of shape {tuple(p.shape)}; a boundary carries "
                    f"up to {max_dims} dimensions of {', '.join(map(str, dtypes))}")
        if p.device != parts[0].device:
            return f"element {i} is on {p.device}, element 0 on {parts[0].device}: use one device"
    return ""


def pack(parts) -> Packed:
    """Copy ``parts`` (checked with ``check_parts``) into one message; no parts (the
    gradients of a boundary of integers only): an empty message."""
    layout = tuple((p.dtype, tuple(p.shape)) for p in parts)
    where, total = spans(layout)
    data = torch.empty(total, dtype=torch.uint8, device=parts[0].device if parts else None)
    for (offset, n), p in zip(where, parts):
        if n:
            data[offset:offset + n].view(p.dtype).view(p.shape).copy_(p)
    return Packed(data, layout)


def unpack(data: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, ...]:
    """The parts of a received message: views of ``data``, each a leaf of its own."""
    where, _ = spans(layout)
    return tuple(data[offset:offset + n].view(dtype).view(shape).detach()
                 for (offset, n), (dtype, shape) in zip(where, layout))
