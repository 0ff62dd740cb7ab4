"""Gradient clipping over a whole model split over ranks: one norm for every part.

``torch.nn.utils.clip_grad_norm_`` on one pipeline stage, one tensor-parallel
shard or one FSDP shard clips by that part's norm: each part a different
factor, none of them the model's. Here every rank
adds up its share of the norm, the shares are summed over the ranks that hold
different parts of the model, and every rank scales by the same factor, so the
result is ``clip_grad_norm_`` on the unsplit model (Megatron's
``clip_grad_norm_fp32`` over its model-parallel group). What counts once:

* a tied parameter (embedding and output layer): after ``step()`` both copies
  hold the same summed gradient; the first stage counts it;
* data parallelism: DDP replicas hold the same averaged gradients, so one
  pipeline's sum is the model's; an FSDP stage's ranks hold different shards,
  whose shares are summed over its group too;
* tensor parallelism (``mpiring.parallel.tensor`` layers in a stage): the
  split weights' shares are summed over the layer's group; every other
  parameter (a row layer's bias, the LayerNorms, whose gradients the group
  keeps equal) is counted on the group's rank 0 only.
"""

from __future__ import annotations

import math

import torch

from mpiring.parallel.pipeline import data_parallel
from mpiring.parallel.pipeline.stage import PipelineStage


def _tensor_parallel(module: torch.nn.Module):
    """``{id(module): names of its split parameters}`` for the tensor-parallel layers in
    ``module``, and their group (None without any)."""
    from mpiring.parallel.tensor.embedding import VocabParallelEmbedding
    from mpiring.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    split, group = {}, None
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            if group is not None and m.comm.size != group.size:
                raise ValueError("clip_grad_norm_: the stage's tensor-parallel layers use groups "
                                 "of different sizes; build them on one tensor-parallel group")
            group = group or m.comm
            # A column layer's bias is split with its columns; a row layer's is whole.
            split[id(m)] = {"weight", "bias"} if isinstance(m, ColumnParallelLinear) else {"weight"}
    return split, group


def _grads(stage, split: dict):
    """``(gradient, split, counted)`` for every piece of gradient this stage holds: split
    over the tensor-parallel group or not, counted here or on the other tied stage."""
    once = set()
    if stage.tied_parameters and stage.is_last and not stage.is_first:
        once = {id(q) for q in stage.tied_parameters}  # the first stage counts them
    # A parameter registered in two places (a tie) is split if any of its places is
    # a tensor-parallel layer's split one, whichever module registered it first.
    if data_parallel.is_fsdp(stage.ddp):  # flat shards: a piece per parameter in each
        for u in stage.ddp.units:
            g, f = u.flat.shard.grad, u.flat
            if g is None:
                continue
            counted = id(f.shard) not in once
            split_index = {s.index for s in f.slots if s.name in split.get(id(s.module), ())}
            for slot, start, stop in f.pieces():
                at = start + slot.offset - f.lo
                yield g[at:at + stop - start], slot.index in split_index, counted
        return
    split_ids = {id(getattr(m, n)) for m in stage.module.modules()
                 for n in split.get(id(m), ()) if getattr(m, n, None) is not None}
    seen = set()  # a parameter registered in two places is one gradient
    for q in stage.module.parameters():  # each once
        if q.grad is not None and id(q) not in seen:
            seen.add(id(q))
            yield q.grad, id(q) in split_ids, id(q) not in once


class _Whole:
    """A model that is not pipelined, seen as the one stage of a pipeline of one."""

    is_first = is_last = True
    tied_comm, tied_parameters, comm = None, [], None

    def __init__(self, module: torch.nn.Module):
        self.module, self.ddp = data_parallel.unwrap(module)


