"""Measure this host's compute constants under the conditions a bench runs in.

``calibrate(comm, spec)`` runs on every rank of the bench's own MPI job, all
ranks at once with one torch thread each, right before the bench: so the GEMMs
share the cores, caches and memory bus exactly as the bench's steps will, and
the host's load at that moment is in both. It times, each the median of
``repeat`` runs after one warm-up:

* every GEMM shape the spec lists (``mpiring.core.hostcost.Gemm``: the shapes
  and operand layouts the model's linears run), as FLOP/s;
* scaled dot-product attention, forward and backward, per (batch, heads,
  sequence, head size), as seconds per call;
* the elementwise probe (LayerNorm, GELU, add; ``hostcost.probe_bytes``) per
  (tokens, d, ffn), as bytes/s;
* a streaming add over ``stream_mib`` MiB (the optimizer's and the reducer's
  whole-parameter passes), as bytes/s.

Every rank's figures are averaged (the ranks run the same shapes at once). The
spec is JSON: {"gemm": [[m, k, n, layout], ...], "attention": [[b, h, s, hd]],
"probe": [[tokens, d, ffn]], "stream_mib": 64}.
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


def _median_s(fn, repeat: int) -> float:
    fn()  # warm-up: first-touch pages, the kernel's packing buffers
    times = []
    for _ in range(max(1, repeat)):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


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


def time_gemm(m: int, k: int, n: int, layout: str, repeat: int = 5) -> float:
    """FLOP/s of one (m x k) @ (k x n) multiply in ``layout``."""
    import torch

    a, b = gemm_operands(m, k, n, layout)
    out = torch.empty(m, n)
    return 2.0 * m * k * n / _median_s(lambda: torch.mm(a, b, out=out), repeat)


def time_attention(b: int, h: int, s: int, hd: int, repeat: int = 5) -> float:
    """Seconds of one causal ``scaled_dot_product_attention`` forward and backward, with
    q, k, v cut from one (b, s, 3 h hd) tensor as the GPT block cuts them."""
    import torch
    from torch.nn import functional as F

    qkv = torch.randn(b, s, 3 * h * hd, requires_grad=True)
    grad = torch.randn(b, h, s, hd)

    def step():
        q, k, v = (z.view(b, s, h, hd).transpose(1, 2) for z in qkv.split(h * hd, dim=2))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        qkv.grad = None
    return _median_s(step, repeat)


def time_probe(tokens: int, d: int, ffn: int, repeat: int = 5) -> float:
    """Bytes/s of the elementwise probe: LayerNorm and GELU forward and backward, one add."""
    import torch
    from torch.nn import functional as F

    x = torch.randn(tokens, d, requires_grad=True)
    u = torch.randn(tokens, ffn, requires_grad=True)
    w, bias = torch.ones(d, requires_grad=True), torch.zeros(d, requires_grad=True)
    gx, gu, out = torch.randn(tokens, d), torch.randn(tokens, ffn), torch.empty(tokens, d)

    def step():
        F.layer_norm(x, (d,), w, bias).backward(gx)
        F.gelu(u).backward(gu)
        torch.add(gx, gx, out=out)
        x.grad = u.grad = w.grad = bias.grad = None
    return probe_bytes(tokens, d, ffn) / _median_s(step, repeat)


def time_stream(mib: float = 64.0, repeat: int = 5) -> float:
    """Bytes/s of an out-of-place float32 add over ``mib`` MiB (2 reads + 1 write)."""
    import torch

    n = int(mib * (1 << 20)) // 4
    a, b, out = torch.ones(n), torch.ones(n), torch.empty(n)
    return 3 * 4 * n / _median_s(lambda: torch.add(a, b, out=out), repeat)


def measure(spec: dict, repeat: int = 5) -> dict:
    """This process's figures for every shape of ``spec``, with one torch thread."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            gemm = {gemm_key(g): time_gemm(*g, repeat=repeat) for g in spec.get("gemm", [])}
        att = {shape_key(a): time_attention(*a, repeat=repeat) for a in spec.get("attention", [])}
        probe = {shape_key(p): time_probe(*p, repeat=repeat) for p in spec.get("probe", [])}
        stream = time_stream(spec.get("stream_mib", 64.0), repeat)
    finally:
        torch.set_num_threads(old)
    return {"gemm": gemm, "attention": att, "probe": probe, "stream_bw": stream}


def _mean_over(rows: list[dict]) -> dict:
    out: dict = {"stream_bw": statistics.fmean(r["stream_bw"] for r in rows)}
    for part in ("gemm", "attention", "probe"):
        out[part] = {k: statistics.fmean(r[part][k] for r in rows) for k in rows[0][part]}
    return out


def calibrate(comm, spec: dict, repeat: int = 5) -> dict:
    """``measure`` on every rank of ``comm`` at once (None: this process alone); the
    ranks' figures averaged, the same dict on every rank."""
    t0 = time.time()
    if comm is None or comm.size == 1:
        rows = [measure(spec, repeat)]
    else:
        comm.barrier()  # every rank starts together: the GEMMs share the cores as in the bench
        rows = comm.control.allgather_json(measure(spec, repeat))
    return {**_mean_over(rows), "ranks": len(rows), "seconds": time.time() - t0,
            "spread": _spread(rows)}


def _spread(rows: list[dict]) -> float:
    """Largest relative difference between the ranks' GEMM rates (how evenly they shared)."""
    worst = 0.0
    for k in rows[0]["gemm"]:
        vals = [r["gemm"][k] for r in rows]
        worst = max(worst, (max(vals) - min(vals)) / max(vals))
    return worst
