"""The project's GPT split into pipeline stages, and one pipelined training step.

The model is cut into units, in order: the embeddings (token + position), each
transformer block, and the head (final LayerNorm + output layer). The units
are split over the stages with numpy.array_split's bounds, so any number of
stages up to the number of units works, and the first stages get the extra
unit when it does not divide. The output layer's weight is tied to the token
embedding: the first and the last stage each hold a copy, and the schedule
sums their gradients after each step (``tied_parameters``), so both copies
take the same optimizer step and stay equal. PipeDream updates each stage on
its own, so there the two copies are untied (they start equal and then train
apart).

    stage, sched, opt = build_pipeline(comm, cfg, "1f1b", n_microbatches=8)
    loss = train_step(sched, opt, x, y)            # x on stage 0, y on the last

With ``pp`` smaller than the world, the ranks form a pp x dp grid: stage =
rank // dp (each stage's dp replicas side by side, Megatron's order), and each
stage's replicas average their gradients with DistributedDataParallel over
``grid.dp``; each pipeline takes its own share of the batch.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.data import DistributedDataParallel
from mpiring.parallel.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    SchedulePipeDream,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
)
from mpiring.parallel.pipeline.data_parallel import stage_grid
from mpiring.parallel.pipeline.schedules import MULTI, PLACEMENT, stages_of
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleZeroBubble,
             "pipedream": SchedulePipeDream, "interleaved": ScheduleInterleaved1F1B,
             "interleaved-zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV, "looped-bfs": ScheduleLoopedBFS}
#: Schedules of several stages per rank (``build_pipeline``'s ``stages_per_rank``).
MULTI_STAGE = tuple(MULTI)


class Embed(nn.Module):
    """Token plus learned position embedding (the GPT's first unit)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding):
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the output layer (the GPT's last unit)."""

    def __init__(self, ln_f: nn.LayerNorm, head: nn.Linear):
        super().__init__()
        self.ln_f, self.head = ln_f, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def units(model: GPT) -> list[nn.Module]:
    """The GPT as a list of modules that run one after another."""
    return [Embed(model.tok, model.pos), *model.blocks, Head(model.ln_f, model.head)]


def split_gpt(model: GPT, num_stages: int, stage_index: int, *,
              blocks_evenly: bool = False) -> tuple[nn.Sequential, list]:
    """Stage ``stage_index``'s part of ``model`` (a copy) and its tied parameters.

    The units are split with array_split's bounds; ``blocks_evenly``: the blocks
    instead, the embeddings with the first stage and the head with the last
    (Megatron's split, for stages of equal work when there are many of them).

    Raises:
        ValueError: more stages than units (embeddings + blocks + head).
    """
    parts = units(model)
    if not 1 <= num_stages <= len(parts):
        raise ValueError(f"{num_stages} stages for a GPT of {len(parts)} units (embeddings, "
                         f"{len(parts) - 2} blocks, head): use 1..{len(parts)} stages or more "
                         "layers")
    if blocks_evenly:
        lo, hi = chunk_bounds(len(parts) - 2, num_stages)[stage_index]
        lo, hi = (0 if stage_index == 0 else lo + 1,
                  hi + (2 if stage_index == num_stages - 1 else 1))
    else:
        lo, hi = chunk_bounds(len(parts), num_stages)[stage_index]
    # deepcopy of the units together keeps the tie inside one stage (one stage: one weight).
    module = copy.deepcopy(nn.Sequential(*parts[lo:hi]))
    tied = []
    if num_stages > 1 and stage_index == 0:
        tied = [module[0].tok.weight]
    elif num_stages > 1 and stage_index == num_stages - 1:
        tied = [module[-1].head.weight]
    return module, tied


def build_pipeline(comm, cfg: GPTConfig, schedule: str, n_microbatches: int, *,
                   pp: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                   lr: float = 3e-4, recompute: bool = False, stages_per_rank: int = 1):
    """This rank's stage of a GPT, its schedule and optimizer.

    Every rank builds the whole model from ``seed`` (so the stages start from one
    model) and keeps its part. ``pp`` ranks along the pipeline (default: every rank
    of ``comm``), each holding ``stages_per_rank`` stages (more than one:
    "interleaved", "interleaved-zb" and "looped-bfs", rank r holding stages r, r + pp, ...;
    "zbv" and "dualpipev", 2: r and
    2 pp - 1 - r); the world / pp replicas
    of each stage reduce with DDP. Returns ``(stage, sched, optimizer)``, where
    ``stage`` is the rank's list of stages with ``stages_per_rank > 1`` (all of them
    are ``sched.stages``); ``sched.grid`` holds the groups (``stage_grid``).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    v = stages_per_rank
    if v != 1 and schedule not in MULTI_STAGE:
        raise ValueError(f"stages_per_rank={v} with schedule {schedule!r}: several stages per "
                         f"rank run with {' or '.join(map(repr, MULTI_STAGE))}")
    if PLACEMENT.get(schedule) == "v" and v != 2:  # zbv, dualpipev
        raise ValueError(f"{schedule} places 2 stages per rank: give stages_per_rank=2, not {v}")
    grid = stage_grid(comm, comm.size if pp is None else pp)
    torch.manual_seed(seed)
    full = GPT(cfg).to(dtype)
    n = grid.pp_size * v
    stages, params = [], []
    for s in stages_of(grid.pp_rank, grid.pp_size, n, PLACEMENT.get(schedule, "loop")):
        # Interleaving rotates through every stage: a 2-block stage beside a 1-block one
        # would set the pace of all, so its stages split the blocks evenly.
        module, tied = split_gpt(full, n, s, blocks_evenly=v > 1)
        if schedule == "pipedream":  # stages update on their own: the two copies go untied
            tied = []
        layers = module if grid.dp_size == 1 else DistributedDataParallel(module, comm=grid.dp)
        stages.append(PipelineStage(layers, s, n, grid.pp, tied_parameters=tied))
        params += list(module.parameters())
    opt = torch.optim.AdamW(params, lr=lr)
    kwargs = {"optimizer": opt} if schedule == "pipedream" else {}
    if schedule == "gpipe":
        kwargs["recompute"] = recompute
    sched = SCHEDULES[schedule](stages if v > 1 else stages[0], n_microbatches, lm_loss,
                                **kwargs)
    sched.grid = grid
    return (stages if v > 1 else stages[0]), sched, opt


def train_step(sched, optimizer, x: torch.Tensor | None, y: torch.Tensor | None, *,
               grad_clip: float = 0.0) -> float | None:
    """One step: the pipeline's forward and backward, the gradients clipped to the whole
    model's norm ``grad_clip`` (0: not), then the optimizer (PipeDream steps inside).
    Returns the mean micro-batch loss on the last stage, None elsewhere."""
    losses: list = []
    first, last = sched.stages[0].is_first, sched.stages[-1].is_last  # the rank's ends
    if not isinstance(sched, SchedulePipeDream):
        optimizer.zero_grad(set_to_none=True)
    sched.step(x if first else None, target=y if last else None,
               losses=losses if last else None)
    if not isinstance(sched, SchedulePipeDream):
        if grad_clip:
            sched.clip_grad_norm_(grad_clip)
        optimizer.step()
    return float(torch.stack(losses).mean()) if last else None
