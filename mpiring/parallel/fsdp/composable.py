r"""``fully_shard``: torch FSDP2's composable API over ``FullyShardedDataParallel``.

A torchtitan-style script ports by changing its import::

    from mpiring import fully_shard          # was: from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)                   # bottom-up, as torch asks
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)   # the flat shards
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

There is one engine, ``FullyShardedDataParallel`` (``module.py``); this file only
decides which modules are its units and makes the model itself behave as the
wrapper does.

How bottom-up calls end in one engine. Each call builds an engine eagerly over
its module, so the parameters are sharded when it returns (the optimizer may be
built right away, and a module sharded alone, with no later call on an ancestor,
is its own root). A later call on an ancestor first takes back the full
parameters of the engines below it (``full_state_dict``, one AllGather per
unit; the modules get plain parameters and their own classes back, those engines
are closed), then builds one engine over the ancestor whose units are the
modules those calls named (and theirs, for nested calls) and whose root is the
ancestor. The gathering back costs one AllGather of each block at setup, and
holds one block's full parameters at a time beside its shards; the other way
round (deferring the sharding to the outermost call) would leave the
parameters unsharded between the calls, which torch's contract does not allow.

A model on the meta device has no values to shard: its calls only record which
modules are units (the same order of dissolving, with no communication), and
the root's ``to_empty()`` builds the engine the last call would have built, with
each unit's buffer left writable through the modules until the first forward,
so that torchtitan's ``init_weights()`` runs in place between the two.

Where the shards live. Each unit's flat shard is registered as a parameter of
its module (``_fsdp_flat``, and ``_fsdp_flat_frozen`` for the flat of its frozen
parameters), in place of the parameters the engine took over. So
``parameters()`` of the model, of a block, or of a plain parent of a block
sharded alone, yields exactly the shards the optimizer must step, as torch's
DTensor parameters are. The engine is kept in the module's ``__dict__``, not as
a submodule: the engine holds the module, and a cycle of submodules would make
``modules()`` recurse for ever.
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch
from torch import nn

from mpiring.parallel.fsdp.flat import ShardedParameter
from mpiring.parallel.fsdp.module import FullyShardedDataParallel
from mpiring.parallel.fsdp.precision import MixedPrecision
from mpiring.parallel.fsdp.unit import SHARDED

_INFO = "_mpiring_fsdp"            # a unit module's _Info, in its __dict__
# On a parameter an engine took over: where (for a tie that reaches outside the call).
_TAKEN = "_mpiring_fully_shard_taken"
_FLAT = ("_fsdp_flat", "_fsdp_flat_frozen")  # the shards' names on a unit module

#: Every module under an engine's root -> its group (top-down calls are refused).
_COVERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CLASSES: dict[type, type] = {}

_STATE = ("fully_shard: {what} on a sharded module is refused, as "
          "FullyShardedDataParallel's: a rank holds only its shards of the parameters. Use "
          "model.full_state_dict() / model.load_full_state_dict(state) on every rank (on "
          "the module fully_shard was called on last), or model.sharded_state_dict() / "
          "model.load_sharded_state_dict(state) for a model too big to gather")


class _Group:
    """One engine and the modules that share it (its root and its units' modules).

    ``engine`` is None while the model is on the meta device: the calls are recorded
    and the engine is built by the root's ``to_empty()``.
    """

    def __init__(self, engine: FullyShardedDataParallel | None, root: nn.Module, order: list):
        self.engine = engine
        self.root = root
        self.internal = 0   # >0 while the engine itself reads the modules' state dicts
        # set_reshard_after_backward asked before to_empty() built the engine: applied
        # to it then.
        self.reshard_after_backward: bool | None = None
        # Each module's parameter names in their original order, to give the plain
        # parameters back in that order (the next engine lays them out by it).
        self.order = order


class _Info:
    """What fully_shard was asked for one module: kept for the engine built later."""

    def __init__(self, orig_cls: type, reshard, mp, comm, group: _Group, sync: bool = True):
        self.orig_cls, self.reshard, self.mp, self.comm, self.group = (
            orig_cls, reshard, mp, comm, group)
        self.sync = sync  # set_requires_gradient_sync's, kept across the engines


def _info(module: nn.Module) -> _Info | None:
    return module.__dict__.get(_INFO)


class FSDPModule:
    """The class every ``fully_shard`` module gets in front of its own (``FSDP<Name>``).

    The module stays the model: ``model(x)`` runs through the engine (the root's
    forward gathers, casts and hooks; a unit's forward is its own, the engine's
    hooks gather it). ``parameters()`` gives the flat shards. ``state_dict()`` and
    ``load_state_dict()`` are refused, as ``FullyShardedDataParallel``'s are (a rank
    holds only shards): use ``full_state_dict()`` / ``load_full_state_dict()`` or
    the sharded ones, on the root. Methods that act on the whole engine
    (``set_reshard_after_backward``, ``full_state_dict``, ``clip_grad_norm_``,
    ``close``...) are called on the root, the module ``fully_shard`` was called on
    last; on another module they raise naming it. ``set_requires_gradient_sync``
    and ``set_reshard_after_forward`` act per module, as torch's.
    """

    def __new__(cls, *args, **kwargs):
        # A container indexed by a slice (nn.Sequential) builds a new module of its own
        # class: build the original class, not a sharded one without an engine.
        orig = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise RuntimeError("fully_shard: a sharded module cannot be deep-copied (its "
                           "parameters are shards tied to an engine): copy it before "
                           "fully_shard")

    # --- the engine ---------------------------------------------------------------------
    def _fsdp_group(self) -> _Group:
        return self.__dict__[_INFO].group

    def _fsdp_engine(self, what: str) -> FullyShardedDataParallel:
        engine = self._fsdp_group().engine
        if engine is None:
            raise RuntimeError(
                f"fully_shard: {what} needs the parameters, which are on the meta device: "
                f"call to_empty(device=...) on the {_info(self._fsdp_group().root).orig_cls.__name__} "
                "fully_shard was called on last, and initialize the weights, first")
        return engine

    def _fsdp_root(self, what: str) -> FullyShardedDataParallel:
        group = self._fsdp_group()
        if group.root is not self:
            raise RuntimeError(
                f"fully_shard: {what} acts on the whole engine, whose root is the "
                f"{_info(group.root).orig_cls.__name__} fully_shard was called on last: call it "
                "there (the engine syncs, keeps and saves all its units together)")
        return self._fsdp_engine(what)

    def _fsdp_units(self, recurse: bool, what: str = "this call"):
        mods = {id(m) for m in (self.modules() if recurse else [self])}
        return [u for u in self._fsdp_engine(what).units if id(u.module) in mods]

    @contextlib.contextmanager
    def _fsdp_internal(self, what: str):
        """The root's engine, ``what`` refused on any other module; meanwhile the engine
        may read the modules' own state dicts (refused to users)."""
        self._fsdp_root(what)
        group = self._fsdp_group()
        group.internal += 1
        try:
            yield group.engine
        finally:
            group.internal -= 1

    def forward(self, *args, **kwargs):
        group = self._fsdp_group()
        self._fsdp_engine("forward")
        if group.root is not self:
            # A unit: the engine's hooks on this module gather and free it.
            return super().forward(*args, **kwargs)
        if group.engine.closed:
            raise RuntimeError("fully_shard: this module's engine was closed (close()): "
                               "it can no longer run a forward")
        # The engine's forward (root gather, input cast, recording) calls the original
        # class's forward, not the module again: that would run this forward and the
        # module's own hooks twice.
        return group.engine.forward(*args, **kwargs)

    # --- torch FSDPModule's methods ----------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Reduce-scatter in the coming backwards (True) or accumulate unsharded (False):
        this module's unit, and with ``recurse`` those of the modules inside it (torch's
        per-module switch; on the root, the whole model)."""
        self._fsdp_set(recurse, "sync", "sync", bool(requires_gradient_sync))

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """Free this module's units (``recurse``: and those inside it) after their forward
        (True) or keep them for their backward. The root unit stays gathered until its
        backward whatever is asked (the engine's rule: its backward comes first)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}")
        self._fsdp_set(recurse, "reshard", "reshard_after_forward", reshard_after_forward)

    def _fsdp_set(self, recurse: bool, asked: str, unit_attr: str, value: bool) -> None:
        """A per-module setting: kept in what each module was asked (``_Info``), which a
        later engine is built with (a parent's call, a meta-device ``to_empty()``), and
        set on the units of the engine there is."""
        group = self._fsdp_group()
        mods = _members(group, self.modules() if recurse else [self])
        for _, info in mods:
            setattr(info, asked, value)
        if group.engine is not None:
            ids = {id(m) for m, _ in mods}
            for u in group.engine.units:
                if id(u.module) in ids:
                    setattr(u, unit_attr, value)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Free the units after their backward (True) or keep them for the next
        micro-batch; on the root with ``recurse=True`` (the engine's switch is global)."""
        if not recurse:
            raise ValueError("fully_shard: set_reshard_after_backward(recurse=False): the "
                             "engine's switch holds for all its units; call it on the root")
        group = self._fsdp_group()
        if group.engine is None and group.root is self:  # on the meta device: for later
            group.reshard_after_backward = bool(reshard_after_backward)
            return
        self._fsdp_root("set_reshard_after_backward").set_reshard_after_backward(
            reshard_after_backward)

    def unshard(self, async_op: bool = False):
        """Gather this module's parameters (not those of units inside it, as torch's);
        with ``async_op=True`` return a handle whose ``wait()`` ends the gather."""
        engine = self._fsdp_engine("unshard")
        engine.finish_init()  # an initialization in place ends before any gather
        units = self._fsdp_units(recurse=False)
        for u in units:
            if (u.status != SHARDED and not engine._in_backward
                    and u.flat.shard._version != u._shard_version):
                u.reshard()  # kept gathered while the shard moved on (an optimizer step)
            u.unshard()
        handle = _UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's gathered parameters (not recursive, as torch's)."""
        for u in self._fsdp_units(recurse=False):
            u.reshard()

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """Accepted and not followed: the engine prefetches the next unit of the forward
        order it recorded at the first step (and the one before in backward) by itself."""
        _check_fsdp_modules(modules)

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """Accepted and not followed, as ``set_modules_to_forward_prefetch``."""
        _check_fsdp_modules(modules)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients and the unsharded ones a no-sync backward kept."""
        super().zero_grad(set_to_none=set_to_none)
        if self._fsdp_group().engine is None:  # on the meta device: nothing kept yet
            return
        for u in self._fsdp_units(recurse=True):
            u.keep_acc(None)

    # --- mpiring's ---------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """The whole model's gradient norm clipped to ``max_norm`` (collective; on the root).
        ``torch.nn.utils.clip_grad_norm_(model.parameters())`` would see this rank's
        shards only."""
        return self._fsdp_root("clip_grad_norm_").clip_grad_norm_(
            max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def shard_masks(self, predicate) -> dict[nn.Parameter, torch.Tensor]:
        """Per flat shard of this module (and the units inside it), a bool mask of its
        elements: True where the element belongs to a parameter for which
        ``predicate(name, param)`` holds (no communication).

        ``name`` is the parameter's key in ``full_state_dict()``; ``param`` a stand-in
        with its shape (``dim()``, ``ndim``, ``shape``, ``numel()``), not its values.
        The shards are 1-D pieces of several parameters, so an optimizer's param groups
        cannot split them by parameter; this is what to do instead, for weight decay
        on some parameters only (nanoGPT's ``p.dim() >= 2``)::

            decay = model.shard_masks(lambda name, p: p.dim() >= 2)
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            ...
            with torch.no_grad():   # AdamW's own decoupled decay, before its update
                for p, mask in decay.items():
                    p[mask] *= 1 - opt.param_groups[0]["lr"] * wd
            opt.step()
        """
        masks = {}
        for u in self._fsdp_units(recurse=True, what="shard_masks"):
            flat = u.flat
            mask = torch.zeros(flat.hi - flat.lo, dtype=torch.bool, device=flat.device)
            for s, start, stop in flat.pieces():
                if predicate(s.fqn, flat.hidden[s.index]):
                    mask[s.offset + start - flat.lo:s.offset + stop - flat.lo] = True
            masks[flat.shard] = mask
        return masks

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's own ``state_dict`` keys with full tensors, on every rank (collective)."""
        with self._fsdp_internal("full_state_dict") as engine:
            return engine.full_state_dict()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Keep this rank's shard of a full state dict (no communication)."""
        with self._fsdp_internal("load_full_state_dict") as engine:
            engine.load_full_state_dict(state_dict)

    def sharded_state_dict(self, save_id: str | None = None) -> dict:
        """This rank's slices (``FullyShardedDataParallel.sharded_state_dict``)."""
        with self._fsdp_internal("sharded_state_dict") as engine:
            return engine.sharded_state_dict(save_id)

    def load_sharded_state_dict(self, state) -> None:
        """Load this rank's shard from sharded dicts (``FullyShardedDataParallel``'s)."""
        with self._fsdp_internal("load_sharded_state_dict") as engine:
            engine.load_sharded_state_dict(state)

    @property
    def fsdp_engine(self) -> FullyShardedDataParallel:
        """The engine (for ``mpiring.parallel.fsdp``'s functions that take the wrapper)."""
        return self._fsdp_engine("fsdp_engine")

    def close(self) -> None:
        """Stop the engine's thread and remove its hooks (on the root)."""
        self._fsdp_root("close").close()

    # --- state dicts: refused, as the wrapper's ------------------------------------------
    def state_dict(self, *args, **kwargs):
        """Refused, as ``FullyShardedDataParallel.state_dict``: use ``full_state_dict()``."""
        if not self._fsdp_group().internal:
            raise RuntimeError(_STATE.format(what="state_dict()"))
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Refused, as ``FullyShardedDataParallel.load_state_dict``."""
        if not self._fsdp_group().internal:
            raise RuntimeError(_STATE.format(what="load_state_dict()"))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in _FLAT:  # the engine's own: the model's keys are what it saves
            destination.pop(prefix + name, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs):
        if not self._fsdp_group().internal:  # a plain parent's load_state_dict
            raise RuntimeError(_STATE.format(what="load_state_dict()"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        mine = {prefix + name for name in _FLAT}
        missing_keys[:] = [k for k in missing_keys if k not in mine]

    def to_empty(self, *, device, recurse: bool = True):
        """The meta-device flow's materialization (torchtitan's order: build on "meta",
        ``fully_shard`` bottom-up, ``to_empty()``, initialize). Collective, on the root.

        Builds the engine with each unit laid out on ``device``, uninitialized, and the
        modules' attributes pointing into it, so that an initialization in place
        (``init_weights()``, ``reset_parameters()``, ``nn.init`` under ``no_grad``)
        writes the values; the first forward or state-dict call shards rank 0's (as
        every rank starts from rank 0's values) and frees the rest. Until then each
        rank holds the whole model. Ties are kept (torch's ``to_empty`` unties them).
        """
        group = self._fsdp_group()
        name = _info(group.root).orig_cls.__name__
        if group.engine is not None:
            raise RuntimeError("fully_shard: to_empty() on a sharded module whose parameters "
                               "have values would drop them; it belongs to the meta-device "
                               "flow (build under torch.device('meta'), fully_shard, "
                               "to_empty(), initialize)")
        if group.root is not self or not recurse:
            raise RuntimeError(f"fully_shard: to_empty() materializes the whole model at once: "
                               f"call it on the {name} fully_shard was called on last, with "
                               "recurse=True")
        made: dict[int, torch.Tensor] = {}
        for m in self.modules():  # the buffers here; the engine lays out the parameters
            for key, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[key] = made.setdefault(id(b), torch.empty_like(b, device=device))
        mods = _dissolve(group)
        info = next(i for m, i in mods if m is self)
        _build(self, [(m, i) for m, i in mods if m is not self], info.comm, info.mp,
               info.reshard, info.orig_cls, init_device=torch.device(device),
               root_sync=info.sync)
        if group.reshard_after_backward is not None:
            self.fsdp_engine.set_reshard_after_backward(group.reshard_after_backward)
        return self

    def _apply(self, fn, recurse=True):
        raise RuntimeError("fully_shard: .to()/.float()/.cuda() on a sharded module would "
                           "change its flat shards under the engine: move or cast the model "
                           "before fully_shard")


class _UnshardHandle:
    """``unshard(async_op=True)``'s handle: ``wait()`` ends the gathers."""

    def __init__(self, units):
        self.units = units

    def wait(self) -> None:
        for u in self.units:
            u.wait()
        with torch.no_grad():  # readable values; the forward makes its own views
            for u in self.units:
                u.flat.set_views()


def _check_fsdp_modules(modules) -> None:
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise ValueError(f"fully_shard: expects FSDPModule(s), got {bad}")


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def _comm_of(mesh):
    """The Communicator ``mesh`` names (None: the default group), or an error."""
    if mesh is None:
        from mpiring.comm.default import resolve

        return resolve(None, "fully_shard"), None
    if all(hasattr(mesh, a) for a in ("all_gather", "reduce_scatter", "dup", "size", "control")):
        return mesh, None
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - a torch without DeviceMesh
        DeviceMesh = ()  # noqa: N806
    if DeviceMesh and isinstance(mesh, DeviceMesh):
        if mesh.ndim > 1:
            return None, ValueError(
                f"fully_shard: a {mesh.ndim}-D DeviceMesh (HSDP: replicate over one dim, "
                "shard over the other) is not available: shard over one mpiring "
                "Communicator (mesh=None for the default group, or e.g. "
                "mpiring.ProcessGrid(...).dp)")
        return None, TypeError(
            "fully_shard: mesh is a torch DeviceMesh (torch's ProcessGroups): pass an mpiring "
            "Communicator (mesh=None for mpiring.init_process_group()'s default group, or a "
            "group from mpiring.new_group / comm.split)")
    return None, TypeError(f"fully_shard: mesh={type(mesh).__name__}: pass None (the default "
                           "group) or an mpiring Communicator")


def _mp_of(mp_policy) -> MixedPrecision | None:
    """torch's ``MixedPrecisionPolicy`` or mpiring's ``MixedPrecision`` -> the engine's."""
    if mp_policy is None:
        return None
    if isinstance(mp_policy, MixedPrecision):
        mp = mp_policy
    elif type(mp_policy).__name__ == "MixedPrecisionPolicy" and hasattr(mp_policy, "output_dtype"):
        if mp_policy.output_dtype is not None:
            raise ValueError("fully_shard: mp_policy.output_dtype is not available (the "
                             "engine casts no outputs): leave it None and cast the model's "
                             "output yourself")
        mp = MixedPrecision(param_dtype=mp_policy.param_dtype,
                            reduce_dtype=mp_policy.reduce_dtype,
                            cast_forward_inputs=mp_policy.cast_forward_inputs)
    else:
        raise TypeError(f"fully_shard: mp_policy={mp_policy!r}: pass torch's "
                        "MixedPrecisionPolicy or mpiring.parallel.fsdp.MixedPrecision")
    # torch's default policy casts nothing: no engine mixed precision at all.
    return None if mp.param_dtype is None and mp.reduce_dtype is None else mp


def _check(module, reshard_after_forward, shard_placement_fn, offload_policy,
           ignored_params, mp_policy, comm):
    """This rank's refusal of the call (an exception), or None; plus the normalized mp."""
    if not isinstance(module, nn.Module):
        return TypeError(f"fully_shard: pass one nn.Module, got {type(module).__name__} "
                         "(torch's list of modules, one unit for several, is not "
                         "available: call it on their common parent)"), None
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        return ValueError(f"fully_shard: reshard_after_forward={reshard_after_forward!r}: an "
                          "int (reshard to a smaller group after forward) is not available; "
                          "pass True, False or None"), None
    if shard_placement_fn is not None:
        return ValueError("fully_shard: shard_placement_fn is not available: the engine "
                          "shards each unit's flat vector (all its parameters back to back) "
                          "in 1/K pieces, not dim by dim; leave it None"), None
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        return ValueError(f"fully_shard: offload_policy={type(offload_policy).__name__}: "
                          "offloading is not available; keep the shards where the "
                          "parameters are (a CPU model computes on the CPU already), and "
                          "leave offload_policy out"), None
    if ignored_params:
        return ValueError("fully_shard: ignored_params is not available: every parameter "
                          "of the module is sharded. Keep a tensor out by making it a "
                          "buffer, or by holding it outside the module"), None
    try:
        mp = _mp_of(mp_policy)
    except (TypeError, ValueError) as exc:
        return exc, None
    if mp is not None and mp.param_dtype is not None and not mp.param_dtype.is_floating_point:
        return TypeError(f"fully_shard: mp_policy param_dtype={mp.param_dtype}: use a "
                         "floating dtype such as torch.bfloat16"), None
    meta = [t.is_meta for t in module.parameters()]
    if not (meta and all(meta)) and any(b.is_meta for b in module.buffers()):
        return ValueError(
            f"fully_shard: {type(module).__name__} has buffers on the meta device and "
            "parameters that are not: the engine would shard the parameters and fail on the "
            "buffers. Materialize the buffers first (to_empty, or set their values), or build "
            "the whole model on the meta device"), None
    if any(meta) and not all(meta):
        # The meta-device flow shards a model that is on "meta" as a whole (to_empty()
        # then builds the engine); a real part would have its values dropped by it.
        return ValueError(
            f"fully_shard: {type(module).__name__} has some parameters on the meta device "
            f"and {meta.count(False)} with values (or a block already sharded with values): "
            "shard a model built on the meta device as a whole (fully_shard bottom-up, then "
            "to_empty(device=...) on the model and initialize), or materialize it first "
            "(to_empty, initialize) and shard it then"), None
    for name, p in module.named_parameters(remove_duplicate=False):
        taken = getattr(p, _TAKEN, None)
        if taken is not None:
            # A parameter tied across calls (an embedding sharded alone, the output head
            # left to the model): the earlier engine holds its values, this module a stale
            # Parameter; going on would untie them silently.
            return ValueError(
                f"fully_shard: {type(module).__name__}'s parameter {name!r} is tied to "
                f"{taken}, which an earlier fully_shard call sharded: a tied parameter must "
                "be in one unit. Do not call fully_shard on one of the modules that share it "
                "alone; their common parent's call holds both (torch's answer, "
                "fully_shard([module_a, module_b]), is not available)"), None
    tie = _tie_across_recorded_calls(module)
    if tie is not None:
        return tie, None
    inside = {id(m) for m in module.modules()}
    for m in module.modules():
        group = _COVERED.get(m)
        if group is not None and id(group.root) not in inside:
            return ValueError(
                f"fully_shard: {type(module).__name__} is inside a module already sharded by "
                f"fully_shard ({type(group.root).__name__}): call fully_shard bottom-up, on "
                "the blocks first and then on the model"), None
        if group is not None and group.root is module:
            return ValueError(f"fully_shard: {type(module).__name__} was already sharded by "
                              "fully_shard; call it once per module"), None
        if group is None and any(isinstance(v, ShardedParameter) for v in vars(m).values()):
            return ValueError(f"fully_shard: {type(module).__name__} holds parameters another "
                              "engine sharded: fully_shard it instead of wrapping it"), None
        info = _info(m)
        if info is not None and m is not module:
            if info.comm is not comm:
                return ValueError(f"fully_shard: {type(m).__name__} was sharded over another "
                                  "communicator: pass the same mesh to every fully_shard "
                                  "call of a model"), None
            if info.mp != mp:
                return ValueError(f"fully_shard: {type(m).__name__} was sharded with "
                                  f"mp_policy {info.mp}, this call asks {mp}: the engine has one "
                                  "policy for all its units; pass the same mp_policy to every "
                                  "fully_shard call of a model"), None
    return None, mp


def _tie_across_recorded_calls(module: nn.Module) -> ValueError | None:
    """A parameter of ``module`` tied to one that a call on the meta device recorded for
    another module (the embedding sharded alone, the head left to the model): the
    meta-device twin of the ``_TAKEN`` check, which needs the engine to have taken it."""
    groups = {id(g): g for g in list(_COVERED.values()) if g.engine is None}
    for group in groups.values():
        inside = {id(m) for m in group.root.modules()}
        theirs = {id(p) for p in group.root.parameters()}
        for prefix, m in module.named_modules():
            if id(m) in inside:
                continue
            for name, p in m._parameters.items():
                if p is not None and id(p) in theirs:
                    where = f"{prefix}.{name}" if prefix else name
                    return ValueError(
                        f"fully_shard: {type(module).__name__}'s parameter {where!r} is tied to "
                        f"one of {_info(group.root).orig_cls.__name__}'s, which an earlier "
                        "fully_shard call sharded: a tied parameter must be in one unit. Do "
                        "not call fully_shard on one of the modules that share it alone; their "
                        "common parent's call holds both (torch's answer, "
                        "fully_shard([module_a, module_b]), is not available)")
    return None


def _agree(comm, error: Exception | None) -> None:
    """Raise on every rank if any rank refused the call (before anything moves)."""
    if comm is not None and comm.size > 1:
        table = comm.control.allgather_json(
            None if error is None else f"{type(error).__name__}: {error}")
        bad = [r for r, e in enumerate(table) if e is not None]
        if error is None and bad:
            raise ValueError(f"fully_shard: rank(s) {bad} refused the call ({table[bad[0]]}); "
                             "no rank went on")
    if error is not None:
        raise error


def _dissolve(group: _Group) -> list[tuple[nn.Module, _Info]]:
    """Give an engine's modules their full parameters and own classes back (collective).

    Returns its units' modules with what fully_shard was asked for each (an engine
    not built yet, on the meta device: its modules, root included, with no
    communication: their parameters never left them).
    """
    if group.engine is None:
        mods = _members(group, group.root.modules())
        _release(group, mods)
        return mods
    engine = group.engine
    for u in engine.units:  # the engine's own switch (no_sync, a pipeline) wrote units only
        if not u.paired:
            _info(u.module).sync = u.sync
    group.internal += 1  # the engine reads the modules' buffers through state_dict()
    try:
        full = engine.full_state_dict()
    finally:
        group.internal -= 1
    if not engine.closed:
        engine.close()
    mods = []
    for u in engine.units:
        if not any(m is u.module for m, _ in mods):
            mods.append((u.module, _info(u.module)))
    with torch.no_grad():
        for m, _ in mods:
            for name in _FLAT:
                m._parameters.pop(name, None)
        for u in engine.units:
            made: dict[int, nn.Parameter] = {}
            for s in u.flat.slots:
                p = made.get(s.index)
                if p is None:  # a shared parameter: one object in every place
                    p = made[s.index] = nn.Parameter(full[s.fqn],
                                                     requires_grad=u.flat.requires_grad)
                s.module.__dict__.pop(s.name, None)  # the view or its stand-in
                s.module._parameters[s.name] = p
    for m, names in group.order:  # the original order: the next engine lays them out by it
        m._parameters = type(m._parameters)(
            [(n, m._parameters[n]) for n in names if n in m._parameters]
            + [(n, p) for n, p in m._parameters.items() if n not in names])
    _release(group, mods)
    return mods


def _members(group: _Group, modules) -> list[tuple[nn.Module, _Info]]:
    """Those of ``modules`` that ``group``'s calls named, with what each was asked."""
    return [(m, _info(m)) for m in modules if _info(m) is not None and _info(m).group is group]


def _release(group: _Group, mods) -> None:
    """The modules' own classes back, and none of them counted as sharded."""
    for m, info in mods:
        m.__class__ = info.orig_cls
        del m.__dict__[_INFO]
    for m in list(_COVERED.keys()):
        if _COVERED.get(m) is group:
            del _COVERED[m]


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | None = None,
                shard_placement_fn=None, mp_policy=None, offload_policy=None,
                ignored_params=None) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` in place (torch FSDP2's ``fully_shard``).

    Call it bottom-up: on each block, then on the model; the calls end in one
    ``FullyShardedDataParallel`` engine over the model whose units are the blocks
    and the root (the model's leftover parameters). A module called alone is its
    own root. Returns ``module`` itself, whose class is now ``FSDP<Name>``
    (``isinstance(module, FSDPModule)``); its ``parameters()`` are the flat shards.

    Args:
        module: the module to shard (one; every rank calls with the same model).
        mesh: None (the default group of ``mpiring.init_process_group``) or an
            mpiring Communicator; the same for every call on one model.
        reshard_after_forward: True (free after forward, gather again for
            backward), False (keep until backward), or None: True, and for the
            root unit the engine keeps it gathered until its backward whatever
            is asked (torch's None for the root).
        mp_policy: torch's ``MixedPrecisionPolicy`` (``output_dtype`` None) or
            ``mpiring.parallel.fsdp.MixedPrecision``; the same for every call on
            one model (the engine has one policy).
        shard_placement_fn, offload_policy, ignored_params: torch's; only their
            defaults (None, ``OffloadPolicy()``, None or empty) are accepted.

    Every rank starts from rank 0's parameters and buffers (the engine's
    ``sync_module_states``), as torch's ranks do when built with one seed.

    Raises:
        TypeError, ValueError: on every rank, before any parameter moves: a torch
            ``DeviceMesh`` (2-D: HSDP), an int ``reshard_after_forward``, a
            ``shard_placement_fn``, an offload policy, ``ignored_params``, an
            ``output_dtype``, a policy or mesh that differs from an earlier call's
            on a submodule, a call on a module inside one already sharded
            (top-down order), a model partly on the meta device, or a parameter
            tied to one an earlier call sharded (the embedding sharded alone, the
            head left to the model).

    A model wholly on the meta device (torchtitan's flow) is sharded when the
    root's ``to_empty(device=...)`` builds the engine; it is initialized in place
    after that (``FSDPModule.to_empty``).
    """
    comm, error = _comm_of(mesh)
    mp = None
    if error is None:
        error, mp = _check(module, reshard_after_forward, shard_placement_fn, offload_policy,
                           ignored_params, mp_policy, comm)
    if comm is None and mesh is None:
        from mpiring.comm.default import default_comm
        comm = default_comm()
    _agree(comm, error)

    # The engines below (earlier bottom-up calls), outermost first, each once.
    below, seen = [], set()
    for m in module.modules():
        group = _COVERED.get(m)
        if group is not None and group.root is m and id(group) not in seen:
            seen.add(id(group))
            below.append(group)
    infos: list[tuple[nn.Module, _Info]] = []
    # From here on the call goes through: what the engine below refuses (a unit of mixed
    # dtypes, ranks whose models differ) it refuses on every rank, leaving the blocks
    # taken back as plain modules.
    for group in below:
        infos.extend(_dissolve(group))
    orig_cls = type(module)
    if any(p.is_meta for p in module.parameters()):
        # No values to shard yet: the calls are recorded, and the root's to_empty()
        # builds the engine that this call would have built.
        group = _Group(None, module, [])
        _mark(module, group, _asked(module, orig_cls, reshard_after_forward, mp, comm, group,
                                    True, infos))
        return module
    return _build(module, infos, comm, mp, reshard_after_forward, orig_cls)


def _asked(module, orig_cls, reshard, mp, comm, group, sync, below) -> list:
    """What each module of ``group`` was asked: the call's own for ``module``, and what
    the calls below asked for theirs (``below``), now of this group."""
    return [(module, _Info(orig_cls, reshard, mp, comm, group, sync))] + [
        (m, _Info(i.orig_cls, i.reshard, i.mp, comm, group, i.sync)) for m, i in below]


def _mark(module: nn.Module, group: _Group, infos) -> None:
    """Give each module its ``_Info`` and ``FSDP<Name>`` class; count all as sharded."""
    for m, info in infos:
        m.__dict__[_INFO] = info
        m.__class__ = _fsdp_class(info.orig_cls)
    for m in module.modules():
        _COVERED[m] = group


def _build(module: nn.Module, infos, comm, mp, reshard_after_forward, orig_cls,
           init_device: torch.device | None = None, root_sync: bool = True) -> nn.Module:
    """The engine over ``module`` whose units are ``infos``' modules (collective)."""
    order = [(m, list(m._parameters.keys())) for m in module.modules()]
    originals = list(module.named_parameters(remove_duplicate=False))
    engine = FullyShardedDataParallel(module, comm, auto_wrap=[m for m, _ in infos] or None,
                                      reshard_after_forward=True, mixed_precision=mp,
                                      init_device=init_device)
    group = _Group(engine, module, order)
    # The engine's forward runs the original class's forward (see FSDPModule.forward).
    engine.inner_forward = types.MethodType(orig_cls.forward, module)
    _mark(module, group, _asked(module, orig_cls, reshard_after_forward, mp, comm, group,
                                root_sync, infos))
    for u in engine.units:
        requested = _info(u.module).reshard
        u.reshard_after_forward = True if requested is None else requested
        u.sync = _info(u.module).sync
        # The shard in place of the parameters it holds: parameters() of the model, of
        # a block, or of a plain parent of a block sharded alone, gives what to step.
        u.module.register_parameter(_FLAT[1] if u.paired else _FLAT[0], u.flat.shard)
    for name, p in originals:
        # The engine holds their values now: a module outside this one that still holds
        # one of these objects (a tie) is refused by a later call (see _check).
        if not hasattr(p, _TAKEN):
            setattr(p, _TAKEN, f"{orig_cls.__name__}'s {name!r}")
    return module
