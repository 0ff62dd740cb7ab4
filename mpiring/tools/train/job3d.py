"""``GridJob``: the training job on the 3D grid (tensor x pipeline x data parallel).

    job = make_job(comm, TrainConfig(tp=2, pp=2, global_batch=16))
    train(job)

Each rank builds the whole GPT from the seed, splits it over its tensor-parallel
group (``TensorParallelGPT``) and keeps its pipeline stage (``grid3d``). The
data axis reduces the stage's gradients with mpiring's DDP (default), shards
the optimizer state with ZeRO-1/2 (``optimizer="zero1"|"zero2"``), or shards
everything with FSDP (``fsdp=True``).

With pp > 1 each reduction on the data axis runs once a step, after the last
micro-batch (DeepSpeed's pipeline order: the tied weight's two copies' gradients
are summed over the pipeline, then the stages reduce over dp):

* DDP and ZeRO-1: DDP's buckets go out during the last micro-batch's backward
  (all-reduced: every copy holds the whole mean, so the tied sum after it is right);
* ZeRO-2: no DDP; the optimizer reduce-scatters the accumulated gradients in
  ``step()``, after the schedule summed the tied copies (a bucket's chunk on the
  first stage and on the last would cover different rows of the tied weight);
* FSDP: the micro-batches before the last accumulate unsharded gradients
  (``set_requires_gradient_sync``); the last one's backward reduce-scatters each
  unit. The tied weight is a unit by itself on the first and the last stage, so
  both shards cover the same rows and the schedule sums the two shards' gradients. Every data-parallel
replica reads its shard of the same global batch as a one-rank run
(``DistributedSampler``: the global order does not depend on the number of
replicas), so the losses equal a one-rank run's step by step, up to rounding.

The loss is known on the last stage; ``global_mean`` averages over its
data-parallel replicas. Checkpoints hold the full model and optimizer state by
parameter name (``reshard``), so they load at any other layout.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from mpiring.parallel.data.sampler import DistributedSampler
from mpiring.tools.train.grid3d import GPTStage, GPTStages, make_grid, split_stage, stage_bounds
from mpiring.tools.train.loop import TrainJob


def default_microbatches(schedule: str, pp: int) -> int:
    """Micro-batches a step when --microbatches is not given: one per stage, two for
    dualpipev (it runs from one per stage of its 2 pp)."""
    return 2 * pp if schedule == "dualpipev" else pp


def validate_grid_config(cfg) -> None:
    """Refuse the 3D flags' combinations that cannot train correctly (no communication).

    Raises:
        ValueError: naming the fix.
    """
    from mpiring.parallel.pipeline.schedules import PLACEMENT
    from mpiring.tools.train.pipeline import MULTI_STAGE, SCHEDULES

    for name in ("pp", "microbatches", "global_batch"):
        v = getattr(cfg, name)
        if v is not None and v < 1:
            raise ValueError(f"{name}={v}: must be at least 1")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}: use one of {', '.join(SCHEDULES)}")
    if isinstance(cfg.vpp, bool) or not isinstance(cfg.vpp, int) or cfg.vpp < 1:
        raise ValueError(f"vpp={cfg.vpp!r}: give the stages per rank, a positive integer")
    multi = cfg.schedule in MULTI_STAGE
    if PLACEMENT.get(cfg.schedule) == "v" and cfg.vpp != 2:  # zbv, dualpipev
        raise ValueError(f"vpp={cfg.vpp} with --schedule {cfg.schedule}: the V holds 2 stages "
                         "per rank; leave --vpp out (TrainConfig: vpp=2)")
    if (cfg.vpp > 1) != multi:
        raise ValueError(f"vpp={cfg.vpp} with --schedule {cfg.schedule}: several stages per "
                         "rank run with --schedule interleaved, interleaved-zb or looped-bfs "
                         "(--vpp 2 or more), zbv or dualpipev")
    if multi and (cfg.pp == 1 or cfg.fsdp or cfg.optimizer != "adamw"):
        raise ValueError(f"--schedule {cfg.schedule} runs on pp > 1 with DDP on the data axis "
                         "and the optimizer adamw (not fsdp, zero1 or zero2): each rank's "
                         "stages are replicated and stepped as one model")
    if cfg.pp_layers is not None and cfg.pp == 1:
        raise ValueError(f"pp_layers={list(cfg.pp_layers)} splits the blocks over pipeline "
                         "stages: use it with pp > 1")
    if cfg.microbatches is not None and cfg.microbatches > 1 and cfg.pp == 1:
        raise ValueError(f"microbatches={cfg.microbatches} split a pipeline's batch: use it "
                         "with pp > 1 (one stage trains on the whole batch)")
    if cfg.uses_grid and (cfg.mode not in ("ddp", "naive") or cfg.comm_hook != "none"):
        # The grid job would run mpiring's DDP anyway, without the mode or hook asked for.
        raise ValueError(f"pp > 1, fsdp and global_batch run on mpiring's own data parallelism, "
                         f"not mode {cfg.mode} with comm hook {cfg.comm_hook}: use mode ddp (or "
                         "naive), no comm hook, or --batch-size instead of --global-batch")
    if cfg.fsdp and cfg.optimizer != "adamw":
        raise ValueError(f"fsdp shards the optimizer state itself (ZeRO-3): leave the optimizer "
                         f"adamw instead of {cfg.optimizer}")
    if cfg.fsdp and cfg.pp > 1 and cfg.schedule in ("zb", "pipedream"):
        raise ValueError(f"fsdp with --schedule {cfg.schedule}: "
                         + ("zero bubble's W writes weight gradients outside autograd, where "
                            "FSDP's flat gradient never sees them" if cfg.schedule == "zb" else
                            "pipedream steps after every micro-batch")
                         + "; use --schedule 1f1b or gpipe with --fsdp")
    if cfg.pp > 1 and cfg.schedule == "pipedream" and (cfg.optimizer != "adamw" or cfg.fsdp):
        raise ValueError("pipedream steps each stage's optimizer after every micro-batch: use "
                         "optimizer adamw, or schedule 1f1b with a sharded optimizer")


def layout_error(cfg, world: int) -> str | None:
    """What is wrong with ``cfg`` at ``world`` ranks (pure: the same text on every rank)."""
    tp, pp = cfg.tp, cfg.pp
    if world % (tp * pp):
        return None  # ProcessGrid names it, on every rank
    dp = world // (tp * pp)
    try:
        stage_bounds(cfg.model_config().n_layers, pp * cfg.vpp, cfg.pp_layers)
    except ValueError as exc:
        return str(exc) + (f" (pp={pp} x vpp={cfg.vpp})" if cfg.vpp > 1 else "")
    batch = cfg.batch_size
    if cfg.global_batch is not None:
        if cfg.global_batch % dp:
            return (f"global_batch={cfg.global_batch} does not split over dp={dp} replicas "
                    f"(world {world} / (tp={tp} x pp={pp})): use a multiple of {dp}")
        batch = cfg.global_batch // dp
    m = cfg.microbatches or default_microbatches(cfg.schedule, pp)
    # DualPipeV's least count first: a divisor below it would only be refused next.
    least = 2 * pp
    if pp > 1 and cfg.schedule == "dualpipev" and (m < least or batch % m):
        fits = [k for k in range(least, batch + 1) if batch % k == 0]
        fix = (f"give --microbatches {' or '.join(map(str, fits[:3]))}" if fits
               else f"raise the windows per replica ({batch}) to {least} or more")
        return (f"--schedule dualpipev runs at least one micro-batch per stage, 2 pp = {least}, "
                f"in equal micro-batches of the {batch} windows per replica, not {m}: {fix}, or "
                "use zbv")
    if pp > 1 and batch % m:
        return (f"{batch} windows per replica do not split into {m} equal micro-batches (the "
                f"loss would weight them unequally): choose --microbatches dividing {batch}")
    if pp > 1 and cfg.schedule == "pipedream" and dp > 1:
        return (f"pipedream steps each stage after every micro-batch, which dp={dp} replicas "
                "cannot average: use --schedule 1f1b (or gpipe, zb) with dp > 1")
    if tp > 1 and cfg.model_config().vocab_size < tp:
        return f"tp={tp} is more than the {cfg.model_config().vocab_size} vocabulary rows"
    return None


class GridJob(TrainJob):
    """``TrainJob`` on the 3D grid: same data, loop, callbacks and checkpoints.

    Attributes:
        grid: this rank's ``grid3d.Grid``.
        tp_model: the ``TensorParallelGPT`` whose modules the stage holds (``shard``).
        model: this rank's stage (``GPTStage``; parameters named as the full GPT's).
        sched: the pipeline schedule (None with one stage).
        fsdp: the FSDP wrapper, or None.
    """

    def _make_groups(self) -> None:
        cfg = self.cfg
        error = layout_error(cfg, self.comm.size)  # before any split
        if self.comm.size > 1:
            # Ranks launched with different flags may judge the layout differently: one
            # that raised alone would leave the others waiting in ProcessGrid's agreement.
            # Every rank hears every rank's verdict first, and all raise together.
            errors = self.comm.control.allgather_json(error)
            bad = [r for r, e in enumerate(errors) if e is not None]
            if bad and error is None:
                error = (f"rank(s) {bad} refused the layout: {errors[bad[0]]} (launch every "
                         "rank with the same flags)")
        if error is not None:
            raise ValueError(error)
        self.grid = g = make_grid(self.comm, cfg.tp, cfg.pp)
        # tp_comm is set in _wrap: TrainJob would split the model over it first,
        # and the full GPT's shapes are needed here.
        self.data_comm = g.dp
        if cfg.global_batch is not None:
            self.cfg = replace(cfg, batch_size=cfg.global_batch // g.dp_size)
        self.microbatches = cfg.microbatches or default_microbatches(cfg.schedule, cfg.pp)

    def _wrap(self):
        from mpiring.parallel.pipeline import PipelineStage
        from mpiring.tools.models.gpt_tp import TensorParallelGPT
        from mpiring.tools.train.pipeline import SCHEDULES

        cfg, g = self.cfg, self.grid
        full = self.model  # the whole GPT, drawn from the seed on every rank
        self.full_params = full.num_params()
        self.full_keys = list(full.state_dict().keys())
        self.full_shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
        self.param_names = [n for n, _ in full.named_parameters()]
        self.tp_model = TensorParallelGPT.from_full(full, g.tp, seed=cfg.seed,
                                                    sequence_parallel=cfg.sequence_parallel)
        if cfg.vpp > 1:
            return self._wrap_interleaved()
        self.model = stage = split_stage(self.tp_model, cfg.pp, g.pp_rank, cfg.pp_layers)
        self.tp_comm = g.tp
        # FSDP takes the parameters over: their names are kept here for checkpoints.
        self.stage_names = [n for n, _ in stage.named_parameters()]
        self.loss_fn = self.tp_model.loss
        self.fsdp, self.sched = None, None
        if cfg.fsdp:
            return self._wrap_fsdp(stage)
        wrapped = stage
        # ZeRO-2 with a pipeline reduces in its own step, after the tied sum (see above).
        zero2_pipe = cfg.pp > 1 and cfg.optimizer == "zero2"
        if (cfg.pp == 1 or g.dp_size > 1) and not zero2_pipe:
            wrapped = self._data_parallel(stage)
        self.optimizer = self._make_optimizer(
            stage.parameters(), ddp=wrapped if wrapped is not stage else None)
        if cfg.pp > 1:
            # PipeDream updates each stage on its own: a tied pair would drift apart
            # between updates, so the last stage's copy trains on its own there.
            tied = [] if cfg.schedule == "pipedream" else stage.tied
            pipe = PipelineStage(wrapped, g.pp_rank, g.pp_size, g.pp, tied_parameters=tied)
            extra = {"optimizer": self.optimizer} if cfg.schedule == "pipedream" else {}
            self.sched = SCHEDULES[cfg.schedule](pipe, self.microbatches, self.loss_fn, **extra)
        return wrapped

    def _data_parallel(self, module):
        """``module`` in mpiring's DDP over the data axis, with the job's bucket options."""
        from mpiring.parallel.data.distributed import DistributedDataParallel

        cfg = self.cfg
        return DistributedDataParallel(
            module, self.grid.dp, bucket_cap_mb=cfg.bucket_mb,
            first_bucket_mb=cfg.first_bucket_mb, overlap=(cfg.mode == "ddp"), algo=cfg.algo,
            gradient_as_bucket_view=cfg.grad_as_bucket_view)

    def _wrap_interleaved(self):
        """vpp stages per rank (interleaved, interleaved-zb, looped-bfs: r, r + pp, ...; zbv
        and dualpipev: r, 2 pp - 1 - r), each its own DDP over the data axis; ``model``
        holds them all, named as the full GPT's."""
        from mpiring.parallel.pipeline import PipelineStage
        from mpiring.parallel.pipeline.schedules import PLACEMENT, stages_of
        from mpiring.tools.train.pipeline import SCHEDULES

        cfg, g = self.cfg, self.grid
        n = cfg.pp * cfg.vpp
        bounds = stage_bounds(self.tp_model.cfg.n_layers, n, cfg.pp_layers)
        mine = stages_of(g.pp_rank, g.pp_size, n, PLACEMENT.get(cfg.schedule, "loop"))
        chunks = [GPTStage(self.tp_model, *bounds[s]) for s in mine]
        self.model = GPTStages(chunks)
        self.tp_comm = g.tp
        self.stage_names = [name for name, _ in self.model.named_parameters()]
        self.loss_fn = self.tp_model.loss
        self.fsdp = None
        pipes = []
        for s, chunk in zip(mine, chunks):
            wrapped = chunk if g.dp_size == 1 else self._data_parallel(chunk)
            pipes.append(PipelineStage(wrapped, s, n, g.pp, tied_parameters=chunk.tied))
        self.optimizer = self._make_optimizer(self.model.parameters())
        self.sched = SCHEDULES[cfg.schedule](pipes, self.microbatches, self.loss_fn)
        return self.model

    def _wrap_fsdp(self, stage):
        from mpiring.parallel.fsdp import FullyShardedDataParallel
        from mpiring.parallel.pipeline import PipelineStage
        from mpiring.tools.train.pipeline import SCHEDULES

        cfg, g = self.cfg, self.grid
        tied_module = stage.tied_module if cfg.pp > 1 else None
        units = list(stage.blocks.values()) + ([tied_module] if tied_module is not None else [])
        fsdp = self.fsdp = FullyShardedDataParallel(stage, g.dp, auto_wrap=units)
        self.optimizer = self._make_optimizer(fsdp.parameters())
        if cfg.pp > 1:
            # Equal numel and dp group on both ends: the two shards hold the same elements.
            tied = [u.flat.shard for u in fsdp.units if u.module is tied_module]
            pipe = PipelineStage(fsdp, g.pp_rank, g.pp_size, g.pp, tied_parameters=tied)
            self.sched = SCHEDULES[cfg.schedule](pipe, self.microbatches, self.loss_fn)
        return fsdp

    # --- one step ------------------------------------------------------------------
    def _update(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if self.sched is None:
            return super()._update(x, y)
        from mpiring.tools.train.pipeline import train_step

        value = train_step(self.sched, self.optimizer, x, y, grad_clip=self.cfg.grad_clip)
        return math.nan if value is None else value

    def _exposed_comm_s(self) -> float | None:
        """Interleaved: each stage's DDP waits on its own reductions, in its own last
        backward; the step's exposed time is their sum."""
        stages = self.sched.stages if self.sched is not None else []
        if len(stages) < 2:
            return super()._exposed_comm_s()
        waits = [st.ddp.reducer.exposed_comm_s for st in stages if st.ddp is not None]
        return sum(waits) if waits else None

    def global_mean(self, values) -> list[float]:
        """The mean over the data-parallel replicas of the last stage's values (collective)."""
        arr = np.asarray(values, dtype=np.float64).copy()
        # The rank of the last stage (pp's last, or ZB-V's first), once per TP group.
        if not (self.model.last and self.grid.tp_rank == 0):
            arr[:] = 0.0  # ranks off the last stage hold no loss (NaN)
        if self.comm.size > 1 and arr.size:
            self.comm.all_reduce(arr, op="sum", algo="native")
        return (arr / self.grid.dp_size).tolist()

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean validation loss, each batch forwarded through the stages in turn (collective)."""
        g, b = self.grid, self.cfg.batch_size
        batches = self.cfg.val_batches if batches is None else batches
        order = list(DistributedSampler(len(self.val_set), g.dp_size, g.dp_rank, shuffle=False,
                                        drop_last=True))
        total = np.zeros(2, dtype=np.float64)
        self.model.eval()
        try:
            for j in range(min(batches, len(order) // b)):
                x, y = self.val_set.batch(order[j * b:(j + 1) * b], self.device)
                if self.sched is not None:  # the stages' forwards, pipelined (no_grad)
                    losses: list = []
                    last = self.sched.stages[-1].is_last
                    self.sched.eval(x if self.sched.stages[0].is_first else None,
                                    target=y if last else None, losses=losses if last else None)
                    # Equal micro-batches (layout_error): their mean loss is the batch's.
                    loss = float(torch.stack(losses).mean()) if last else math.nan
                else:
                    out = self.fsdp(x) if self.fsdp is not None else self.model(x)
                    loss = float(self.loss_fn(out, y))  # collective over the TP group
                if self.model.last and g.tp_rank == 0:
                    total += (loss * len(x), len(x))
        finally:
            self.model.train()
        if self.comm.size > 1:
            self.comm.all_reduce(total, op="sum", algo="native")
        return float(total[0] / total[1]) if total[1] else math.nan

    # --- state (reshard: full tensors by parameter name) --------------------------------
    def state_dict(self):
        from dataclasses import asdict

        from mpiring.tools.train.reshard import grid_full_state

        model, optim = grid_full_state(self)
        return {"config": asdict(self.cfg), "model": model, "optimizer": optim,
                "step": self.step, "sampler": self.sampler.state_dict(),
                "losses": list(self.losses)}

    def close(self) -> None:
        """Collective: stop the threads and give back every window and communicator."""
        if self.sched is not None:
            self.sched.free()  # collective: the pipeline's windows and communicators
            for st in self.sched.stages:
                if st.ddp is not None and st.ddp is not self.wrapped:
                    st.ddp.close()  # interleaved: a DDP per stage (the job's own: below)
                st.free()
        if self.fsdp is not None:
            self.fsdp.close()
        super().close()
        self.grid.free()


def make_job(comm, cfg, **kwargs) -> TrainJob:
    """``GridJob`` when ``cfg`` needs the 3D grid (``cfg.uses_grid`` or tp > 1), else ``TrainJob``."""
    return (GridJob if cfg.uses_grid or cfg.tp > 1 else TrainJob)(comm, cfg, **kwargs)
