"""Published runs and the clusters they ran on, as the planner's presets.

Sources (figures as printed there):
  * Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1: the
    weak-scaling runs on Selene (DGX A100 80 GB; s = 2048, V = 51,200, full
    activation recomputation, TFLOP/s counted with the recomputed forward).
  * Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models", SC'20 (arXiv 1910.02054), Figure 1: 7.5B parameters,
    N_d = 64, K = 12.
  * DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437): 2,048 H800,
    PP16 (DualPipe), EP64, ZeRO-1 DP, no TP, 14.8T tokens, 2.664M GPU-hours of
    pre-training, 20 of 132 SMs kept for communication, FP8 GEMMs, one MTP
    module; and its published training profile (github.com/deepseek-ai/profile-data).
  * Llama Team, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4 and the
    Llama 3.1 model card: 405B on 16,384 H100, TP8 CP1 PP16 DP128, s = 8192,
    16M tokens a batch, 400 TFLOP/s per GPU, BF16 MFU 41%, 15.6T tokens,
    30.84M GPU-hours.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpiring.core.costmodel import AlphaBeta
from mpiring.core.netmodel import Fabric
from mpiring.core.stepmodel import GPT
from mpiring.core.steptime import Cluster, Layout
from mpiring.tools.plan import dsprofile

GB = 1e9

# --- clusters: nominal figures of the parts; the two efficiencies fitted per generation ---
#: A100 80 GB SXM: 312 TFLOP/s bf16, 2.04 TB/s HBM, NVLink 3 (300 GB/s each way),
#: 8 HDR InfiniBand NICs of 200 Gb/s. gemm_eff and elementwise_passes are the
#: least-squares fit on Megatron's Table 1 (docs/planner.md).
A100_GEMM_EFF, A100_PASSES = 0.68, 6.0


def selene(gpus: int = 3072) -> Cluster:
    """NVIDIA Selene, DGX A100 80 GB nodes (Narayanan et al. 2021, §5)."""
    fabric = Fabric(AlphaBeta(5e-6, 300 * GB * 0.8), AlphaBeta(8e-6, 25 * GB * 0.9), 8, 8)
    return Cluster("selene-a100", gpus, 312e12, 80 * GB, 2.04e12, fabric,
                   A100_GEMM_EFF, A100_PASSES)


def h100_cluster(gpus: int = 16384) -> Cluster:
    """H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s, NVLink 4 (450 GB/s each way), 8 x 400 Gb/s NICs."""
    fabric = Fabric(AlphaBeta(5e-6, 450 * GB * 0.8), AlphaBeta(8e-6, 50 * GB * 0.9), 8, 8)
    return Cluster("h100", gpus, 989e12, 80 * GB, 3.35e12, fabric, A100_GEMM_EFF, A100_PASSES)


def h800_cluster(gpus: int = 2048, fp8: bool = True) -> Cluster:
    """H800: the H100's cores, NVLink cut to 160 GB/s achieved, 8 x 400 Gb/s IB (DeepSeek-V3 §3.2).

    fp8: the linear layers' GEMMs at the FP8 peak (1,979 TFLOP/s dense) with the
    share and the memory-bound work measured in DeepSeek's published profile
    (``dsprofile``); attention and the head stay BF16 (989) at the A100 share.
    False: everything BF16 with the A100 constants (a what-if).
    """
    fabric = Fabric(AlphaBeta(5e-6, 160 * GB), AlphaBeta(8e-6, 50 * GB * 0.9), 8, 8)
    if not fp8:
        return Cluster("h800", gpus, 989e12, 80 * GB, 3.35e12, fabric, A100_GEMM_EFF,
                       A100_PASSES)
    hbm = 3.35e12
    return Cluster("h800-fp8", gpus, 1979e12, 80 * GB, hbm, fabric,
                   dsprofile.fp8_gemm_eff(DEEPSEEK_V3, 1979e12),
                   dsprofile.elementwise_passes(DEEPSEEK_V3, hbm),
                   bf16_flops=989e12, bf16_eff=A100_GEMM_EFF)


# --- Megatron-LM weak scaling (Narayanan et al. 2021, Table 1) ----------------------
@dataclass(frozen=True)
class MegatronRow:
    """One row: the model, its layout, and the published per-GPU throughput."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    def model(self) -> GPT:
        return GPT(self.layers, self.hidden, self.heads, 2048, 51200, tied_embeddings=True,
                   name=f"gpt-{self.params_b:g}b")

    def layout(self) -> Layout:
        # Micro-batch 1 and the plain 1F1B schedule are assumptions: the table
        # does not print them (docs/planner.md). Megatron (2021) reduced the
        # gradients after the flush, in fp32 main-gradient buffers.
        return Layout(dp=self.gpus // (self.tp * self.pp), tp=self.tp, pp=self.pp,
                      micro_batch=1, schedule="1f1b", recompute="full", overlap_dp=0.0,
                      grad_bytes=4)


