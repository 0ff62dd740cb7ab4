"""Measure this host's compute constants under the conditions a bench runs in.

``calibrate(comm, spec)`` runs on every rank of the bench's own MPI job, all
ranks at once with one torch thread each, right before the bench: so the GEMMs
share the cores, caches and memory bus exactly as the bench's steps will, and
the host's load at that moment is in both. It times, each the median of
``repeat`` turns after one warm-up (``measure``):

* every GEMM shape the spec lists (``mpiring.core.hostcost.Gemm``: the shapes
  and operand layouts the model's linears run), as FLOP/s;
* scaled dot-product attention, forward and backward, per (batch, heads,
  sequence, head size), as seconds per call;
* the elementwise probe (LayerNorm, GELU, add; ``hostcost.probe_bytes``) per
  (tokens, d, ffn), as bytes/s;
* a streaming add over ``stream_mib`` MiB (the optimizer's and the reducer's
  whole-parameter passes), as bytes/s.

Each figure comes twice: over wall-clock time (what the bench's clock sees, the
host's other load included) and over this thread's CPU time ("oncore": the rate
while the rank holds a core). ``plan --calibrate`` runs it once before the bench
and once after, in the same job, ``combine`` joins the two, and it records each
rank's share of a core during the bench (process CPU time / wall time,
``bench_share``), the load the bench itself saw.

Each rank's figures are kept, and their mean (the ranks run the same shapes at
once; on a loaded host one may get less of a core than the other). The
spec is JSON: {"gemm": [[m, k, n, layout], ...], "attention": [[b, h, s, hd]],
"probe": [[tokens, d, ffn]], "stream_mib": 64, "repeat": 5}.
"""

from __future__ import annotations

import statistics
import time

from mpiring.core.hostcost import Gemm, probe_bytes

clock = time.perf_counter


def gemm_key(g: Gemm | list | tuple) -> str:
    """'m x k x n:layout', the calibration's name for a GEMM shape."""
    m, k, n, layout = (g.m, g.k, g.n, g.layout) if isinstance(g, Gemm) else g
    return f"{m}x{k}x{n}:{layout}"


def shape_key(shape) -> str:
    return "x".join(str(int(v)) for v in shape)


def gemm_operands(m: int, k: int, n: int, layout: str):
    """(a, b) with a @ b of shape (m, n), strided as autograd has them (see ``Gemm``)."""
    import torch

    if layout == "nt":  # x @ W.t(), W stored (n, k)
        return torch.randn(m, k), torch.randn(n, k).t()
    if layout == "nn":  # dY @ W, W stored (k, n)
        return torch.randn(m, k), torch.randn(k, n)
    if layout == "tn":  # dY.t() @ X, dY stored (k, m)
        return torch.randn(k, m).t(), torch.randn(k, n)
    raise ValueError(f"layout {layout!r}: use nt, nn or tn")


def gemm_probe(m: int, k: int, n: int, layout: str):
    """(run once, FLOPs) of one (m x k) @ (k x n) multiply in ``layout``."""
    import torch

    a, b = gemm_operands(m, k, n, layout)
    out = torch.empty(m, n)
    return (lambda: torch.mm(a, b, out=out)), 2.0 * m * k * n


def attention_probe(b: int, h: int, s: int, hd: int):
    """(run once, 1 call) of a causal ``scaled_dot_product_attention`` forward and
    backward, with q, k, v cut from one (b, s, 3 h hd) tensor as the GPT block cuts them."""
    import torch
    from torch.nn import functional as F

    qkv = torch.randn(b, s, 3 * h * hd, requires_grad=True)
    grad = torch.randn(b, h, s, hd)

    def step():
        with torch.enable_grad():
            q, k, v = (z.view(b, s, h, hd).transpose(1, 2) for z in qkv.split(h * hd, dim=2))
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        qkv.grad = None
    return step, 1.0


def elementwise_probe(tokens: int, d: int, ffn: int):
    """(run once, bytes) of LayerNorm and GELU forward and backward and one add
    (``hostcost.probe_bytes``)."""
    import torch
    from torch.nn import functional as F

    x = torch.randn(tokens, d, requires_grad=True)
    u = torch.randn(tokens, ffn, requires_grad=True)
    w, bias = torch.ones(d, requires_grad=True), torch.zeros(d, requires_grad=True)
    gx, gu, out = torch.randn(tokens, d), torch.randn(tokens, ffn), torch.empty(tokens, d)

    def step():
        with torch.enable_grad():
            F.layer_norm(x, (d,), w, bias).backward(gx)
            F.gelu(u).backward(gu)
        torch.add(gx, gx, out=out)
        x.grad = u.grad = w.grad = bias.grad = None
    return step, probe_bytes(tokens, d, ffn)


def stream_probe(mib: float = 64.0):
    """(run once, bytes) of an out-of-place float32 add over ``mib`` MiB (2 reads, 1 write)."""
    import torch

    n = int(mib * (1 << 20)) // 4
    a, b, out = torch.ones(n), torch.ones(n), torch.empty(n)
    return (lambda: torch.add(a, b, out=out)), 3 * 4.0 * n


