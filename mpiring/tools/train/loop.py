"""A data-parallel training job in four modes, built and run the same way.

Modes:

* ``ddp``: ``mpiring.DistributedDataParallel`` (buckets overlap backward);
* ``naive``: the same with ``overlap=False`` (backward first, then every bucket);
* ``ps``: the parameter-server baseline (Reduce to rank 0, update, Broadcast);
* ``torch-ddp``: PyTorch's own DDP over gloo (nccl on GPUs), initialised from
  the MPI ranks, for comparison.

Everything a later feature needs to save and restore a run lives on
``TrainJob``: ``state_dict()``/``load_state_dict()`` cover the model, the
optimizer (on the ranks that hold one), the step, the data position (the
sampler's ``epoch`` and ``start``) and the loss history; ``train()`` calls
``on_start(job)`` and ``on_step_end(job)`` of each callback, so checkpointing
can be added as a callback in its own module.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from mpiring.parallel.clip import clip_grad_norm_
from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO
from mpiring.parallel.data.ps import ParameterServer
from mpiring.parallel.data.sampler import DistributedSampler
from mpiring.runtime.trace import clock
from mpiring.tools.models.gpt import GPT, PRESETS, GPTConfig, lm_loss
from mpiring.tools.train.data import Windows, shared_corpus

MODES = ("ddp", "naive", "ps", "torch-ddp")
OPTIMIZERS = ("adamw", "zero1", "zero2")  # AdamW, or AdamW sharded by ZeroRedundancyOptimizer


@dataclass
class TrainConfig:
    """What to train and how (the CLI's flags, as data)."""

    mode: str = "ddp"
    steps: int = 50
    batch_size: int = 8           # windows per rank per step
    seq_len: int | None = None    # default: the preset's
    lr: float = 1e-3
    seed: int = 0
    preset: str = "small"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    dropout: float = 0.0          # attention dropout (draws from torch's RNG)
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    algo: str = DEFAULT_BUCKET_ALGO  # bucket AllReduce: any of Communicator.all_reduce's
    grad_as_bucket_view: bool = False  # .grad a view into the bucket (ddp, naive, torch-ddp)
    max_data_mb: float = 4.0
    val_batches: int = 4
    log_every: int = 10
    # Sharded optimizer and DDP communication hooks (modes ddp and naive; see
    # mpiring.parallel.zero and mpiring.parallel.data.comm_hooks).
    optimizer: str = "adamw"      # adamw, zero1, zero2
    fused_adamw: bool = True      # torch's fused AdamW kernel where the device has one
    comm_hook: str = "none"       # none, allreduce, fp16, bf16, topk, powersgd
    topk_ratio: float = 0.01      # topk: fraction of each bucket sent
    powersgd_rank: int = 1        # powersgd: rank of the approximation
    hook_start: int = 10          # topk, powersgd: plain AllReduce for the first steps
    # Tensor parallelism (mpiring.tools.train.tensor): groups of tp adjacent ranks,
    # data parallelism over the world / tp groups.
    tp: int = 1
    sequence_parallel: bool = False
    # The 3D grid (mpiring.tools.train.job3d.GridJob): pipeline stages, FSDP on the
    # data axis, the schedule, and a global batch that fixes the data at any layout.
    pp: int = 1
    fsdp: bool = False
    schedule: str = "1f1b"
    vpp: int = 1                      # stages per rank ("interleaved": Megatron's virtual pp)
    pp_layers: tuple[int, ...] | None = None  # blocks per stage (default: array_split)
    microbatches: int | None = None   # default: pp (dualpipev 2 pp) with pp > 1, 1 otherwise
    global_batch: int | None = None   # windows per step over all replicas (overrides batch_size)
    # Clip the gradients' global 2-norm (over every rank's part of the model) to this
    # before each optimizer step; 0: off.
    grad_clip: float = 0.0

    @property
    def uses_grid(self) -> bool:
        """Whether this run needs the 3D grid job (``job3d.GridJob``) rather than ``TrainJob``."""
        return self.pp > 1 or self.fsdp or self.global_batch is not None or (
            self.tp > 1 and self.optimizer != "adamw")

    def model_config(self) -> GPTConfig:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown model preset {self.preset!r}: use one of {', '.join(PRESETS)}")
        return PRESETS[self.preset].with_(seq_len=self.seq_len, d_model=self.d_model,
                                          n_layers=self.n_layers, n_heads=self.n_heads,
                                          dropout=self.dropout)

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: use one of {', '.join(MODES)}")
        for name in ("steps", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        for name in ("val_batches", "hook_start"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be 0 or more")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr}: must be a positive, finite number")
        if not (math.isfinite(self.max_data_mb) and self.max_data_mb > 0):
            raise ValueError(f"max_data_mb={self.max_data_mb}: give a positive, finite number "
                             "of MiB (e.g. 4)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}: use a probability in [0, 1)")
        self._validate_clip()
        self.model_config()
        self._validate_zero_and_hook()
        if self.tp < 1:
            raise ValueError(f"tp={self.tp}: must be at least 1")
        if self.tp > 1 and (self.mode not in ("ddp", "naive") or self.comm_hook != "none"):
            raise ValueError(f"tp={self.tp} runs with mpiring's DDP over the data-parallel "
                             "ranks: use mode ddp or naive, no comm hook")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits the sequence over the tensor-parallel "
                             "group: use it with tp > 1")
        from mpiring.tools.train.job3d import validate_grid_config

        validate_grid_config(self)

    def _validate_clip(self) -> None:
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(f"grad_clip={self.grad_clip}: give a positive norm, or 0 (off)")
        if not self.grad_clip:
            return
        if self.mode == "ps":
            raise ValueError("grad_clip with mode ps: the parameter server steps on gradients "
                             "the workers never hold averaged; use mode ddp")
        if self.optimizer != "adamw" and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"grad_clip with optimizer {self.optimizer} and tp={self.tp}, "
                             f"pp={self.pp}: the sharded optimizer clips by its data-parallel "
                             "group's norm only; use optimizer adamw (or tp = pp = 1)")
        if self.pp > 1 and self.schedule == "pipedream":
            raise ValueError("grad_clip with schedule pipedream: each stage steps after every "
                             "micro-batch, with no whole-model gradient to clip; use 1f1b")

    def _validate_zero_and_hook(self) -> None:
        from mpiring.parallel.data.comm_hooks import HOOKS

        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.comm_hook not in HOOKS:
            raise ValueError(f"unknown comm hook {self.comm_hook!r}: use one of {', '.join(HOOKS)}")
        if self.mode not in ("ddp", "naive") and (self.optimizer != "adamw" or self.comm_hook != "none"):
            raise ValueError(f"optimizer={self.optimizer} comm_hook={self.comm_hook}: sharded "
                             "optimizers and comm hooks run on mpiring's DDP: use mode ddp or naive")
        if self.optimizer == "zero2" and self.comm_hook != "none":
            raise ValueError("zero2 reduce-scatters the buckets itself (its own comm hook): use "
                             "comm_hook none, or zero1 with a comm hook")


