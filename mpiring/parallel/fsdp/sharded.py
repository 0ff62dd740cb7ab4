"""Sharded state dicts of a sharded model and its optimizer: each rank's own slices.

A full state dict puts every parameter together on every rank; a model that fits only
sharded cannot be saved that way. A sharded state dict holds this rank's slices alone,
keyed by the unwrapped model's names, each saying which element range of the flattened
parameter it holds and the full shape (torch DCP's chunk metadata). Saving it needs no
communication and no copy (the values are views of the shards). Loading it at the same
world size and wrap copies this rank's own slices back; at another world size or wrap,
each rank copies the overlap of every saved slice with its new slices, straight into
its shard: no rank ever holds a whole parameter.

``save_sharded`` / ``load_sharded``: a file per rank and an index, written
atomically as ``mpiring.parallel.checkpoint``'s files are.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
from typing import Any

import torch

from mpiring.parallel.checkpoint import _remove_stale_temporaries, write_atomic
from mpiring.parallel.fsdp.state import _scalars_from_wire, _scalars_to_wire

SHARDED_FORMAT = "mpiring-fsdp-sharded-1"
INDEX_NAME = "index.pt"
_SHARD_FILE = re.compile(r"^shard-(\d{5,})-of-(\d{5,})\.pt$")


def shard_file_name(rank: int, world_size: int) -> str:
    """``shard-00002-of-00004.pt``: rank 2's file of a 4-rank save."""
    return f"shard-{rank:05d}-of-{world_size:05d}.pt"


def _canonical(fsdp) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """``name -> first name`` of its tensor (tied weights share one), and the shapes."""
    canon, shapes = {}, {}
    for u in fsdp.units:
        first: dict[int, str] = {}
        for s in u.flat.slots:
            canon[s.fqn] = first.setdefault(s.index, s.fqn)
            shapes[s.fqn] = tuple(int(d) for d in s.shape)
    return canon, shapes


def _header(fsdp, kind: str, save_id: str | None) -> dict[str, Any]:
    if save_id is not None and not isinstance(save_id, str):
        raise TypeError(f"save_id={save_id!r}: give a string (the same on every rank), or None")
    canon, shapes = _canonical(fsdp)
    return {"format": SHARDED_FORMAT, "kind": kind, "save_id": save_id,
            "rank": fsdp.comm.rank, "world_size": fsdp.comm.size,
            "shapes": {c: list(shapes[c]) for c in dict.fromkeys(canon.values())},
            "aliases": {n: c for n, c in canon.items() if n != c}}


def _own_slices(f):
    """``(slot, start, stop, at)``: this rank's piece ``[start, stop)`` of each parameter
    of flat ``f``, found at ``shard[at:at + stop - start]``."""
    for s, a, b in f.pieces():
        yield s, a, b, s.offset + a - f.lo


def sharded_state_dict(fsdp, save_id: str | None = None) -> dict[str, Any]:
    """This rank's slices of the model, keyed by the unwrapped model's names (no communication,
    except that the first call after a meta-device ``to_empty()`` ends its initialization
    on every rank: ``finish_init``).

    Args:
        save_id: a string, the same on every rank of one save (``save_sharded`` makes
            one): loading then refuses dicts of two different saves mixed together.

    Returns:
        ``{"format", "kind": "model", "save_id", "rank", "world_size", "shapes": {name:
        full shape}, "aliases": {tied name: its first name}, "params": {name: {"shape",
        "start", "stop", "values"}}, "buffers": {name: tensor}}``: ``values`` holds the
        elements ``[start, stop)`` of the flattened parameter, a parameter this rank holds
        no element of has no entry, a tied parameter is under its first name only. Like
        ``nn.Module.state_dict()`` it references the live tensors (the values are views
        of the shards: no copy, no memory): save it, or clone it, before the next step.
    """
    fsdp.finish_init()
    fsdp.runner.wait_all()  # nothing queued may still write a shard
    out = _header(fsdp, "model", save_id)
    params: dict[str, dict[str, Any]] = {}
    for u in fsdp.units:
        shard = u.flat.shard.detach()
        for s, a, b, at in _own_slices(u.flat):
            params[s.fqn] = {"shape": list(s.shape), "start": a, "stop": b,
                             "values": shard[at:at + b - a]}
    out["params"] = params
    # What the module still holds are its buffers (the parameters are the shards'): each
    # rank's own, as DDP lets each rank's forward update its own (BatchNorm's statistics).
    out["buffers"] = fsdp.module.state_dict()
    return out


