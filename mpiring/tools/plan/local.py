"""The planner on this machine: predict mpiring's own measured step times.

The constants come from measurements, not from a datasheet: alpha and beta
from ``python -m mpiring bench`` (the ring AllReduce rows, fitted with the
ring's own formula), the FLOP rate from timing a matrix multiply of the
model's shape with the threads each rank gets. The prediction is then the
step model's, with a one-GPU-per-rank "cluster" whose peak is that FLOP rate.

Two host terms the GPU model has no need of: the AdamW update (memory-bound,
``adamw_seconds``), and the cores: on a GPU the copy engines and NICs move
the gradients while the SMs compute, on a CPU the communication thread needs
a core of its own, or it time-slices with backward and the reduction adds to
the step (``cpu_overlap``). ``compare_runs`` prices the DDP, TP and PP bench
rows that ``local_runs.measure_all`` collects.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from mpiring.core import stepmodel as sm
from mpiring.core.costmodel import AlphaBeta, fit_alpha_beta
from mpiring.core.netmodel import Fabric
from mpiring.core.steptime import Cluster, Layout, step_time


def fit_ring_rows(rows: Iterable[dict]) -> AlphaBeta:
    """alpha, beta from bench rows of the ring AllReduce: t = 2(K-1)(alpha + M/(K beta)).

    Each row gives one step's message M/K and time t / (2(K-1)).
    """
    pts = [(r["bytes"] / r["ranks"], r["time_us"] * 1e-6 / (2 * (r["ranks"] - 1)))
           for r in rows if r.get("collective") == "all_reduce" and r.get("algo") == "ring"
           and r.get("ranks", 1) > 1]
    if len(pts) < 2:
        raise ValueError("need ring all_reduce rows of at least two sizes: run "
                         "mpiexec -n 2 python -m mpiring bench -c all_reduce -a ring --json FILE")
    return fit_alpha_beta([p[0] for p in pts], [p[1] for p in pts], source="ring-rows")


def measure_flop_rate(m: int, k: int, n: int, threads: int = 1, repeat: int = 5) -> float:
    """FLOP/s of a float32 (m x k) @ (k x n) matmul with ``threads`` torch threads (best of ``repeat``)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 2.0 * m * k * n / best


