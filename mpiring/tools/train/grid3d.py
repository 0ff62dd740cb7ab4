r"""The 3D grid of a training job and the tensor-parallel GPT cut into pipeline stages.

Every rank sits at one point ``(tp_rank, dp_rank, pp_rank)`` of a T x D x P
grid in Megatron's order (``mpiring.parallel.grid``): tensor parallel inside a
stage, pipeline across stages, data parallel across the D copies of each
(stage, tp_rank)::

    global rank = tp_rank + T * (dp_rank + D * pp_rank)

The model is the project's GPT, split over the TP group (``TensorParallelGPT``)
and then cut into units, in order: the embeddings (token + position), each
block, and the head (final LayerNorm + the tied output layer). The units go to
the stages with numpy.array_split's bounds, as ``tools.train.pipeline`` cuts the
plain GPT. A stage's parameter names are the full GPT's (``blocks.2.fc.weight``),
so a state saved from any layout is keyed alike. The last stage of a pipeline
of more than one stage holds its own copy of the tied weight (``head.weight``,
this TP rank's vocabulary rows); the schedule sums the two copies' gradients
after each step, so they stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.grid import ProcessGrid
from mpiring.parallel.pipeline.schedules import stage_ranks
from mpiring.parallel.tensor import (
    all_gather_forward_reduce_scatter_backward,
    all_reduce_in_backward,
    split_sizes,
)


@dataclass
class Grid:
    """This rank's coordinates and the three communicators of its groups."""

    tp: object
    dp: object
    pp: object
    tp_rank: int
    dp_rank: int
    pp_rank: int
    tp_size: int
    dp_size: int
    pp_size: int

    def free(self) -> None:
        """Collective: give back the three groups' communicators (the job is done)."""
        for comm in (self.tp, self.dp, self.pp):
            comm.free()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(dp, tp, pp)``: the order the docs and tests name layouts in."""
        return self.dp_size, self.tp_size, self.pp_size


def make_grid(comm, tp: int, pp: int) -> Grid:
    """The grid of ``comm`` (collective).

    ``ProcessGrid`` checks and agrees the layout on every rank and makes the
    three groups (each: the ranks sharing the other two coordinates, ordered by
    global rank, as torch's ``init_device_mesh(..., (pp, dp, tp))`` makes them).

    Raises:
        ValueError: on every rank, when ``tp * pp`` does not divide the world.
    """
    g = ProcessGrid(comm, tp=tp, pp=pp)
    return Grid(g.tp, g.dp, g.pp, g.tp_rank, g.dp_rank, g.pp_rank, tp, g.dp_size, pp)


def stage_bounds(n_layers: int, pp: int, layers=None) -> list[tuple[int, int]]:
    """Each stage's ``[lo, hi)`` over the units (0: embeddings, 1..L: blocks, L+1: head).

    ``layers``: the blocks of each stage (Megatron's uneven split, e.g. fewer on the
    last stage, which also computes the head and the loss); the embeddings go with
    the first stage, the head with the last. None: array_split of the units.

    Raises:
        ValueError: more stages than units, or ``layers`` that do not fit, naming the fix.
    """
    units = n_layers + 2
    if layers is not None:
        counts = list(layers)
        if (len(counts) != pp or any(isinstance(c, bool) or not isinstance(c, int) or c < 0
                                     for c in counts) or sum(counts) != n_layers):
            raise ValueError(f"pp_layers={counts}: give {pp} block counts (>= 0), one per "
                             f"stage, summing to the model's {n_layers} blocks (the embeddings "
                             "go with the first stage, the head with the last)")
        bounds, at = [], 1
        for k, c in enumerate(counts):
            lo = 0 if k == 0 else at
            at += c
            bounds.append((lo, at + (1 if k == pp - 1 else 0)))
        return bounds
    if not 1 <= pp <= units:
        raise ValueError(f"pp={pp} stages for a GPT of {units} units (embeddings, {n_layers} "
                         f"blocks, head): use --pp 1..{units}, or more --layers")
    return list(chunk_bounds(units, pp))


def stage_of(name: str, n_layers: int, pp: int, vpp: int = 1, layers=None,
             placement: str = "loop") -> int:
    """The pipeline rank holding the full GPT's parameter ``name`` (the tied weight: rank 0),
    with ``vpp`` stages per rank (rank r holds stages r, r + pp, ...; ZB-V's "v"
    placement: r and 2 pp - 1 - r) and the stages' block counts ``layers``
    (``stage_bounds``)."""
    if name.startswith(("tok.", "pos.", "head.")):
        unit = 0
    elif name.startswith("blocks."):
        unit = 1 + int(name.split(".")[1])
    else:  # ln_f
        unit = n_layers + 1
    bounds = stage_bounds(n_layers, pp * vpp, layers)
    stage = next(s for s, (lo, hi) in enumerate(bounds) if lo <= unit < hi)
    return stage_ranks(pp, pp * vpp, placement)[stage]


class _Weight(nn.Module):
    """The last stage's copy of the tied weight, as the output layer (``F.linear``).

    A module with its own forward, so that FSDP can make it a unit by itself:
    then its shard covers the same elements as the first stage's embedding's.
    """

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(w.detach().clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


class GPTStage(nn.Module):
    """Units ``[lo, hi)`` of a ``TensorParallelGPT`` (its own modules, not copies).

    ``forward`` takes ``[b, t]`` tokens on the first stage and the previous
    stage's ``[t, b, d]`` activations elsewhere (``[t / T, b, d]`` under sequence
    parallelism); the last stage returns this TP rank's logits ``[b, t, V_r]``.
    """

    def __init__(self, model, lo: int, hi: int):
        super().__init__()
        n = model.cfg.n_layers
        self.cfg, self.comm, self.sp, self.algo = model.cfg, model.comm, model.sp, model.algo
        self.first, self.last = lo == 0, hi == n + 2
        if self.first:
            self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleDict({str(i - 1): model.blocks[i - 1]
                                     for i in range(max(lo, 1), min(hi, n + 1))})
        if self.last:
            self.ln_f = model.ln_f
            if not self.first:  # its own copy of the tied weight, kept equal by the schedule
                self.head = _Weight(model.tok.weight)

    @property
    def tied(self) -> list[nn.Parameter]:
        """The tied weight's copy on this stage (none when one stage holds both ends)."""
        if self.first and self.last:
            return []
        return [self.tok.weight] if self.first else [self.head.weight] if self.last else []

    @property
    def tied_module(self) -> nn.Module | None:
        """The module that holds ``tied`` (the embedding or the output copy), or None."""
        if self.first and self.last:
            return None
        return self.tok if self.first else self.head if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The whole window is seq_len tokens: under sequence parallelism a middle
        # stage sees only its rank's rows and cannot tell the length from them.
        t = x.shape[1] if self.first else (self.cfg.seq_len if self.sp else x.shape[0])
        if self.first:
            x = self._embed(x)
        for block in self.blocks.values():
            x = block(x, t)
        return self._head(x, t) if self.last else x

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len="
                             f"{self.cfg.seq_len}: build the model with a larger seq_len")
        x = self.tok(idx.t())
        pos = self.pos.weight
        if not self.sp:
            return x + pos[:t].unsqueeze(1)
        pos = all_reduce_in_backward(pos, self.comm, self.algo)  # each rank's rows differ
        lo = sum(split_sizes(t, self.comm.size)[:self.comm.rank])
        return x + pos[lo:lo + x.shape[0]].unsqueeze(1)

    def _head(self, x: torch.Tensor, t: int) -> torch.Tensor:
        h = self.ln_f(x)
        if self.sp:
            h = all_gather_forward_reduce_scatter_backward(h, self.comm, 0,
                                                           split_sizes(t, self.comm.size), self.algo)
        else:
            h = all_reduce_in_backward(h, self.comm, self.algo)
        out = F.linear(h, self.tok.weight) if self.first else self.head(h)
        return out.transpose(0, 1)

    def num_params(self) -> int:
        """This rank's trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


class GPTStages(nn.Module):
    """A rank's several stages (interleaved 1F1B, ZB-V) as one module: the chunks' own modules
    under the full GPT's names, for the optimizer, checkpoints and evaluation's
    bookkeeping; the schedule runs the chunks (``chunks``, in stage order).
    """

    def __init__(self, chunks: list[GPTStage]):
        super().__init__()
        self.chunks = list(chunks)  # a plain list, unregistered: registered, names get a prefix
        self.cfg = chunks[0].cfg
        self.first, self.last = chunks[0].first, chunks[-1].last
        if self.first:
            self.tok, self.pos = chunks[0].tok, chunks[0].pos
        self.blocks = nn.ModuleDict({k: b for c in chunks for k, b in c.blocks.items()})
        if self.last:
            self.ln_f = chunks[-1].ln_f
            # The last chunk's own copy of the tied weight, also beside the embedding
            # (ZB-V's rank 0 holds both ends): the optimizer must step it too.
            if hasattr(chunks[-1], "head"):
                self.head = chunks[-1].head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GPTStages holds a rank's stages of a multi-stage pipeline, run "
                           "by its schedule (of several stages per rank): call sched.step()")

    def num_params(self) -> int:
        """This rank's trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def split_stage(model, pp: int, pp_rank: int, layers=None) -> GPTStage:
    """Stage ``pp_rank`` of ``pp`` of a ``TensorParallelGPT`` (``layers``: ``stage_bounds``'s)."""
    lo, hi = stage_bounds(model.cfg.n_layers, pp, layers)[pp_rank]
    return GPTStage(model, lo, hi)