def _per_element(key: str, value: Any, n: int) -> bool:
    # One value per shard element; "step" is a count even when it is a 1-element tensor.
    return key != "step" and torch.is_tensor(value) and value.dim() == 1 and value.numel() == n


def sharded_optim_state_dict(fsdp, optimizer: torch.optim.Optimizer,
                             save_id: str | None = None) -> dict[str, Any]:
    """This rank's slices of the optimizer state, keyed by parameter name (no communication).

    Returns:
        ``sharded_state_dict``'s header with ``"kind": "optim"``, ``"state": {name:
        {"shape", "start", "stop", "values": {key: slice}, "scalars": {key: value}}}``
        and ``"param_groups"`` (the hyperparameters, without "params"). A parameter of a
        unit that has state gets an entry on every rank, an empty range (``start ==
        stop``) where this rank holds none of it, so that each rank's file carries the
        scalar state (``step``) even with an empty shard. References the live state,
        as ``optimizer.state_dict()`` does.
    """
    fsdp.runner.wait_all()
    out = _header(fsdp, "optim", save_id)
    state: dict[str, dict[str, Any]] = {}
    for u in fsdp.units:
        f = u.flat
        st = optimizer.state.get(f.shard)
        if not st:  # no step ever had its gradient: torch keeps no state either
            continue
        n = f.hi - f.lo
        per = {k: v.detach() for k, v in st.items() if _per_element(k, v, n)}
        scalars = {k: v for k, v in st.items() if k not in per}
        own = {s.index: (a, b, at) for s, a, b, at in _own_slices(f)}
        seen: set[int] = set()
        for s in f.slots:
            if s.index in seen:
                continue
            seen.add(s.index)
            a, b, at = own.get(s.index, (0, 0, 0))
            state[s.fqn] = {"shape": list(s.shape), "start": a, "stop": b,
                            "values": {k: v[at:at + b - a] for k, v in per.items()},
                            "scalars": scalars}
    out["state"] = state
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                           for g in optimizer.param_groups]
    return out


def _json(obj: Any) -> Any:
    """``obj`` as the control channel hands it back (lists for tuples), to compare."""
    return json.loads(json.dumps(obj))


def _meta(sd: Any, kind: str) -> dict[str, Any]:
    """What a sharded dict holds, without its values (plain data), after checking that it
    is one: the same on every rank that reads it, and what the index records per rank."""
    fix = (f"give what sharded_{'state' if kind == 'model' else 'optim_state'}_dict() "
           "returned (or its file, saved by save_sharded)")
    if not isinstance(sd, dict) or sd.get("format") != SHARDED_FORMAT:
        got = (f"a dict with format {sd.get('format')!r}" if isinstance(sd, dict)
               else f"a {type(sd).__name__}")
        raise ValueError(f"not a sharded state dict (format {SHARDED_FORMAT!r}): got {got}; "
                         f"{fix}")
    if sd.get("kind") != kind:
        raise ValueError(f"a sharded state dict of kind {sd.get('kind')!r} where {kind!r} is "
                         f"needed (the model's and the optimizer's are apart); {fix}")
    meta = {k: sd[k] for k in ("save_id", "rank", "world_size", "shapes", "aliases")}
    entries: dict[str, Any] = {}
    for name, e in sd["params" if kind == "model" else "state"].items():
        a, b = int(e["start"]), int(e["stop"])
        tensors = {"": e["values"]} if kind == "model" else e["values"]
        for k, v in tensors.items():
            if not torch.is_tensor(v) or v.numel() != b - a:
                raise ValueError(f"{name}: the entry of rank {sd['rank']} says elements "
                                 f"[{a}, {b}) but {k or 'values'} holds "
                                 f"{v.numel() if torch.is_tensor(v) else type(v).__name__}; "
                                 f"{fix}")
        if kind == "model":
            entries[name] = [a, b, list(e["shape"]), str(e["values"].dtype)]
        else:
            entries[name] = [a, b, list(e["shape"]),
                             {k: str(v.dtype) for k, v in sorted(e["values"].items())},
                             _scalars_to_wire(e["scalars"])]
    meta["entries"] = entries
    if kind == "model":
        meta["buffers"] = {k: list(v.shape) for k, v in sd["buffers"].items()}
    else:
        meta["groups"] = len(sd["param_groups"])
    return _json(meta)


