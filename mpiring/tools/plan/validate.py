"""The planner against what was published: one function per table, rows as dicts.

Each row carries the published figure, the prediction and the residual
(predicted - published) / published, so the docs and the tests read the same numbers.
"""

from __future__ import annotations

from mpiring.core import stepmodel as sm
from mpiring.core.steptime import Cluster, throughput
from mpiring.tools.plan.presets import MEGATRON_TABLE, RUNS, ZERO_FIGURE1, selene


def residual(predicted: float, published: float) -> float:
    """(predicted - published) / published."""
    return (predicted - published) / published


def megatron_rows(cluster: Cluster | None = None) -> list[dict]:
    """Narayanan et al. 2021 Table 1: per-GPU TFLOP/s, every row with one cluster's constants."""
    c = cluster or selene()
    rows = []
    for r in MEGATRON_TABLE:
        g, lay = r.model(), r.layout()
        t = throughput(g, c.with_(gpus=r.gpus), lay, r.batch)
        rows.append({"params_b": r.params_b, "layers": r.layers, "hidden": r.hidden,
                     "tp": r.tp, "pp": r.pp, "dp": lay.dp, "gpus": r.gpus, "batch": r.batch,
                     "published_tflops": r.tflops, "predicted_tflops": t["tflops_per_gpu"],
                     "residual": residual(t["tflops_per_gpu"], r.tflops),
                     "memory_gb": t["memory_gb"],
                     "parts": {k: v / t["step_s"] for k, v in t["breakdown"].parts().items()}})
    return rows


def zero_rows() -> list[dict]:
    """ZeRO paper Figure 1: model-state GB per GPU for each stage, rounded as printed."""
    psi, nd = ZERO_FIGURE1["psi"], ZERO_FIGURE1["nd"]
    rows = []
    for stage, published in ZERO_FIGURE1["gb"].items():
        gb = sm.zero_model_state_bytes(psi, nd, stage) / 1e9
        rows.append({"stage": stage, "published_gb": published, "predicted_gb": gb,
                     "printed": round(gb, 1)})
    return rows


def run_rows(**overrides) -> list[dict]:
    """The lecture's two runs: GPU-hours from the published layout and token count."""
    rows = []
    for name, make in RUNS.items():
        run = make(**overrides.get(name, {}))
        t = throughput(run.model, run.cluster, run.layout, run.batch)
        hours = sm.gpu_hours(run.tokens, t["tokens_per_s"], run.layout.gpus)
        rows.append({"run": name, "gpus": run.layout.gpus, "layout": run.layout.describe(),
                     "cluster": run.cluster.name, "tokens": run.tokens,
                     "params_b": sm.params(run.model) / 1e9,
                     "active_b": sm.params(run.model, active=True) / 1e9,
                     "published_gpu_hours": run.gpu_hours, "predicted_gpu_hours": hours,
                     "residual": residual(hours, run.gpu_hours),
                     "tflops_per_gpu": t["tflops_per_gpu"], "mfu": t["mfu"],
                     "memory_gb": t["memory_gb"],
                     "parts": {k: v / t["step_s"] for k, v in t["breakdown"].parts().items()},
                     "source": run.source})
    return rows
