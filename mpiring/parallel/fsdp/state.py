"""Full (unsharded) state dicts of a sharded model and of its optimizer.

A full state dict does not depend on the number of ranks: saved at K ranks it
loads at any other K (each rank keeps its own chunk), or into the plain model.

* ``full_state_dict``: each unit's flat parameters are put back together with
  the ring AllGather (one unit at a time), then cut into the model's own keys.
* ``full_optim_state_dict``: the same for every per-element optimizer state
  (AdamW's ``exp_avg``, ``exp_avg_sq``), keyed by parameter name, so it is
  independent of the layout too; scalar state (``step``) is the same on
  every rank and travels as it is.

For a model that fits only sharded, ``sharded.py`` saves each rank's own slices.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _gather_flat(fsdp, unit, shard_values: torch.Tensor) -> torch.Tensor:
    """The full flat vector of ``unit`` from every rank's ``shard_values`` (collective)."""
    f = unit.flat
    buf = torch.zeros(f.numel, dtype=shard_values.dtype, device=f.device)
    buf[f.lo:f.hi].copy_(shard_values.detach())
    if fsdp.comm.size == 1 or not f.numel:
        return buf
    if fsdp.closed:  # close() freed the thread's communicator: the model's own, here
        fsdp.comm.all_gather(buf, algo=fsdp.algo, check=False)
    else:  # on the communication thread, behind anything still queued there
        comm = fsdp.thread_comm
        fsdp.runner.result(fsdp.runner.submit(
            lambda: comm.all_gather(buf, algo=fsdp.algo, check=False)))
    return buf


def full_state_dict(fsdp) -> dict[str, torch.Tensor]:
    """The unwrapped model's state_dict on every rank: same keys, full tensors."""
    fsdp.finish_init()  # an initialization in place (init_device) ends here at the latest
    fsdp.runner.wait_all()
    values: dict[str, torch.Tensor] = {}
    for u in fsdp.units:
        buf = _gather_flat(fsdp, u, u.flat.shard)
        for s in u.flat.slots:
            values[s.fqn] = buf[s.offset:s.offset + s.numel].view(s.shape).clone()
    buffers = fsdp.module.state_dict()  # what is left in the module: its buffers
    return {k: values[k] if k in values else buffers[k] for k in fsdp._keys}


def _check_keys(expected, got, what: str) -> None:
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    if missing or unexpected:
        raise KeyError(f"{what} does not match the model: missing {missing[:5]}, unexpected "
                       f"{unexpected[:5]}; load a state dict saved from the same model")