def _plan(fsdp, metas: list[dict[str, Any]], kind: str, whole: bool, what: str) -> dict:
    """Check a set of saved ranks' metadata against the model; where each slice comes from.

    The checks read metadata only and depend on nothing but ``metas`` and the model, so
    every rank given the same set reaches the same verdict, with no communication.

    Args:
        whole: ``metas`` claims every saved rank (any layout may load it); else it is
            this rank's own dict alone, which loads only into the layout that saved it.

    Returns:
        ``{"canon": model name -> saved name, "slices": saved name -> [(start, stop, i)]
        (i: the position in metas), "K": the saved world size}``.

    Raises:
        ValueError: naming what does not match and how to get a set that does.
    """
    ids: dict[Any, list[int]] = {}
    for m in metas:
        ids.setdefault(m["save_id"], []).append(m["rank"])
    if len(ids) > 1:
        shown = "; ".join(f"save {sid!r}: rank(s) {sorted(r)}" for sid, r in ids.items())
        raise ValueError(f"{what}: the files come from {len(ids)} different saves ({shown}); "
                         "give every rank's file of one save (one save_sharded directory)")
    sizes = sorted({m["world_size"] for m in metas})
    ranks = [m["rank"] for m in metas]
    if len(sizes) != 1 or len(set(ranks)) != len(ranks):
        raise ValueError(f"{what}: the set mixes saves of {sizes} ranks, or repeats a rank "
                         f"({sorted(ranks)}): give each saved rank's file once, all of one save")
    k = sizes[0]
    if whole:
        missing = sorted(set(range(k)) - set(ranks))
        if missing or any(not 0 <= r < k for r in ranks):
            raise ValueError(f"{what}: saved at {k} ranks, but the set holds rank(s) "
                             f"{sorted(ranks)}: rank(s) {missing} missing, so it does not "
                             "cover every element; give every saved rank's file")
    elif k != fsdp.comm.size or ranks != [fsdp.comm.rank]:
        raise ValueError(f"{what}: one dict loads only on the rank that saved it, at the same "
                         f"world size (this is r{fsdp.comm.rank} of {fsdp.comm.size}; the dict "
                         f"is r{ranks[0]} of {k}); to load at another world size or wrap, pass "
                         "the list of every saved rank's dicts, or use load_sharded(path_dir)")
    first = metas[0]
    if any(m["shapes"] != first["shapes"] or m["aliases"] != first["aliases"] for m in metas):
        raise ValueError(f"{what}: the saved ranks describe different models (names or "
                         "shapes differ between their files): files of different saves mixed")
    canon, shapes = _canonical(fsdp)
    saved_canon = {n: first["aliases"].get(n, n) for n in [*first["shapes"], *first["aliases"]]}
    lacks = sorted(set(saved_canon) - set(canon))
    absent = sorted(set(canon) - set(saved_canon))
    if lacks or absent:
        raise ValueError(f"{what}: the save names {lacks[:5]}, which the model lacks, and lacks "
                         f"{absent[:5]} of the model's: load a save of the same model "
                         "(the unwrapped model's parameter names)")
    for n in canon:
        saved = tuple(first["shapes"][saved_canon[n]])
        if saved != shapes[n]:
            raise ValueError(f"{what}: {n} was saved with shape {saved}, the model's is "
                             f"{shapes[n]}: load a save of the same model configuration")
    # A tensor the model ties under several names must be one tensor in the save too
    # (the other way round, a saved tie now untied, each name loads the same values).
    groups: dict[str, set[str]] = {}
    for n, c in canon.items():
        groups.setdefault(c, set()).add(saved_canon[n])
    for c, from_ in groups.items():
        if len(from_) > 1:
            raise ValueError(f"{what}: the model ties {sorted(n for n in canon if canon[n] == c)}"
                             f" (one tensor), the save holds them apart {sorted(from_)}")
    slices: dict[str, list[tuple[int, int, int]]] = {}
    for i, m in enumerate(metas):
        for n, (a, b, shape, *_) in m["entries"].items():
            if n not in first["shapes"] or shape != first["shapes"][n]:
                raise ValueError(f"{what}: rank {m['rank']}'s file holds {n} of shape {shape}, "
                                 f"which its save lists as {first['shapes'].get(n)}: a damaged "
                                 "or foreign file")
            numel = math.prod(first["shapes"][n])
            if not 0 <= a <= b <= numel:
                raise ValueError(f"{what}: rank {m['rank']}'s slice [{a}, {b}) of {n} is "
                                 f"outside its {numel} elements")
            if a < b:
                slices.setdefault(n, []).append((a, b, i))
    for n, got in slices.items():
        got.sort()
        for (_, b0, i0), (a1, _, i1) in zip(got, got[1:]):
            if a1 < b0:
                raise ValueError(f"{what}: ranks {metas[i0]['rank']} and {metas[i1]['rank']} "
                                 f"both hold elements [{a1}, {b0}) of {n}: not one save's files")
    # Which saved names must be whole: all of them (model), or those with state (optim).
    need = set(groups) if kind == "model" else {n for m in metas for n in m["entries"]}
    if whole:
        for n in sorted(need):
            s = saved_canon[n]
            at = 0
            for a, b, _ in slices.get(s, []):
                if a != at:
                    break
                at = b
            if at != math.prod(first["shapes"][s]):
                raise ValueError(f"{what}: elements [{at}, ...) of {s} are in no file of the "
                                 f"set (saved at {k} ranks): it does not cover every element; "
                                 "give every saved rank's file of one save")
    else:
        for u in fsdp.units:
            for s, a, b in u.flat.pieces():
                if kind == "optim" and saved_canon[s.fqn] not in first["entries"]:
                    continue
                if not any(x <= a and b <= y for x, y, _ in slices.get(saved_canon[s.fqn], [])):
                    raise ValueError(f"{what}: the dict does not hold elements [{a}, {b}) of "
                                     f"{s.fqn}, which this rank's shard holds: it was saved "
                                     "with another wrap; pass every saved rank's dicts, or use "
                                     "load_sharded(path_dir)")
    return {"canon": {n: saved_canon[n] for n in canon}, "slices": slices, "K": k}