MEGATRON_TABLE = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

#: ZeRO paper, Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> GB per GPU by stage.
ZERO_FIGURE1 = {"psi": 7.5e9, "nd": 64, "gb": {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}}


# --- the lecture's two runs ------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """A published run: model, cluster, layout, batch (sequences), tokens, GPU-hours."""

    name: str
    model: GPT
    cluster: Cluster
    layout: Layout
    batch: int
    tokens: float
    gpu_hours: float
    source: str


def _mla_params(h: int = 7168, heads: int = 128, q_rank: int = 1536, kv_rank: int = 512,
                nope: int = 128, rope: int = 64, v: int = 128) -> int:
    """DeepSeek's multi-head latent attention: low-rank q and kv projections (V3 report §2.1.1)."""
    q = h * q_rank + q_rank * heads * (nope + rope)
    kv = h * (kv_rank + rope) + kv_rank * heads * (nope + v)
    return q + kv + heads * v * h


DEEPSEEK_V3 = GPT(61, 7168, 128, 4096, 129280, ffn=18432, gated=True, experts=256, top_k=8,
                  shared_experts=1, expert_ffn=2048, dense_layers=3, node_limit=4, mtp_depth=1,
                  attn_params_per_layer=_mla_params(), attn_width=128 * (192 + 128),
                  name="deepseek-v3")


def reshape(g: GPT, **changes) -> GPT:
    """``g.with_(**changes)``; DeepSeek-V3's MLA resized to a new hidden or head count
    (its fixed attention size would otherwise stay that of h = 7168, a = 128)."""
    out = g.with_(**changes)
    if g.name == DEEPSEEK_V3.name and ({"hidden", "heads"} & changes.keys()):
        out = out.with_(attn_params_per_layer=_mla_params(out.hidden, out.heads),
                        attn_width=out.heads * (192 + 128))
    return out


LLAMA31_405B = GPT(126, 16384, 128, 8192, 128256, ffn=53248, kv_heads=8, gated=True,
                   name="llama-3.1-405b")


def deepseek_v3_run(fp8: bool = True) -> Run:
    # b = 1 (m = 120 per step) is an assumption; the batch is the final 15,360
    # sequences of 4,096 tokens (the report ramps it up over the first 469B tokens).
    lay = Layout(dp=128, tp=1, pp=16, micro_batch=1, schedule="dualpipe", zero=1,
                 recompute="selective", flash=True, overlap_dp=1.0, ep=64, ep_overlap=1.0,
                 comm_sm_fraction=20 / 132, a2a_bytes=1.5)
    return Run("deepseek-v3", DEEPSEEK_V3, h800_cluster(2048, fp8), lay, 15360, 14.8e12,
               2.664e6, "DeepSeek-V3 Technical Report, arXiv 2412.19437, Table 1 and §3")


def llama31_405b_run(vpp: int = 4) -> Run:
    # 2,048 sequences of 8,192 tokens (16M) over dp 128: m = 16 micro-batches of 1.
    # The interleaving depth v is not published: an assumption (docs/planner.md).
    # FSDP without resharding after forward: ZeRO-2's memory (Llama 3 §3.3.2), which
    # also takes one layer off the first and the last stage for the embedding and head.
    lay = Layout(dp=128, tp=8, pp=16, micro_batch=1, schedule="interleaved", vpp=vpp, zero=2,
                 recompute="none", sp=True, flash=True, overlap_dp=1.0, light_ends=True)
    return Run("llama-3.1-405b", LLAMA31_405B, h100_cluster(16384), lay, 2048, 15.6e12,
               30.84e6, "The Llama 3 Herd of Models, arXiv 2407.21783, Table 4; Llama 3.1 model card")


RUNS = {"deepseek-v3": deepseek_v3_run, "llama-3.1-405b": llama31_405b_run}
