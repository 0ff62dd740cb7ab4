r"""ZeRO-style sharded optimizer on the ring's ReduceScatter and AllGather.

Data parallelism keeps K full copies of the optimizer state (for AdamW: two
floats per parameter, twice the model). ZeRO (Rajbhandari et al., 2020) removes
the redundancy: rank r keeps the state of only its shard of the parameters, and
the step becomes exactly the two halves of the lecture's Ring AllReduce::

    flat gradient  [ c0 | c1 | c2 | c3 ]      every rank, after backward
        ReduceScatter (ring)   ->  rank r holds chunk r summed over the ranks
        rank r: inner optimizer step on chunk r of the parameters, with the
                state of chunk r only (1/K of the state)
        AllGather (ring)       ->  every rank holds every updated chunk
    flat parameter [ c0 | c1 | c2 | c3 ]

* Stage 2 (default): the gradient is reduce-scattered, so each rank reduces and
  keeps only its chunk of the mean gradient. The wire carries ReduceScatter +
  AllGather = 2(K-1)/K of the model per rank: the same bytes as DDP's
  AllReduce, with 1/K of the state.
* Stage 1: the gradient is all-reduced (every rank gets the full mean gradient
  in ``p.grad``, as with DDP) and the state is still sharded; the parameter
  AllGather comes on top, 3(K-1)/K of the model per rank.

Layout. Parameters of one dtype and device are laid out back to back in one
flat buffer (a *segment*), and each parameter's ``.data`` becomes a view into
it, so the AllGather writes the new values straight into the model, without a
copy. The shard of rank r is chunk r of every segment with the ring's own
``numpy.array_split`` bounds (``comm.chunk_bounds``), so a shard may start or
end inside a parameter: the inner optimizer sees one 1-D view per piece of a
parameter that falls in the shard, and its per-element state (``exp_avg``...)
has the size of that piece.

Gradient averaging. Each rank divides its gradient by K *before* the sum
(``op="sum"`` on pre-divided values), as DDP does: a float16 or bfloat16 sum
of K gradients can overflow where the sum of K values divided by K cannot. For
K a power of two the division is exact, so this is bit-for-bit the mean.

With DDP (``ddp=``). Stage 2 registers a comm hook on the DDP model: each
bucket is reduce-scattered on the reducer's communication thread as soon as
backward fills it, overlapped with the rest of backward, and the segments are
the DDP buckets, so chunk r of each bucket is rank r's shard; ``step()`` then
reads its slices of ``p.grad`` in place and only updates and all-gathers. DDP
rebuilds its buckets after its first synced backward, so that one backward is
all-reduced and the first step lays the shards out like the rebuilt buckets.
Stage 1 leaves DDP's AllReduce alone and takes the means from ``p.grad``.
``no_sync()`` accumulates locally as with DDP; a step with no synced backward
since the last one raises instead of updating with unreduced gradients.

State dicts. ``consolidate_state_dict(to=0)`` (on every rank) assembles the
sharded state on rank ``to``, with the ring AllGather of every state tensor;
``state_dict()`` there returns it in the format of an unsharded optimizer
(``{"state": {index: {...}}, "param_groups": [...]}``, full-shape tensors), so it
does not depend on the world size: ``load_state_dict`` takes it on any number of
ranks (each rank keeps its own slice), and so does a plain ``torch.optim.AdamW``.

Interface after ``torch.distributed.optim.ZeroRedundancyOptimizer``, which shards
whole parameters and broadcasts them; this one shards a flat buffer, so the
shards are equal to one element whatever the parameter sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpiring.backends.control import allgather_json
from mpiring.core.chunking import chunk_bounds
from mpiring.runtime import pages

__all__ = ["ZeroRedundancyOptimizer"]


@dataclass
class _Piece:
    """The part ``[start, stop)`` (flat, within the parameter) of one parameter in this shard."""

    index: int          # global parameter index (order of self.param_groups)
    group: int          # its parameter group
    offset: int         # where the parameter starts in its segment
    start: int
    stop: int
    view: torch.Tensor  # flat_param[...] : what the inner optimizer updates
    grad: torch.Tensor  # flat_grad[...] (or, DDP-reduced, a slice of p.grad): its gradient


@dataclass
class _Segment:
    """One flat buffer of parameters of one dtype and device."""

    indices: list[int]
    offsets: list[int]
    numel: int
    flat_param: torch.Tensor
    flat_grad: torch.Tensor
    lo: int = 0
    hi: int = 0
    pieces: list[_Piece] = field(default_factory=list)
    external: bool = False  # gradients arrive reduced (by DDP), not reduced in step()


def _state_to_wire(local: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-parameter state metadata as JSON-ready data: dtypes by name, tensors as lists."""
    def scalar(v):
        if torch.is_tensor(v):
            return {"tensor": v.tolist(), "dtype": str(v.dtype).replace("torch.", "")}
        return v

    return {str(i): {"first": e["first"],
                     "elem": {k: str(d).replace("torch.", "") for k, d in e["elem"].items()},
                     "scalar": {k: scalar(v) for k, v in e["scalar"].items()}}
            for i, e in local.items()}


