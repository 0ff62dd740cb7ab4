"""Train a small GPT on the standard library's source, data-parallel (ddp, naive, ps, torch-ddp).

    mpiexec -n 4 python -m mpiring train --mode ddp --steps 50
    mpiexec -n 4 python -m mpiring train --mode naive --preset comm --steps 20
    mpiexec -n 4 python -m mpiring train --tp 2 --steps 20   # 2-way tensor x 2-way data parallel
    mpiexec -n 8 python -m mpiring train --tp 2 --pp 2 --global-batch 16 --metrics m.jsonl

Every rank reads the same byte-level corpus (rank 0 reads, all receive), trains
on its shard (a distributed sampler), and rank 0 prints a progress bar, the loss
and tokens/s, the validation loss and one summary line with the median step
time, so that modes can be compared run against run.
"""

from __future__ import annotations

import argparse
import os
import sys

from mpiring.cli import add_backend_arguments, non_negative_int, positive_int, refuse


def add_arguments(p) -> None:
    from mpiring.comm.communicator import ALGOS
    from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO
    from mpiring.tools.train.checkpointing import add_arguments as add_checkpoint_arguments
    from mpiring.tools.train.loop import MODES

    p.add_argument("--mode", choices=MODES, default="ddp",
                   help="ddp (overlapped buckets), naive (buckets after backward), ps "
                        "(parameter server), torch-ddp (PyTorch DDP over gloo/nccl)")
    p.add_argument("--steps", type=positive_int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per rank per step (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per window (default: the preset's)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order (same on all ranks)")
    p.add_argument("--preset", default="small",
                   help="model size: tiny (0.1M), small (3.2M, default), comm (12.8M)")
    p.add_argument("--d-model", type=positive_int, default=None, help="override the preset's width")
    p.add_argument("--layers", type=positive_int, default=None, help="override the preset's depth")
    p.add_argument("--heads", type=positive_int, default=None, help="override the preset's heads")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout (default 0)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB (default 25)")
    p.add_argument("--first-bucket-mb", type=float, default=1.0, help="first bucket in MiB (default 1)")
    p.add_argument("--algo", choices=ALGOS["all_reduce"], default=DEFAULT_BUCKET_ALGO,
                   help="bucket AllReduce: the lecture's ring in 1 MiB segments (ring-seg, the "
                        "default), the lecture's loop as written (ring), another of mpiring's "
                        "algorithms, or native (the MPI library's own)")
    p.add_argument("--grad-as-bucket-view", action="store_true",
                   help="make each .grad a view into its DDP bucket: no copy back after the "
                        "AllReduce, one gradient copy less memory (ddp, naive, torch-ddp)")
    p.add_argument("--max-data-mb", type=float, default=4.0,
                   help="read at most this much standard-library source (default 4)")
    p.add_argument("--val-batches", type=non_negative_int, default=4,
                   help="validation batches per rank (default 4; 0: no validation)")
    p.add_argument("--log-every", type=positive_int, default=10, help="global loss every N steps (default 10)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    # Sharded optimizer and gradient compression (mpiring.parallel.zero, mpiring.parallel.data.comm_hooks).
    p.add_argument("--optimizer", choices=("adamw", "zero1", "zero2"), default="adamw",
                   help="adamw, or AdamW sharded over the ranks: zero1 (state sharded), zero2 "
                        "(state sharded, buckets reduce-scattered during backward)")
    p.add_argument("--no-fused-adamw", action="store_true",
                   help="the plain AdamW instead of torch's fused kernel (which is used where "
                        "the device has one: on the CPU a step of the optimizer 3-5x faster)")
    p.add_argument("--comm-hook", choices=("none", "allreduce", "fp16", "bf16", "topk", "powersgd"),
                   default="none", help="how DDP buckets travel: fp16/bf16 (half the bytes), topk "
                                        "(largest entries, error feedback), powersgd (low rank)")
    p.add_argument("--topk-ratio", type=float, default=0.01,
                   help="topk: fraction of each bucket sent (default 0.01)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="powersgd: approximation rank (default 1)")
    p.add_argument("--hook-start", type=non_negative_int, default=10,
                   help="topk/powersgd: plain AllReduce for the first N steps (default 10)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size: the GPT split over groups of N adjacent ranks "
                        "(Megatron's column/row layers), DDP over the world / N groups (default 1)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp > 1: split the sequence too outside the column/row layers")
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline stages: the GPT's units split over P stages, tensor parallel "
                        "inside each, data parallel over world / (tp * pp) (default 1)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard parameters, gradients and AdamW state over the data axis (ZeRO-3)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "zb", "pipedream", "interleaved",
                                          "interleaved-zb", "zbv", "dualpipev", "looped-bfs"),
                   default=None, help="pipeline schedule with --pp > 1 (default 1f1b; "
                                        "interleaved-zb: interleaved with zb's split backward; "
                                        "zbv: zero bubble, 2 stages per rank in a V; "
                                        "dualpipev: DeepSeek's order on zbv's V, at least "
                                        "2 pp micro-batches; looped-bfs: interleaved's "
                                        "stages, breadth first)")
    p.add_argument("--pp-layers", type=_counts, default=None, metavar="N,N,...",
                   help="blocks per stage, comma list summing to the model's (the embeddings "
                        "go with the first stage, the head with the last), e.g. 3,1 for a "
                        "last stage that also computes the head; with --vpp, one per stage "
                        "of the pp x vpp (default: the units split evenly)")
    p.add_argument("--vpp", type=positive_int, default=None,
                   help="stages per rank with --schedule interleaved, interleaved-zb or "
                        "looped-bfs (Megatron's virtual pipeline size; default 2); zbv and "
                        "dualpipev hold 2")
    p.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches per step with --pp > 1 (default: pp; dualpipev 2 pp); "
                        "must divide the windows per replica")
    p.add_argument("--global-batch", type=int, default=None,
                   help="windows per step over all data-parallel replicas (instead of "
                        "--batch-size per replica): the same data at any layout")
    p.add_argument("--grad-clip", type=float, default=0.0, metavar="NORM",
                   help="clip the gradients' global 2-norm (the whole model's, over every "
                        "rank's part) to NORM before each step; 0: off (default)")
    p.add_argument("--metrics", metavar="FILE", default=None,
                   help="write one JSON line per step (step, loss, tokens, ms) to FILE")
    add_checkpoint_arguments(p)  # --checkpoint-dir/-every/-keep, --resume, --check-replicas
    add_backend_arguments(p)


def _counts(text: str) -> tuple[int, ...]:
    """``"3,1"`` -> ``(3, 1)``: argparse's type for --pp-layers."""
    try:
        counts = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give block counts separated by commas, "
                                         "e.g. 3,1") from None
    if any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: block counts are 0 or more")
    return counts


def args_error(args) -> str | None:
    """What the flags ask for that the run would silently not do (pure: the same on
    every rank, before any communication), with the fix; None if nothing."""
    if args.schedule is not None and args.pp == 1:
        return (f"--schedule {args.schedule} orders a pipeline's micro-batches, and --pp 1 "
                "has no pipeline: add --pp 2 or more, or leave --schedule out")
    if args.grad_as_bucket_view and (args.mode == "ps" or args.fsdp):
        # (Not in TrainConfig.validate: bench-ddp runs mode ps beside the others with it.)
        return ("--grad-as-bucket-view makes .grad a view into a DDP bucket: "
                f"{'--fsdp' if args.fsdp else '--mode ps'} has no DDP buckets; leave "
                "--grad-as-bucket-view out")
    if args.metrics is not None:
        return metrics_path_error(args.metrics)
    return None


def metrics_path_error(path: str) -> str | None:
    """Why ``--metrics path`` could not be written, or None (checked before the run starts)."""
    if os.path.isdir(path):
        return f"--metrics {path}: is a directory; give a file name, e.g. {os.path.join(path, 'metrics.jsonl')}"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"--metrics {path}: the directory {parent} does not exist; create it or give another path"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"--metrics {path}: the file is not writable; give another path"
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        return f"--metrics {path}: the directory {parent} is not writable; give another path"
    return None


def config_from_args(args):
    """A ``TrainConfig`` from parsed flags."""
    from mpiring.tools.train.loop import TrainConfig
    from mpiring.tools.train.pipeline import MULTI_STAGE

    return TrainConfig(
        mode=args.mode, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
        lr=args.lr, seed=args.seed, preset=args.preset, d_model=args.d_model,
        n_layers=args.layers, n_heads=args.heads, dropout=args.dropout, bucket_mb=args.bucket_mb,
        first_bucket_mb=args.first_bucket_mb, algo=args.algo, max_data_mb=args.max_data_mb,
        grad_as_bucket_view=args.grad_as_bucket_view,
        val_batches=args.val_batches, log_every=args.log_every,
        optimizer=args.optimizer, fused_adamw=not args.no_fused_adamw,
        comm_hook=args.comm_hook, topk_ratio=args.topk_ratio,
        powersgd_rank=args.powersgd_rank, hook_start=args.hook_start,
        tp=args.tp, sequence_parallel=args.sequence_parallel, pp=args.pp, fsdp=args.fsdp,
        schedule=args.schedule or "1f1b", microbatches=args.microbatches, global_batch=args.global_batch,
        vpp=args.vpp or (2 if args.schedule in MULTI_STAGE else 1),
        pp_layers=args.pp_layers,
        grad_clip=args.grad_clip)


class ProgressBar:
    """Rank 0's progress: a bar redrawn in place on a terminal, a line per log step otherwise."""

    def __init__(self, total: int, tokens_per_step: int, enabled: bool, stream=None):
        self.total = total
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.loss: float | None = None

    def __call__(self, job, loss: float | None) -> None:
        if not self.enabled:
            return
        if loss is not None:
            self.loss = loss
        recent = job.step_times[-10:]
        step_s = sorted(recent)[len(recent) // 2] if recent else 0.0
        tok_s = self.tokens_per_step / step_s if step_s else 0.0
        width = 24
        filled = int(width * job.step / self.total)
        loss_txt = f"{self.loss:.3f}" if self.loss is not None else "-"
        line = (f"step {job.step:>{len(str(self.total))}}/{self.total} "
                f"[{'#' * filled}{'.' * (width - filled)}] loss {loss_txt} "
                f"{tok_s:,.0f} tok/s {step_s * 1e3:.0f} ms/step")
        if self.tty:
            end = "\n" if job.step == self.total else ""
            self.stream.write("\r" + line + end)
            self.stream.flush()
        elif loss is not None:
            self.stream.write(line + "\n")
            self.stream.flush()


def run(args) -> int:
    import torch

    import mpiring
    from mpiring.parallel.checkpoint import ReplicaDivergenceError
    from mpiring.runtime.pages import steady_malloc
    from mpiring.tools.train.checkpointing import (
        CheckpointWriteError,
        ResumeError,
        callbacks_from_args,
    )
    from mpiring.tools.train.job3d import make_job
    from mpiring.tools.train.loop import train
    from mpiring.tools.train.metrics import MetricsWriteError, MetricsWriter

    cfg = config_from_args(args)
    try:
        error = args_error(args)
        if error is not None:
            raise ValueError(error)
        cfg.validate()
        callbacks = callbacks_from_args(args)
        if cfg.fsdp and args.check_replicas is not None:
            raise ValueError("--check-replicas compares whole replicas; FSDP keeps shards: "
                             "leave it out with --fsdp")
    except ValueError as exc:
        return refuse(f"mpiring train: {exc}")
    steady_malloc()  # every step reuses the last one's freed memory (see mpiring.runtime.pages)
    comm = mpiring.init(backend=args.backend, trace=args.trace, log=args.log)
    if comm.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a host would otherwise each start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))
    if args.backend == "nccl":
        device = torch.device("cuda", comm.local_rank % max(1, torch.cuda.device_count()))
    else:
        device = torch.device("cpu")
    try:
        # A layout that cannot run is refused on every rank alike, before training.
        job = make_job(comm, cfg, device=device)
    except ValueError as exc:
        if comm.rank == 0:
            print(f"mpiring train: {exc}", file=sys.stderr, flush=True)
        comm.tracer.close()
        return 2
    cfg = job.cfg  # --global-batch fixed the windows per replica
    n_params = getattr(job, "full_params", None) or job.model.num_params()
    dp = job.data_comm.size  # the ranks that read different batches (all of them at --tp 1)
    tokens = dp * cfg.batch_size * job.model_cfg.seq_len
    if args.metrics:
        callbacks.append(MetricsWriter(args.metrics, tokens))
    if comm.rank == 0:
        layout = (f" (dp={dp} x tp={cfg.tp} x pp={cfg.pp}"
                  f"{', fsdp' if cfg.fsdp else ''}{', sequence parallel' if cfg.sequence_parallel else ''}"
                  f"{f', {cfg.schedule} x {job.microbatches} micro-batches' if cfg.pp > 1 else ''})")
        print(f"train: mode={cfg.mode} backend={args.backend} ranks={comm.size}"
              f"{layout if hasattr(job, 'grid') else ''} "
              f"model={cfg.preset} ({n_params / 1e6:.2f}M params, d={job.model_cfg.d_model}, "
              f"{job.model_cfg.n_layers} layers) batch {dp}x{cfg.batch_size}x"
              f"{job.model_cfg.seq_len} tokens, {len(job.train_set)} training windows",
              file=sys.stderr, flush=True)
    bar = ProgressBar(cfg.steps, tokens, enabled=comm.rank == 0 and not args.no_progress)
    try:
        result = train(job, callbacks=callbacks, progress=bar)
    except (ReplicaDivergenceError, ResumeError, CheckpointWriteError, MetricsWriteError) as exc:
        # Raised on every rank with the same text: one message, no tracebacks.
        if comm.rank == 0:
            print(f"mpiring train: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        job.close()
        comm.tracer.close()
    if comm.rank == 0:
        step_s = result.median_step_s
        exposed = ""
        if result.exposed_comm:
            tail = sorted(result.exposed_comm[1:] or result.exposed_comm)
            exposed = f", exposed comm {tail[len(tail) // 2] * 1e3:.1f} ms/step"
        print(f"train: mode={cfg.mode} backend={args.backend} ranks={comm.size} "
              f"model={cfg.preset} {n_params / 1e6:.2f}M params, {cfg.steps} steps of "
              f"{tokens} tokens: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
              f"{_val_text(cfg, job, result.val_loss)}, median step {step_s * 1e3:.1f} ms, "
              f"{tokens / step_s if step_s else 0:,.0f} tok/s{exposed}{_zero_and_hook(cfg, job)}",
              flush=True)
    return 0


def _val_text(cfg, job, val_loss: float) -> str:
    """The validation loss for the summary line, or why there is none (never a bare nan)."""
    if cfg.val_batches == 0:
        return "no validation (--val-batches 0)"
    if len(job.val_set) // job.data_comm.size < cfg.batch_size:
        return (f"no validation: the {len(job.val_set)} validation windows fill no batch of "
                f"{cfg.batch_size} per replica (raise --max-data-mb or lower the batch)")
    return f"val loss {val_loss:.3f}"


def _zero_and_hook(cfg, job) -> str:
    """The sharded optimizer and comm hook, if any, for the summary line."""
    parts = []
    if cfg.optimizer != "adamw":
        parts.append(f"optimizer {cfg.optimizer}")
    state = job.comm_hook_state
    if state is not None:
        ratio = state.dense_bytes / state.bytes_sent if state.bytes_sent else float("nan")
        parts.append(f"comm hook {cfg.comm_hook}: {state.bytes_sent / max(1, cfg.steps) / 2**20:.2f} "
                     f"MiB/step sent by rank 0, {ratio:.1f}x fewer than plain")
    return "".join(", " + p for p in parts)
