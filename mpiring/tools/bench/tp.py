"""Tensor-parallel step times: one block on 1 rank, on mpiring's TP, on torch's TP over gloo.

Each measurement is forward plus backward of one block on ``tokens`` tokens:

* ``mlp``: Linear(d, 4d), GELU, Linear(4d, d) (a Transformer MLP block);
* ``layer``: one block of the project's GPT (attention and MLP, d/64 heads).

Modes: ``single`` (the full block on rank 0 while the others wait without
spinning), ``mpiring`` (ColumnParallelLinear/RowParallelLinear, or the
TensorParallelBlock, over all ranks with ``algo``) and ``torch`` (the same
block under ``torch.distributed.tensor.parallel``'s ColwiseParallel and
RowwiseParallel over gloo). torch's plain column split cannot cut a fused QKV
weight by heads, so its GPT block is the same block with the QKV weight held
as three linears (q, k, v column-wise, as torch's own tensor-parallel examples
do), loaded from the same full weights. mpiring's communication share is the
time spent inside its collectives, measured by a timing proxy around the
Communicator; weight memory is this rank's parameter bytes (gradients are the
same again).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from mpiring.tools.models.gpt import Block, GPTConfig
from mpiring.tools.models.gpt_tp import TensorParallelBlock

clock = time.perf_counter
MODES = ("single", "mpiring", "torch")
BLOCKS = ("mlp", "layer")


class TimedComm:
    """A Communicator whose collectives add their wall time to ``seconds``."""

    def __init__(self, comm):
        self._comm, self.seconds = comm, 0.0

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in ("all_reduce", "all_gather", "reduce_scatter"):
            return attr

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += clock() - t0
        return timed


@dataclass
class TPBenchConfig:
    widths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])
    blocks: list[str] = field(default_factory=lambda: list(BLOCKS))
    modes: list[str] = field(default_factory=lambda: list(MODES))
    tokens: int = 256
    steps: int = 5
    warmup: int = 1
    algo: str = "ring"
    device: str = "cpu"  # "cuda": every rank on its local GPU (mpiring on MPI, torch on gloo)


def _mlp(d: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="none"), nn.Linear(4 * d, d))


class _SplitQKVBlock(nn.Module):
    """The GPT block with q, k and v as three linears: the form torch's TP can shard."""

    def __init__(self, full: Block):
        super().__init__()
        d = full.qkv.in_features
        self.head_dim = d // full.n_heads
        self.ln1, self.proj, self.ln2, self.fc, self.out = (full.ln1, full.proj, full.ln2,
                                                            full.fc, full.out)
        for i, name in enumerate("qkv"):
            part = nn.Linear(d, d)
            with torch.no_grad():
                part.weight.copy_(full.qkv.weight[i * d:(i + 1) * d])
                part.bias.copy_(full.qkv.bias[i * d:(i + 1) * d])
            setattr(self, name, part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # After ColwiseParallel each rank holds its heads' columns: -1 is the local head count.
        heads = [z(h).view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q, self.k,
                                                                                self.v)]
        att = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def torch_can_split(block: str, d: int, ranks: int) -> bool:
    """Whether torch's TP can shard the block: its uneven splits fail in the GEMMs' sharding
    propagation, and its column split would cut heads apart (mpiring needs neither)."""
    return (4 * d) % ranks == 0 and (block == "mlp" or max(1, d // 64) % ranks == 0)


def bench_device(name: str, comm) -> torch.device:
    """The device of this rank's blocks: the CPU, or the local rank's GPU (round robin)."""
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: use cpu, or cuda on a host with a GPU")
    device = torch.device("cuda", comm.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)  # torch.cuda.synchronize() and new tensors follow it
    return device


def _build(block: str, mode: str, d: int, tokens: int, comm, timed: TimedComm, algo: str,
           device: torch.device | None = None):
    """(module, input, forward) for one measurement; the same full weights in every mode."""
    torch.manual_seed(0)
    full = _mlp(d) if block == "mlp" else Block(GPTConfig(d_model=d, n_heads=max(1, d // 64),
                                                          seq_len=64))
    seq = 64 if block == "layer" else 1
    x = torch.randn(seq, max(1, tokens // seq), d)  # sequence-first, as the TP block takes it
    device = device or torch.device("cpu")
    full, x = full.to(device), x.to(device)
    if mode == "single":
        if block == "layer":
            return full, x.transpose(0, 1).contiguous(), full
        return full, x, full
    if mode == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device.type, (comm.size,))
        if block == "mlp":
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        else:
            full = _SplitQKVBlock(full)
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                    "proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}
            x = x.transpose(0, 1).contiguous()  # batch-first, as the GPT block takes it
        model = parallelize_module(full, mesh, plan)
        return model, x, model
    if block == "mlp":
        from mpiring.parallel.tensor import ColumnParallelLinear, RowParallelLinear

        fc = ColumnParallelLinear.from_full(full[0], timed, algo=algo)
        out = RowParallelLinear.from_full(full[2], timed, algo=algo)
        model = nn.ModuleList([fc, out])
        return model, x, lambda z: out(F.gelu(fc(z)))
    from mpiring.parallel.tensor import RNGStreams

    cfg = GPTConfig(d_model=d, n_heads=max(1, d // 64), seq_len=64)
    model = TensorParallelBlock(full, cfg, timed, False, algo, RNGStreams(0, comm.rank), 0.0)
    return model, x, lambda z: model(z, z.shape[0])


def _wait(comm) -> None:
    control = getattr(comm, "control", None)
    if control is not None:
        control.barrier(poll_s=0.002)  # a waiting rank must not spin on a shared core
    else:
        comm.barrier()


def measure(comm, cfg: TPBenchConfig, block: str, mode: str, d: int) -> dict | None:
    """One row: median step time (the slowest rank's), comm share and weight memory per rank."""
    timed = TimedComm(comm)
    active = mode != "single" or comm.rank == 0
    times, comm_s = [], []
    device = bench_device(cfg.device, comm)
    # GPU kernels run ahead of the clock: a step is timed to its last kernel's end.
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if active:
        model, x, fwd = _build(block, mode, d, cfg.tokens, comm, timed, cfg.algo, device)
    for i in range(cfg.warmup + cfg.steps):
        _wait(comm)
        if not active:
            continue
        timed.seconds = 0.0
        sync()
        t0 = clock()
        y = fwd(x)
        y.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        sync()
        if i >= cfg.warmup:
            times.append(clock() - t0)
            comm_s.append(timed.seconds)
    _wait(comm)
    if not active:
        return None
    weight = 0
    for p in model.parameters():
        local = getattr(p, "to_local", None)
        weight += (local() if local else p).numel() * p.element_size()
    step = statistics.median(times)
    return {"block": block, "mode": mode, "width": d, "ranks": 1 if mode == "single" else comm.size,
            "tokens": cfg.tokens, "device": cfg.device, "step_ms": step * 1e3,
            "comm_share": (statistics.median(comm_s) / step) if mode == "mpiring" else None,
            "weight_mib": weight / 2**20}


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per block and width, the modes side by side."""
    by = {(r["block"], r["width"], r["mode"]): r for r in rows}
    lines = ["| block | width | 1 rank ms | mpiring TP ms | torch TP ms | speedup vs 1 rank "
             "| mpiring / torch | comm share | weight MiB/rank (1 rank) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for block, width in sorted({(r["block"], r["width"]) for r in rows}):
        one, ours, theirs = (by.get((block, width, m)) for m in MODES)

        def ms(r):
            return f"{r['step_ms']:.1f}" if r else "-"
        speed = f"{one['step_ms'] / ours['step_ms']:.2f}x" if one and ours else "-"
        vs = f"{ours['step_ms'] / theirs['step_ms']:.2f}x" if ours and theirs else "-"
        share = f"{ours['comm_share']:.0%}" if ours and ours["comm_share"] is not None else "-"
        mem = (f"{ours['weight_mib']:.1f} ({one['weight_mib']:.1f})" if ours and one else "-")
        lines.append(f"| {block} | {width} | {ms(one)} | {ms(ours)} | {ms(theirs)} | {speed} "
                     f"| {vs} | {share} | {mem} |")
    return "\n".join(lines)
