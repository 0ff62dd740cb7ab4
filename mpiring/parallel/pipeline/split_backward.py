"""Split a backward into B (input gradient) and W (weight gradient), for zero bubble.

Every ``nn.Linear`` of a stage gets a forward through ``DeferredWeightGradLinear``:
its backward returns the input's gradient at once and, while a micro-batch's
B is running with a queue set, pushes the weight-gradient GEMM (dW = dY^T X,
db = sum dY) onto that queue as a closure instead of computing it. The
schedule's W action runs the queue. The zero-bubble repository does the same
at the linear layer (``WeightGradStore``); torch.distributed.pipelining instead
walks the autograd graph. Other parameters (LayerNorm, embeddings) get their
gradients in B: they are a small part of the weight-gradient work.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F


class WeightGradSink:
    """Where deferred weight gradients go: ``queue`` is None (compute them now) or a list."""

    def __init__(self) -> None:
        self.queue: list | None = None


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class DeferredWeightGradLinear(torch.autograd.Function):
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
        weight, bias = ctx.params
        gx = gy @ w_saved if ctx.needs_input_grad[0] else None

        def weight_grads():
            g2 = gy.reshape(-1, gy.shape[-1])
            gw = g2.t() @ x.reshape(-1, x.shape[-1])
            return gw, (g2.sum(0) if bias is not None else None)

        queue = ctx.sink.queue
        if queue is None:
            gw, gb = weight_grads()
            return gx, gw, gb, None

        def run() -> None:
            gw, gb = weight_grads()
            _accumulate(weight, gw)
            if gb is not None:
                _accumulate(bias, gb)
        queue.append(run)
        return gx, None, None, None


def _deferred_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return DeferredWeightGradLinear.apply(x, self.weight, self.bias, self._mpiring_wsink)


def install(module: nn.Module) -> WeightGradSink:
    """Route every ``nn.Linear`` in ``module`` through the deferrable backward; returns the sink."""
    sink = WeightGradSink()
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m._mpiring_wsink = sink
            m.forward = types.MethodType(_deferred_forward, m)
    return sink
