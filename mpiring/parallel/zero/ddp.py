"""ZeRO beside DDP: the stage-2 comm hook, and shards that follow DDP's bucket rebuild.

Stage 2 reduce-scatters each DDP bucket on the reducer's communication thread
as soon as backward fills it; the segments are then the buckets, so chunk r of
each bucket is rank r's shard. DDP rebuilds its buckets after the first synced
backward: that one is all-reduced, and the first step lays the shards out like
the rebuilt buckets, taking any optimizer state along.
"""

from __future__ import annotations

from typing import Any

import torch

from mpiring.parallel.zero.layout import _Piece, _Segment


class FollowDDP:
    """The optimizer's DDP methods (a mixin of ``ZeroRedundancyOptimizer``)."""

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


def _reduce_scatter_hook(opt, bucket) -> torch.Tensor:
    """DDP comm hook for stage 2: reduce-scatter the bucket (ring), chunk ``rank`` is ours.

    ``opt`` is the ``ZeroRedundancyOptimizer`` that registered it.

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
