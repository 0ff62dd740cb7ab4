"""The planner on this machine: predict mpiring's own measured step times.

The constants come from measurements, not from a datasheet: alpha and beta
from ``python -m mpiring bench`` (the ring AllReduce rows, fitted with the
ring's own formula); every GEMM shape's FLOP rate, attention's time and the
elementwise and streaming bandwidths from ``calibrate``, run inside each
bench's own job (``local_runs``). ``local_work`` lists and prices each run's
work (``mpiring.core.hostcost``); the step model then adds the communication,
bubble and reduction terms with a one-GPU-per-rank "cluster" whose peak is
the effective rate of that priced compute (``effective_rate``).

One host term the GPU model has no need of: the cores. On a GPU the copy
engines and NICs move the gradients while the SMs compute; on a CPU the
communication thread needs a core of its own, or it time-slices with backward
and the reduction adds to the step (``cpu_overlap``). ``compare_runs`` prices
the DDP, TP and PP bench rows that ``local_runs.measure_all`` collects.
"""

from __future__ import annotations

from collections.abc import Iterable

from mpiring.core import stepmodel as sm
from mpiring.core.costmodel import AlphaBeta, fit_alpha_beta
from mpiring.core.netmodel import Fabric
from mpiring.core.steptime import Cluster, Layout, step_time
from mpiring.tools.plan import local_work as lw


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
    """Ranks on one host: the fitted link inside the 'node', ``flop_rate`` as the peak.

    gemm_eff is 1 and elementwise_passes 0: ``flop_rate`` is the host model's
    effective rate (the step's FLOPs over its priced GEMM, attention and
    elementwise seconds, ``effective_rate``), so the memory-bound work is in it.
    """
    fabric = Fabric(ab, ab, gpus_per_node=max(1, ranks), nics_per_node=max(1, ranks))
    return Cluster("this-host", ranks, flop_rate, 1e12, mem_bw, fabric, 1.0, 0.0)


def effective_rate(g: sm.GPT, tokens: int, gpus: int, seconds: float) -> float:
    """The FLOP/s that makes the step model's compute term (training FLOPs x tokens /
    gpus / rate) equal the host model's ``seconds`` of one rank's compute."""
    if not seconds > 0:
        raise ValueError("the priced compute must take a positive time")
    return sm.training_flops_per_token(g) * tokens / gpus / seconds


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


def _priced(g, layout, batch, tokens, ab, host, per_rank_s):
    rate = effective_rate(g, tokens, layout.gpus, per_rank_s)
    pred = predict(g, layout, batch, ab, rate)
    extra = {f"host_{k}_ms": host[k] * 1e3 for k in ("gemm", "attention", "elementwise")}
    return {"flop_rate": rate, "gemm_rate": host["gemm_rate"],
            "elementwise_bw": host["elementwise_bw"], **extra, **pred}


