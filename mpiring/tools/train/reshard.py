r"""Checkpoints that move between layouts: the full model and optimizer state by parameter name.

A checkpoint holds what a one-rank run would hold: the GPT's ``state_dict``
(full tensors, its own keys) and the AdamW state as full tensors keyed by the
GPT's parameter names. Saving puts the pieces back together::

    FSDP shard --full_state_dict (dp)--> this TP rank's slice
    TP slices  --broadcast from each TP rank, placed by index (tp)--> this stage's tensors
    stages     --broadcast from each stage (pp)--> the whole model, on rank 0

Every step copies values; none adds, so the full tensors are the trained bits.
Loading cuts them again: each rank keeps ``TensorParallelGPT.shard`` of its
stage's parameters (and of their AdamW moments); FSDP and ZeRO keep their own
slice of that. The data position moves as the number of windows the replicas
have read this epoch (``start * dp``), which any other dp divides when the
global batch is the same.
"""

from __future__ import annotations

from typing import Any

import torch

from mpiring.parallel.pipeline.schedules import PLACEMENT
from mpiring.tools.models.gpt_tp import TIED as _TIED
from mpiring.tools.train.grid3d import stage_of


def layout(job) -> dict[str, Any]:
    """The job's layout, as plain data: world, dp, tp, pp, and how the data axis shards."""
    g = getattr(job, "grid", None)
    cfg = job.cfg
    dp, tp, pp = g.shape if g is not None else (job.data_comm.size, cfg.tp, 1)
    return {"kind": "grid" if g is not None else "train", "world": job.comm.size, "dp": dp,
            "tp": tp, "pp": pp, "fsdp": bool(cfg.fsdp), "optimizer": cfg.optimizer}


def by_name(names: list[str], optim: dict[str, Any] | None) -> dict[str, Any] | None:
    """A torch optimizer ``state_dict`` (index-keyed, one group) keyed by parameter name."""
    if optim is None:
        return None
    groups = [{k: v for k, v in gr.items() if k != "params"} for gr in optim["param_groups"]]
    order = [i for gr in optim["param_groups"] for i in gr["params"]]
    state = {names[pos]: optim["state"][i] for pos, i in enumerate(order) if i in optim["state"]}
    return {"state": state, "param_groups": groups}


