"""The ZeroRedundancyOptimizer: checks, the gradient reduction, and the step.

Its layout (``layout``), state dicts (``state``) and DDP hook (``ddp``) live
beside it; the package docstring tells the whole story.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mpiring.comm.default import resolve
from mpiring.parallel.zero.ddp import FollowDDP, _reduce_scatter_hook
from mpiring.parallel.zero.layout import ShardLayout
from mpiring.parallel.zero.state import ShardedState

__all__ = ["ZeroRedundancyOptimizer"]

#: Optimizers whose state or step looks at a whole tensor, not element by element:
#: on flat shards they run, and give other numbers than on the model's tensors.
#: Adafactor factors a matrix's second moment by rows and columns (a 1-D shard gets
#: a per-element one) and scales by the tensor's RMS; LBFGS takes dot products and
#: line searches over every parameter at once (each rank would see only its shard).
_WHOLE_TENSOR = tuple(c for c in (getattr(torch.optim, "Adafactor", None), torch.optim.LBFGS)
                      if c is not None)


def whole_tensor_optimizer_error(optimizer_class, who: str) -> TypeError | None:
    """The error for an optimizer that needs whole tensors on flat shards, or None."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, _WHOLE_TENSOR)):
        return None
    return TypeError(
        f"{who}: {optimizer_class.__name__} does not work on flat shards: its state or step "
        "spans whole tensors (Adafactor factors a matrix by rows and columns and scales by "
        "its RMS; LBFGS takes dot products over every parameter), and a shard is a 1-D "
        "piece of them, so it would silently give other results. Use an optimizer whose "
        "state is per element or scalar (AdamW, Adam, SGD, Adagrad, RMSprop, ...), or "
        "train that model with mpiring.DistributedDataParallel (whole parameters)")


def _describe_param(p: torch.Tensor) -> str:
    return f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')} {p.device.type}"