def _state_from_wire(wire: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The inverse of ``_state_to_wire`` (only torch dtypes are looked up by name)."""
    def dtype(name: str) -> torch.dtype:
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype):
            raise ValueError(f"a peer sent an unknown dtype {name!r}")
        return value

    def scalar(v):
        if isinstance(v, dict) and "tensor" in v:
            return torch.tensor(v["tensor"], dtype=dtype(v["dtype"]))
        return v

    return {int(i): {"first": e["first"],
                     "elem": {k: dtype(d) for k, d in e["elem"].items()},
                     "scalar": {k: scalar(v) for k, v in e["scalar"].items()}}
            for i, e in wire.items()}


def _describe_param(p: torch.Tensor) -> str:
    return f"{tuple(p.shape)} {str(p.dtype).replace('torch.', '')} {p.device.type}"


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
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
        comm: the ``mpiring.Communicator`` over the data-parallel ranks.
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
            stage 1 takes DDP's averaged gradients as they are. ``no_sync``
            works as with DDP: step after the synced backward.
        **defaults: hyperparameters for ``optimizer_class`` (lr, betas, ...).

    Raises:
        TypeError: a bad ``comm``, ``optimizer_class`` or parameter (sparse,
            not floating point).
        ValueError: a bad ``stage``, no parameters, or ranks that passed
            different parameters (the message names the first difference).

    After ``step``, parameters are identical on every rank. With stage 2,
    ``p.grad`` is left as this rank's local gradient (only the shard's mean is
    ever formed; with ``ddp``, only this rank's shard of ``p.grad`` is the mean,
    the rest holds partial sums); with stage 1 it is the mean over ranks.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], comm,
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 stage: int = 2, *, broadcast_params: bool = True, ddp=None,
                 **defaults: Any):
        self._initialized = False
        error: Exception | None = None
        try:
            if not all(hasattr(comm, a) for a in ("reduce_scatter", "all_gather", "rank", "size")):
                raise TypeError(f"comm must be an mpiring.Communicator (mpiring.init()), "
                                f"got {type(comm).__name__}")
            if not (isinstance(optimizer_class, type)
                    and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass such as "
                                f"torch.optim.AdamW, got {optimizer_class!r}")
            if stage not in (1, 2):
                raise ValueError(f"stage={stage!r}: use 1 (shard the optimizer state) or 2 "
                                 "(also reduce-scatter the gradients)")
            if ddp is not None and not (hasattr(ddp, "register_comm_hook")
                                        and hasattr(ddp, "reducer")):
                raise TypeError(f"ddp must be an mpiring.DistributedDataParallel, got "
                                f"{type(ddp).__name__}")
            if ddp is not None and ddp.comm.size != comm.size:
                raise ValueError(f"ddp runs on {ddp.comm.size} ranks, comm has {comm.size}: "
                                 "pass the communicator the DDP model was built with")
        except (TypeError, ValueError) as exc:
            error = exc
        if error is not None and not hasattr(comm, "mpi_comm"):
            raise error  # no communicator to agree through
        super().__init__(params, defaults)
        self.comm = comm
        self.stage = int(stage) if error is None else 2
        self.optimizer_class = optimizer_class
        self._all_params: list[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._shapes = [p.shape for p in self._all_params]
        self._group_of: list[int] = [g for g, grp in enumerate(self.param_groups)
                                     for _ in grp["params"]]
        if error is None:
            error = self._check_params()
        self._agree(error)  # every rank raises (or none does) before a byte moves

        self.rank: int = comm.rank
        self.world_size: int = comm.size
        self._consolidated: dict[str, Any] | None = None
        self._consolidated_at = -1
        self._steps = 0
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

    # --- construction ---------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group before construction ends; afterwards the flat layout is fixed."""
        if getattr(self, "_initialized", False):
            raise NotImplementedError(
                "ZeroRedundancyOptimizer lays its parameters out in flat buffers at construction: "
                "pass every parameter group to the constructor instead of add_param_group()")
        super().add_param_group(param_group)

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

    def _agree(self, error: Exception | None) -> None:
        """Raise on every rank if any rank failed its checks or passed different parameters."""
        desc = (None if error is None else f"{type(error).__name__}: {error}",
                self.stage, self.optimizer_class.__name__,
                [len(g["params"]) for g in self.param_groups],
                [_describe_param(p) for p in self._all_params])
        # JSON through byte buffers, never pickle (see mpiring.backends.control).
        table = allgather_json(self.comm, desc) if self.comm.size > 1 else [desc]
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

    def _by_dtype(self, indices: Iterable[int]) -> list[list[int]]:
        by_key: dict[tuple, list[int]] = {}
        for i in indices:
            p = self._all_params[i]
            by_key.setdefault((p.dtype, p.device), []).append(i)
        return list(by_key.values())

    def _layout(self, buckets: list[list[int]] | None = None) -> list[tuple[list[int], bool]]:
        """Segments as (parameter indices, gradients reduced by DDP already)."""
        # Alone: one segment per (dtype, device), parameters in registration order:
        # one ReduceScatter and one AllGather per dtype per step, the largest
        # messages (best bandwidth) the ring can send.
        if self._ddp is None:
            return [(seg, False) for seg in self._by_dtype(range(len(self._all_params)))]
        index_of = {id(p): i for i, p in enumerate(self._all_params)}
        reducer = self._ddp.reducer
        if buckets is None:
            buckets = [[index_of[id(reducer.params[j])] for j in bucket
                        if id(reducer.params[j]) in index_of] for bucket in reducer.bucket_params]
        covered = {i for bucket in buckets for i in bucket}
        rest = [i for i in range(len(self._all_params)) if i not in covered]
        if self.stage == 1:
            # DDP all-reduced these already; any layout will do.
            segments = [(seg, True) for seg in self._by_dtype(sorted(covered))]
        else:
            # The hook reduce-scattered each bucket: chunk r of every bucket is ours.
            segments = [(bucket, True) for bucket in buckets if bucket]
        # Parameters DDP does not reduce (not in the wrapped module): on our own.
        return segments + [(seg, False) for seg in self._by_dtype(rest)]

    def _build_segments(self, layout: list[tuple[list[int], bool]]) -> list[_Segment]:
        segments = []
        for indices, external in layout:
            first = self._all_params[indices[0]]
            dtype, device = first.dtype, first.device
            offsets, total = [], 0
            for i in indices:
                offsets.append(total)
                total += self._all_params[i].numel()
            flat_param = pages.zeros(total, dtype, device)  # huge pages: faster MPI copies
            for i, off in zip(indices, offsets):
                p = self._all_params[i]
                view = flat_param[off:off + p.numel()].view_as(p)
                view.copy_(p.detach())
                # The parameter now lives in the flat buffer: the AllGather updates the model.
                p.data = view
            lo, hi = chunk_bounds(total, self.comm.size)[self.comm.rank]
            # Gradients DDP reduced arrive in p.grad and the inner optimizer reads
            # slices of it: no buffer. Ours to reduce need the whole flat buffer.
            flat_grad = pages.zeros(0 if external else total, dtype, device)
            seg = _Segment(indices, offsets, total, flat_param, flat_grad, lo, hi,
                           external=external)
            for i, off in zip(indices, offsets):
                a, b = max(lo, off), min(hi, off + self._all_params[i].numel())
                if a < b:
                    seg.pieces.append(_Piece(i, self._group_of[i], off, a - off, b - off,
                                             seg.flat_param[a:b],
                                             flat_grad[0:0] if external else flat_grad[a:b]))
            segments.append(seg)
        return segments

    def _pieces(self):
        for seg in self._segments:
            yield from seg.pieces

    def _make_inner_optimizer(self) -> torch.optim.Optimizer:
        groups = []
        for g, group in enumerate(self.param_groups):
            inner = {k: v for k, v in group.items() if k != "params"}
            inner["params"] = [pc.view for pc in self._pieces() if pc.group == g]
            groups.append(inner)
        return self.optimizer_class(groups)

    @staticmethod
    def _sync_groups(src: list[dict], dst: list[dict]) -> None:
        for s, d in zip(src, dst):
            for k, v in s.items():
                if k != "params":
                    d[k] = v

    # --- the step ---------------------------------------------------------------
    @property
    def shard_numel(self) -> int:
        """Number of parameter elements this rank updates (and keeps state for)."""
        return sum(seg.hi - seg.lo for seg in self._segments)

    def _rebind(self) -> None:
        # Someone replaced p.data (model.to(), a load that rebinds): take the new values
        # into the flat buffer and make the parameter a view of it again.
        for seg in self._segments:
            for i, off in zip(seg.indices, seg.offsets):
                p = self._all_params[i]
                view = seg.flat_param[off:off + p.numel()]
                if p.data_ptr() != view.data_ptr() or p.dtype != view.dtype:
                    if p.shape != self._shapes[i]:
                        raise ValueError(f"parameter {i} changed shape to {tuple(p.shape)} after "
                                         "the optimizer was built: build a new optimizer")
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)

    def _has_grad(self) -> list[bool]:
        """Per parameter: does any rank have a gradient? (None on every rank: skip it, as torch does.)"""
        import numpy as np

        flags = np.array([p.grad is not None for p in self._all_params], dtype=np.uint8)
        if self.comm.size > 1:
            from mpi4py import MPI

            self.comm.mpi_comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
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

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Average the gradients, update this rank's shard, gather the parameters.

        A collective: every rank must call it. ``closure`` (re-evaluates the
        model and calls backward) runs first, before the gradients are reduced.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._rebind()
        if self._ddp is not None:
            self._follow_ddp()
        has_grad = self._has_grad()
        self._reduce_gradients()
        for pc in self._pieces():
            pc.view.grad = pc.grad if has_grad[pc.index] else None
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

    def _follow_ddp(self) -> None:
        iteration = self._ddp.reducer.iteration
        if iteration == self._ddp_iteration:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.step(): no synced backward since the last step (every "
                "backward ran under no_sync?), so the gradients were never reduced; step after "
                "a backward outside no_sync()")
        self._ddp_iteration = iteration
        if self.stage != 2:
            return
        reduced, self._reduced = self._reduced, {}
        current = [seg.indices for seg in self._segments if seg.external]
        if any(full for _, full in reduced.values()):
            # DDP's first backward: the hook all-reduced (p.grad holds the whole
            # mean) because DDP rebuilds its buckets after it. Rebuild them now and
            # lay the shards out like the new buckets before any state exists.
            self._ddp.reducer.rebuild_if_due()
            layout = self._layout()
        else:
            index_of = {id(p): i for i, p in enumerate(self._all_params)}
            layout = self._layout([[index_of[j] for j in reduced[b][0] if j in index_of]
                                   for b in sorted(reduced)])
        if [seg for seg, external in layout if external] != current:
            # The buckets changed under us: follow them, taking the state along.
            self._relayout(layout)

    def _relayout(self, layout: list[tuple[list[int], bool]]) -> None:
        # Each rank needs the old state of its new pieces: gather one (old
        # segment, key) at a time and copy out the new pieces' slices, so no rank
        # ever holds more than one segment's state tensor beyond its own shard.
        new_segments = self._build_segments(layout)
        new_pieces: dict[int, list[_Piece]] = {}
        for seg in new_segments:
            for pc in seg.pieces:
                new_pieces.setdefault(pc.index, []).append(pc)
        moved: dict[int, dict[str, Any]] = {}  # id(new piece view) -> state

        def take(seg: _Segment, key: str, buf: torch.Tensor, merged) -> None:
            for i, off in zip(seg.indices, seg.offsets):
                if i in merged and key in merged[i]["elem"]:
                    for pc in new_pieces.get(i, ()):
                        moved.setdefault(id(pc.view), {})[key] = \
                            buf[off + pc.start:off + pc.stop].clone()

        merged = self._exchange_state(take)
        self.relayouts += 1
        self._segments = new_segments
        self.optim = self._make_inner_optimizer()
        for pc in self._pieces():
            if pc.index in merged:
                scalars = {k: v.clone() if torch.is_tensor(v) else v
                           for k, v in merged[pc.index]["scalar"].items()}
                self.optim.state[pc.view] = {**scalars, **moved.get(id(pc.view), {})}

    # --- state dicts --------------------------------------------------------------
    def _per_element(self, key: str, value: Any, like_shape: torch.Size, ndim: int) -> bool:
        # State with one entry per parameter element (exp_avg, momentum_buffer, ...)
        # is sharded; anything else (the step count) is the same on every rank.
        if not torch.is_tensor(value):
            return False
        if ndim == 0:  # a 0-d parameter: only the name tells its step from its moments
            return key != "step" and value.numel() == 1
        return value.shape == like_shape

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Assemble the full optimizer state on rank ``to`` (a collective: call it on every rank).

        Every per-element state tensor is put back together with the ring
        AllGather over its segment, so each rank briefly holds one full state
        tensor of one segment at a time. Then ``state_dict()`` on rank ``to``
        (on every rank if ``to`` is None) returns the unsharded state.
        """
        if to is not None and not (isinstance(to, int) and 0 <= to < self.comm.size):
            raise ValueError(f"to={to!r}: use a rank in 0..{self.comm.size - 1}, or None for all")
        full = self._gather_state(to)
        if to is None or self.comm.rank == to:
            groups = []
            start = 0
            for group in self.param_groups:
                g = {k: v for k, v in group.items() if k != "params"}
                g["params"] = list(range(start, start + len(group["params"])))
                start += len(group["params"])
                groups.append(g)
            self._consolidated = {"state": full, "param_groups": groups}
            self._consolidated_at = self._steps
        else:
            self._consolidated = None

    def _gather_state(self, to: int | None) -> dict[int, dict[str, Any]]:
        """Full per-parameter state on rank ``to`` (or every rank if None)."""
        mine = to is None or self.comm.rank == to
        out: dict[int, dict[str, Any]] = {}

        def keep(seg: _Segment, key: str, buf: torch.Tensor, merged) -> None:
            if mine:
                for i, off in zip(seg.indices, seg.offsets):
                    if i in merged and key in merged[i]["elem"]:
                        p = self._all_params[i]
                        out.setdefault(i, {})[key] = buf[off:off + p.numel()].clone().view(p.shape)

        merged = self._exchange_state(keep)
        if not mine:
            return {}
        return {i: {**merged[i]["scalar"], **out.get(i, {})} for i in sorted(merged)}

    def _exchange_state(self, visit) -> dict[int, dict[str, Any]]:
        """Put each (segment, state key) back together and hand it to ``visit`` (collective).

        Returns the merged metadata: per parameter with state, the per-element
        keys' dtypes (``elem``) and the scalar state (``scalar``).
        """
        # 1. Metadata: which parameters have which state on which rank; scalar
        #    state travels here too (it is tiny).
        local: dict[int, dict[str, Any]] = {}
        for pc in self._pieces():
            st = self.optim.state.get(pc.view)
            if not st:
                continue
            entry = local.setdefault(pc.index, {"first": pc.start == 0, "elem": {}, "scalar": {}})
            for k, v in st.items():
                if self._per_element(k, v, pc.view.shape, 1):
                    entry["elem"][k] = v.dtype
                else:
                    entry["scalar"][k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
        if self.comm.size > 1:  # as JSON through byte buffers, never pickle
            table = [_state_from_wire(t) for t in allgather_json(self.comm, _state_to_wire(local))]
        else:
            table = [local]
        merged: dict[int, dict[str, Any]] = {}
        for entries in table:
            for i, e in entries.items():
                m = merged.setdefault(i, {"elem": {}, "scalar": {}})
                m["elem"].update(e["elem"])
                if e["first"] or not m["scalar"]:
                    m["scalar"].update(e["scalar"])
        # 2. Per-element state, one flat buffer per (segment, key) at a time: each
        #    rank fills its own chunk and the ring AllGather fills in the rest.
        for seg in self._segments:
            keys: dict[str, torch.dtype] = {}
            for i in seg.indices:
                if i in merged:
                    keys.update(merged[i]["elem"])
            for key in sorted(keys):
                buf = torch.zeros(seg.numel, dtype=keys[key], device=seg.flat_param.device)
                for pc in seg.pieces:
                    st = self.optim.state.get(pc.view)
                    if st and key in st:
                        buf[pc.offset + pc.start:pc.offset + pc.stop].copy_(st[key])
                self.comm.all_gather(buf)
                visit(seg, key, buf, merged)
                del buf
        return merged

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state, on the rank named in ``consolidate_state_dict``.

        Returns:
            ``{"state": {index: {...}}, "param_groups": [...]}`` with full-shape
            state tensors, indexed like an unsharded optimizer over the same
            parameters: load it on any number of ranks, or into a plain optimizer.

        Raises:
            RuntimeError: ``consolidate_state_dict(to=this rank)`` was not called
                on every rank since the last ``step``.
        """
        if self._consolidated is None or self._consolidated_at != self._steps:
            raise RuntimeError(
                f"the optimizer state is sharded: call consolidate_state_dict(to={self.comm.rank}) "
                "on every rank after the last step, then state_dict() on that rank")
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (consolidated or unsharded) state dict; every rank keeps its slice.

        Needs no communication: call it on every rank with the same dict, on any
        number of ranks.

        Raises:
            ValueError: the dict's parameter groups do not match this optimizer's.
        """
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "state dict does not match: it has "
                f"{[len(g['params']) for g in groups]} parameters per group, this optimizer "
                f"{[len(g['params']) for g in self.param_groups]}; build the optimizer over the "
                "same parameter groups as the one that saved it")
        # The dict's indices follow its own groups' order; map them to ours.
        index_of = {}
        pos = 0
        for g in groups:
            for saved in g["params"]:
                index_of[saved] = pos
                pos += 1
        state = {index_of[k]: v for k, v in state_dict["state"].items()}
        self._sync_groups(groups, self.param_groups)
        self._sync_groups(self.param_groups, self.optim.param_groups)
        self._load_full_state(state)
        self._consolidated = None

    def _load_full_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Keep this rank's slice of every parameter's full state."""
        self.optim.state.clear()
        for pc in self._pieces():
            full = state.get(pc.index)
            if not full:
                continue
            p = self._all_params[pc.index]
            mine = {}
            for k, v in full.items():
                if self._per_element(k, v, p.shape, p.dim()):
                    v = v.detach().reshape(-1)[pc.start:pc.stop]
                    dtype = pc.view.dtype if v.is_floating_point() else v.dtype
                    mine[k] = v.to(device=pc.view.device, dtype=dtype).clone()
                else:
                    mine[k] = v.clone() if torch.is_tensor(v) else v
            self.optim.state[pc.view] = mine


def _reduce_scatter_hook(opt: ZeroRedundancyOptimizer, bucket) -> torch.Tensor:
    """DDP comm hook for stage 2: reduce-scatter the bucket (ring), chunk ``rank`` is ours.

    Runs on the reducer's communication thread while backward goes on. Only this
    rank's chunk of the returned buffer is the mean; ``step()`` reads just that.
    """
    buf = bucket.buffer()
    comm = bucket.comm
    # DDP rebuilds its buckets after its first synced backward: all-reduce that
    # one, so the first step can lay the shards out like the rebuilt buckets.
    full = bucket.iteration == 0 and not opt._ddp.reducer.rebuilt
    if comm.size > 1:
        buf.div_(comm.size)  # divide before the sum, as everywhere in mpiring
        if full:
            comm.all_reduce(buf, op="sum", check=False)
        else:
            comm.reduce_scatter(buf, op="sum", check=False)
    opt._reduced[bucket.index()] = (tuple(id(p) for p in bucket.parameters()), full)
    return buf