def _tp_row(r: dict, ab: AlphaBeta, calib: dict, oncore: bool = False) -> dict:
    # One GPT block (d/64 heads, 64-token windows), forward + backward, no head, no optimizer.
    d, k = r["width"], r["ranks"]
    g = sm.GPT(1, d, max(1, d // 64), lw.TP_WINDOW, 1, name="tp-block")
    b = max(1, r["tokens"] // lw.TP_WINDOW)
    host = lw.price(lw.tp_work(d, r["tokens"], k), calib, oncore)
    lay = Layout(dp=1, tp=k, micro_batch=b, act_bytes=4)
    pred = _priced(g, lay, b, b * lw.TP_WINDOW, ab, host, host["compute"])
    return {"run": f"TP={k}", "what": f"GPT block d={d}, {r['tokens']} tokens",
            **pred, **compare(r["step_ms"], pred)}


def _pp_row(r: dict, cfg, mb_rows: int, ranks: int, ab: AlphaBeta, calib: dict,
            oncore: bool = False) -> dict:
    g = local_model(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.vocab_size)
    work = lw.pp_work(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.vocab_size,
                      mb_rows, r["m"])
    host = lw.price(work, calib, oncore)
    lay = Layout(dp=1, pp=ranks, micro_batch=mb_rows, schedule="1f1b", act_bytes=4)
    # The step model splits the layers evenly: each stage does 1/pp of the whole.
    pred = _priced(g, lay, r["m"] * mb_rows, r["m"] * mb_rows * cfg.seq_len, ab, host,
                   host["compute"] / ranks)
    return {"run": f"PP={ranks}", "what": f"GPT d={cfg.d_model} l={cfg.n_layers}, 1F1B m={r['m']}"
            f" x {mb_rows}", **pred, **compare(r["step_ms"], pred)}


def _ddp_row(r: dict, cfg, ab: AlphaBeta, calib: dict, overlap: float,
             oncore: bool = False) -> dict:
    g = local_model(cfg.d_model, cfg.n_layers, cfg.n_heads, r["seq_len"], cfg.vocab_size)
    dp = r["ranks"] if r["mode"] == "ddp" else 1
    work = lw.ddp_work(cfg.d_model, cfg.n_layers, cfg.n_heads, r["seq_len"], cfg.vocab_size,
                       r["batch"], r["params"], reducer=dp > 1)
    host = lw.price(work, calib, oncore)
    lay = Layout(dp=dp, micro_batch=r["batch"], overlap_dp=overlap)
    pred = _priced(g, lay, r["batch"] * dp, r["batch"] * r["seq_len"] * dp, ab, host,
                   host["compute"])
    opt, buckets = host["optimizer"] * 1e3, host["bucket"] * 1e3
    pred = {**pred, "optimizer_ms": opt, "bucket_ms": buckets,
            "step_ms": pred["step_ms"] + opt + buckets}
    name = f"DDP={r['ranks']}" if dp > 1 else "compute alone"
    return {"run": name, "what": f"GPT d={cfg.d_model} l={cfg.n_layers}, {r['batch']} x "
            f"{r['seq_len']} tokens/rank", "comm_measured_ms": r.get("comm_total_ms"),
            **pred, **compare(r["step_ms"], pred)}


def run_works(runs: dict, *, pp_preset: str, pp_mb_rows: int) -> list[lw.Work]:
    """The ``local_work`` lists of the rows ``compare_runs`` prices (for ``spec_for``)."""
    from mpiring.tools.models.gpt import PRESETS as GPT_PRESETS

    out = []
    for r in runs.get("ddp", []):
        if r["mode"] in ("compute", "ddp"):
            c = GPT_PRESETS[r["preset"]]
            out.append(lw.ddp_work(c.d_model, c.n_layers, c.n_heads, r["seq_len"], c.vocab_size,
                                   r["batch"], r["params"], r["mode"] == "ddp"))
    for r in runs.get("tp", []):
        if r["mode"] == "mpiring" and r["block"] == "layer":
            out.append(lw.tp_work(r["width"], r["tokens"], r["ranks"]))
    c = GPT_PRESETS[pp_preset]
    for r in runs.get("pp", []):
        if r["mode"] == "1f1b":
            out.append(lw.pp_work(c.d_model, c.n_layers, c.n_heads, c.seq_len, c.vocab_size,
                                  pp_mb_rows, r["m"]))
    return out


def compare_runs(runs: dict, ab: AlphaBeta, calib: dict, *, pp_preset: str, pp_mb_rows: int,
                 ranks: int, cores: int, oncore: bool = False) -> list[dict]:
    """Predicted beside measured for one round of bench rows {"ddp", "tp", "pp": rows}.

    ``calib`` is one calibration (``calibrate.calibrate``) or {kind: calibration}
    (each bench's own, measured in its job right before it); DDP's overlap is
    ``cpu_overlap`` with one communication thread per rank. ``oncore``: price the
    compute at the CPU-time rates over the bench's measured share of a core
    (``local_work.price``).
    """
    from mpiring.tools.models.gpt import PRESETS as GPT_PRESETS

    def cal(kind):
        return calib[kind] if kind in calib else calib
    out = []
    for r in runs.get("ddp", []):
        if r["mode"] in ("compute", "ddp"):
            overlap = cpu_overlap(r["ranks"], 1, 1, cores)
            out.append(_ddp_row(r, GPT_PRESETS[r["preset"]], ab, cal("ddp"), overlap, oncore))
    for r in runs.get("tp", []):
        if r["mode"] == "mpiring" and r["block"] == "layer":
            out.append(_tp_row(r, ab, cal("tp"), oncore))
    for r in runs.get("pp", []):
        if r["mode"] == "1f1b":
            out.append(_pp_row(r, GPT_PRESETS[pp_preset], pp_mb_rows, ranks, ab, cal("pp"),
                               oncore))
    return out