class ZeroRedundancyOptimizer(ShardLayout, ShardedState, FollowDDP, torch.optim.Optimizer):
    """A data-parallel optimizer whose state is sharded over the ranks (ZeRO stage 1 or 2).

    Use it instead of wrapping the model in DDP: after ``loss.backward()`` on each
    rank's own data, ``step()`` averages the gradients over the ranks, updates
    this rank's shard and gathers the updated parameters everywhere, so every
    replica stays identical, as with DDP plus ``optimizer_class``::

        comm = mpiring.init()
        opt = mpiring.ZeroRedundancyOptimizer(model.parameters(), comm,
                                              optimizer_class=torch.optim.AdamW, lr=3e-4)
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer.
        comm: the ``mpiring.Communicator`` over the data-parallel ranks (default:
            the DDP model's, else the one ``mpiring.init_process_group()`` made).
        optimizer_class: the inner optimizer, run on this rank's shard (any
            ``torch.optim.Optimizer`` whose state is per element or scalar:
            SGD, Adam, AdamW, Adagrad, RMSprop, ...).
        stage: 2 (reduce-scatter the gradients) or 1 (all-reduce them; ``p.grad``
            then holds the mean over ranks after ``step``).
        broadcast_params: copy rank 0's parameters to every rank at
            construction, so that replicas start equal (as DDP does).
        ddp: an ``mpiring.DistributedDataParallel`` wrapping the model. Stage 2
            then reduce-scatters each DDP bucket on the reducer's communication
            thread as soon as backward fills it (a comm hook; overlapped with
            the rest of backward), with the shards laid out like the buckets
            (DDP's first synced backward is all-reduced instead: DDP rebuilds
            its buckets after it, and the first step lays the shards out like
            the rebuilt ones);
            stage 2 needs every trainable parameter of the DDP module in this
            optimizer (it refuses otherwise); stage 1 takes DDP's averaged
            gradients as they are, for any subset of them. ``no_sync``
            works as with DDP: step after the synced backward.
        max_grad_norm: clip the mean gradient to this global 2-norm in ``step()``,
            once the gradients are averaged (DeepSpeed's ``gradient_clipping``);
            ``last_grad_norm`` is the norm before clipping. Do not call
            ``torch.nn.utils.clip_grad_norm_`` before ``step()``: until then
            ``p.grad`` is this rank's own gradient, and its norm is not the mean's.
        process_group: torch's name for ``comm`` (one of the two, or neither).
        parameters_as_bucket_view: torch's option, accepted: the parameters here
            always are views of the flat buffers.
        overlap_with_ddp: torch's option; refused: pass ``ddp=`` with stage 2.
        **defaults: hyperparameters for ``optimizer_class`` (lr, betas, ...),
            checked by that class at construction as torch would (a TypeError
            for a name it does not take, on every rank).

    Raises:
        TypeError: a bad ``comm``, ``optimizer_class`` or parameter (sparse,
            not floating point).
        ValueError: a bad ``stage``, no parameters, ranks that passed
            different parameters (the message names the first difference), or
            stage 2 with ``ddp`` over only some of the DDP module's parameters.

    After ``step``, parameters are identical on every rank. With stage 2,
    ``p.grad`` is left as this rank's local gradient (only the shard's mean is
    ever formed; with ``ddp``, only this rank's shard of ``p.grad`` is the mean,
    the rest holds partial sums); with stage 1 it is the mean over ranks.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], comm=None,
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 stage: int = 2, *, broadcast_params: bool = True, ddp=None,
                 max_grad_norm: float | None = None, process_group=None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any):
        self._initialized = False
        # torch's signature is (params, optimizer_class, process_group=None, ...): a
        # ported call passes the optimizer class where ours takes comm. Refused here,
        # before any byte moves, since without a communicator no rank can agree.
        if isinstance(comm, type) and issubclass(comm, torch.optim.Optimizer):
            raise TypeError(
                f"ZeroRedundancyOptimizer(params, {comm.__name__}, ...): the second argument is "
                f"comm here (torch's is optimizer_class): pass optimizer_class={comm.__name__} "
                "by keyword, and comm=/process_group= the communicator (or nothing, after "
                "mpiring.init_process_group())")
        if overlap_with_ddp:
            raise ValueError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True): pass the DDP model instead, "
                "ddp=model with stage=2: its comm hook reduce-scatters each bucket while "
                "backward runs")
        if process_group is not None:  # torch's name for the communicator
            if comm is not None and comm is not process_group:
                raise ValueError("ZeroRedundancyOptimizer: comm and process_group name two "
                                 "communicators: pass one of them")
            comm = process_group
        # parameters_as_bucket_view: ours are always views of flat buffers (the
        # segments), so torch's option is what this optimizer does anyway.
        self._broadcast_params = bool(broadcast_params)
        if comm is None:  # torch's habit: the default process group (or DDP's)
            comm = ddp.comm if ddp is not None else resolve(None, "ZeroRedundancyOptimizer")
        error: Exception | None = None
        try:
            if not all(hasattr(comm, a) for a in ("reduce_scatter", "all_gather", "rank", "size")):
                raise TypeError(f"comm must be an mpiring.Communicator (mpiring.init()), "
                                f"got {type(comm).__name__}")
            if not (isinstance(optimizer_class, type)
                    and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass such as "
                                f"torch.optim.AdamW, got {optimizer_class!r}")
            refused = whole_tensor_optimizer_error(optimizer_class, "ZeroRedundancyOptimizer")
            if refused is not None:
                raise refused
            if stage not in (1, 2):
                raise ValueError(f"stage={stage!r}: use 1 (shard the optimizer state) or 2 "
                                 "(also reduce-scatter the gradients)")
            if ddp is not None and not (hasattr(ddp, "register_comm_hook")
                                        and hasattr(ddp, "reducer")):
                raise TypeError(f"ddp must be an mpiring.DistributedDataParallel, got "
                                f"{type(ddp).__name__}")
            if max_grad_norm is not None and not float(max_grad_norm) > 0:
                raise ValueError(f"max_grad_norm={max_grad_norm!r}: give a positive norm, or None "
                                 "to leave the gradients unclipped")
            if ddp is not None and ddp.comm.size != comm.size:
                raise ValueError(f"ddp runs on {ddp.comm.size} ranks, comm has {comm.size}: "
                                 "pass the communicator the DDP model was built with")
        except (TypeError, ValueError) as exc:
            error = exc
        if error is not None and not hasattr(comm, "control"):
            raise error  # no communicator to agree through
        try:
            super().__init__(params, defaults)
        except (TypeError, ValueError) as exc:
            # torch's own checks (an empty list, a non-leaf, a duplicate): agreed
            # below like ours, so a rank-dependent mistake makes every rank raise.
            error = error or exc
            self.param_groups = []
        self.comm = comm
        self.stage = int(stage) if error is None else 2
        self.optimizer_class = optimizer_class
        self._all_params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._shapes = [p.shape for p in self._all_params]
        self._group_of: list[int] = [g for g, grp in enumerate(self.param_groups)
                                     for _ in grp["params"]]
        if error is None:
            error = self._check_params()
        if error is None:
            error = self._check_defaults(defaults)
        if error is None and ddp is not None and self.stage == 2:
            error = self._check_ddp_coverage(ddp)
        self._agree(error)  # every rank raises (or none does) before a byte moves

        self.rank: int = comm.rank
        self.world_size: int = comm.size
        self._consolidated: dict[str, Any] | None = None
        self._consolidated_at = -1
        self._steps = 0
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.last_grad_norm: float | None = None
        self._ddp = ddp
        self._ddp_iteration = -1   # DDP's synced backward count at the last step
        # bucket -> (ids of its params, all-reduced rather than reduce-scattered), from the hook
        self._reduced: dict[int, tuple[tuple[int, ...], bool]] = {}
        self.relayouts = 0         # times the shards followed a DDP bucket rebuild
        self._segments = self._build_segments(self._layout())
        if broadcast_params:
            for seg in self._segments:
                comm.broadcast(seg.flat_param, root=0)
        self.optim = self._make_inner_optimizer()
        # The inner optimizer filled in its defaults (betas, eps, ...): show them here too.
        self._sync_groups(self.optim.param_groups, self.param_groups)
        if ddp is not None and self.stage == 2:
            ddp.register_comm_hook(self, _reduce_scatter_hook)
        self._initialized = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (a collective after construction, as in torch's ZeRO).

        Call it on every rank with the same group. The flat buffers are laid out
        again with the new parameters (rank 0's values, if ``broadcast_params``),
        the shards move with them, and the existing optimizer state follows its
        parameters to their new shards.

        Raises:
            TypeError, ValueError: on every rank, before anything moves, if any
                rank's group is bad (torch's own checks, a sparse or non-float
                parameter) or the ranks passed different groups; the optimizer
                is then left as it was.
        """
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)  # torch.optim.Optimizer.__init__ builds groups
            return
        before, groups_before = len(self._all_params), len(self.param_groups)
        error: Exception | None = None
        try:
            super().add_param_group(param_group)  # torch's checks: duplicates, non-leaf, ...
        except (TypeError, ValueError) as exc:
            error = exc
        added = [] if error is not None else list(self.param_groups[-1]["params"])
        self._all_params.extend(added)
        self._shapes.extend(p.shape for p in added)
        self._group_of.extend(len(self.param_groups) - 1 for _ in added)
        if error is None:
            error = self._check_params()
        try:
            self._agree(error)  # every rank raises (or none does) before a byte moves
        except (TypeError, ValueError):
            # Leave the optimizer as it was, on every rank: it can go on training.
            del self.param_groups[groups_before:]
            del self._all_params[before:], self._shapes[before:], self._group_of[before:]
            raise
        # The new parameters join the segments: lay them out again and take every
        # piece's state along to its new shard (the DDP rebuild's path).
        relayouts = self.relayouts
        self._relayout(self._layout())
        self.relayouts = relayouts  # that counter is for DDP bucket rebuilds
        if self._broadcast_params:  # replicas start equal, as at construction
            new = set(range(before, len(self._all_params)))
            for seg in self._segments:
                if new.intersection(seg.indices):
                    self.comm.broadcast(seg.flat_param, root=0)
        # The inner optimizer filled in the new group's defaults: show them here too.
        self._sync_groups(self.optim.param_groups, self.param_groups)
        self._consolidated = None

    def _check_params(self) -> Exception | None:
        if not self._all_params:
            return ValueError("ZeroRedundancyOptimizer got no parameters: pass model.parameters()")
        for i, p in enumerate(self._all_params):
            if p.is_sparse:
                return TypeError(f"parameter {i} is sparse: the flat ring buffers hold dense "
                                 "tensors only; use a dense parameter")
            if not p.is_floating_point():
                return TypeError(f"parameter {i} has dtype {p.dtype}: gradients are averaged, "
                                 "which needs a floating-point dtype")
        return None

    def _check_defaults(self, defaults: dict[str, Any]) -> Exception | None:
        """``optimizer_class``'s own check of the hyperparameters, as torch would run it.

        They reach the inner optimizer as param-group keys, never as constructor
        arguments, so a misspelt name (``weight_decy``) or another class's
        (``betas`` for SGD) would be kept silently and the default used.
        """
        first = self._all_params[0]
        probe = torch.zeros(1, dtype=first.dtype, device=first.device, requires_grad=True)
        try:
            self.optimizer_class([probe], **defaults)
        except (TypeError, ValueError) as exc:
            return exc
        return None

    def _check_ddp_coverage(self, ddp) -> Exception | None:
        """Stage 2 with ``ddp``: every parameter DDP reduces must be one of ours.

        The hook reduce-scatters whole DDP buckets, so chunk r of a bucket is the
        mean only if rank r's shard is that same chunk: a parameter we do not
        hold would shift the shard off the reduced chunk, and leave its own
        ``p.grad`` partial sums that another optimizer would step on differently
        on each rank.
        """
        ours = {id(p) for p in self._all_params}
        missing = [n for n, p in zip(ddp.reducer.names, ddp.reducer.params) if id(p) not in ours]
        if not missing:
            return None
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return ValueError(
            f"ZeroRedundancyOptimizer(stage=2, ddp=...): the DDP model's parameter(s) {shown} "
            "are not in this optimizer, and stage 2 reduce-scatters whole DDP buckets: give "
            "ZeRO every trainable parameter of the DDP module (several param groups are fine), "
            "or use stage=1, or leave out ddp=")

    def _agree(self, error: Exception | None) -> None:
        """Raise on every rank if any rank failed its checks or passed different parameters."""
        desc = (None if error is None else f"{type(error).__name__}: {error}",
                self.stage, self.optimizer_class.__name__,
                [len(g["params"]) for g in self.param_groups],
                [_describe_param(p) for p in self._all_params])
        # JSON through the control channel, never pickle.
        table = self.comm.control.allgather_json(desc) if self.comm.size > 1 else [desc]
        if error is not None:
            raise error
        bad = [r for r, d in enumerate(table) if d[0] is not None]
        if bad:
            raise ValueError(f"ZeroRedundancyOptimizer: rank(s) {', '.join(f'r{r}' for r in bad)} "
                             f"rejected their arguments ({table[bad[0]][0]}); no rank went on")
        mine = table[0]
        for r, d in enumerate(table):
            for what, a, b in (("stage", mine[1], d[1]), ("optimizer_class", mine[2], d[2]),
                               ("parameters per group", mine[3], d[3])):
                if a != b:
                    raise ValueError(f"ZeroRedundancyOptimizer: {what} differs: r0={a} r{r}={b}; "
                                     "every rank must build the same optimizer")
            for i, (a, b) in enumerate(zip(mine[4], d[4])):
                if a != b:
                    raise ValueError(f"ZeroRedundancyOptimizer: parameter {i} differs: r0 has {a}, "
                                     f"r{r} has {b}; every rank must pass the same model")

    def _has_grad(self) -> list[bool]:
        """Per parameter: does any rank have a gradient? (None on every rank: skip it, as torch does.)"""
        flags = [int(p.grad is not None) for p in self._all_params]
        if self.comm.size > 1:
            flags = self.comm.control.allgather_array(flags).max(axis=0).tolist()
        return [bool(f) for f in flags]

    def _reduce_gradients(self) -> None:
        k = self.comm.size
        for seg in self._segments:
            flat = seg.flat_grad
            if seg.external:
                # DDP reduced these (the whole mean, or our chunk of each bucket):
                # the inner optimizer reads this rank's slices of p.grad in place.
                for pc in seg.pieces:
                    g = self._all_params[pc.index].grad
                    if g is None:  # no gradient here but on another rank: a zero one
                        pc.grad = torch.zeros_like(pc.view)
                    else:
                        pc.grad = g.detach().reshape(-1)[pc.start:pc.stop]
                continue
            for i, off in zip(seg.indices, seg.offsets):
                p = self._all_params[i]
                dst = flat[off:off + p.numel()]
                if p.grad is None:
                    dst.zero_()
                elif p.grad.is_sparse:
                    raise TypeError(f"parameter {i} has a sparse gradient: ZeRO reduces dense "
                                    "flat buffers; use a dense embedding (sparse=False)")
                else:
                    dst.copy_(p.grad.reshape(-1))
            if k > 1:
                # Divide before summing: K float16/bfloat16 gradients can overflow
                # their sum, K gradients divided by K cannot.
                flat.div_(k)
                if self.stage == 2:
                    self.comm.reduce_scatter(flat, op="sum")
                else:
                    self.comm.all_reduce(flat, op="sum")
            if self.stage == 1:
                # Stage 1 promises the DDP contract: p.grad is the mean over ranks.
                for i, off in zip(seg.indices, seg.offsets):
                    p = self._all_params[i]
                    if p.grad is not None:
                        p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))

    def _clip(self) -> None:
        """Scale this rank's shard of the mean gradient so the whole one's 2-norm is at
        most ``max_grad_norm``: the shards cover every parameter once, so the squares
        of all ranks' pieces sum to the norm's square (one scalar all-reduce)."""
        grads = [pc.view.grad for pc in self._pieces() if pc.view.grad is not None]
        local = sum(float(g.double().pow(2).sum()) for g in grads)
        total = math.sqrt(self.comm.control.allreduce_scalar(local, "sum")
                          if self.comm.size > 1 else local)
        self.last_grad_norm = total
        coef = self.max_grad_norm / (total + 1e-6)  # torch's clip_grad_norm_ epsilon
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    # torch.amp.GradScaler hands itself to step() (grad_scaler=): its inf check
    # must be agreed over the ranks, since step() is a collective.
    _step_supports_amp_scaling = True

    def _amp_found_inf(self, grad_scaler) -> bool:
        """Unscale ``p.grad`` and agree over the ranks whether any rank found inf/nan.

        The scaler checks ``p.grad``, which is this rank's own gradient (or, with
        ``ddp`` and stage 2, partial sums outside the shard): one rank alone may
        see an overflow. Each rank skipping on its own view would pair its next
        step's collectives with the others' this step. One scalar all-reduce
        (max) gives every rank the same answer, written back into the scaler so
        that ``update()`` backs off (or grows) the scale alike on every rank.
        """
        from torch.amp.grad_scaler import OptState

        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.READY:
            grad_scaler.unscale_(self)
        flags = state["found_inf_per_device"].values()
        local = int(any(float(f) for f in flags))
        found = self.comm.control.allreduce_scalar(local, "max") if self.comm.size > 1 else local
        for f in flags:
            f.fill_(float(found))
        return bool(found)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, grad_scaler=None,
             **kwargs: Any) -> float | None:
        """Average the gradients, update this rank's shard, gather the parameters.

        A collective: every rank must call it. ``closure`` (re-evaluates the
        model and calls backward) runs first, before the gradients are reduced.
        ``grad_scaler`` is passed by ``torch.amp.GradScaler.step(opt)``: every
        rank then skips the step, or none does, as any rank's gradient overflowed.

        Returns:
            The closure's loss, if a closure was given.
        """
        if self._ddp is not None and getattr(self._ddp, "_join", None) is not None:
            # join() shadows DDP's bucket reductions only: a rank out of inputs would
            # answer this step's exchanges with its join flags (a truncated message).
            # Every rank steps in the first iteration, so all raise here together.
            raise RuntimeError(
                "ZeroRedundancyOptimizer.step() inside ddp.join(): join() shadows only DDP's "
                "gradient reductions, not ZeRO's collectives, so a rank that ran out of inputs "
                "could not take part in them. Give every rank the same number of batches "
                "(DistributedSampler(drop_last=True)) and train without join(), or use a "
                "plain torch optimizer inside join()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is None and hasattr(self, "found_inf"):
            raise RuntimeError(
                "ZeroRedundancyOptimizer: this torch's GradScaler no longer passes itself to "
                "step(), so the ranks cannot agree on skipping an overflowed step; step without "
                "the scaler (bfloat16 autocast needs none)")
        self._rebind()
        if self._ddp is not None:
            self._follow_ddp()
        if grad_scaler is not None and self._amp_found_inf(grad_scaler):
            return loss  # every rank skips alike: the replicas stay equal
        has_grad = self._has_grad()
        self._reduce_gradients()
        for pc in self._pieces():
            pc.view.grad = pc.grad if has_grad[pc.index] else None
        if self.max_grad_norm is not None:
            self._clip()
        # Learning-rate schedulers change self.param_groups: pass that on.
        self._sync_groups(self.param_groups, self.optim.param_groups)
        self.optim.step(**kwargs)
        for seg in self._segments:
            if seg.external:  # let zero_grad() free p.grad: drop our slices of it
                for pc in seg.pieces:
                    pc.view.grad = pc.grad = None
            self.comm.all_gather(seg.flat_param)
        self._steps += 1
        return loss