def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Scale ``model``'s gradients so that the whole model's norm is at most ``max_norm``.

    ``model``: a ``PipelineStage`` (after its schedule's ``step()``), a list of
    them (the rank's stages of an interleaved schedule), or a module that is not
    pipelined: with tensor-parallel layers, FSDP
    (``FullyShardedDataParallel``) or mpiring's DDP around it, or plain.
    Collective over every group that holds a different part (the pipeline,
    the tensor-parallel group, FSDP's). Returns the model's norm before
    clipping (float64), the same on every rank. A norm that is not finite
    leaves the gradients as they are (torch would multiply them by NaN, or by
    0 for an infinite norm), or with ``error_if_nonfinite`` raises on every rank.
    ``foreach`` is accepted for torch's signature and ignored.

    Raises:
        TypeError: ``model`` is a tensor or an iterable of them (torch's call): which
            ranks hold which part of the model is known from the model only.
    """
    is_stages = isinstance(model, (list, tuple)) and bool(model) and all(
        isinstance(x, PipelineStage) for x in model)
    if not (is_stages or isinstance(model, (torch.nn.Module, PipelineStage))):
        # Parameters alone do not say which ranks hold other parts of the model, so a
        # norm of them could silently be one shard's: refuse, naming both fixes.
        raise TypeError(
            f"clip_grad_norm_ takes the model (a module, DDP, FSDP, or pipeline stages), "
            f"got {type(model).__name__}: pass the model itself; for a plain or DDP model's "
            "parameters torch.nn.utils.clip_grad_norm_(model.parameters(), ...) gives the "
            "same result (every replica holds the same gradients)")
    if is_stages:
        stages = list(model)
    else:
        stages = [model if isinstance(model, PipelineStage) else _Whole(model)]
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type={norm_type!r}: use a positive number or math.inf")
    kinds = {data_parallel.is_fsdp(st.ddp) for st in stages}
    if len(kinds) > 1:
        raise ValueError("clip_grad_norm_: some of this rank's stages are FSDP-sharded and "
                         "some are not; shard every stage or none")
    pieces, fsdp, tp = [], None, None
    for stage in stages:
        fsdp = stage.ddp if data_parallel.is_fsdp(stage.ddp) else None
        if fsdp is not None:
            fsdp.runner.wait_all()  # its ReduceScatters write the shards' gradients
        split, group = _tensor_parallel(fsdp.module if fsdp is not None else stage.module)
        if tp is not None and group is not None and group.size != tp.size:
            raise ValueError("clip_grad_norm_: this rank's stages use tensor-parallel groups "
                             "of different sizes; build them on one tensor-parallel group")
        tp = tp or group
        pieces += list(_grads(stage, split))
    stage = stages[0]
    # Each rank adds its split pieces; rank 0 of the tensor-parallel group adds the
    # rest, which every rank of the group holds alike.
    first = tp is None or tp.rank == 0
    op = "max" if math.isinf(p) else "sum"
    mine, nans = 0.0, 0.0
    for g, is_split, counted in pieces:
        if counted and (is_split or first) and g.numel():
            g = g.detach()
            if op == "max":
                top = float(g.abs().max())
                # max() drops a NaN (and MPI's MAX of one is undefined): counted apart.
                nans += math.isnan(top)
                mine = max(mine, top)
            else:
                mine += float(g.double().abs().pow(p).sum())  # NaN stays NaN in a sum
    groups = [tp, stage.comm, None if fsdp is None else fsdp.comm]
    for comm in groups:  # stage parts, then stages, then FSDP's shards of each
        if comm is not None and comm.size > 1:
            mine = comm.control.allreduce_scalar(mine, op)
            if op == "max":
                nans = comm.control.allreduce_scalar(nans, "sum")
    total = (math.nan if nans else mine) if op == "max" else mine ** (1.0 / p)
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"clip_grad_norm_: the gradients' total norm of order {norm_type} "
                           f"is {total} (the same on every rank); skip this step's update, or "
                           "lower the learning rate or the loss scale")
    coef = float(max_norm) / (total + 1e-6)
    if math.isfinite(total) and coef < 1.0:  # inf would zero them, NaN poison them
        scaled = set()  # one Parameter in two of a rank's stages (one rank, tied): once
        for g, _, _ in pieces:  # the tied copies too: they must stay equal
            if id(g) not in scaled:
                scaled.add(id(g))
                g.detach().mul_(coef)
    return torch.tensor(total, dtype=torch.float64)
