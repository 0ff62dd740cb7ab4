"""ZeRO's flat layout: segments of parameters, and this rank's pieces of them.

A segment is one flat buffer of parameters of one dtype and device, each
parameter's ``.data`` a view into it; rank r's shard is chunk r of every
segment (``comm.chunk_bounds``), so a shard may start or end inside a
parameter, and the inner optimizer sees one 1-D view per piece.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from mpiring.core.chunking import chunk_bounds
from mpiring.runtime import pages


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


class ShardLayout:
    """The optimizer's layout methods (a mixin of ``ZeroRedundancyOptimizer``)."""

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