def _copy_into(dest: torch.Tensor, name: str, a: int, b: int, plan: dict, get) -> None:
    """Fill ``dest`` (elements ``[a, b)`` of saved parameter ``name``) from the saved slices
    that overlap it: ``get(i, name)`` is the i-th saved rank's flat values of ``name``."""
    for x, y, i in plan["slices"].get(name, []):
        lo, hi = max(a, x), min(b, y)
        if lo < hi:
            dest[lo - a:hi - a].copy_(get(i, name)[lo - x:hi - x])


def _load_model(fsdp, plan: dict, get, buffers: dict[str, torch.Tensor]) -> None:
    fsdp.finish_init(sync=False)  # every value comes from the save: nothing to agree
    with torch.no_grad():
        for u in fsdp.units:
            shard = u.flat.shard.detach()
            for s, a, b, at in _own_slices(u.flat):
                _copy_into(shard[at:at + b - a], plan["canon"][s.fqn], a, b, plan, get)
        fsdp.module.load_state_dict(buffers, strict=True)


def _buffer_source(fsdp, metas: list[dict[str, Any]]) -> int:
    """Whose buffers this rank takes: its own at the same world size, else saved rank 0's
    (as ``sync_module_states`` starts every rank from rank 0's)."""
    want = fsdp.comm.rank if metas[0]["world_size"] == fsdp.comm.size else 0
    return next(i for i, m in enumerate(metas) if m["rank"] == want or len(metas) == 1)


