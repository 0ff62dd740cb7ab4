r"""The DDP bench: where a training step's time goes, mode by mode, on the project's GPT.

Modes, each on the same model, data and ranks:

* ``compute``: the model and optimizer alone, no communication: the lower bound
  (every rank computes at the same time, so ranks sharing cores slow each
  other exactly as in the other modes);
* ``ddp``: ``mpiring.DistributedDataParallel``, bucket AllReduces overlapping
  backward;
* ``naive``: the same reducer with ``overlap=False``: backward, then every bucket;
* ``flat-mpi``: no reducer: backward, then every gradient copied into one flat
  buffer, one ``MPI_Allreduce`` of it (the library's own), and the means copied
  back (the textbook baseline, as simple as data parallelism gets);
* ``ps``: the parameter-server baseline (Reduce to rank 0, update, Broadcast);
* ``torch-ddp``: PyTorch's DDP over gloo.

All jobs are built first and then take turns, one step each, so that load
from elsewhere on a shared machine hits every mode alike (the price: every
job's model and optimizer state are in memory at once); the order of the
turns changes from step to step (``measure.balanced_orders``).

A step is split into forward, backward compute, exposed communication (time
the step waits for communication that did not hide behind compute), optimizer
and the rest (batch, zero_grad)::

    ddp/naive   exposed = the reducer's wait after autograd ends (measured)
                backward = loss.backward() - exposed
    flat-mpi    exposed = flatten + MPI_Allreduce + copy back, after backward
    ps          exposed = ps.step(): push, server update, pull (nothing overlaps)
    torch-ddp   exposed ~ loss.backward() - compute's backward (estimated: torch
                DDP waits inside backward and does not report the split)

The overlap fraction is the share of the communication time hidden behind
backward: 1 - exposed / (sum of the bucket AllReduce times), from the
reducer's own trace events.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO
from mpiring.runtime import pages
from mpiring.runtime.trace import NULL_CALL, Tracer, clock
from mpiring.tools.bench.measure import balanced_orders

DDP_MODES = ("compute", "ddp", "naive", "flat-mpi", "ps", "torch-ddp")
#: Modes that train the bare model (no wrapper): compute alone, and flat-mpi,
#: which reduces the gradients itself after backward.
BARE = ("compute", "flat-mpi")
PARTS = ("forward", "backward", "exposed", "optimizer", "other")


class EventSink(Tracer):
    """An in-memory tracer that keeps the event records (DDP buckets, waits) and no ring steps.

    Installed as ``comm.tracer`` it lets the bench read the reducer's bucket
    timings without writing files or slowing the ring down with step records.
    """

    def __init__(self, rank: int):
        super().__init__(rank)
        self.events: list[dict[str, Any]] = []

    @property
    def enabled(self) -> bool:
        return True

    def call(self, collective: str, call: int, algo: str):
        return NULL_CALL

    def write(self, rec: dict[str, Any]) -> None:
        if rec.get("type") == "event":
            self.events.append(rec)


@dataclass
class DDPBenchConfig:
    """What the DDP bench runs (the command's flags, as data)."""

    preset: str = "comm"
    batch_size: int = 8
    seq_len: int | None = None
    steps: int = 8
    warmup: int = 2
    modes: Sequence[str] = DDP_MODES
    bucket_mb: float = 25.0
    bucket_sweep: Sequence[float] = ()
    algo: str = DEFAULT_BUCKET_ALGO
    grad_as_bucket_view: bool = False
    max_data_mb: float = 2.0
    fused_adamw: bool = True
    notes: list[str] = field(default_factory=list)

    def validate(self) -> None:
        for m in self.modes:
            if m not in DDP_MODES:
                raise ValueError(f"unknown mode {m!r}: use one of {', '.join(DDP_MODES)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("steps must be >= 1 and warmup >= 0")
        for b in (self.bucket_mb, *self.bucket_sweep):
            if not b > 0:
                raise ValueError(f"bucket size {b} MiB: must be positive")


def _train_config(cfg: DDPBenchConfig, mode: str, bucket_mb: float):
    from mpiring.tools.train.loop import TrainConfig

    return TrainConfig(mode=mode, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       preset=cfg.preset, bucket_mb=bucket_mb,
                       first_bucket_mb=min(1.0, bucket_mb), algo=cfg.algo,
                       grad_as_bucket_view=cfg.grad_as_bucket_view, max_data_mb=cfg.max_data_mb,
                       fused_adamw=cfg.fused_adamw)


def _flat_all_reduce(job) -> tuple[float, float]:
    """flat-mpi's communication: one MPI_Allreduce of every gradient.

    Returns the Allreduce's time and the whole exchange's (flatten, Allreduce,
    mean copied back), in seconds. The flat buffer is allocated once and reused.
    """
    import torch

    params = [p for p in job.model.parameters() if p.grad is not None]
    t0 = clock()
    n = sum(p.numel() for p in params)
    flat = getattr(job, "_bench_flat", None)
    if flat is None or flat.numel() != n:  # one buffer, reused: no fresh pages every step
        # On huge pages, like the reducer's buckets (see mpiring.runtime.pages).
        flat = job._bench_flat = pages.zeros(n, params[0].grad.dtype)
    torch.cat([p.grad.reshape(-1) for p in params], out=flat)
    t1 = clock()
    job.comm.all_reduce(flat, op="sum", algo="native", check=False)
    t2 = clock()
    offset = 0
    for p in params:  # the mean, copied back in the same pass
        k = p.numel()
        torch.div(flat[offset:offset + k].view_as(p.grad), job.comm.size, out=p.grad)
        offset += k
    return t2 - t1, clock() - t0


def _step_parts(job, sink: EventSink | None, compute_only: bool,
                flat_mpi: bool = False) -> dict[str, float]:
    """Run one training step; return its parts in seconds (this rank's)."""
    from mpiring.tools.models.gpt import lm_loss

    if sink is not None:
        sink.events.clear()
    t0 = clock()
    x, y = job.next_batch()
    if job.ps is not None:
        job.ps.zero_grad()
    else:
        job.optimizer.zero_grad(set_to_none=True)
    t1 = clock()
    model = job.model if compute_only else job.wrapped
    loss = lm_loss(model(x), y)
    t2 = clock()
    loss.backward()
    comm_s = wait_s = float("nan")
    if flat_mpi:
        comm_s, wait_s = _flat_all_reduce(job)
    t3 = clock()
    if job.ps is not None:
        job.ps.step()
    else:
        job.optimizer.step()
    t4 = clock()
    parts = {"step": t4 - t0, "forward": t2 - t1, "backward_call": t3 - t2,
             "update": t4 - t3, "other": t1 - t0, "comm_total": comm_s, "wait": wait_s}
    if sink is not None:
        buckets = [e for e in sink.events if e["name"] == "ddp.all_reduce"]
        waits = [e for e in sink.events if e["name"] == "ddp.wait"]
        if buckets:
            parts["comm_total"] = sum(e["t_end"] - e["t_start"] for e in buckets)
        if waits:
            parts["wait"] = waits[-1]["t_end"] - waits[-1]["t_start"]
    return parts


KEYS = ("step", "forward", "backward_call", "update", "other", "comm_total", "wait")


def _summarise(comm, local: np.ndarray) -> dict[str, float]:
    """Per part: the median over steps of the mean over ranks (the step: of the slowest rank)."""
    steps = local.shape[0]
    table = comm.control.allgather_array(local.reshape(-1)).reshape(comm.size, steps, len(KEYS))
    out = {}
    for j, k in enumerate(KEYS):
        col = table[:, :, j]
        per_step = col.max(axis=0) if k == "step" else col.mean(axis=0)
        out[k] = float(np.median(per_step)) if np.isfinite(per_step).all() else float("nan")
    return out


def _split(mode: str, m: dict[str, float], compute: dict[str, float] | None) -> dict[str, float]:
    """Turn raw timings into forward / backward / exposed / optimizer / other (seconds)."""
    fwd, bcall, upd = m["forward"], m["backward_call"], m["update"]
    parts = {"forward": fwd, "optimizer": upd, "exposed": 0.0, "backward": bcall,
             "estimated": False}
    if mode in ("ddp", "naive", "flat-mpi") and np.isfinite(m["wait"]):
        # The wait is timed inside the backward call (the reducer's, at the end of
        # autograd; flat-mpi's exchange, right after it), so it can be at most that
        # call (both are means over ranks; clamping keeps forward + backward +
        # exposed + optimizer + other equal to the step).
        parts["exposed"] = min(m["wait"], bcall)
        parts["backward"] = bcall - parts["exposed"]
    elif mode == "ps":
        parts["exposed"], parts["optimizer"] = upd, 0.0
    elif mode == "torch-ddp" and compute is not None:
        parts["backward"] = min(bcall, compute["backward_call"])
        parts["exposed"] = bcall - parts["backward"]
        parts["estimated"] = True
    parts["other"] = max(0.0, m["step"] - fwd - bcall - upd)
    return parts


def run_ddp_bench(comm, cfg: DDPBenchConfig, progress=None) -> list[dict[str, Any]]:
    """Run every mode (and the ddp bucket sweep); rows with times in ms, on every rank."""
    import torch

    from mpiring.tools.train.data import shared_corpus
    from mpiring.tools.train.loop import TrainJob

    cfg.validate()
    if "torch-ddp" in cfg.modes and not _gloo_ok():
        cfg.notes.append("torch-ddp skipped: torch.distributed with gloo is not available")
    if comm.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a host would otherwise each start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.local_size))
    train, val = shared_corpus(comm, int(cfg.max_data_mb * (1 << 20)))
    plan: list[tuple[str, float]] = [(m, cfg.bucket_mb) for m in cfg.modes
                                     if m != "torch-ddp" or _gloo_ok()]
    if "compute" in [m for m, _ in plan]:  # the lower bound first: torch-ddp's split needs it
        plan.sort(key=lambda p: p[0] != "compute")
    plan += [("ddp", b) for b in cfg.bucket_sweep if b != cfg.bucket_mb or "ddp" not in cfg.modes]
    # Every job is built first and the jobs then take turns, one step each, so
    # that load from elsewhere on a shared machine hits every mode alike.
    quiet = comm.tracer
    sink = EventSink(comm.rank)
    jobs = []
    try:
        for mode, bucket in plan:
            if progress:
                progress.show(f"building {mode} bucket {bucket:g} MiB")
            job = TrainJob(comm, _train_config(cfg, "naive" if mode in BARE else mode, bucket),
                           train_data=train, val_data=val)
            if mode in BARE:
                job.wrapped.close()  # no hooks, no thread: the bare model and its optimizer
            jobs.append(job)
        comm.tracer = sink  # the reducers write their bucket events here
        local = np.zeros((len(jobs), cfg.steps, len(KEYS)))
        orders = balanced_orders(len(jobs))  # the order changes step by step (see there)
        for i in range(cfg.warmup + cfg.steps):
            if progress:
                progress.show(f"step {i + 1}/{cfg.warmup + cfg.steps} of every mode")
            for j in orders[i % len(orders)]:
                (mode, _), job = plan[j], jobs[j]
                ours = mode in ("ddp", "naive")
                parts = _step_parts(job, sink if ours else None, compute_only=(mode in BARE),
                                    flat_mpi=(mode == "flat-mpi"))
                if i >= cfg.warmup:
                    local[j, i - cfg.warmup] = [parts[k] for k in KEYS]
            if progress:
                progress.update(f"step {i + 1}/{cfg.warmup + cfg.steps} of every mode")
    finally:
        comm.tracer = quiet
        for job in jobs:
            job.close()
    raws = [_summarise(comm, local[j]) for j in range(len(jobs))]
    compute = next((raw for (mode, _), raw in zip(plan, raws) if mode == "compute"), None)
    rows: list[dict[str, Any]] = []
    for (mode, bucket), job, raw in zip(plan, jobs, raws):
        parts = _split(mode, raw, compute)
        comm_total = raw["comm_total"] if np.isfinite(raw["comm_total"]) else None
        overlap = None
        if comm_total:
            overlap = min(1.0, max(0.0, 1.0 - parts["exposed"] / comm_total))
        n_params = job.model.num_params()
        rows.append({
            "mode": mode, "bucket_mb": None if mode in BARE else bucket,
            "ranks": comm.size, "preset": cfg.preset, "params": n_params,
            "grad_bytes": n_params * 4, "batch": cfg.batch_size, "seq_len": job.model_cfg.seq_len,
            "steps": cfg.steps, "warmup": cfg.warmup, "algo": cfg.algo,
            "grad_as_bucket_view": cfg.grad_as_bucket_view,
            "step_ms": raw["step"] * 1e3,
            **{f"{p}_ms": parts[p] * 1e3 for p in PARTS},
            "exposed_estimated": parts["estimated"],
            "comm_total_ms": comm_total * 1e3 if comm_total else None,
            "overlap": overlap,
        })
    base = next((r["step_ms"] for r in rows if r["mode"] == "compute"), None)
    for r in rows:
        r["vs_compute"] = r["step_ms"] / base if base else None
    return rows