def measure_mem_bw(nbytes: int = 64 << 20, threads: int = 1, repeat: int = 5) -> float:
    """Bytes/s of an out-of-place float32 add (2 reads + 1 write per element), best of ``repeat``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)
        out = torch.empty_like(a)
        torch.add(a, b, out=out)
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            torch.add(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return 3 * nbytes / best


def adamw_seconds(n_params: int, mem_bw: float) -> float:
    """AdamW's update is memory-bound: it reads the parameter, gradient and both
    moments and writes the parameter and moments, 7 x 4 bytes per fp32 parameter
    (torch.optim.AdamW, Loshchilov and Hutter 2019, Algorithm 2)."""
    return 28.0 * n_params / mem_bw


def cpu_overlap(ranks: int, threads_per_rank: int, comm_threads_per_rank: int, cores: int) -> float:
    """Share of the gradient reduction that can hide behind backward on a CPU host.

    1 when every rank's compute threads and communication thread have a core
    each; otherwise the cores left after the compute threads, shared among the
    communication threads (0 when none is left: the reduction runs in the
    backward's time slices and adds to the step).
    """
    if min(ranks, threads_per_rank, cores) < 1 or comm_threads_per_rank < 0:
        raise ValueError("ranks, threads_per_rank and cores must be >= 1")
    comm = ranks * comm_threads_per_rank
    if comm == 0:
        return 0.0
    free = cores - ranks * threads_per_rank
    return max(0.0, min(1.0, free / comm))


def local_model(d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab: int = 256) -> sm.GPT:
    """The project's GPT (mpiring.tools.models.gpt) as the step model sees it."""
    return sm.GPT(n_layers, d_model, n_heads, seq_len, vocab, name="mpiring-gpt")


def local_cluster(ab: AlphaBeta, flop_rate: float, ranks: int, mem_bw: float = 1e10) -> Cluster:
    """Ranks on one host: the fitted link inside the 'node', the measured rate as the peak.

    gemm_eff is 1 (the rate is already an achieved one) and the memory-bound ops
    are left out (elementwise_passes 0): on a CPU they run inside the measured
    layers' time only roughly, a stated approximation (docs/planner.md).
    """
    fabric = Fabric(ab, ab, gpus_per_node=max(1, ranks), nics_per_node=max(1, ranks))
    return Cluster("this-host", ranks, flop_rate, 1e12, mem_bw, fabric, 1.0, 0.0)


def predict(g: sm.GPT, layout: Layout, batch: int, ab: AlphaBeta, flop_rate: float,
            grad_bytes: int = 4) -> dict[str, float]:
    """Predicted step (ms) and its parts for ``batch`` sequences in all (fp32 gradients)."""
    lay = layout.with_(grad_bytes=grad_bytes, flash=False)
    br = step_time(g, local_cluster(ab, flop_rate, lay.gpus), lay, batch)
    return {"step_ms": br.total * 1e3, **{f"{k}_ms": v * 1e3 for k, v in br.parts().items()},
            "dp_total_ms": br.dp_total * 1e3}


def compare(measured_ms: float, predicted: dict[str, float]) -> dict[str, float]:
    """Measured beside predicted, with (predicted - measured) / measured."""
    return {"measured_ms": measured_ms, "predicted_ms": predicted["step_ms"],
            "residual": (predicted["step_ms"] - measured_ms) / measured_ms}


def _tp_row(r: dict, ab: AlphaBeta, rate_of) -> dict:
    # One GPT block (d/64 heads, 64-token windows), forward + backward, no head, no optimizer.
    d, k = r["width"], r["ranks"]
    g = sm.GPT(1, d, max(1, d // 64), 64, 1, name="tp-block")
    b = r["tokens"] // 64
    rate = rate_of(r["tokens"], d, 4 * d // k)
    pred = predict(g, Layout(dp=1, tp=k, micro_batch=b, act_bytes=4), b, ab, rate)
    return {"run": f"TP={k}", "what": f"GPT block d={d}, {r['tokens']} tokens",
            "flop_rate": rate, **pred, **compare(r["step_ms"], pred)}


def _pp_row(r: dict, cfg, mb_rows: int, ranks: int, ab: AlphaBeta, rate_of) -> dict:
    g = local_model(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.vocab_size)
    rate = rate_of(mb_rows * cfg.seq_len, cfg.d_model, 4 * cfg.d_model)
    lay = Layout(dp=1, pp=ranks, micro_batch=mb_rows, schedule="1f1b", act_bytes=4)
    pred = predict(g, lay, r["m"] * mb_rows, ab, rate)
    return {"run": f"PP={ranks}", "what": f"GPT d={cfg.d_model} l={cfg.n_layers}, 1F1B m={r['m']}"
            f" x {mb_rows}", "flop_rate": rate, **pred, **compare(r["step_ms"], pred)}


def _ddp_row(r: dict, cfg, ab: AlphaBeta, rate_of, mem_bw: float, overlap: float) -> dict:
    g = local_model(cfg.d_model, cfg.n_layers, cfg.n_heads, r["seq_len"], cfg.vocab_size)
    dp = r["ranks"] if r["mode"] == "ddp" else 1
    rate = rate_of(r["batch"] * r["seq_len"], cfg.d_model, 4 * cfg.d_model)
    pred = predict(g, Layout(dp=dp, micro_batch=r["batch"], overlap_dp=overlap),
                   r["batch"] * dp, ab, rate)
    opt = adamw_seconds(r["params"], mem_bw) * 1e3
    pred = {**pred, "optimizer_ms": opt, "step_ms": pred["step_ms"] + opt}
    name = f"DDP={r['ranks']}" if dp > 1 else "compute alone"
    return {"run": name, "what": f"GPT d={cfg.d_model} l={cfg.n_layers}, {r['batch']} x "
            f"{r['seq_len']} tokens/rank", "flop_rate": rate, "comm_measured_ms":
            r.get("comm_total_ms"), **pred, **compare(r["step_ms"], pred)}


def compare_runs(runs: dict, ab: AlphaBeta, *, pp_preset: str, pp_mb_rows: int, ranks: int,
                 cores: int, flop_rate=None, mem_bw: float | None = None) -> list[dict]:
    """Predicted beside measured for one round of bench rows {"ddp", "tp", "pp": rows}.

    ``flop_rate(m, k, n)`` gives the FLOP/s of each run's matmul shape (default:
    ``measure_flop_rate`` with one thread, as the benches run); DDP's overlap
    is ``cpu_overlap`` with one communication thread per rank.
    """
    from mpiring.tools.models.gpt import PRESETS as GPT_PRESETS

    rate_of = flop_rate or (lambda m, k, n: measure_flop_rate(m, k, n, 1))
    bw = mem_bw or measure_mem_bw()
    out = []
    for r in runs.get("ddp", []):
        if r["mode"] in ("compute", "ddp"):
            overlap = cpu_overlap(r["ranks"], 1, 1, cores)
            out.append(_ddp_row(r, GPT_PRESETS[r["preset"]], ab, rate_of, bw, overlap))
    for r in runs.get("tp", []):
        if r["mode"] == "mpiring" and r["block"] == "layer":
            out.append(_tp_row(r, ab, rate_of))
    for r in runs.get("pp", []):
        if r["mode"] == "1f1b":
            out.append(_pp_row(r, GPT_PRESETS[pp_preset], pp_mb_rows, ranks, ab, rate_of))
    return out