@functools.cache
def fused_adamw_available(device: torch.device | str) -> bool:
    """Whether ``torch.optim.AdamW(fused=True)`` runs on ``device`` with this torch.

    The fused kernel updates every parameter in one pass per tensor instead of
    a dozen elementwise ops (docs/design-notes.md). Where the kernel is missing
    (an older torch, another device) the plain AdamW runs.
    """
    try:
        p = torch.zeros(1, device=device, requires_grad=True)
        p.grad = torch.zeros_like(p)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


class Callback(Protocol):
    """Hooks into ``train()``; every rank calls them at the same points."""

    def on_start(self, job: TrainJob) -> None: ...
    def on_step_end(self, job: TrainJob) -> None: ...


@dataclass
class TrainResult:
    """What a run did; ``losses`` is the global mean loss of every step."""

    losses: list[float]
    val_loss: float
    step_times: list[float]
    exposed_comm: list[float] = field(default_factory=list)

    @property
    def median_step_s(self) -> float:
        # The first step pays for allocation, bucket rebuild and warm-up.
        times = self.step_times[1:] or self.step_times
        return statistics.median(times) if times else 0.0


class TrainJob:
    """Model, data-parallel wrapper, optimizer and this rank's shard of the data."""

    def __init__(self, comm, cfg: TrainConfig, device: torch.device | str = "cpu",
                 train_data: np.ndarray | None = None, val_data: np.ndarray | None = None):
        cfg.validate()
        self.comm = comm
        self.cfg = cfg
        self.device = torch.device(device)
        self.model_cfg = cfg.model_config()
        # Data parallelism runs over data_comm: the whole world, or the ranks that
        # share a tensor-parallel rank (each TP group reads one batch together).
        self.tp_comm, self.data_comm = None, comm
        self._own_groups: tuple = ()  # the groups this job split, freed by close()
        self._make_groups()
        cfg = self.cfg  # _make_groups may fix the per-replica batch from the global one
        if train_data is None or val_data is None:
            train_data, val_data = shared_corpus(comm, int(cfg.max_data_mb * (1 << 20)))
        self.train_set = Windows(train_data, self.model_cfg.seq_len)
        self.val_set = Windows(val_data, self.model_cfg.seq_len)
        dp = self.data_comm
        if len(self.train_set) < dp.size * cfg.batch_size:
            raise ValueError(f"{len(self.train_set)} training windows cannot fill one step of "
                             f"{dp.size} x {cfg.batch_size}: raise max_data_mb or lower the batch")
        self.sampler = DistributedSampler(len(self.train_set), dp.size, dp.rank,
                                          shuffle=True, seed=cfg.seed, drop_last=True)
        torch.manual_seed(cfg.seed)
        self.model = GPT(self.model_cfg).to(self.device)
        self.loss_fn = lm_loss
        if self.tp_comm is not None:
            from mpiring.tools.train.tensor import tensor_parallel_model

            self.model = tensor_parallel_model(self.model, self.tp_comm, seed=cfg.seed,
                                               sequence_parallel=cfg.sequence_parallel)
            self.loss_fn = self.model.loss  # vocab-parallel: each rank has its logits' share
        self.step = 0                  # optimizer steps done
        self.losses: list[float] = []  # this rank's loss of every step
        self.step_times: list[float] = []
        self.exposed_comm: list[float] = []
        self._shard: list[int] | None = None  # this epoch's shard (sampler.start marks the position)
        self._pg = None
        self.ps: ParameterServer | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.comm_hook_state = None    # the comm hook's state (bytes_sent), if one is registered
        self.wrapped = self._wrap()

    # --- construction per mode ---------------------------------------------------
    def _make_groups(self) -> None:
        if self.cfg.uses_grid:
            raise ValueError("pp > 1, fsdp, global_batch or a sharded optimizer with tp > 1 "
                             "run on the 3D grid: build mpiring.tools.train.job3d.GridJob "
                             "(or make_job) instead of TrainJob")
        if self.cfg.tp > 1:
            from mpiring.tools.train.tensor import split_groups

            self.tp_comm, self.data_comm = split_groups(self.comm, self.cfg.tp)
            self._own_groups = (self.tp_comm, self.data_comm)

    def _make_optimizer(self, params, ddp=None) -> torch.optim.Optimizer:
        hyper = dict(lr=self.cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        if self.cfg.fused_adamw and fused_adamw_available(self.device):
            hyper["fused"] = True
        if self.cfg.optimizer in ("zero1", "zero2"):
            from mpiring.parallel.zero import ZeroRedundancyOptimizer

            # It clips in step(), once the gradients are averaged (stage 2 holds them
            # only there): tp = pp = 1, where its group's norm is the model's (validate).
            return ZeroRedundancyOptimizer(params, self.data_comm, torch.optim.AdamW,
                                           stage=int(self.cfg.optimizer[-1]), ddp=ddp,
                                           max_grad_norm=self.cfg.grad_clip or None, **hyper)
        return torch.optim.AdamW(params, **hyper)

    def _register_comm_hook(self, ddp) -> None:
        from mpiring.parallel.data.comm_hooks import make_hook

        state, hook = make_hook(self.cfg.comm_hook, ratio=self.cfg.topk_ratio,
                                rank=self.cfg.powersgd_rank, start_iter=self.cfg.hook_start)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
            self.comm_hook_state = state

    def _wrap(self):
        mode, cfg = self.cfg.mode, self.cfg
        if mode in ("ddp", "naive"):
            from mpiring.parallel.data.distributed import DistributedDataParallel

            wrapped = DistributedDataParallel(
                self.model, self.data_comm, bucket_cap_mb=cfg.bucket_mb,
                first_bucket_mb=cfg.first_bucket_mb, overlap=(mode == "ddp"), algo=cfg.algo,
                gradient_as_bucket_view=cfg.grad_as_bucket_view)
            self._register_comm_hook(wrapped)
            self.optimizer = self._make_optimizer(self.model.parameters(), ddp=wrapped)
            return wrapped
        if mode == "ps":
            self.ps = ParameterServer(self.model, self.comm, self._make_optimizer,
                                      server=0, bucket_cap_mb=cfg.bucket_mb)
            self.optimizer = self.ps.optimizer
            return self.model
        return self._wrap_torch_ddp()

    def _wrap_torch_ddp(self):
        from mpiring.tools.train.torch_pg import init_torch_process_group

        self._pg = init_torch_process_group(self.comm, self.device)
        # torch DDP takes rank 0's parameters at construction, like ours.
        wrapped = torch.nn.parallel.DistributedDataParallel(
            self.model, bucket_cap_mb=self.cfg.bucket_mb, process_group=self._pg,
            gradient_as_bucket_view=self.cfg.grad_as_bucket_view,
            device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = self._make_optimizer(self.model.parameters())
        return wrapped

    # --- data ----------------------------------------------------------------------
    @property
    def batches_per_epoch(self) -> int:
        return len(self.sampler) // self.cfg.batch_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next batch; a new epoch (new shuffle, same on all ranks) when one ends.

        The position lives in the sampler (``epoch``, ``start``), so a checkpoint
        of ``sampler.state_dict()`` resumes the data exactly.
        """
        b = self.cfg.batch_size
        if self.sampler.start + b > len(self.sampler):
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._shard = None
        if self._shard is None:
            self._shard = self.sampler.shard()
        idx = self._shard[self.sampler.start:self.sampler.start + b]
        self.sampler.start += b
        return self.train_set.batch(idx, self.device)

    # --- one step ------------------------------------------------------------------
    def train_step(self) -> float:
        """Forward, backward (gradients averaged over ranks), update. Returns the local loss."""
        t0 = clock()
        x, y = self.next_batch()
        value = self._update(x, y)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = clock()
        self.step += 1
        self.losses.append(value)
        self.step_times.append(t1 - t0)
        exposed = self._exposed_comm_s()
        if exposed is not None:
            self.exposed_comm.append(exposed)
        self.comm.tracer.event("train.step", "train", t0, t1, step=self.step, loss=value)
        return value

    def _update(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward, backward and the optimizer's step on one batch; returns the local loss."""
        loss = self.loss_fn(self.wrapped(x), y)
        if self.ps is not None:
            self.ps.zero_grad()
            loss.backward()
            self.ps.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.cfg.grad_clip and self.cfg.optimizer == "adamw":
                # The whole model's norm: tensor-parallel and FSDP parts summed over their
                # groups; DDP's replicas hold the mean already.
                clip_grad_norm_(self.wrapped, self.cfg.grad_clip)
            self.optimizer.step()
        return float(loss.detach())

    def global_mean(self, values: Sequence[float]) -> list[float]:
        """Element-wise mean over ranks of a per-rank list of floats (collective)."""
        arr = np.asarray(values, dtype=np.float64).copy()
        if self.comm.size > 1 and arr.size:
            self.comm.all_reduce(arr, op="avg", algo="native")
        return arr.tolist()

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> float:
        """Mean validation loss over ``batches`` batches per rank (collective)."""
        batches = self.cfg.val_batches if batches is None else batches
        sampler = DistributedSampler(len(self.val_set), self.data_comm.size, self.data_comm.rank,
                                     shuffle=False, drop_last=True)
        order = list(sampler)
        b = self.cfg.batch_size
        total = np.zeros(2, dtype=np.float64)
        was_training = self.model.training
        self.model.eval()
        try:
            for j in range(min(batches, len(order) // b)):
                x, y = self.val_set.batch(order[j * b:(j + 1) * b], self.device)
                total[0] += float(self.loss_fn(self.model(x), y)) * len(x)
                total[1] += len(x)
        finally:
            self.model.train(was_training)
        if self.comm.size > 1:
            self.comm.all_reduce(total, op="sum", algo="native")
        return float(total[0] / total[1]) if total[1] else math.nan

    def _exposed_comm_s(self) -> float | None:
        """Seconds the step's synced backward waited on its reductions (None: no mpiring DDP)."""
        reducer = self._our_reducer()
        return None if reducer is None else reducer.exposed_comm_s

    def _our_reducer(self):
        from mpiring.parallel.data.reducer import Reducer

        reducer = getattr(self.wrapped, "reducer", None)
        return reducer if isinstance(reducer, Reducer) else None

    # --- state for checkpoints -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue this rank's run exactly (optimizer: where held).

        With a sharded optimizer (zero1, zero2) this is a collective: the
        optimizer state is consolidated onto every rank.
        """
        self._refuse_tp_checkpoint()
        if hasattr(self.optimizer, "consolidate_state_dict"):
            self.optimizer.consolidate_state_dict(to=None)
        return {
            "config": asdict(self.cfg),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "losses": list(self.losses),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (on the same mode and world size)."""
        self._refuse_tp_checkpoint()
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._shard = None
        self.losses = list(state.get("losses", []))

    def _refuse_tp_checkpoint(self) -> None:
        # Each rank of a tensor-parallel group holds its own shard, and this job's
        # checkpoint is one rank's state_dict: it would save rank 0's shards only and
        # load them on every rank. GridJob gathers the full model by name.
        if self.tp_comm is not None and type(self).state_dict is TrainJob.state_dict:
            raise ValueError("a TrainJob with tp > 1 holds a weight shard per rank, which its "
                             "checkpoint does not gather: build the job with "
                             "job3d.make_job (as `train --tp` does), whose checkpoints hold the "
                             "full model")

    def close(self) -> None:
        """Stop the DDP communication thread and tear down torch's process group."""
        reducer = self._our_reducer()
        if reducer is not None:
            reducer.close()
        if self._pg is not None:
            from mpiring.tools.train.torch_pg import destroy_torch_process_group

            self.wrapped = self.model  # torch's DDP must not outlive its group
            destroy_torch_process_group(self.comm)
            self._pg = None
        for comm in self._own_groups:
            comm.free()


def train(job: TrainJob, callbacks: Sequence[Callback] = (),
          progress: Callable[[TrainJob, float | None], None] | None = None) -> TrainResult:
    """Run ``job.cfg.steps - job.step`` steps, then the validation loss (collective).

    ``progress(job, global_loss)`` is called after every step on every rank, with
    the global mean loss every ``log_every`` steps and at the last step (a
    collective at the same steps on every rank), ``None`` otherwise.
    """
    for cb in callbacks:
        getattr(cb, "on_start", lambda j: None)(job)
    while job.step < job.cfg.steps:
        job.train_step()
        shown = None
        if job.step % job.cfg.log_every == 0 or job.step == job.cfg.steps:
            shown = job.global_mean(job.losses[-1:])[0]
        if progress is not None:
            progress(job, shown)
        for cb in callbacks:
            getattr(cb, "on_step_end", lambda j: None)(job)
    val = job.evaluate()
    losses = job.global_mean(job.losses)
    return TrainResult(losses=losses, val_loss=val, step_times=list(job.step_times),
                       exposed_comm=list(job.exposed_comm))
