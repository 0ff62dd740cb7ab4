r"""One unit's parameters as one flat buffer, sharded with the ring's chunk bounds.

A unit's parameters are laid out back to back (in module order, a shared
parameter once) in a flat vector of ``numel`` elements. Rank r keeps chunk r
of it, ``numpy.array_split`` bounds (``comm.chunk_bounds``), as its *shard*:
an ``nn.Parameter`` of ``hi - lo`` elements in the parameters' own dtype, the
only copy that persists and the one the optimizer updates::

    flat   [ w1 ........ | b1 | w2 ......... | b2 ]      numel elements
    chunks [ r0      | r1      | r2      | r3     ]      first numel % K one longer
    shard of r1 = flat[lo1:hi1]  (may start or end inside a parameter, may be empty)

A unit's frozen parameters (``requires_grad=False``: a LoRA model's base
weights, a frozen embedding) are a flat of their own whose shard and ``full``
take no gradient, so the optimizer and the ReduceScatter never see them.

The gathered vector is ``full``: a tensor that requires grad (trainable), whose storage
is allocated before a forward or backward needs the parameters and set to zero
bytes after (``untyped_storage().resize_``). The module's parameters are
replaced by views of it (``full[off:off+n].view(shape)``), made anew at each
forward, so autograd sums every view's gradient into one flat ``full.grad``:
the buffer the ReduceScatter works on. Autograd keeps the views it saved for
backward; they see the storage again once it is gathered again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mpiring.core.chunking import chunk_bounds


class ShardedParameter(torch.Tensor):
    """What a module holds for a parameter while its unit is sharded (outside its forward).

    The views of ``full`` would point at zero bytes then: reading one (logging a
    weight, another module's forward using it) read freed memory and crashed the
    process. This stand-in keeps the shape and dtype and refuses anything else,
    naming where the values are. A meta tensor: it never holds any bytes.
    """

    _fqn = "a parameter"
    # Metadata that does not read the values: allowed (a module's repr, a shape check).
    _ALLOWED = frozenset([torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
                          torch.Tensor.ndim.__get__, torch.Tensor.size, torch.Tensor.dim,
                          torch.Tensor.numel, torch.Tensor.requires_grad.__get__])

    @staticmethod
    def make(fqn: str, shape: torch.Size, dtype: torch.dtype) -> ShardedParameter:
        t = torch.Tensor._make_subclass(ShardedParameter, torch.empty(shape, dtype=dtype,
                                                                       device="meta"))
        t._fqn = fqn
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._ALLOWED:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        # Passed as a keyword too (F.layer_norm(x, shape, weight=w)): name it either way.
        fqn = next((a._fqn for a in (*args, *(kwargs or {}).values())
                    if isinstance(a, ShardedParameter)), cls._fqn)
        raise RuntimeError(
            f"FullyShardedDataParallel: {fqn} is sharded now (each rank holds 1/K of it, as "
            "the flat model.parameters()), so its module has its values only inside its "
            f"unit's forward and backward. Read it with model.full_state_dict()[{fqn!r}] (on "
            "every rank); a module that uses another unit's parameter in its forward must be "
            "in that unit: list both in one unit with auto_wrap")

    def __repr__(self, *args, **kwargs):
        return f"ShardedParameter({self._fqn}, shape={tuple(self.shape)}, dtype={self.dtype})"


@dataclass
class Slot:
    """Where one parameter lives: ``module.<name>`` is ``full[offset:offset+numel].view(shape)``."""

    module: nn.Module
    name: str
    fqn: str          # its name in the unwrapped model's state_dict
    index: int        # which distinct parameter of the unit (shared ones share it)
    offset: int
    numel: int
    shape: torch.Size


class FlatParam:
    """The flat layout, the shard and the gathered buffer of one unit.

    Args:
        places: ``(module, attribute, fqn, parameter)`` for every place a
            parameter of the unit is registered (a shared one appears several
            times and is laid out once).
        rank, size: this rank and the number of ranks the shards spread over.
        compute_dtype: the dtype of the gathered buffer (the parameters' own,
            or the mixed-precision ``param_dtype``).
        requires_grad: trainable parameters (False: frozen ones, gathered only).
        device: where parameters on the meta device are laid out (``initial``
            uninitialized there, as ``to_empty`` leaves them); None: where they are.
    """

    def __init__(self, places, rank: int, size: int, compute_dtype: torch.dtype | None = None,
                 requires_grad: bool = True, device: torch.device | None = None):
        self.requires_grad = requires_grad
        self.slots: list[Slot] = []
        offsets: dict[int, int] = {}
        index: dict[int, int] = {}
        tensors: list[torch.Tensor] = []
        numel = 0
        for module, name, fqn, p in places:
            if id(p) not in offsets:
                offsets[id(p)] = numel
                index[id(p)] = len(tensors)
                tensors.append(p)
                numel += p.numel()
            self.slots.append(Slot(module, name, fqn, index[id(p)], offsets[id(p)], p.numel(), p.shape))
        self.numel = numel
        self.sizes = [t.numel() for t in tensors]   # of the distinct parameters, in order
        self.shapes = [t.shape for t in tensors]
        self.dtype = tensors[0].dtype if tensors else torch.float32
        meta = bool(tensors) and tensors[0].is_meta and device is not None
        self.device = (torch.device(device) if meta else tensors[0].device if tensors
                       else torch.device(device or "cpu"))
        self.compute_dtype = compute_dtype or self.dtype
        self.bounds = chunk_bounds(numel, size)
        self.lo, self.hi = self.bounds[rank]
        with torch.no_grad():
            # Meta parameters have no values to lay out: one buffer for all of them,
            # never a materialized copy of each beside it.
            flat = (torch.empty(numel, dtype=self.dtype, device=self.device) if meta else
                    torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors
                    else torch.zeros(0, dtype=self.dtype, device=self.device))
        self.initial = flat  # dropped by the unit once every rank has its shard
        self.shard = nn.Parameter(flat[self.lo:self.hi].clone(), requires_grad=requires_grad)
        self.full = torch.empty(numel, dtype=self.compute_dtype, device=self.device)
        self.full.requires_grad_(requires_grad)
        # One stand-in per distinct parameter, shown by its module while it is sharded.
        self.hidden = [ShardedParameter.make(next(s.fqn for s in self.slots if s.index == i),
                                             shape, self.dtype)
                       for i, shape in enumerate(self.shapes)]
        self.free()

    @property
    def allocated(self) -> bool:
        """Whether the gathered buffer holds memory now."""
        return self.full.untyped_storage().nbytes() > 0

    def alloc(self) -> None:
        """Give the gathered buffer its memory back (contents undefined)."""
        nbytes = self.numel * self.full.element_size()
        if self.full.untyped_storage().nbytes() != nbytes:
            self.full.untyped_storage().resize_(nbytes)

    def free(self) -> None:
        """Release the gathered buffer's memory; views keep their shape, not their bytes."""
        self.full.untyped_storage().resize_(0)

    def fill_own_chunk(self) -> torch.Tensor:
        """Copy this rank's shard (cast to the compute dtype) into its chunk of ``full``.

        Returns the buffer for the AllGather (``full`` without its autograd identity).
        """
        buf = self.full.detach()
        # The copy must not bump the version autograd saved: the views it keeps
        # for backward are meant to see the data gathered again.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            buf[self.lo:self.hi].copy_(self.shard.detach())
        return buf

    def set_views(self) -> None:
        """Point every module attribute at its view of ``full`` (new views: new graph nodes)."""
        if not self.slots:
            return
        # One split for all parameters, not a slice each: a slice's backward
        # writes a zero-filled gradient of the whole unit per parameter, the
        # split's backward concatenates the parameters' gradients once.
        pieces = torch.split(self.full, self.sizes)
        views = [p.view(shape) for p, shape in zip(pieces, self.shapes)]
        for s in self.slots:
            # A plain attribute, not a Parameter: the module reads it in forward,
            # and parameters() no longer sees it (the shards are the parameters).
            # A shared parameter gets the same view in each place.
            setattr(s.module, s.name, views[s.index])

    def show_initial(self) -> None:
        """Point every module attribute at its view of ``initial`` and the shard at its
        chunk: an initialization in place (``init_weights()`` after ``to_empty()``)
        writes the values that ``keep_initial`` then shards."""
        pieces = torch.split(self.initial, self.sizes)
        views = [p.view(shape) for p, shape in zip(pieces, self.shapes)]
        for s in self.slots:
            setattr(s.module, s.name, views[s.index])
        self.shard.data = self.initial[self.lo:self.hi]

    def keep_initial(self) -> None:
        """End ``show_initial``: the shard keeps a copy of its chunk, ``initial`` goes."""
        self.shard.data = self.initial[self.lo:self.hi].clone()
        self.initial = None
        self.hide_views()

    def hide_views(self) -> None:
        """Point every module attribute at its ``ShardedParameter`` (once ``full`` is freed)."""
        for s in self.slots:
            setattr(s.module, s.name, self.hidden[s.index])

    def unregister(self) -> None:
        """Remove the original parameters from their modules (the shard replaces them)."""
        for s in self.slots:
            s.module._parameters.pop(s.name, None)
        # Stand-ins until the first gather sets the views (a view needs the bytes).
        self.hide_views()

    def pieces(self, rank: int | None = None):
        """``(slot, start, stop)`` for the part ``[start, stop)`` of each parameter in a shard.

        ``start`` and ``stop`` are offsets within the parameter; the piece sits at
        ``start + slot.offset - lo`` in the shard. Shared parameters come once.
        """
        lo, hi = (self.lo, self.hi) if rank is None else self.bounds[rank]
        seen = set()
        for s in self.slots:
            if s.index in seen:
                continue
            seen.add(s.index)
            start, stop = max(lo, s.offset), min(hi, s.offset + s.numel)
            if start < stop:
                yield s, start - s.offset, stop - s.offset
