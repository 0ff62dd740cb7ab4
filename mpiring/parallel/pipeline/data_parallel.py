"""Pipeline x data parallelism: each stage's replicas reduce their gradients with mpiring's DDP.

A grid of pp stages times dp replicas (``mpiring.ProcessGrid(comm, pp=P)``:
stage = rank // dp, the dp replicas of one stage side by side, Megatron's
order) runs dp pipelines at once, each on its own share of the batch. Stage
s of every pipeline wraps its layers in ``DistributedDataParallel`` over its
data-parallel group (``grid.dp``) and hands the wrapper to ``PipelineStage``::

    grid = stage_grid(comm, pp=2)          # or mpiring.ProcessGrid(comm, pp=2)
    ddp = mpiring.DistributedDataParallel(layers, comm=grid.dp)
    stage = mpiring.PipelineStage(ddp, grid.pp_rank, grid.pp_size, grid.pp)

The stage runs the unwrapped layers; DDP only reduces. Like torch.distributed.
pipelining, every micro-batch but the last accumulates into ``.grad`` locally
(DDP's ``no_sync``: the reducer stays disarmed), and the reducer is armed just
before the last micro-batch's backward, so its buckets go out while that
backward still runs (``overlap``) and the step ends with every ``.grad`` the
mean over the replicas of the gradient of the mean micro-batch loss.

Zero bubble splits the backward: W writes the Linear weights' ``.grad``
directly (``split_backward``), outside autograd, after a B in which autograd
saw no weight gradient for them (their hooks, if they fire, find no gradient;
the reducer is never armed in such a B). When the stage's last W comes after its
last B (ZB-H1, the interleaved zero bubble, ZB-V), that W runs through autograd instead (``reduce_in_w``): each deferred layer's
weight gradient is the backward of a node of its own, AccumulateGrad adds it
to ``.grad`` and fires the hook, and the buckets go out while the remaining
layers' W still runs, as they do in 1F1B's last B. The parameters whose
gradients came in B (LayerNorm, embeddings) join that pass with a zero
gradient, so one that no micro-batch used ends with zeros, not an error. When its last B
comes after its last W (DualPipeV's head stage, whose split backwards come in the
warm-up; a hand-written program), that B is whole and reduces as 1F1B's does,
armed on the last micro-batch's graph (``find_unused_parameters`` as 1F1B's),
with the earlier W's gradients already in ``.grad``. ``reduce_now`` is the
fallback for a stage that does neither.

FSDP on the data axis (``FullyShardedDataParallel`` over ``grid.dp`` as the
stage's submodule) follows the same two moments, as torch.distributed.pipelining
does with FSDP2: ``start_step`` turns the gradient sync off, so every
micro-batch's backward gathers each unit, computes and adds its unsharded
gradient to what the unit keeps; ``arm`` turns it on just before the last
micro-batch's backward, whose units reduce-scatter the sum once, each as soon
as its backward is done. The stage runs the FSDP wrapper itself (its hooks
gather the units); a stage module that ``fully_shard`` was called on last
(torchtitan's order, meta device included) is run and synced the same way. A split backward (W outside autograd) cannot feed FSDP's
flat gradient: a schedule with W actions refuses FSDP stages when it is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mpiring.parallel.grid import ProcessGrid
from mpiring.parallel.pipeline import split_backward


@dataclass
class StageGrid:
    """This rank's place in a pp x dp grid and its two communicators."""

    pp: object
    dp: object
    pp_rank: int
    dp_rank: int
    pp_size: int
    dp_size: int

    def free(self) -> None:
        """Collective: give back the two groups' communicators (the grid is done)."""
        self.pp.free()
        self.dp.free()


def stage_grid(comm, pp: int) -> StageGrid:
    """The pipeline (``.pp``) and data-parallel (``.dp``) groups of ``ProcessGrid(comm, pp=pp)``.

    Stage = rank // dp: the dp replicas of a stage are neighbours. The layout is
    checked on every rank by ``ProcessGrid``; each pipeline's communicator ranks
    its stages in order (stage i is rank i there), as ``PipelineStage`` needs.
    """
    grid = ProcessGrid(comm, pp=pp)
    grid.tp.free()  # one rank each here: not kept
    return StageGrid(grid.pp, grid.dp, grid.pp_rank, grid.dp_rank, pp, grid.dp_size)


