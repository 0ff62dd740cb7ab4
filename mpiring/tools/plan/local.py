"""The planner on this machine: predict mpiring's own measured step times.

The constants come from measurements, not from a datasheet: alpha and beta
from ``python -m mpiring bench`` (the ring AllReduce rows, fitted with the
ring's own formula), the FLOP rate from timing a matrix multiply of the
model's shape with the threads each rank gets. The prediction is then the
step model's, with a one-GPU-per-rank "cluster" whose peak is that FLOP rate.

Hooks: ``predict(cfg, layout, ...)`` takes any Layout, so TP=2 (``Layout(dp=1,
tp=2)``) and PP=2 (``Layout(dp=1, pp=2, schedule=...)``) are priced today;
``compare`` needs a measured row for them (the step time in ms) from the
TP and PP benches once they exist.
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
