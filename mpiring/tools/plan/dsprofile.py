"""H800 FP8 constants measured from DeepSeek's published training profile.

The A100 constants are fitted on Megatron-LM's table; nothing in that table
says how fast an H800 runs FP8 GEMMs with DeepSeek-V3's fine-grained (1 x 128
and 128 x 128) scaling, or how much memory-bound casting, transposing and
token permutation FP8 MoE training adds. DeepSeek published a PyTorch profiler
trace of exactly that (github.com/deepseek-ai/profile-data, ``train.json``):
one DualPipe pair of a forward and a backward chunk of 4 MoE layers, EP64,
TP1, 4K tokens per micro-batch, balanced routing, pipeline sends left out.

``summarize_trace`` sums its GPU kernels by kind; ``PROFILE`` holds the sums
(one run of it over the published file); ``fp8_gemm_eff`` and
``elementwise_passes`` turn them into the step model's two constants. The
prediction of the 2.664M GPU-hours then rests on this kernel trace, not on the
GPU-hours it is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable

from mpiring.core import stepmodel as sm

#: Kernel-time sums (ms) of train.json's compute streams, by ``summarize_trace``.
#: The chunks: forward of one micro-batch and full backward of another (F&B),
#: 4 MoE layers each, 4,096 tokens per GPU; GEMMs on 112 of the 132 SMs.
PROFILE = {"layers": 4, "tokens": 4096, "span_ms": 129.01, "fp8_gemm_ms": 74.52,
           "attention_ms": 21.96, "other_ms": 33.04, "a2a_ms": 114.52, "sms": 132,
           "gemm_sms": 112}


def _kind(name: str) -> str:
    if "dpsk::ep" in name:
        return "a2a"
    if "grouped_gemm" in name and "Gemm" in name:
        return "fp8_gemm"
    if "flash" in name.lower():
        return "attention"
    return "other"  # casts, transposes, norms, rope, SwiGLU, permutes, router


def summarize_trace(events: Iterable[dict]) -> dict[str, float]:
    """Kernel milliseconds by kind (fp8_gemm, attention, a2a, other) and the span.

    ``events`` are a Chrome trace's ``traceEvents``; only ``cat == "kernel"`` count.
    Every kernel on a stream that runs all-to-all kernels counts as a2a: those
    streams run on the 20 communication SMs, beside the compute.
    """
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm = {e.get("tid") for e in kernels if _kind(e["name"]) == "a2a"}
    out = {"fp8_gemm_ms": 0.0, "attention_ms": 0.0, "a2a_ms": 0.0, "other_ms": 0.0}
    t0, t1 = float("inf"), float("-inf")
    for e in kernels:
        kind = "a2a" if e.get("tid") in comm else _kind(e["name"])
        out[kind + "_ms"] += e["dur"] / 1e3
        t0, t1 = min(t0, e["ts"]), max(t1, e["ts"] + e["dur"])
    out["span_ms"] = (t1 - t0) / 1e3 if t1 >= t0 else 0.0
    return out


def moe_layer_linear_flops(g: sm.GPT) -> float:
    """Forward FLOPs per token of one MoE layer's weight matmuls (attention
    projections, top_k routed + shared experts; router left out)."""
    return 2.0 * (sm.layer_params(g, True, True) - g.hidden * g.experts)


def fp8_gemm_eff(g: sm.GPT, fp8_peak: float, prof: dict = PROFILE) -> float:
    """Achieved share of the FP8 peak on the SMs the GEMMs get.

    FLOPs = 3 x forward (F, then the backward's input and weight halves) of the
    profile's layers and tokens; time = the FP8 GEMM kernels' sum.
    """
    flops = 3 * moe_layer_linear_flops(g) * prof["layers"] * prof["tokens"]
    rate = flops / (prof["fp8_gemm_ms"] * 1e-3)
    return rate / (fp8_peak * prof["gemm_sms"] / prof["sms"])


def elementwise_passes(g: sm.GPT, mem_bw: float, prof: dict = PROFILE) -> float:
    """The memory-bound kernels' time as passes over Korthikanti's activation bytes.

    passes = other_ms x HBM bandwidth / (layers x one MoE layer's activation
    bytes) at the profile's tokens (``layer_activation_bytes``, selective
    recomputation, flash attention: no s x s term; 33.4 s b h for DeepSeek-V3).
    """
    # The profile's layers are MoE layers: the count the step model prices them with.
    act = sm.layer_activation_bytes(g.with_(seq=prof["tokens"]), 1, 1, False, "selective",
                                    moe=True)
    return prof["other_ms"] * 1e-3 * mem_bw / (prof["layers"] * act)