def load_full_state_dict(fsdp, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy this rank's chunk of every parameter (and every buffer) from a full state dict."""
    _check_keys(fsdp._keys, state_dict, "the state dict")
    fsdp.runner.wait_all()
    for u in fsdp.units:  # every shape first: a refused dict must leave the model as it was
        for s in u.flat.slots:
            if tuple(state_dict[s.fqn].shape) != tuple(s.shape):
                raise ValueError(f"{s.fqn}: the state dict has shape "
                                 f"{tuple(state_dict[s.fqn].shape)}, the model "
                                 f"{tuple(s.shape)}")
    fsdp.finish_init(sync=False)  # every value comes from the dict: nothing to agree
    with torch.no_grad():
        for u in fsdp.units:
            f = u.flat
            for s, a, b in f.pieces():
                at = s.offset + a - f.lo
                f.shard[at:at + b - a].copy_(state_dict[s.fqn].reshape(-1)[a:b])
        params = {s.fqn for u in fsdp.units for s in u.flat.slots}
        fsdp.module.load_state_dict({k: v for k, v in state_dict.items() if k not in params},
                                    strict=True)


def full_optim_state_dict(fsdp, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state for the unsharded model, keyed by parameter name (collective).

    Returns:
        ``{"state": {fqn: {key: full tensor or scalar}}, "param_groups":
        [hyperparameters without "params"], "per_element": [keys with one value
        per parameter element]}``. Every rank gets it.
    """
    fsdp.runner.wait_all()
    # Which per-element keys exist, agreed on every rank: a rank with an empty
    # shard has state tensors of zero elements, which look like scalars.
    keys = sorted({k for st in optimizer.state.values() for k, v in st.items()
                   if torch.is_tensor(v) and v.dim() == 1 and k != "step"})
    if fsdp.comm.size > 1:
        keys = sorted({k for t in fsdp.comm.control.allgather_json(keys) for k in t})
    out: dict[str, dict[str, Any]] = {}
    for u in fsdp.units:
        shard = u.flat.shard
        st = optimizer.state.get(shard, {})
        scalars = {k: v for k, v in st.items() if k not in keys}
        has = bool(st)
        if fsdp.comm.size > 1:  # rank 0's step count (every rank holds the same one)
            wire = fsdp.comm.control.bcast_json([has, _scalars_to_wire(scalars)])
            has, scalars = wire[0], _scalars_from_wire(wire[1])
        if not has:
            # No step ever had its gradient (a unit no backward reached): no state, as
            # torch keeps none for such a parameter (an entry of zeros would load as a
            # state without its step count).
            continue
        full = {}
        for k in keys:
            mine = st.get(k, torch.zeros(shard.numel(), dtype=shard.dtype))
            full[k] = _gather_flat(fsdp, u, mine.reshape(-1))
        for s in u.flat.slots:
            if s.fqn in out or not (full or scalars):
                continue
            entry = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()}
            for k, buf in full.items():
                entry[k] = buf[s.offset:s.offset + s.numel].view(s.shape).clone()
            out[s.fqn] = entry
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": out, "param_groups": groups, "per_element": keys}


def _scalars_to_wire(scalars: dict[str, Any]) -> dict[str, Any]:
    return {k: {"tensor": v.item(), "dtype": str(v.dtype).replace("torch.", "")}
            if torch.is_tensor(v) else v for k, v in scalars.items()}


def _scalars_from_wire(wire: dict[str, Any]) -> dict[str, Any]:
    def back(v):
        if isinstance(v, dict) and "tensor" in v:
            dtype = getattr(torch, v["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"a peer sent an unknown dtype {v['dtype']!r}")
            return torch.tensor(v["tensor"], dtype=dtype)
        return v
    return {k: back(v) for k, v in wire.items()}


def _check_optim_state(fsdp, state) -> None:
    """Refuse a state that would load nothing, or part of a unit, without a word."""
    fix = ("save it with full_optim_state_dict(model, opt) (keyed by parameter name) and load "
           "that")
    if not isinstance(state, dict) or not {"state", "param_groups", "per_element"} <= set(state):
        kind = ("torch's optimizer.state_dict() (keyed by parameter number)"
                if isinstance(state, dict) and {"state", "param_groups"} <= set(state)
                else f"a {type(state).__name__} without 'state', 'param_groups', 'per_element'")
        raise ValueError(f"load_full_optim_state_dict: got {kind}, which names no parameter "
                         f"of the model, so no state would load; {fix}")
    names = {s.fqn for u in fsdp.units for s in u.flat.slots}
    unknown = [k for k in state["state"] if k not in names]
    if unknown:
        raise ValueError(f"load_full_optim_state_dict: the state names {unknown[:5]}, which "
                         f"are not parameters of this model (its own: {sorted(names)[:3]}...): "
                         f"its state would be dropped; {fix} from the same model")
    for u in fsdp.units:
        have = [s.fqn for s in u.flat.slots if state["state"].get(s.fqn)]
        if have and len(have) != len(u.flat.slots):
            missing = [s.fqn for s in u.flat.slots if not state["state"].get(s.fqn)]
            raise ValueError(f"load_full_optim_state_dict: the state has {have[:3]} but not "
                             f"{missing[:3]} of the same unit: a unit's optimizer state is one "
                             f"flat shard, it loads whole or not at all; {fix}")


def load_full_optim_state_dict(fsdp, optimizer: torch.optim.Optimizer,
                               state: dict[str, Any]) -> None:
    """Give ``optimizer`` (over ``fsdp.parameters()``) this rank's part of a full state.

    Raises:
        ValueError: ``state`` is not ``full_optim_state_dict``'s (torch's own
            ``optimizer.state_dict()``, keyed by number), names parameters this
            model does not have, or gives a unit's parameters only in part;
            nothing is loaded then.
    """
    _check_optim_state(fsdp, state)
    if len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the optimizer state has {len(state['param_groups'])} parameter "
                         f"groups, this optimizer {len(optimizer.param_groups)}")
    for u in fsdp.units:  # every size first: a copy below would cut a larger tensor short
        for s in u.flat.slots:
            for k, v in (state["state"].get(s.fqn) or {}).items():
                n = math.prod(s.shape)
                if k in state["per_element"] and v.numel() != n:
                    raise ValueError(f"{s.fqn}: the optimizer state's {k!r} has {v.numel()} "
                                     f"elements, the parameter {n}: load the state of this "
                                     "model")
    for mine, saved in zip(optimizer.param_groups, state["param_groups"]):
        mine.update({k: v for k, v in saved.items() if k != "params"})
    with torch.no_grad():
        for u in fsdp.units:
            f = u.flat
            entries = [state["state"].get(s.fqn) for s in f.slots]
            first = next((e for e in entries if e), None)
            if first is None:
                continue
            new: dict[str, Any] = {}
            for k, v in first.items():
                if k not in state["per_element"]:
                    new[k] = v.clone() if torch.is_tensor(v) else v
                    continue
                buf = torch.zeros(f.hi - f.lo, dtype=v.dtype, device=f.device)
                for s, a, b in f.pieces():
                    at = s.offset + a - f.lo
                    buf[at:at + b - a].copy_(state["state"][s.fqn][k].reshape(-1)[a:b])
                new[k] = buf
            optimizer.state[f.shard] = new
