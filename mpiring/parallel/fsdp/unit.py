r"""One fully sharded unit: gather before it runs, free after, reduce-scatter its gradient.

The lecture's ZeRO-3 step for one unit (a block of the model), on K ranks::

    forward:   AllGather (ring) shards -> full parameters     (pre-forward hook)
               compute the unit
               free the full parameters                       (post-forward hook)
    backward:  AllGather (ring) again                         (hook on the output's grad)
               compute the unit's backward -> full gradient
               free the full parameters; ReduceScatter (ring,
               averaged) -> this rank's shard of the mean      (hook on full.grad)

Each rank sends 3(K-1)/K of the unit per step (two AllGathers and one
ReduceScatter), 1.5x DDP's AllReduce: the price of holding 1/K of everything.

States (after DeepSpeed's ZeroParamStatus): ``SHARDED`` (only the shard has
bytes), ``INFLIGHT`` (the gather is queued on the communication thread, or
running), ``GATHERED`` (``full`` holds every parameter). The owner prefetches:
a unit's gather is queued while the unit before it (forward) or after it
(backward) computes, and the main thread waits only for that one gather.
"""

from __future__ import annotations

import weakref

import torch

from mpiring.parallel.fsdp.flat import FlatParam
from mpiring.parallel.fsdp.runner import CommRunner

SHARDED, INFLIGHT, GATHERED = "sharded", "inflight", "gathered"