def _check_buffers(fsdp, meta: dict[str, Any], what: str) -> None:
    mine = {k: list(v.shape) for k, v in fsdp.module.state_dict().items()}
    if meta["buffers"] != mine:
        raise ValueError(f"{what}: the saved buffers {sorted(meta['buffers'])[:5]} (shapes "
                         f"{list(meta['buffers'].values())[:5]}) are not the model's "
                         f"{sorted(mine)[:5]} ({list(mine.values())[:5]}): load a save of "
                         "the same model")


def _as_set(state: Any) -> tuple[list[Any], bool]:
    if isinstance(state, (list, tuple)):
        if not state:
            raise ValueError("an empty list of sharded state dicts: give every saved rank's")
        return list(state), True
    return [state], False


def load_sharded_state_dict(fsdp, state: Any) -> None:
    """Load this rank's shard from sharded state dicts (no communication).

    Args:
        state: this rank's own ``sharded_state_dict()`` (same world size and wrap: its
            slices are this rank's shard), or the list of every saved rank's dicts, of
            any world size and wrap (files opened with ``mmap=True`` and ``weights_only=True``
            read only the pages this rank copies). Each rank copies the overlap of each
            saved slice with its own slices straight into its shard.

    Raises:
        ValueError: a set that does not cover every element, names the model lacks,
            shapes that differ, dicts of two saves (``save_id``) mixed, a lone dict of
            another rank or layout. Given the same list, every rank raises alike; nothing
            has changed then.
    """
    what = "load_sharded_state_dict"
    dicts, whole = _as_set(state)
    metas = [_meta(d, "model") for d in dicts]
    plan = _plan(fsdp, metas, "model", whole, what)
    src = _buffer_source(fsdp, metas)
    _check_buffers(fsdp, metas[src], what)
    fsdp.runner.wait_all()
    _load_model(fsdp, plan, lambda i, n: dicts[i]["params"][n]["values"],
                dicts[src]["buffers"])


def _plan_optim(fsdp, optimizer, metas, whole: bool, groups: int, what: str) -> dict:
    plan = _plan(fsdp, metas, "optim", whole, what)
    if groups != len(optimizer.param_groups):
        raise ValueError(f"{what}: the saved optimizer has {groups} parameter groups, this one "
                         f"{len(optimizer.param_groups)}: build it as the saved one was")
    # What each saved name carries (the same on every rank that has an entry for it).
    info = {}
    for m in metas:
        for n, (_a, _b, _shape, keys, scalars) in m["entries"].items():
            info.setdefault(n, (keys, scalars))
    units = {}
    for u in fsdp.units:
        names = list(dict.fromkeys(plan["canon"][s.fqn] for s in u.flat.slots))
        have = [n for n in names if n in info]
        if have and len(have) != len(names):
            raise ValueError(f"{what}: the save has optimizer state for {have[:3]} but not "
                             f"{[n for n in names if n not in info][:3]}, which this wrap puts "
                             "in one unit: a unit's state is one flat shard, whole or none")
        if have and any(info[n] != info[have[0]] for n in have):
            odd = next(n for n in have if info[n] != info[have[0]])
            raise ValueError(f"{what}: {have[0]} and {odd} have different optimizer state "
                             f"(keys or step: {info[have[0]]} and {info[odd]}) and this wrap "
                             "puts them in one unit, which has one: load with the saved wrap")
        units[id(u)] = info[have[0]] if have else None
    plan["units"] = units
    return plan


