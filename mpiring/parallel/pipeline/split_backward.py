"""Split a backward into B (input gradient) and W (weight gradient), for zero bubble.

Every ``nn.Linear`` of a stage (the attention projections, the MLP and the LM
head) gets a forward through a ``torch.autograd.Function`` of its own. Its
backward returns dX = dY W at once and, while a micro-batch's B runs with a
queue set, pushes dW = dY^T X and db = sum dY onto that queue instead of
computing them; the W action runs them.

The Linear layers only, as the zero-bubble repository (``WeightGradStore`` in
Megatron's linear layers) and DeepSeek's DualPipe do: they hold nearly all of
the weight-gradient time (two GEMMs per Linear, one in B and one in W). What
decides it is the memory between B and W: a deferred layer keeps its input
and its output gradient alive until W. For the Linear layers of a transformer
block that is 16 d-wide rows per token, as much as the forward saved, so
ZB-H1 holds no more than 1F1B. LayerNorm's dgamma and dbeta would keep its
input and output gradient (4 more rows per block) for two reductions that
cost next to nothing, and an embedding's would keep dY for one scatter-add:
their weight gradients, and those of any other layer, stay in B.

Each queued item keeps the tensors W needs (``Deferred.tensors``: X and dY), so
that the stage can count the bytes a micro-batch holds between its B and its W.

A backward that is not split (1F1B's, GPipe's, and every B of a schedule
without W) sends its layers of at least ``FUSE_MIN_WEIGHTS`` weights through
the same layer with ``fuse`` set: dW = dY^T X is one GEMM that adds into
``.grad`` (``addmm_``), where autograd would allocate dW and add it to
``.grad`` in a second pass over the weights (AccumulateGrad). A parameter
whose gradient a hook would see or change (``register_hook``, a
post-accumulate hook that is not the stage's own DDP's) takes autograd's
path, as does one whose dtype differs from its activations'. A layer under
autocast is never routed (``_linear``).
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

#: The fewest weights for which an unsplit backward adds dW into ``.grad`` in the GEMM.
#: Below it the deferring Function's own steps (a Python forward, context and backward
#: per call) cost more than the allocation and the pass over dW that they save; a
#: split backward defers every Linear whatever its size.
FUSE_MIN_WEIGHTS = 1 << 17


class WeightGradSink:
    """Where deferred weight gradients go: ``queue`` is None (compute them now) or a list.

    ``fuse`` (with no queue): add dW into ``.grad`` inside the layer's backward, one
    GEMM, instead of returning it to autograd. ``inert_hooks``: how many
    post-accumulate hooks per parameter do nothing in such a backward (the stage's
    DDP's, disarmed: its reducer is armed only for the backward that syncs, which
    never fuses).
    """

    def __init__(self) -> None:
        self.queue: list | None = None
        self.fuse = False
        self.inert_hooks = 0
        # The layers take the deferring path only in the forwards that ask for it (the
        # stage's), and then those with at least ``route`` weights: elsewhere they are
        # plain nn.Linear, without the Function's steps. None: no layer.
        self.route: int | None = None


def _trained(p) -> bool:
    return p is not None and p.requires_grad


class Deferred:
    """One Linear's weight gradients for one micro-batch: dW = dY^T X, db = sum dY.

    ``tensors`` (X and dY) are what it keeps alive between B and W, detached: X
    requires grad (a stage's activation), and a GEMM on it would hang dY's graph on
    ``.grad``; detached once here, W needs no ``no_grad`` around each item.
    """

    __slots__ = ("params", "tensors")

    def __init__(self, weight, bias, x, gy):
        self.params, self.tensors = (weight, bias), (x.detach(), gy.detach())

    def _flat(self):
        x, gy = self.tensors
        return gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])

    def worth(self) -> float:
        """W's work per element it keeps: dW is rows x in x out multiply-adds, and X and
        dY keep rows x (in + out) elements, so in * out / (in + out), whatever the rows.

        A cap on the held bytes (``max_held_bytes``) runs the least worth first: per
        byte kept, a d x d projection or a narrow head fills half the bubble time of
        the 4d-wide MLP layers, which are also the largest items.
        """
        x, gy = self.tensors
        n_in, n_out = x.shape[-1], gy.shape[-1]
        return n_in * n_out / (n_in + n_out)

    def fusable(self, inert_hooks: int) -> bool:
        """Whether ``run()`` may stand in for autograd's accumulation: no hook would miss a
        gradient or change one, and dW has the parameter's dtype."""
        x, gy = self.tensors
        for p in self.params:
            if _trained(p) and (p.dtype != gy.dtype or p.dtype != x.dtype or p._backward_hooks
                                or len(p._post_accumulate_grad_hooks or ()) > inert_hooks):
                return False
        return True

    def grads(self) -> tuple:
        """(dW, db), None for a parameter that is frozen or absent."""
        g2, x2 = self._flat()
        weight, bias = self.params
        return (g2.t() @ x2 if _trained(weight) else None,
                g2.sum(0) if _trained(bias) else None)

    def run(self) -> None:
        """Add the gradients to ``.grad`` (a frozen parameter gets none, as in autograd)."""
        g2, x2 = self._flat()
        weight, bias = self.params
        if _trained(weight):
            if weight.grad is None:
                weight.grad = g2.t() @ x2
            else:  # the GEMM adds into .grad: no dW to allocate, no second pass over it
                weight.grad.addmm_(g2.t(), x2)
        if _trained(bias):
            db = g2.sum(0)
            if bias.grad is None:
                bias.grad = db
            else:
                bias.grad.add_(db)


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
        weight, bias = ctx.params
        item = Deferred(weight, bias, x, gy)
        sink = ctx.sink
        queue = sink.queue
        if queue is None:  # an unsplit backward: the weight gradients now
            if sink.fuse and item.fusable(sink.inert_hooks):
                item.run()
                return gx, None, None, None
            return (gx, *item.grads(), None)
        if _trained(weight) or _trained(bias):  # else nothing to defer
            queue.append(item)
        return gx, None, None, None


def _linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    sink = self._mpiring_wsink
    route = sink.route
    params = self._parameters  # not nn.Module's attribute lookup, once per tensor per call
    if "weight" not in params or "bias" not in params:
        # Parametrized after install: the tensor is computed (nn.Module's lookup finds
        # it), not a leaf that W could write .grad onto.
        return F.linear(x, self.weight, self.bias)
    weight, bias = params["weight"], params["bias"]
    # Autocast casts inside F.linear and saves the cast copies for its backward; the
    # deferring Function would save the uncast ones: autograd's layer, unsplit.
    if route is None or weight.numel() < route or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    return DeferredLinear.apply(x, weight, bias, sink)


def _plain_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` whose forward is F.linear on its own parameter: nn.Linear's
    forward, not overridden on the class or the instance, and a weight that is a
    Parameter (weight_norm's is computed from two: W would write .grad onto it)."""
    return (isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
            and "forward" not in vars(m) and isinstance(m.weight, nn.Parameter))


def install(module: nn.Module) -> WeightGradSink:
    """Route every ``nn.Linear`` in ``module`` through the deferring backward; the sink.

    A subclass that defines its own forward (LoRA's, a quantised layer's), or a
    parametrized Linear, is left as it is: the deferring forward computes
    ``F.linear`` on the module's own weight and nothing else.
    """
    sink = WeightGradSink()
    for m in module.modules():
        if _plain_linear(m):
            m._mpiring_wsink = sink
            m.forward = types.MethodType(_linear, m)
    return sink


class _WeightGrads(torch.autograd.Function):
    """One queued W item as an autograd node: its backward returns the weight gradients,
    so that AccumulateGrad adds them to ``.grad`` and fires the parameters' hooks."""

    @staticmethod
    def forward(ctx, item, *params):
        ctx.item = item
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return (None, *(g for g in ctx.item.grads() if g is not None))


def run_through_autograd(queue: list[Deferred], touched: list[torch.Tensor]) -> None:
    """Run ``queue``'s W items as one autograd backward, so that every parameter's
    post-accumulate hook fires as its gradient is done (DDP's buckets go out during W).

    ``touched``: parameters that get a zero gradient in the same pass, so that their
    hooks fire too (their gradients are complete already). Their AccumulateGrad nodes
    run first; then the items, in queue order (the engine runs the ready node made
    last first, so they are made in reverse), each followed by its parameters' own
    AccumulateGrad, which autograd runs as soon as it is ready.
    """
    roots = [_WeightGrads.apply(item, *(p for p in item.params if _trained(p)))
             for item in reversed(queue) if any(_trained(p) for p in item.params)]
    grads = [torch.ones_like(r) for r in roots] + [torch.zeros_like(p) for p in touched]
    if roots or touched:
        torch.autograd.backward(roots + list(touched), grads)


def storage_refs(queue: list[Deferred]) -> dict[int, list]:
    """The distinct storages a micro-batch's queued W items keep alive: data pointer ->
    [bytes, how many of the tensors the items keep are views of it]."""
    refs: dict[int, list] = {}
    for item in queue:
        for t in item.tensors:
            s = t.untyped_storage()
            refs.setdefault(s.data_ptr(), [s.nbytes(), 0])[1] += 1
    return refs


def held_bytes(queue: list[Deferred]) -> int:
    """Bytes of the distinct storages a micro-batch's queued W items keep alive."""
    return sum(n for n, _ in storage_refs(queue).values())
