"""ZeRO's state dicts: the sharded optimizer state put back together, and split again.

``consolidate_state_dict`` reassembles every per-element state tensor with the
ring AllGather, one (segment, key) at a time; the metadata (which parameters
have which state, and the scalar state) crosses the ranks as JSON through the
control channel, never pickle. ``load_state_dict`` keeps this rank's slice of a
full state dict, with no communication.
"""

from __future__ import annotations

from typing import Any

import torch

from mpiring.parallel.zero.layout import _Segment


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


class ShardedState:
    """The optimizer's state-dict methods (a mixin of ``ZeroRedundancyOptimizer``)."""

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
            table = [_state_from_wire(t) for t in self.comm.control.allgather_json(_state_to_wire(local))]
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