def _load_optim(fsdp, optimizer, plan: dict, get, scalars_of, param_groups) -> None:
    for mine, saved in zip(optimizer.param_groups, param_groups):
        mine.update({k: v for k, v in saved.items() if k != "params"})
    with torch.no_grad():
        for u in fsdp.units:
            f = u.flat
            info = plan["units"][id(u)]
            if info is None:
                # No state saved (a unit no backward reached): none, as in the saved run.
                optimizer.state.pop(f.shard, None)
                continue
            keys, _ = info
            first = plan["canon"][f.slots[0].fqn]
            group = next((g for g in optimizer.param_groups
                          if any(p is f.shard for p in g["params"])), {})
            # A capturable or fused optimizer keeps its step on the parameter's device (as
            # torch's Optimizer.load_state_dict puts it); the others keep it on the CPU.
            device = f.device if group.get("capturable") or group.get("fused") else None
            new = {k: (v.to(device, copy=True) if torch.is_tensor(v) else v)
                   for k, v in scalars_of(first).items()}
            for k, dtype in keys.items():
                buf = torch.zeros(f.hi - f.lo, dtype=getattr(torch, dtype.replace("torch.", "")),
                                  device=f.device)
                for s, a, b, at in _own_slices(f):
                    _copy_into(buf[at:at + b - a], plan["canon"][s.fqn], a, b, plan,
                               lambda i, n, k=k: get(i, n)[k])
                new[k] = buf
            optimizer.state[f.shard] = new