class ShardedRoot:
    """A stage module that ``fully_shard`` was called on last (torchtitan shards each
    stage's blocks, then the stage): the data-parallel side of its engine.

    The engine is looked up when used: a stage built on the meta device has none
    until its ``to_empty()``, which may come after the stage and schedule are made.
    """

    def __init__(self, module: nn.Module):
        self.module = module

    @property
    def engine(self):
        return self.module.fsdp_engine

    @property
    def comm(self):
        return self.engine.comm


def is_fsdp(wrapper) -> bool:
    from mpiring.parallel.fsdp import FullyShardedDataParallel

    return isinstance(wrapper, (FullyShardedDataParallel, ShardedRoot))


def _engine(wrapper):
    return wrapper.engine if isinstance(wrapper, ShardedRoot) else wrapper


def unwrap(submodule: nn.Module) -> tuple[nn.Module, object | None]:
    """``(layers to run, data-parallel wrapper or None)`` for a stage's submodule.

    DDP only reduces, so the stage runs its module; FSDP must run itself (its
    hooks gather the parameters), so it is both; so is a ``fully_shard`` root.
    """
    from mpiring.parallel.data.distributed import DistributedDataParallel
    from mpiring.parallel.fsdp import FSDPModule

    if isinstance(submodule, DistributedDataParallel):
        return submodule.module, submodule
    if is_fsdp(submodule):
        return submodule, submodule
    if isinstance(submodule, FSDPModule) and submodule._fsdp_group().root is submodule:
        # Its blocks' own forwards gather them; the schedule decides which backward
        # reduce-scatters, as for the wrapper (without this, every micro-batch's would).
        return submodule, ShardedRoot(submodule)
    return submodule, None


def start_step(ddp) -> None:
    """Once a step, before the first forward: DDP's bucket rebuild and buffer broadcast;
    FSDP: accumulate unsharded gradients until ``arm``."""
    if is_fsdp(ddp):
        fsdp = _engine(ddp)
        fsdp.set_requires_gradient_sync(False)
        # Units kept gathered from forward to backward stay so for the step's next
        # micro-batches too (torch.distributed.pipelining's choice): once a step, not
        # once a micro-batch. ZeRO-3's own setting frees them as before.
        fsdp.set_reshard_after_backward(fsdp.reshard_after_forward)
        return
    ddp.sync_before_backward()


def arm(ddp, outputs) -> None:
    """Let the next backward (of ``outputs``) reduce the accumulated gradients, bucket by
    bucket (DDP) or unit by unit (FSDP)."""
    if is_fsdp(ddp):
        fsdp = _engine(ddp)
        fsdp.set_requires_gradient_sync(True)
        fsdp.set_reshard_after_backward(True)  # the last backward frees every unit
        return
    ddp.reducer.prepare_for_backward(outputs, True)


def reduce_in_w(ddp, queue: list) -> None:
    """Run the stage's last W (``queue``, its deferred weight gradients) so that DDP's
    buckets go out while it runs: each parameter's hook fires as its gradient is done.

    Every other parameter's gradient is complete already (from the B's): it joins
    the same autograd pass with a zero gradient, as in ``reduce_now``.
    """
    params = ddp.reducer.params
    written = {id(p) for item in queue for p in item.params if p is not None}
    arm(ddp, params)  # the parameters are the graph: none counts as unused
    split_backward.run_through_autograd(queue, [p for p in params if id(p) not in written])


#: Why FSDP and a split backward do not go together (the schedule says it when built).
FSDP_SPLIT = ("FullyShardedDataParallel with a split backward (zero bubble; a fully_shard stage "
              "too): W writes weight "
              "gradients outside autograd, where FSDP's flat gradient never sees them; use "
              "Schedule1F1B or ScheduleGPipe with FSDP")


def reduce_now(ddp) -> None:
    """Reduce the accumulated ``.grad`` through DDP's buckets now (a stage whose program
    reduced in no B and no W).

    ``backward`` on the parameters with zero gradients adds nothing, but it runs
    each parameter's AccumulateGrad, so the post-accumulate hooks fire in one
    autograd pass and the reducer's end-of-backward wait returns the means.
    """
    params = ddp.reducer.params
    arm(ddp, params)  # the parameters are the graph: none counts as unused
    torch.autograd.backward(params, [torch.zeros_like(p) for p in params])
