"""Split a backward into B (input gradient) and W (weight gradient), for zero bubble.

Every parameter-holding layer of a stage that autograd lets us split gets a
forward through a ``torch.autograd.Function`` of its own: ``nn.Linear`` (the
attention projections, the MLP and the LM head included), ``nn.LayerNorm`` and
``nn.Embedding``. Its backward returns the input's gradient at once and, while
a micro-batch's B runs with a queue set, pushes the weight-gradient work onto
that queue instead of doing it:

* Linear: dX = dY W in B; dW = dY^T X, db = sum dY in W;
* LayerNorm: dX in B, dgamma and dbeta in W (the same ATen kernel,
  ``native_layer_norm_backward``, asked for different outputs);
* Embedding: no input gradient (the input is token ids); the whole
  ``embedding_dense_backward`` (a scatter-add of dY into the table) in W.

That is the zero-bubble paper's split: every weight gradient in W, so W costs
about what B does (two GEMMs per Linear, one each). The zero-bubble repository
does the same at the linear layer (``WeightGradStore``);
torch.distributed.pipelining instead walks the autograd graph. A layer of
another kind (a convolution, a custom module's own parameter) keeps its weight
gradient in B: correct, only less deferred. An Embedding with ``max_norm`` or
``sparse=True`` stays unsplit too (its forward or gradient is not the dense
one written here).

Each queued item keeps the tensors W needs (``Deferred.tensors``: X and dY), so
that the stage can count the bytes a micro-batch holds between its B and its W.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

aten = torch.ops.aten


class WeightGradSink:
    """Where deferred weight gradients go: ``queue`` is None (compute them now) or a list."""

    def __init__(self) -> None:
        self.queue: list | None = None


class Deferred:
    """One layer's weight-gradient work for one micro-batch: ``run()`` accumulates it."""

    __slots__ = ("fn", "params", "tensors")

    def __init__(self, fn, params, tensors):
        self.fn, self.params, self.tensors = fn, params, tensors

    def run(self) -> None:
        for p, g in zip(self.params, self.fn()):
            if p is None or g is None or not p.requires_grad:
                continue  # a frozen parameter gets no .grad, as in autograd
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


def _now_or_later(ctx, fn, tensors):
    """The weight gradients now (no queue: an unsplit backward) or None and queued."""
    queue = ctx.sink.queue
    if queue is None:
        return fn()
    if any(p is not None and p.requires_grad for p in ctx.params):  # else nothing to defer
        queue.append(Deferred(fn, ctx.params, tensors))
    return (None,) * len(ctx.params)


class DeferredLinear(torch.autograd.Function):
    """y = x W^T + b. Backward: dX = dY W now; dW, db now or queued on ``sink``."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        # The parameters themselves (not the saved copies autograd unpacks), so that
        # W writes the gradient onto the module's own .grad.
        ctx.params, ctx.sink = (weight, bias), sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, w_saved = ctx.saved_tensors
        gx = gy @ w_saved if ctx.needs_input_grad[0] else None
        has_bias = ctx.params[1] is not None

        def weight_grads():
            g2 = gy.reshape(-1, gy.shape[-1])
            gw = g2.t() @ x.reshape(-1, x.shape[-1])
            return gw, (g2.sum(0) if has_bias else None)
        return (gx, *_now_or_later(ctx, weight_grads, (x, gy)), None)


class DeferredLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dims. Backward: dX now; dgamma, dbeta now or queued."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, sink):
        out, mean, rstd = aten.native_layer_norm(x, shape, weight, bias, eps)
        # What torch's own LayerNorm saves (input, mean, rstd; the weight is a parameter).
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.params, ctx.sink, ctx.shape = (weight, bias), sink, shape
        return out

    @staticmethod
    def backward(ctx, gy):
        x, mean, rstd, weight, bias = ctx.saved_tensors
        shape = ctx.shape
        gx = None
        if ctx.needs_input_grad[0]:
            gx = aten.native_layer_norm_backward(gy, x, shape, mean, rstd, weight, bias,
                                                 [True, False, False])[0]

        def weight_grads():
            _, gw, gb = aten.native_layer_norm_backward(
                gy, x, shape, mean, rstd, weight, bias,
                [False, weight is not None, bias is not None])
            return gw, gb
        return (gx, *_now_or_later(ctx, weight_grads, (x, mean, rstd, gy)), None, None, None)


class DeferredEmbedding(torch.autograd.Function):
    """table[ids]. Backward: nothing for the ids; d(table) now or queued."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, scale_by_freq, sink):
        ctx.save_for_backward(ids)
        ctx.params, ctx.sink = (weight,), sink
        ctx.rows, ctx.padding, ctx.scale = weight.shape[0], padding_idx, scale_by_freq
        return F.embedding(ids, weight, padding_idx, None, 2.0, scale_by_freq, False)

    @staticmethod
    def backward(ctx, gy):
        (ids,) = ctx.saved_tensors
        padding = -1 if ctx.padding is None else ctx.padding

        def weight_grads():
            return (aten.embedding_dense_backward(gy, ids, ctx.rows, padding, ctx.scale),)
        return (None, *_now_or_later(ctx, weight_grads, (ids, gy)), None, None, None)


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return DeferredLinear.apply(x, self.weight, self.bias, self._mpiring_wsink)


def _layer_norm(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return DeferredLayerNorm.apply(x, self.weight, self.bias, list(self.normalized_shape),
                                   self.eps, self._mpiring_wsink)


def _embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return DeferredEmbedding.apply(ids, self.weight, self.padding_idx, self.scale_grad_by_freq,
                                   self._mpiring_wsink)


def _splittable(m: nn.Module):
    """The deferring forward for ``m``, or None where its weight gradient stays in B."""
    if isinstance(m, nn.Linear):
        return _linear
    if isinstance(m, nn.LayerNorm) and m.weight is not None:
        return _layer_norm
    if isinstance(m, nn.Embedding) and m.max_norm is None and not m.sparse:
        return _embedding
    return None


def install(module: nn.Module) -> WeightGradSink:
    """Route every splittable layer in ``module`` through its deferring backward; the sink."""
    sink = WeightGradSink()
    for m in module.modules():
        fwd = _splittable(m)
        if fwd is not None:
            m._mpiring_wsink = sink
            m.forward = types.MethodType(fwd, m)
    return sink


def held_bytes(queue: list[Deferred]) -> int:
    """Bytes of the distinct storages a micro-batch's queued W items keep alive."""
    seen: set[int] = set()
    total = 0
    for item in queue:
        for t in item.tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total