def _probes(spec: dict) -> list[tuple[str, str, object, float]]:
    out = [("gemm", gemm_key(g), *gemm_probe(*g)) for g in spec.get("gemm", [])]
    out += [("attention", shape_key(a), *attention_probe(*a)) for a in spec.get("attention", [])]
    out += [("probe", shape_key(p), *elementwise_probe(*p)) for p in spec.get("probe", [])]
    return out + [("stream", "stream", *stream_probe(spec.get("stream_mib", 64.0)))]


def measure(spec: dict, repeat: int = 5) -> dict:
    """This process's figures for every shape of ``spec``, with one torch thread.

    The probes take turns, one run each, ``repeat`` rounds after a warm-up round,
    and each figure is its work over its *total* time (the mean, not the best or
    the median): a step of the bench is one long stretch in which this rank loses
    its core to others now and then, and a mean over turns spread across the
    whole calibration sees those losses in the same proportion; a median of short
    runs would skip them.
    """
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            probes = _probes(spec)
            for _, _, fn, _ in probes:
                fn()  # warm-up: first-touch pages, the kernels' packing buffers
            spent, cpu = [0.0] * len(probes), [0.0] * len(probes)
            for _ in range(max(1, repeat)):
                for i, (_, _, fn, _) in enumerate(probes):
                    t0, c0 = clock(), time.thread_time()
                    fn()
                    spent[i] += clock() - t0
                    cpu[i] += time.thread_time() - c0
    finally:
        torch.set_num_threads(old)
    return {**_figures(probes, spent, repeat), "oncore": _figures(probes, cpu, repeat)}


def _figures(probes, seconds: list[float], repeat: int) -> dict:
    out: dict = {"gemm": {}, "attention": {}, "probe": {}}
    for (part, key, _, work), t in zip(probes, seconds):
        mean = max(t, 1e-9) / max(1, repeat)
        if part == "stream":
            out["stream_bw"] = work / mean
        else:  # attention: seconds per call; the others: work per second
            out[part][key] = mean if part == "attention" else work / mean
    return out


def _mean_over(rows: list[dict]) -> dict:
    out: dict = {"stream_bw": statistics.fmean(r["stream_bw"] for r in rows)}
    for part in ("gemm", "attention", "probe"):
        out[part] = {k: statistics.fmean(r[part][k] for r in rows) for k in rows[0][part]}
    if all("oncore" in r for r in rows):
        out["oncore"] = _mean_over([r["oncore"] for r in rows])
    return out


def calibrate(comm, spec: dict, repeat: int | None = None) -> dict:
    """``measure`` on every rank of ``comm`` at once (None: this process alone): the
    ranks' figures averaged, and each rank's own under "per_rank" (the same dict on
    every rank). ``repeat``: turns per probe (default the spec's "repeat", else 5)."""
    repeat = repeat or int(spec.get("repeat", 5))
    t0 = time.time()
    if comm is None or comm.size == 1:
        rows = [measure(spec, repeat)]
    else:
        comm.barrier()  # every rank starts together: the GEMMs share the cores as in the bench
        rows = comm.control.allgather_json(measure(spec, repeat))
    return {**_mean_over(rows), "ranks": len(rows), "seconds": time.time() - t0,
            "spread": _spread(rows), "per_rank": rows}


def combine(a: dict, b: dict) -> dict:
    """Two calibrations of the same spec as one: each figure's work over the two times
    added (for rates the harmonic mean, for attention's seconds the mean), per rank too."""
    def one(x: dict, y: dict) -> dict:
        out = {"stream_bw": 2 / (1 / x["stream_bw"] + 1 / y["stream_bw"]),
               "attention": {k: (v + y["attention"][k]) / 2 for k, v in x["attention"].items()}}
        for part in ("gemm", "probe"):
            out[part] = {k: 2 / (1 / v + 1 / y[part][k]) for k, v in x[part].items()}
        if "oncore" in x and "oncore" in y:
            out["oncore"] = one(x["oncore"], y["oncore"])
        return out
    rows = [one(x, y) for x, y in zip(a.get("per_rank") or [a], b.get("per_rank") or [b])]
    return {**one(a, b), "ranks": a["ranks"], "seconds": a["seconds"] + b["seconds"],
            "spread": max(a["spread"], b["spread"]), "per_rank": rows,
            "before": {k: a[k] for k in ("gemm", "stream_bw")},
            "after": {k: b[k] for k in ("gemm", "stream_bw")}}


def _spread(rows: list[dict]) -> float:
    """Largest relative difference between the ranks' GEMM rates (how evenly they shared)."""
    worst = 0.0
    for k in rows[0]["gemm"]:
        vals = [r["gemm"][k] for r in rows]
        worst = max(worst, (max(vals) - min(vals)) / max(vals))
    return worst
