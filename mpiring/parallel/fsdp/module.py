r"""``FullyShardedDataParallel``: ZeRO-3 over mpiring's ring AllGather and ReduceScatter.

Each rank keeps 1/K of every parameter, of its gradient and (through the
optimizer, which sees only the shards) of the optimizer state. Per unit::

    shard (1/K) --AllGather--> full --forward--> free
                --AllGather--> full --backward--> full grad --ReduceScatter/K--> shard.grad

Model-state bytes per rank, with Psi parameters, AdamW and K ranks (the ZeRO
paper's stage 3, here with every state in the parameters' dtype of b bytes):
``(b + b + 2b) Psi / K`` (parameter, gradient, two moments), plus the gathered
parameters and unsharded gradients of the units in flight: with
``prefetch=False`` the computing unit's only, beside the root's (gathered
around the whole forward); ``prefetch=True`` one unit more (the next one
gathered early; in backward also the last one's gradient, still being
reduce-scattered). ``peak_unsharded_bytes`` counts them.

Collectives run on a communication thread with its own ``comm.dup()``: the
next unit's AllGather is queued while the current unit computes, and each
unit's ReduceScatter while backward goes on; ``loss.backward()`` returns once
every shard's gradient is in ``shard.grad``.

Every rank must run the units in the same order (the same model and control
flow), as with any FSDP: the gathers are issued in that order, and every
rank's backward must reach the same units (the reductions are issued in
backward order). So a unit that a backward did not reach was reached on no
rank: it issues no ReduceScatter and its shard keeps ``grad=None``, as torch's
parameters do, so the optimizer leaves it alone (AdamW would decay a zero
gradient's parameter and move its moments). What ``no_sync`` kept for it is
still reduced, if the unit syncs in that backward. A unit reached in part (some of its parameters unused) gets
zeros for the unused ones: a flat shard cannot leave part of itself out.
"""

from __future__ import annotations

import contextlib
import os
import threading
import zlib

import torch
from torch import nn

from mpiring.parallel.data.distributed import sync_from_root
from mpiring.parallel.fsdp.flat import FlatParam
from mpiring.parallel.fsdp.precision import _cast, _mixed
from mpiring.parallel.fsdp.runner import CommRunner
from mpiring.parallel.fsdp.unit import Unit
from mpiring.parallel.fsdp.wrap import Policy, assign_parameters, choose_units
from mpiring.parallel.zero.optimizer import whole_tensor_optimizer_error

#: Why FullyShardedDataParallel has no plain state_dict, and what to call instead.
_WHOLE_STATE = ("FullyShardedDataParallel.{what}: a rank holds only its shards of the "
                "parameters. Save with full_state_dict() on every rank (a collective; save "
                "it from one), load with load_full_state_dict() on every rank, and for the "
                "optimizer full_optim_state_dict(model, opt) / load_full_optim_state_dict "
                "(mpiring.parallel.fsdp); for a model too big to gather, sharded_state_dict() "
                "or save_sharded(dir, model, opt) / load_sharded")

#: The collectives' default algorithm: the segmented ring bounds the receive
#: buffer to a few segments whatever the unit's size.
DEFAULT_ALGO = "ring-seg"


_STEP_HOOK = None


def _watch_optimizers() -> None:
    """Refuse (at its first step) an optimizer whose state is not per element on shards.

    FSDP never sees the optimizer being built, so one global step pre-hook (registered
    once; a type check per step) looks for Adafactor or LBFGS over FSDP shards.
    """
    global _STEP_HOOK
    if _STEP_HOOK is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK = register_optimizer_step_pre_hook(_refuse_optimizer)


def _refuse_optimizer(optimizer, args, kwargs) -> None:
    error = whole_tensor_optimizer_error(type(optimizer), "FullyShardedDataParallel")
    if error is not None and any(getattr(p, "_mpiring_fsdp_shard", False)
                                 for g in optimizer.param_groups for p in g["params"]):
        raise error