def load_sharded_optim_state_dict(fsdp, optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Give ``optimizer`` (over ``fsdp.parameters()``) this rank's part of a sharded state.

    Args:
        state: this rank's own ``sharded_optim_state_dict()`` (same world size and wrap),
            or the list of every saved rank's, of any world size and wrap.

    Raises:
        ValueError: as ``load_sharded_state_dict``, and a state whose parameter groups
            differ, or that gives a unit only part of its state; nothing is loaded then.
    """
    what = "load_sharded_optim_state_dict"
    dicts, whole = _as_set(state)
    metas = [_meta(d, "optim") for d in dicts]
    plan = _plan_optim(fsdp, optimizer, metas, whole, metas[0]["groups"], what)
    fsdp.runner.wait_all()

    def scalars_of(name: str) -> dict[str, Any]:
        return next(d["state"][name]["scalars"] for d in dicts if name in d["state"])

    _load_optim(fsdp, optimizer, plan, lambda i, n: dicts[i]["state"][n]["values"],
                scalars_of, dicts[0]["param_groups"])


# --- files: one per rank and an index, written atomically -------------------------------

INDEX_FORMAT = "mpiring-fsdp-sharded-index-1"


def _read(path: str, mmap: bool) -> Any:
    """A file ``checkpoint.write_atomic`` wrote: checksum verified, tensors only (``weights_only``);
    with ``mmap`` its tensors are mapped, and only the pages a copy touches are read."""
    from mpiring.parallel.checkpoint import verify_checkpoint

    verify_checkpoint(path)  # streams the file: refuses a damaged one, never follows a link
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


_ERRORS = {e.__name__: e for e in (ValueError, KeyError, TypeError, OSError,
                                    FileNotFoundError, PermissionError)}


def _agree(comm, error: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed (one small exchange on the control channel)."""
    mine = None if error is None else [type(error).__name__, str(error)]
    seen = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
    bad = [(r, e) for r, e in enumerate(seen) if e is not None]
    if not bad:
        return
    r, (kind, msg) = bad[0]
    msg = msg.removeprefix(f"{what}: ")
    if kind == "CheckpointCorruptError":
        from mpiring.parallel.checkpoint import CheckpointCorruptError as cls
    else:
        cls = _ERRORS.get(kind, RuntimeError)
    others = f" (and r{', r'.join(str(q) for q, _ in bad[1:])})" if len(bad) > 1 else ""
    raise cls(f"{what}: r{r}{others}: {msg}") from error


@contextlib.contextmanager
def _engine(model, what: str):
    """The wrapper behind ``model``: itself, or the engine of a ``fully_shard`` model (its
    root), which may read its modules' own state dicts meanwhile (refused to users)."""
    inside = getattr(model, "_fsdp_internal", None)
    if inside is None:
        yield model
        return
    with inside(what) as engine:
        yield engine


def save_sharded(path_dir: str, model, optimizer: torch.optim.Optimizer | None = None,
                 step: int = 0) -> str:
    """Save the model (and optimizer) as one file per rank plus an index (collective).

    Rank r writes ``path_dir/shard-{r}-of-{K}.pt`` (its ``sharded_state_dict`` and
    ``sharded_optim_state_dict``: its shard's bytes, no full tensor anywhere), then rank 0
    writes ``path_dir/index.pt``: the save's id, step and every rank's slices. Each file
    is written atomically with a checksum and loads with ``torch.load(weights_only=True)``
    (as ``mpiring.parallel.checkpoint.save_checkpoint``'s). The index goes last and the
    previous one is removed first, so a save cut short leaves no index, never an index
    over a mix of two saves. ``path_dir`` must be one folder that every rank sees (a
    shared filesystem); use one per step to keep the previous save while writing.

    Only small control values cross ranks (the save's id, each file's metadata, who
    failed), never a tensor. Returns ``path_dir``.

    ``model``: a ``FullyShardedDataParallel``, or the root of a ``fully_shard`` model.

    Raises:
        ValueError, OSError: a bad step, or a rank that could not write (on every rank).
    """
    with _engine(model, "save_sharded") as fsdp:
        return _save_sharded(path_dir, fsdp, optimizer, step)


def _save_sharded(path_dir: str, model, optimizer, step: int) -> str:
    what = "save_sharded"
    comm = model.comm
    error: BaseException | None = None
    try:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: give the non-negative number of steps taken")
        if not isinstance(path_dir, (str, os.PathLike)):
            raise TypeError(f"path_dir={path_dir!r}: give a folder path")
        path_dir = os.fspath(path_dir)
        if comm.rank == 0:
            os.makedirs(path_dir, mode=0o700, exist_ok=True)
            _remove_stale_temporaries(path_dir)  # a crashed save's, this host's, writer gone
            with contextlib.suppress(FileNotFoundError):
                # First: a save cut short below must not be taken for the old one.
                os.unlink(os.path.join(path_dir, INDEX_NAME))
    except (TypeError, ValueError, OSError) as exc:
        error = exc
    _agree(comm, error, what)
    # Here, where every rank is: in sharded_state_dict below, one rank's failed folder
    # check would leave the others alone in its Broadcast.
    model.finish_init()
    save_id = comm.control.bcast_json(secrets.token_hex(8)) if comm.size > 1 else \
        secrets.token_hex(8)
    metas = None
    try:
        if not os.path.isdir(path_dir):
            raise FileNotFoundError(f"r{comm.rank} does not see the folder rank 0 made: save to "
                                    "a folder on a filesystem every rank shares")
        state = {"format": SHARDED_FORMAT, "step": step,
                 "model": sharded_state_dict(model, save_id),
                 "optim": None if optimizer is None
                 else sharded_optim_state_dict(model, optimizer, save_id)}
        metas = [_meta(state["model"], "model"),
                 None if optimizer is None else _meta(state["optim"], "optim")]
        write_atomic(os.path.join(path_dir, shard_file_name(comm.rank, comm.size)), state)
    except (TypeError, ValueError, OSError) as exc:
        error = exc
    _agree(comm, error, what)
    every = comm.control.allgather_json(metas) if comm.size > 1 else [metas]
    if comm.rank == 0:
        try:
            index = {"format": INDEX_FORMAT, "save_id": save_id, "step": step,
                     "world_size": comm.size,
                     "files": [shard_file_name(r, comm.size) for r in range(comm.size)],
                     "model": [m[0] for m in every],
                     "optim": None if optimizer is None else [m[1] for m in every],
                     "param_groups": None if optimizer is None
                     else state["optim"]["param_groups"]}
            write_atomic(os.path.join(path_dir, INDEX_NAME), index)
            for entry in os.scandir(path_dir):
                m = _SHARD_FILE.match(entry.name)
                if m and int(m.group(2)) != comm.size:  # another world size's: not this save's
                    os.unlink(entry.path)
        except (TypeError, ValueError, OSError) as exc:
            error = exc
    _agree(comm, error, what)
    return path_dir


def load_sharded(path_dir: str, model, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Load what ``save_sharded`` wrote, at any world size and wrap (collective); returns
    the step.

    Every rank reads the index, checks it against the model, then opens (memory-mapped)
    only the files whose slices overlap its own and checks each against the index.
    Only then, if every rank found everything in order (one small exchange of verdicts,
    so that a missing or damaged file is refused on every rank), each copies its slices
    in: at the saving world size and wrap, from its own file alone.

    Raises:
        ValueError: an index or files that do not cover every element, names the model
            lacks, shapes that differ, files of two saves mixed; ``CheckpointCorruptError``
            a damaged file; ``FileNotFoundError`` a missing one (no index: the save did
            not finish). On every rank, before anything changed.
    """
    with _engine(model, "load_sharded") as fsdp:
        return _load_sharded(path_dir, fsdp, optimizer)


def _load_sharded(path_dir: str, model, optimizer) -> int:
    what = "load_sharded"
    comm = model.comm
    error: BaseException | None = None
    files: dict[int, Any] = {}
    try:
        path_dir = os.fspath(path_dir)
        index_path = os.path.join(path_dir, INDEX_NAME)
        if not os.path.lexists(index_path):
            raise FileNotFoundError(f"no {INDEX_NAME} in the folder: not a save_sharded folder, "
                                    "or a save that did not finish (the index is written last)")
        index = _read(index_path, mmap=False)
        if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
            raise ValueError(f"{INDEX_NAME} is not a save_sharded index (format {INDEX_FORMAT!r})")
        plan = _plan(model, index["model"], "model", True, what)
        src = _buffer_source(model, index["model"])
        _check_buffers(model, index["model"][src], what)
        need = {src} | {i for n in _my_names(model, plan) for *_, i in _overlaps(model, plan, n)}
        oplan = None
        if optimizer is not None:
            if index["optim"] is None:
                raise ValueError("the save holds no optimizer state (saved with optimizer=None):"
                                 " pass optimizer=None, or load a save that has one")
            oplan = _plan_optim(model, optimizer, index["optim"], True,
                                len(index["param_groups"]), what)
            need |= {i for n in _my_names(model, oplan) for *_, i in _overlaps(model, oplan, n)}
        for i in sorted(need):
            name = index["files"][i]
            if _SHARD_FILE.match(name) is None:
                raise ValueError(f"{INDEX_NAME} names a file {name!r}: a damaged index")
            d = _read(os.path.join(path_dir, name), mmap=True)
            saved = [_meta(d["model"], "model"),
                     None if d["optim"] is None else _meta(d["optim"], "optim")]
            if (saved[0] != index["model"][i]
                    or (optimizer is not None and saved[1] != index["optim"][i])):
                raise ValueError(f"{name} is not the file the index describes (save "
                                 f"{saved[0]['save_id']!r}, the index's "
                                 f"{index['save_id']!r}): files of two different saves mixed; "
                                 "save again, or restore the folder as it was written")
            files[i] = d
    except (TypeError, ValueError, KeyError, OSError) as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - CheckpointCorruptError, torch's unpickling
        error = exc
    _agree(comm, error, what)
    model.runner.wait_all()
    _load_model(model, plan, lambda i, n: files[i]["model"]["params"][n]["values"],
                files[src]["model"]["buffers"])
    if optimizer is not None:
        def scalars_of(name: str) -> dict[str, Any]:
            return _scalars_from_wire(next(m["entries"][name][4] for m in index["optim"]
                                           if name in m["entries"]))

        _load_optim(model, optimizer, oplan, lambda i, n: files[i]["optim"]["state"][n]["values"],
                    scalars_of, index["param_groups"])
    return int(index["step"])


def _my_names(fsdp, plan: dict) -> list[tuple[str, int, int]]:
    """``(saved name, start, stop)`` of every slice this rank's shards hold."""
    return [(plan["canon"][s.fqn], a, b) for u in fsdp.units for s, a, b in u.flat.pieces()]


def _overlaps(fsdp, plan: dict, piece: tuple[str, int, int]):
    name, a, b = piece
    return [(x, y, i) for x, y, i in plan["slices"].get(name, []) if x < b and a < y]
