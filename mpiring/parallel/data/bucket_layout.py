"""The reducer's buckets: flat gradient buffers, their layout, and the rebuild.

Buckets are laid out in reverse parameter order (gradients arrive roughly in
reverse), then rebuilt once from the order the first synced backward produced
them (``order_from_observed``), as torch's DDP does. The layout travels in
checkpoints (``layout_state``) so a resumed run reduces in the same buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpiring.parallel.data.bucketing import (
    bucket_offsets,
    compute_buckets,
    order_from_observed,
)
from mpiring.parallel.data.eager import outside_compile
from mpiring.runtime import pages


class _Bucket:
    """One flat buffer of gradients, reduced with a single AllReduce."""

    __slots__ = ("index", "params", "offsets", "numel", "flat", "tail", "dtype", "device")

    def __init__(self, index: int, params: list[int], offsets: list[int], numel: int,
                 flat: torch.Tensor, tail: int | None):
        self.index = index
        self.params = params          # global parameter indices, in fill order
        self.offsets = offsets        # element offset of each parameter in ``flat``
        self.numel = numel            # gradient elements (without the status tail)
        self.flat = flat
        self.tail = tail              # offset of the status tail (last bucket only)
        self.dtype = flat.dtype
        self.device = flat.device




class BucketLayout:
    """The reducer's layout methods (a mixin of ``Reducer``)."""

    def _build(self, order: Sequence[int] | None) -> None:
        nbytes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, str(p.device)) for p in self.params]
        groups = compute_buckets(nbytes, keys, bucket_cap_bytes=self.bucket_cap_bytes,
                                 first_bucket_bytes=self.first_bucket_bytes, order=order)
        numels = [p.numel() for p in self.params]
        tail_len = self.size + len(self.params)
        self.buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = [(-1, -1)] * len(self.params)
        for b, group in enumerate(groups):
            offsets, total = bucket_offsets(group, numels)
            last = b == len(groups) - 1
            first = self.params[group[0]]
            # On huge pages: MPI copies between processes faster (see mpiring.runtime.pages).
            flat = pages.zeros(total + (tail_len if last else 0), first.dtype, first.device)
            self.buckets.append(_Bucket(b, group, offsets, total, flat, total if last else None))
            for i, off in zip(group, offsets):
                self._where[i] = (b, off)
        self.bucket_params = [list(b.params) for b in self.buckets]
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    if p.grad is not None:
                        view = self._view(i)
                        view.copy_(p.grad)
                        p.grad = view

    def _view(self, i: int) -> torch.Tensor:
        b, off = self._where[i]
        p = self.params[i]
        return self.buckets[b].flat[off:off + p.numel()].view_as(p)

    @outside_compile
    def rebuild_if_due(self) -> bool:
        """Rebuild the buckets once, from rank 0's observed gradient order (collective).

        Called before the forward that follows the first synced backward, on every
        rank (the DDP wrapper does it). Returns True if the buckets changed.
        """
        if not self._rebuild_due:
            return False
        self._rebuild_due = False
        self.rebuilt = True
        n = len(self.params)
        # Rank 0's order decides: ranks may see different orders (data-dependent
        # control flow), and the layout must be identical everywhere.
        order = torch.tensor(order_from_observed(self._observed, n), dtype=torch.int64)
        self.comm.broadcast(order, root=0)
        order_list = order.tolist()
        if sorted(order_list) != list(range(n)):  # pragma: no cover - defensive
            raise RuntimeError("bucket rebuild: rank 0 sent an order that is not a permutation")
        old = self.bucket_params
        self._build(order=order_list)
        return self.bucket_params != old

    def layout_state(self) -> dict[str, Any]:
        """The bucket layout and iteration count, for a checkpoint (plain data).

        A resumed run must reduce with the same buckets as an uninterrupted one:
        the ring sums each element in an order that depends on where it sits in
        its bucket, so another layout changes the last bits of the mean.
        """
        due = self.rebuilt or self._rebuild_due
        return {"iteration": self.iteration,
                "order": order_from_observed(self._observed, len(self.params)) if due else None}

    def load_layout_state(self, state: dict[str, Any]) -> None:
        """Continue with the layout ``layout_state()`` saved (before the next forward).

        The buckets are rebuilt from the saved order at the next synced forward,
        by ``rebuild_if_due`` (rank 0's order, as in the run that saved it).
        """
        self.iteration = int(state["iteration"])
        order = state.get("order")
        if order is not None and not self.rebuilt:
            self._observed = [int(i) for i in order]
            self._rebuild_due = True