class FullyShardedDataParallel(nn.Module):
    """Shard a model's parameters, gradients and optimizer state over the ranks (ZeRO-3).

    ::

        model = mpiring.FullyShardedDataParallel(GPT(cfg), comm)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # the shards
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    Args:
        module: the model (its parameters are taken over: use the wrapper).
        comm: the Communicator over the data-parallel ranks.
        auto_wrap: which submodules are units (``mpiring.parallel.fsdp.wrap``):
            "blocks" (default: each child of a ModuleList/Sequential), a
            callable, a tuple of classes, a list of submodules, or None.
        reshard_after_forward: free each unit's gathered parameters after its
            forward and gather them again for backward (ZeRO-3, 1.5x DDP's
            bytes on the wire), or keep them until backward (DDP's bytes, more
            memory; under a pipeline, until the step's last backward: one
            gather a step, except after a ``no_grad`` forward, which frees
            the unit as always). The root unit, and from the second forward on the
            last unit run, always stay until their backward (it comes next).
        mixed_precision: None, a dtype, or a ``MixedPrecision`` (float16: scale the
            loss with ``mpiring.ShardedGradScaler``, whose skip the ranks agree on).
        algo: the ring algorithm for AllGather and ReduceScatter ("ring-seg"
            or "ring"; any of ``Communicator.all_gather``'s).
        sync_module_states: start every rank from rank 0's parameters and buffers.
        prefetch: queue the next unit's AllGather while the current one computes
            (forward: the next unit, backward: the one before) and its
            ReduceScatter while backward goes on. ``False`` gathers a unit only
            when it runs and lets a unit's backward start only after the ReduceScatters
            before it finished: at most one unit's parameters and one unit's
            gradient are unsharded at a time (beside the root's), the ZeRO-3
            bound, at the price of no overlap (torch's ``limit_all_gathers``
            taken to one unit).
        init_device: for a model on the meta device (``fully_shard``'s meta-device
            flow): lay each unit out on this device, uninitialized, and leave its
            values writable through the module's attributes (plain tensors, one
            buffer per unit) for an initialization in place, until the first
            forward or state-dict call (``finish_init``), which shards rank 0's.

    Raises:
        TypeError, ValueError: bad arguments, parameters of mixed dtypes in one
            unit, a parameter shared by two units, or ranks whose models differ;
            raised on every rank before any parameter moves.
    """

    def __init__(self, module: nn.Module, comm, *, auto_wrap: Policy = "blocks",
                 reshard_after_forward: bool = True, mixed_precision=None,
                 algo: str = DEFAULT_ALGO, sync_module_states: bool = True,
                 prefetch: bool = True, init_device: torch.device | str | None = None):
        super().__init__()
        error, places, mp, units = None, [], None, []
        try:
            if not all(hasattr(comm, a) for a in ("all_gather", "reduce_scatter", "dup", "size")):
                raise TypeError(f"comm must be an mpiring.Communicator (mpiring.init()), "
                                f"got {type(comm).__name__}")
            if not isinstance(module, nn.Module):
                raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
            mp = _mixed(mixed_precision)
            if mp is not None and mp.param_dtype is not None and not mp.param_dtype.is_floating_point:
                raise TypeError(f"mixed_precision param_dtype={mp.param_dtype}: use a floating "
                                "dtype such as torch.bfloat16")
            units = choose_units(module, auto_wrap)
            places, shared = assign_parameters(module, units)
            if shared:
                raise ValueError(f"parameter(s) {shared[:3]} are shared by two units: wrap the "
                                 "modules that share a parameter in one unit (or leave them to "
                                 "the root) with auto_wrap")
            error = self._check_places(places)
        except (TypeError, ValueError) as exc:
            error = exc
        self._agree(comm, error, places)
        self.comm, self.mixed_precision, self.algo = comm, mp, algo
        self.reduce_dtype = (mp.reduce_dtype or mp.param_dtype) if mp else None
        self.reshard_after_forward = bool(reshard_after_forward)
        self.reshard_after_backward = True
        self.prefetch = bool(prefetch)
        # Gathered parameters + gradients waiting for their ReduceScatter (bytes):
        # changed by the main thread and the communication thread, hence the lock.
        self._live_lock = threading.Lock()
        self.unsharded_bytes = 0
        self.peak_unsharded_bytes = 0
        self._keys = list(module.state_dict().keys())
        self.module = module
        # What forward() runs inside the root's gather: the module, or (fully_shard, whose
        # module is the model itself and whose forward calls this one) its class's own
        # forward, so that the module's forward and hooks do not run twice.
        self.inner_forward = None
        self.closed = False
        # Its own communicator, made on every rank in the same order: the
        # thread's collectives never match a message of the main thread's.
        self.thread_comm = comm.dup()
        self._init_later = init_device is not None
        where = torch.device(init_device) if init_device is not None else None
        cpu = all((where if p.is_meta and where else p.device).type == "cpu"
                  for grp in places for (*_, p) in grp)
        if comm.backend == "mpi" and cpu and not os.environ.get("MPIRING_IDLE"):
            # Leave the cores to the unit that computes (as DDP's thread does);
            # an MPIRING_IDLE of the user's choice applies here too.
            self.thread_comm.idle = "sleep"
        # On a GPU the thread would need the streams synchronised: run inline there.
        self.runner = CommRunner(f"mpiring-fsdp-r{comm.rank}", threaded=cpu)
        self.units: list[Unit] = []
        for i, grp in enumerate(places):
            owner_module = module if i == 0 else units[i - 1]
            trainable = [pl for pl in grp if pl[3].requires_grad]
            frozen = [pl for pl in grp if not pl[3].requires_grad]
            made = []
            # A unit's frozen parameters are a unit of their own on the same module.
            for part, grad in ((trainable, True), (frozen, False)):
                if part or (grad and not frozen):  # an empty unit keeps its place
                    flat = FlatParam(part, comm.rank, comm.size,
                                     mp.param_dtype if mp else None, requires_grad=grad,
                                     device=where)
                    if self._init_later:
                        flat.unregister()
                        flat.show_initial()  # until finish_init
                    else:
                        if sync_module_states and comm.size > 1 and flat.numel:
                            comm.broadcast(flat.initial, root=0)
                            flat.shard.data.copy_(flat.initial[flat.lo:flat.hi])
                        flat.initial = None
                        flat.unregister()
                    made.append(Unit(i, owner_module, flat, self, bool(reshard_after_forward)))
            if len(made) == 2:
                made[0].frozen, made[1].paired = made[1], True
            self.units.extend(made)
        self._sync_states = sync_module_states
        if sync_module_states and comm.size > 1 and not self._init_later:
            # As raw bytes, as DDP does: a bool mask or an int16 buffer is no reducible dtype.
            sync_from_root(comm, [b.data for b in module.buffers()])
        self.shards = nn.ParameterList([u.flat.shard for u in self.units])
        for sh in self.shards:
            sh._mpiring_fsdp_shard = True  # what the optimizer check looks for
        _watch_optimizers()
        # float16 compute: the ranks compare their gradient shards' inf checks (one
        # scalar after each synced backward), as a per-rank GradScaler cannot.
        self._fp16 = (self.reduce_dtype == torch.float16
                      or any(u.flat.compute_dtype == torch.float16 for u in self.units))
        self._skip_versions: list[int] | None = None
        self._handles = []
        for u in self.units:
            if u.module is module:  # the root's: forward() calls them
                continue
            # With the keyword inputs too: a wholly frozen unit is freed when its inputs'
            # gradients are in, wherever they were passed.
            self._handles.append(u.module.register_forward_pre_hook(
                lambda m, args, kwargs, u=u: self._unit_pre_forward(u, args, kwargs),
                with_kwargs=True))
            self._handles.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: u.post_forward(out)))
        self._order: list[Unit] = []
        self._recording = False
        self._in_backward = False

    @staticmethod
    def _check_places(places) -> Exception | None:
        for i, grp in enumerate(places):
            for grad in (True, False):  # the trainable and the frozen part: a flat each
                kinds = {(p.dtype, p.device) for (*_, p) in grp if p.requires_grad == grad}
                if len(kinds) > 1:
                    return TypeError(f"unit {i} mixes parameter dtypes/devices "
                                     f"{sorted(map(str, kinds))}: cast the model to one dtype, "
                                     "or wrap the parts apart")
            for _, _, fqn, p in grp:
                if not p.is_floating_point():
                    return TypeError(f"parameter {fqn} ({p.dtype}): FSDP shards floating-point "
                                     "parameters; make it a buffer instead")
        return None

    @staticmethod
    def _agree(comm, error, places) -> None:
        """Raise on every rank if any rank failed or holds a different model."""
        def unit(g) -> list:
            distinct = {id(p): p for *_, p in g}.values()
            # Which parameter goes where in the flats, frozen or not: the same sizes laid
            # out in another order would take each other's values from rank 0.
            layout = repr([(fqn, tuple(p.shape), bool(p.requires_grad), str(p.dtype))
                           for _, _, fqn, p in g])
            return [sum(p.numel() for p in distinct if p.requires_grad),
                    sum(p.numel() for p in distinct if not p.requires_grad),
                    str(g[0][3].dtype) if g else "", zlib.crc32(layout.encode())]
        desc = [None if error is None else f"{type(error).__name__}: {error}",
                [unit(g) for g in places]]
        table = comm.control.allgather_json(desc) if comm.size > 1 else [desc]
        if error is not None:
            raise error
        bad = [r for r, d in enumerate(table) if d[0] is not None]
        if bad:
            raise ValueError(f"FullyShardedDataParallel: rank(s) {bad} rejected their arguments "
                             f"({table[bad[0]][0]}); no rank went on")
        for r, d in enumerate(table):
            if d[1] != table[0][1]:
                raise ValueError(f"FullyShardedDataParallel: the units differ between ranks "
                                 f"(r0: {table[0][1]}, r{r}: {d[1]} as [trainable numel, "
                                 "frozen numel, dtype, layout checksum]): build "
                                 "the same model with the same auto_wrap on every rank")

    def finish_init(self, sync: bool = True) -> None:
        """End ``init_device``'s initialization: each unit keeps its shard (with ``sync``,
        of rank 0's values, one Broadcast per unit, and rank 0's buffers: collective)
        and the modules show stand-ins again. Called by the first forward and the
        state-dict calls; a no-op after that, or without ``init_device``."""
        if not self._init_later:
            return
        comm = self.comm
        for u in self.units:
            if u.flat.initial is None:  # kept by a call that failed part way
                continue
            if sync and self._sync_states and comm.size > 1 and u.flat.numel:
                comm.broadcast(u.flat.initial, root=0)
            u.flat.keep_initial()
        if sync and self._sync_states and comm.size > 1:
            sync_from_root(comm, [b.data for b in self.module.buffers()])
        self._init_later = False

    # --- forward and backward ----------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.finish_init()
        roots = [u for u in self.units if u.module is self.module]  # trainable, frozen
        self._recording = not self._order
        if self._skip_versions is not None and not self._in_backward:
            self._check_same_step()
        for root in roots:
            root.pre_forward()
        mp = self.mixed_precision
        if mp is not None and mp.cast_forward_inputs:
            args, kwargs = _cast(args, mp.param_dtype), _cast(kwargs, mp.param_dtype)
        try:
            out = (self.inner_forward or self.module)(*args, **kwargs)
        finally:
            self._recording = False
        for root in roots:
            out = root.post_forward(out)
        return out

    def _unit_pre_forward(self, unit: Unit, args: tuple, kwargs: dict):
        """A unit's forward pre-hook: cast its inputs (mixed precision), then gather it."""
        self.finish_init()
        mp = self.mixed_precision
        if mp is not None and mp.cast_forward_inputs:
            # Every unit's inputs, not only the root's (torch FSDP2's per-module cast): a
            # float32 buffer added on the way (a positional table, a mask) promotes the
            # activation back to float32, which a bfloat16 LayerNorm or Linear refuses.
            args, kwargs = _cast(args, mp.param_dtype), _cast(kwargs, mp.param_dtype)
        unit.pre_forward(args, kwargs)  # after the cast: a frozen unit hooks what it gets
        return args, kwargs

    def _on_pre_forward(self, unit: Unit) -> None:
        if self._recording and unit.position is None:
            unit.position = len(self._order)
            self._order.append(unit)
        elif self.prefetch and unit.position is not None:
            # Prefetch: the next module's AllGathers run while this one computes.
            for u in self._next_module(unit, +1):
                u.unshard()

    def _prefetch_backward(self, unit: Unit) -> None:
        if self.prefetch and unit.position is not None:
            for u in self._next_module(unit, -1):
                if u.had_backward:  # a unit below every gradient has no backward
                    u.unshard()

    def _next_module(self, unit: Unit, step: int) -> list[Unit]:
        """The units (a trainable and a frozen part) of the module after (+1) or before
        (-1) ``unit``'s in the recorded forward order."""
        i = unit.position + step
        while 0 <= i < len(self._order) and self._order[i].module is unit.module:
            i += step  # its own other part
        if not 0 <= i < len(self._order):
            return []
        module = self._order[i].module
        return [u for u in self._order if u.module is module]

    def _on_backward_start(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        try:
            for u in self.units:  # unit order: the same on every rank
                # Not reached: on no rank (the same-units rule). Only what no_sync
                # kept for it goes out; without that, its gradient stays None.
                if u.sync and not u.reduced and u.acc is not None:
                    u.reduce(None)
            self.runner.wait_all()
            if any(u.sync for u in self.units) and self._fp16 and self.comm.size > 1:
                self._compare_inf()
        finally:
            for u in self.units:
                u.end_backward()
            self._in_backward = False

    def _compare_inf(self) -> None:
        """After a synced float16 backward: do the ranks agree whether a shard's gradient
        is inf/nan? If not, a per-rank GradScaler would skip on some ranks only, so the
        next forward checks that the ranks stepped alike (cheap: only after such a backward)."""
        grads = [sh.grad for sh in self.shards if sh.grad is not None and sh.grad.numel()]
        local = bool(torch.stack([~torch.isfinite(g).all() for g in grads]).any()) if grads else False
        flags = self.comm.control.allgather_array([int(local)])[:, 0]
        if flags.min() != flags.max():
            self._skip_versions = [sh._version for sh in self.shards]

    def _check_same_step(self) -> None:
        """Raise on every rank if, after a backward whose inf checks differed, some ranks
        updated their shards and others did not (a torch.amp.GradScaler per rank)."""
        before, self._skip_versions = self._skip_versions, None
        moved = int(any(sh._version != v for sh, v in zip(self.shards, before)))
        table = self.comm.control.allgather_array([moved])[:, 0]
        if not table.any():
            # No rank has stepped yet (more micro-batches of the step): check again at
            # the next forward, or a step after a backward that synced no unit would
            # pass unchecked.
            self._skip_versions = before
        elif table.min() != table.max():
            stepped = [f"r{r}" for r, m in enumerate(table) if m]
            skipped = [f"r{r}" for r, m in enumerate(table) if not m]
            raise RuntimeError(
                f"FullyShardedDataParallel: the last backward's gradient shards held inf/nan on "
                f"some ranks only, and then rank(s) {', '.join(skipped)} skipped the step while "
                f"{', '.join(stepped)} stepped: torch.amp.GradScaler checks only this rank's "
                "shards. Use mpiring.ShardedGradScaler(model) instead (it agrees the skip over "
                "the ranks); the shards now differ, so restart from a checkpoint")

    def _count(self, nbytes: int) -> None:
        """Add ``nbytes`` (negative: released) to the unsharded bytes and their peak."""
        with self._live_lock:
            self.unsharded_bytes += nbytes
            self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, self.unsharded_bytes)

    def reset_peak(self) -> None:
        """Start counting ``peak_unsharded_bytes`` again from what is unsharded now."""
        with self._live_lock:
            self.peak_unsharded_bytes = self.unsharded_bytes

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """Reduce-scatter in the coming backwards (True) or accumulate unsharded (False).

        ``no_sync()`` as a switch, for a pipeline schedule (torch FSDP2's name):
        off for every micro-batch's backward but the last, on before the last,
        so that each unit's ReduceScatter runs once a step on the sum of the
        micro-batches' gradients.
        """
        for u in self.units:
            u.sync = bool(sync)

    @property
    def sync(self) -> bool:
        """Whether every unit reduce-scatters in the coming backwards."""
        return all(u.sync for u in self.units)

    def set_reshard_after_forward(self, reshard: bool) -> None:
        """Free each unit's gathered parameters after its forward (True, ZeRO-3) or keep
        them for its backward (False); the constructor's ``reshard_after_forward``."""
        self.reshard_after_forward = bool(reshard)
        for u in self.units:
            u.reshard_after_forward = self.reshard_after_forward

    def set_reshard_after_backward(self, reshard: bool) -> None:
        """Free each unit's gathered parameters after its backward (True, the default) or
        keep them for the next micro-batch (False: a pipeline's micro-batches but the
        last, torch FSDP2's name). With ``reshard_after_forward=False`` as well, each
        unit is gathered once for all of them; the next backward with True frees it."""
        self.reshard_after_backward = bool(reshard)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate unsharded gradients locally; the next synced backward reduces them all."""
        before = [u.sync for u in self.units]
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for u, sync in zip(self.units, before):
                u.sync = sync

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients and the unsharded ones no_sync kept."""
        super().zero_grad(set_to_none=set_to_none)
        for u in self.units:
            u.keep_acc(None)

    # --- gradients and state ---------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale the shards' gradients so that their global norm is at most ``max_norm``.

        The norm is over every rank's shard (and, with tensor-parallel layers
        inside, every rank of their group): ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model (``mpiring.parallel.clip``). Returns it.
        """
        from mpiring.parallel.clip import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def state_dict(self, *args, **kwargs):
        """Refused: nn.Module's would hold this rank's flat shards only, under names of
        their own, and loading it on every rank would give each rank rank r's slices."""
        raise RuntimeError(_WHOLE_STATE.format(what="state_dict()"))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Refused, as ``state_dict`` (see there)."""
        raise RuntimeError(_WHOLE_STATE.format(what="load_state_dict()"))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped model's ``state_dict`` (same keys), on every rank (collective)."""
        from mpiring.parallel.fsdp.state import full_state_dict

        return full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep this rank's shard of a full state dict (no communication)."""
        from mpiring.parallel.fsdp.state import load_full_state_dict

        load_full_state_dict(self, state_dict)

    def sharded_state_dict(self, save_id: str | None = None) -> dict:
        """This rank's slices of every parameter, keyed by the unwrapped model's names, each
        with its element range and full shape (no copy: views of the shards; no
        communication, but the first call after a meta-device ``to_empty()``, which ends
        its initialization on every rank). ``mpiring.parallel.fsdp.sharded.sharded_state_dict``
        says what it holds."""
        from mpiring.parallel.fsdp.sharded import sharded_state_dict

        return sharded_state_dict(self, save_id)

    def load_sharded_state_dict(self, state) -> None:
        """Load this rank's shard from its own sharded dict (same world size and wrap) or
        from the list of every saved rank's (any world size and wrap); no communication."""
        from mpiring.parallel.fsdp.sharded import load_sharded_state_dict

        load_sharded_state_dict(self, state)

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for h in self._handles:
            h.remove()
        for u in self.units:
            u.remove_hooks()
        self.runner.close()
        self.thread_comm.free()  # the thread's duplicate: MPI has a few thousand
        self.closed = True  # the state dicts still gather, on self.comm