def output_tensors(obj) -> list[torch.Tensor]:
    """Every tensor that requires grad inside nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in output_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in output_tensors(o)]
    return []


class _Pending:
    """One forward of a frozen-only unit whose backward may still come.

    Held only by the hooks on that forward's inputs, so it lives as long as the
    graph that can still be backpropagated: a forward whose graph is dropped
    unused (an evaluation with grad on) stops counting by itself.
    """

    __slots__ = ("n", "fired", "task", "__weakref__")

    def __init__(self, n: int):
        self.n = n                 # inputs whose gradients end this forward's backward
        self.fired: set[int] = set()
        self.task = None           # the backward (graph task) ``fired`` belongs to


class Unit:
    """The shard, the gathered buffer and the hooks of one wrapped module.

    Args:
        index: position in the owner's unit list (the root is 0).
        module: the wrapped module (the root: the whole model).
        flat: its parameters' flat layout.
        owner: the ``FullyShardedDataParallel`` (communicator, thread, policy).
        reshard_after_forward: free the gathered parameters after forward
            (ZeRO-3) or keep them until backward (fewer gathers, more memory).
    """

    def __init__(self, index: int, module: torch.nn.Module, flat: FlatParam, owner,
                 reshard_after_forward: bool):
        self.index = index
        self.module = module
        self.flat = flat
        self.owner = owner
        self.reshard_after_forward = reshard_after_forward
        self.status = SHARDED
        self.position: int | None = None   # in the forward order (recorded once)
        self.pre_backward_done = False
        self.reduced = False               # its gradient was handed over in this backward
        self.acc: torch.Tensor | None = None  # full gradient kept under no_sync
        # Reduce-scatter in the coming backwards (False: keep the unsharded sum): the
        # owner's set_requires_gradient_sync sets every unit's, fully_shard's one
        # module's (torch FSDP2's per-module switch).
        self.sync = True
        self._gather = None
        self._shard_version = -1
        # The same module's frozen parameters, a unit of their own (no gradient): freed
        # with this one after its backward, which is when the module's backward is done.
        self.frozen: Unit | None = None
        self.paired = False          # the frozen part of such a pair
        self.had_backward = False    # its last forward's output required grad
        # Forwards whose inputs' gradients are still to come (their graphs still alive).
        self._pending: weakref.WeakSet[_Pending] = weakref.WeakSet()
        self._hook = (flat.full.register_post_accumulate_grad_hook(self._post_backward)
                      if flat.requires_grad else None)

    # --- parameters: gather and free ----------------------------------------------
    def unshard(self) -> None:
        """Queue the AllGather of the full parameters (no-op unless SHARDED)."""
        if self.status != SHARDED:
            return
        self._shard_version = self.flat.shard._version  # what ``full`` will hold
        if not self.flat.allocated:
            self.owner._count(self.flat.numel * self.flat.full.element_size())
        self.flat.alloc()
        buf = self.flat.fill_own_chunk()
        comm, algo = self.owner.thread_comm, self.owner.algo
        if comm.size == 1 or self.flat.numel == 0:
            self.status = GATHERED
            return
        self.status = INFLIGHT
        # The ring's chunk r is rank r's shard: the same array_split bounds.
        self._gather = self.owner.runner.submit(
            lambda: comm.all_gather(buf, algo=algo, check=False))

    def wait(self) -> None:
        """Block until the queued AllGather has filled ``full``."""
        if self.status == INFLIGHT:
            fut, self._gather = self._gather, None
            self.status = GATHERED  # set first: a failed gather must not be waited on twice
            CommRunner.result(fut)

    def reshard(self) -> None:
        """Free the full parameters (after any gather in flight has landed)."""
        self.wait()
        if self.status == GATHERED:
            if self.flat.allocated:
                self.owner._count(-self.flat.numel * self.flat.full.element_size())
            self.flat.free()
            # Views of freed bytes would crash whoever reads them outside the forward.
            self.flat.hide_views()
            self.status = SHARDED

    # --- hooks ------------------------------------------------------------------------
    def pre_forward(self, args: tuple = (), kwargs: dict | None = None) -> None:
        """Gather for the forward (``args``, ``kwargs``: the module's inputs)."""
        if (self.status != SHARDED and not self.owner._in_backward
                and self.flat.shard._version != self._shard_version):
            # Kept gathered (a forward with no backward after it) while the shard moved
            # on (an optimizer step, a loaded state dict): gather the new values.
            self.reshard()
        self.unshard()
        if self.frozen is not None:
            self.frozen.unshard()  # the same module's other flat: both gathers in flight
        self.wait()
        self.flat.set_views()
        self.owner._on_pre_forward(self)
        if self.flat.requires_grad or self.paired or not torch.is_grad_enabled():
            return
        # Frozen parameters alone: no gradient of theirs says when the unit's backward
        # is over, so the inputs' gradients do (FSDP2's post-backward on the inputs). A
        # hook, not an identity on them: the forward may change an input in place.
        # Positional or keyword, nested in tuples, lists and dicts: every input that
        # takes a gradient.
        inputs = output_tensors((args, kwargs or {}))
        if inputs:
            # A token per forward, not a counter reset by the next forward: two forwards
            # before one backward must both be backpropagated before the unit is freed.
            # Plain hooks, not register_multi_grad_hook: its closure holds the inputs'
            # nodes, a cycle that keeps a dropped graph's token until the cyclic GC.
            token = _Pending(len(inputs))
            self._pending.add(token)
            for i, t in enumerate(inputs):
                t.register_hook(lambda grad, i=i, token=token: self._input_done(token, i))

    def _input_done(self, token: _Pending, i: int) -> None:
        task = torch._C._current_graph_task_id()
        if token.task != task:  # a new backward through the same graph (retain_graph)
            token.task, token.fired = task, set()
        token.fired.add(i)
        # Every input's gradient is in (an input this backward never reaches keeps the
        # unit until the backward ends: memory, never correctness).
        if len(token.fired) == token.n:
            self._pending.discard(token)
            if not self._pending and self.owner.reshard_after_backward:
                self.reshard()

    def post_forward(self, output):
        grad = torch.is_grad_enabled()
        # The root and the last unit of the forward order stay gathered: their
        # backward comes first, right away; freeing them would only gather them again.
        # (Known once the first forward has recorded the order.)
        owner = self.owner
        last = (not owner._recording and self.position is not None
                and owner._order[-1].module is self.module)
        if not grad or (self.reshard_after_forward and self.index != 0 and not last):
            self.reshard()
        outputs = output_tensors(output) if grad else []
        self.had_backward = bool(outputs)  # prefetched for the backward only if so
        for t in outputs:
            t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        if not self.pre_backward_done:
            self.pre_backward_done = True
            self.owner._on_backward_start()
            if not self.owner.prefetch:
                # One unit's gradient at a time: the ReduceScatters queued by the
                # units after this one end before its backward makes another.
                self.owner.runner.wait_all()
            self._gather_for_backward()
            self.owner._prefetch_backward(self)
        elif self.status == SHARDED:
            # Freed earlier in this backward (another forward's graph went first, or a
            # frozen unit whose count was done): gather again, never read freed storage.
            self._gather_for_backward()
        return None

    def _gather_for_backward(self) -> None:
        """Gather the unit (and its frozen part) and give the module its parameters'
        views again: activation checkpointing runs the module's forward again in its
        backward, reading its attributes (after the forward they are the stand-ins).
        With grad on, as in the forward (autograd runs hooks with it off): a
        recomputation must save what the forward saved."""
        self.unshard()
        if self.frozen is not None:
            self.frozen.unshard()
        self.wait()
        with torch.enable_grad():
            for u in (self, self.frozen):
                if u is not None:
                    u.flat.set_views()

    def _post_backward(self, full: torch.Tensor) -> None:
        # Autograd has summed every view's gradient into full.grad: the unit's
        # backward is over. Take the gradient away from autograd and free the
        # parameters before the ReduceScatter (which needs only the gradient).
        grad, full.grad = full.grad, None
        held = 0 if grad is None else grad.numel() * grad.element_size()
        self.owner._count(held)  # the gradient exists while the parameters still do
        if self.owner.reshard_after_backward:
            self.reshard()
            if self.frozen is not None:
                # Autograd runs a unit's nodes, the frozen weights' too, before the
                # split that sums the trainable views' gradients (created first in the
                # forward, it comes last in the backward): they are done with.
                self.frozen.reshard()
        if grad is not None:
            self.reduce(grad.reshape(-1))
        self.owner._count(-held)  # reduce() counts what it keeps

    # --- gradients ---------------------------------------------------------------------
    def reduce(self, grad: torch.Tensor | None) -> None:
        """ReduceScatter (averaged) ``grad`` + what no_sync kept into ``shard.grad``.

        ``grad=None``: a unit this backward did not reach (on any rank), whose
        ``no_sync`` micro-batches kept a sum: that sum alone goes out.
        """
        self.reduced = True
        f, owner = self.flat, self.owner
        rd = owner.reduce_dtype or f.compute_dtype
        buf = (grad.to(rd).contiguous() if grad is not None
               else torch.zeros(f.numel, dtype=rd, device=f.device))
        if self.acc is not None:
            buf = buf + self.acc
        if not self.sync:  # no_sync: keep the unsharded sum for the synced backward
            self.keep_acc(buf)
            return
        self.keep_acc(None)  # buf holds it now, counted below
        if f.numel == 0:
            return
        comm, algo, shard = owner.thread_comm, owner.algo, f.shard
        lo, hi = f.lo, f.hi
        nbytes = buf.numel() * buf.element_size()
        owner._count(nbytes)

        def reduce_scatter() -> None:
            try:
                if comm.size > 1:
                    # Divide BEFORE the sum, as DDP does: K low-precision gradients can
                    # overflow where K gradients divided by K cannot.
                    buf.div_(comm.size)
                    comm.reduce_scatter(buf, op="sum", algo=algo, check=False)
                mine = buf[lo:hi].to(shard.dtype, copy=True)
                if shard.grad is None:
                    shard.grad = mine
                else:
                    shard.grad.add_(mine)
            finally:
                owner._count(-nbytes)

        owner.runner.submit(reduce_scatter)

    def keep_acc(self, acc: torch.Tensor | None) -> None:
        """Keep ``acc`` as the unsharded gradient sum no_sync holds (None: drop it), with
        its bytes in the owner's unsharded count (the whole model's, in a pipeline's
        micro-batches)."""
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()
        self.owner._count(size(acc) - size(self.acc))
        self.acc = acc

    def end_backward(self) -> None:
        """Back to SHARDED (unless the owner keeps units after backward) and ready for the
        next iteration."""
        if self.owner.reshard_after_backward:
            self.reshard()
        self.pre_backward_done = False
        self.reduced = False

    def remove_hooks(self) -> None:
        if self._hook is not None:
            self._hook.remove()