def _gloo_ok() -> bool:
    from mpiring.tools.bench.gloo import available

    return available()


def _label(r: dict[str, Any]) -> str:
    if r["mode"] in BARE:
        return r["mode"]
    return f"{r['mode']} {r['bucket_mb']:g}M"


def format_ddp_table(rows: list[dict[str, Any]]) -> str:
    """Step time and its parts per mode (ms), overlap, and the slowdown over compute alone."""
    if not rows:
        return ""
    r0 = rows[0]
    out = [f"# DDP step: GPT preset {r0['preset']} ({r0['params'] / 1e6:.1f}M parameters, "
           f"{r0['grad_bytes'] / 1e6:.1f} MB of float32 gradients), {r0['ranks']} ranks x "
           f"{r0['batch']} windows x {r0['seq_len']} tokens, bucket AllReduce algo {r0['algo']}"
           + (", .grad views into the buckets" if r0.get("grad_as_bucket_view") else ""),
           f"# median over {r0['steps']} steps ({r0['warmup']} warm-up) of the mean over ranks "
           "(step: of the slowest rank); ~ = estimated (see mpiring/tools/bench/ddp.py)",
           "# exposed = communication the step waits for; comm = sum of the bucket AllReduce "
           "times; overlap = 1 - exposed/comm",
           "#",
           f"#{'mode':>13} {'step':>8} {'forward':>8} {'backward':>9} {'exposed':>9} "
           f"{'optim':>7} {'other':>7} {'comm':>8} {'overlap':>8} {'x compute':>10}",
           f"#{'':>13} {'(ms)':>8} {'(ms)':>8} {'(ms)':>9} {'(ms)':>9} {'(ms)':>7} {'(ms)':>7} "
           f"{'(ms)':>8} {'':>8} {'':>10}"]
    for r in rows:
        est = "~" if r.get("exposed_estimated") else ""
        comm = f"{r['comm_total_ms']:.1f}" if r.get("comm_total_ms") is not None else "-"
        ov = f"{r['overlap'] * 100:.0f}%" if r.get("overlap") is not None else "-"
        vs = f"{r['vs_compute']:.2f}" if r.get("vs_compute") is not None else "-"
        out.append(f"{_label(r):>14} {r['step_ms']:>8.1f} {r['forward_ms']:>8.1f} "
                   f"{r['backward_ms']:>9.1f} {est + format(r['exposed_ms'], '.1f'):>9} "
                   f"{r['optimizer_ms']:>7.1f} {r['other_ms']:>7.1f} {comm:>8} {ov:>8} {vs:>10}")
    return "\n".join(out)


def plot_ddp(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Step-time bars: one stacked horizontal bar per mode/bucket size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"forward": "tab:blue", "backward": "tab:green", "exposed": "tab:red",
              "optimizer": "tab:purple", "other": "tab:gray"}
    labels = [_label(r) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.45 * len(rows)))
    left = np.zeros(len(rows))
    for part in PARTS:
        widths = np.array([r[f"{part}_ms"] for r in rows])
        ax.barh(labels, widths, left=left, color=colors[part],
                label="exposed communication" if part == "exposed" else part)
        left += widths
    for y, r in enumerate(rows):
        if r.get("overlap") is not None:
            ax.text(left[y], y, f"  overlap {r['overlap'] * 100:.0f}%", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time per training step (ms)")
    # Under the axis, so that it never covers the title or a bar.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=5, frameon=False)
    r0 = rows[0]
    ax.set_title(title or f"GPT {r0['preset']} ({r0['params'] / 1e6:.1f}M params), "
                 f"{r0['ranks']} ranks", fontsize=9, loc="left")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