def by_index(names: list[str], optim: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``by_name`` for an optimizer over ``names`` (one parameter group)."""
    groups = optim["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups; "
                         "a training job has one")
    state = {i: optim["state"][n] for i, n in enumerate(names) if n in optim["state"]}
    return {"state": state, "param_groups": [{**groups[0], "params": list(range(len(names)))}]}


def _per_element(key: str, v, shape) -> bool:
    return key != "step" and torch.is_tensor(v) and tuple(v.shape) == tuple(shape)


# --- saving ------------------------------------------------------------------------------

def _local(job) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], list]:
    """This rank's TP-slice tensors of its stage (parameters, optimizer state) by GPT name."""
    opt = job.optimizer
    if job.fsdp is not None:
        from mpiring.parallel.fsdp import full_optim_state_dict, full_state_dict

        params = full_state_dict(job.fsdp)
        o = full_optim_state_dict(job.fsdp, opt)
        return params, o["state"], o["param_groups"]
    names = job.stage_names
    if hasattr(opt, "consolidate_state_dict"):
        opt.consolidate_state_dict(to=None)  # collective over the data axis
    o = by_name(names, opt.state_dict())
    params = {n: p.detach() for n, p in job.model.named_parameters()}
    return params, o["state"], o["param_groups"]


def _index(job, names: list[str]) -> torch.Tensor:
    """Where this TP rank's slices of ``names`` sit in their flattened full tensors."""
    out, at = [], 0
    for n in names:
        shape = job.full_shapes[n]
        full = torch.arange(at, at + int(torch.Size(shape).numel()), dtype=torch.int64)
        out.append(job.tp_model.shard(_TIED.get(n, n), full.view(shape)).reshape(-1))
        at += full.numel()
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def _tp_gather(job, names: list[str], values: list[torch.Tensor]) -> torch.Tensor:
    """The flat full tensors of ``names`` from every TP rank's slices (collective over tp)."""
    g = job.grid
    total = sum(int(torch.Size(job.full_shapes[n]).numel()) for n in names)
    flat = torch.cat([v.detach().reshape(-1) for v in values]) if values else torch.zeros(0)
    if g.tp_size == 1:
        return flat.clone()
    mine = _index(job, names)
    sizes = g.tp.control.allgather_json(int(mine.numel()))
    out = torch.empty(total, dtype=flat.dtype)
    # Highest rank first, so that rank 0's copy of a replicated tensor is the one kept.
    for r in reversed(range(g.tp_size)):
        idx = mine.clone() if r == g.tp_rank else torch.empty(sizes[r], dtype=torch.int64)
        val = flat.clone() if r == g.tp_rank else torch.empty(sizes[r], dtype=flat.dtype)
        if sizes[r]:
            g.tp.broadcast(idx, root=r)
            g.tp.broadcast(val, root=r)
        out[idx] = val
    return out


def _pp_gather(job, per_stage: dict[int, list[str]], mine: torch.Tensor, dtype) -> torch.Tensor:
    """Every stage's flat tensors, in stage order, from each stage in turn (collective over pp)."""
    g = job.grid
    parts = []
    for s in range(g.pp_size):
        n = sum(int(torch.Size(job.full_shapes[k]).numel()) for k in per_stage[s])
        buf = mine.clone() if s == g.pp_rank else torch.empty(n, dtype=dtype)
        if g.pp_size > 1 and n:
            g.pp.broadcast(buf, root=s)
        parts.append(buf)
    return torch.cat(parts)


def _assemble(job, per_stage, local: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    names = per_stage[job.grid.pp_rank]
    flat = _tp_gather(job, names, [local[n] for n in names])
    whole = _pp_gather(job, per_stage, flat.to(dtype), dtype)
    out, at = {}, 0
    for s in range(job.grid.pp_size):
        for n in per_stage[s]:
            shape = job.full_shapes[n]
            k = int(torch.Size(shape).numel())
            out[n] = whole[at:at + k].view(shape).clone()
            at += k
    return out


def grid_full_state(job) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The GPT's full ``state_dict`` and the AdamW state by name, on every rank (collective)."""
    cfg = job.model_cfg
    params, ostate, groups = _local(job)
    pp, vpp = job.grid.pp_size, job.cfg.vpp
    placement = PLACEMENT.get(job.cfg.schedule, "loop")
    per_stage = {s: [n for n in job.param_names
                     if stage_of(n, cfg.n_layers, pp, vpp, job.cfg.pp_layers, placement) == s]
                 for s in range(pp)}
    dtype = next(iter(params.values())).dtype
    full = _assemble(job, per_stage, params, dtype)
    model = {k: full[_TIED.get(k, k)] for k in job.full_keys}  # the tie: one tensor, two keys
    # Which per-element keys exist is the same on every rank (AdamW: none before step 1).
    keys = sorted({k for st in ostate.values() for k, v in st.items() if torch.is_tensor(v)
                   and k != "step"})
    keys = job.comm.control.bcast_json(keys, root=0) if job.comm.size > 1 else keys
    moments = {k: _assemble(job, per_stage, {n: st[k] for n, st in ostate.items()}, dtype)
               for k in keys}
    scalars = next(iter(ostate.values()), {})  # every parameter has taken the same steps
    step = scalars.get("step")
    state = {}
    if keys:
        for n in job.param_names:
            entry = {k: moments[k][n] for k in keys}
            if step is not None:
                entry["step"] = step.clone() if torch.is_tensor(step) else step
            state[n] = entry
    optim = {"state": state, "param_groups": groups}
    untied = _untied_head(job, params, ostate, keys, dtype)
    if untied is not None:
        # Beside the one-rank state, not in it: the model keeps the first stage's tied
        # weight (what any other layout, or one rank, loads); a PipeDream resume takes this.
        optim[UNTIED] = untied
    return model, optim


# PipeDream's last stage trains its own copy of the tied weight (``head.weight``).
UNTIED = "untied_head"
_HEAD = "head.weight"


def _untied(job) -> bool:
    return job.cfg.schedule == "pipedream" and job.grid.pp_size > 1


def _untied_head(job, params, ostate, keys: list[str], dtype) -> dict[str, torch.Tensor] | None:
    """PipeDream's last-stage copy of the tied weight and its AdamW moments, full tensors
    on every rank (collective over the last stage's tp group, then over pp); None when the
    schedule keeps the two copies equal."""
    if not _untied(job):
        return None
    g = job.grid
    last = g.pp_size - 1
    shape = job.full_shapes[_HEAD]
    out = {}
    for k in ("weight", *keys):
        if g.pp_rank == last:
            v = params[_HEAD] if k == "weight" else ostate[_HEAD][k]
            buf = _tp_gather(job, [_HEAD], [v]).to(dtype)
        else:
            buf = torch.empty(int(torch.Size(shape).numel()), dtype=dtype)
        g.pp.broadcast(buf, root=last)
        out[k] = buf.view(shape).clone()
    return out


# --- loading -----------------------------------------------------------------------------

def _check_model(job, model: dict[str, Any], only: list[str] | None = None) -> None:
    """Refuse a full state of another model before anything is loaded: cutting it would
    fail deep in a shard, or load only part of it (a checkpoint with more blocks)."""
    want = {k: job.full_shapes[k] for k in (only or job.full_keys)}
    missing = [k for k in want if k not in model]
    extra = [] if only else [k for k in model if k not in want]
    wrong = [f"{k} {tuple(model[k].shape)} here {want[k]}" for k in want
             if k in model and tuple(model[k].shape) != tuple(want[k])]
    if not (missing or extra or wrong):
        return
    what = [f"{label} {', '.join(ks[:4])}{' ...' if len(ks) > 4 else ''}"
            for label, ks in (("missing", missing), ("unexpected", extra), ("shapes", wrong))
            if ks]
    raise ValueError(f"the checkpoint holds another model than this run's GPT ({'; '.join(what)})"
                     ": resume with the model flags it was trained with (--preset, --d-model, "
                     "--layers, --heads, --seq-len)")


def load_grid_full_state(job, model: dict[str, torch.Tensor], optim: dict[str, Any] | None) -> None:
    """Keep this rank's part of a full model state and AdamW state (no communication)."""
    _check_model(job, model)
    cut = job.tp_model.shard
    names = job.stage_names
    mine = {n: cut(_TIED.get(n, n), model[_TIED.get(n, n)]) for n in names}
    untied = (optim or {}).get(UNTIED)
    own_head = untied is not None and _untied(job) and _HEAD in names
    if own_head:  # PipeDream's last stage at PipeDream again: its own copy, not the first's
        _check_model(job, {_HEAD: untied["weight"]}, only=[_HEAD])
        mine[_HEAD] = cut(_TIED[_HEAD], untied["weight"])
    local_state = {}
    for n in names:
        saved = (optim or {}).get("state", {}).get(_TIED.get(n, n))
        if saved and own_head and n == _HEAD:
            saved = {**saved, **{k: v for k, v in untied.items() if k != "weight"}}
        if saved:
            shape = job.full_shapes[_TIED.get(n, n)]
            local_state[n] = {k: cut(_TIED.get(n, n), v) if _per_element(k, v, shape) else
                              (v.clone() if torch.is_tensor(v) else v) for k, v in saved.items()}
    if job.fsdp is not None:
        from mpiring.parallel.fsdp import load_full_optim_state_dict

        job.fsdp.load_full_state_dict(mine)
        if optim is not None and local_state:
            per = sorted({k for st in local_state.values() for k in st if k != "step"})
            load_full_optim_state_dict(job.fsdp, job.optimizer, {
                "state": local_state, "param_groups": optim["param_groups"], "per_element": per})
        return
    with torch.no_grad():
        for n, p in job.model.named_parameters():
            p.copy_(mine[n])
    if optim is not None:
        job.optimizer.load_state_dict(by_index(names, {**optim, "state": local_state}))
