r"""A GPT training step on paper: FLOPs, memory, pipeline bubbles, MFU, GPU-hours.

Each formula is a small pure function with its source. Notation (Narayanan et
al. 2021, Korthikanti et al. 2022): l layers, h hidden, a heads, s sequence,
V vocabulary, b micro-batch, B global batch (sequences), t/p/d tensor-,
pipeline- and data-parallel degrees, m micro-batches per step, v virtual
stages per rank.

The step time that puts these together is ``steptime.step_time``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class GPT:
    """A GPT-style decoder (dense; mixture-of-experts optional).

    Attributes:
        layers, hidden, heads, seq, vocab: l, h, a, s, V.
        ffn: the MLP's inner size (4h when 0).
        kv_heads: key/value heads (grouped-query attention; ``heads`` when 0).
        gated: SwiGLU-style MLP (three h x ffn matrices instead of two).
        experts, top_k, shared_experts, expert_ffn, dense_layers: mixture of
            experts: ``experts`` routed experts of inner size ``expert_ffn``,
            ``top_k`` of them per token plus ``shared_experts`` always on; the
            first ``dense_layers`` layers keep the dense MLP. experts=0: dense.
        attn_params_per_layer: overrides the attention's parameter count (MLA).
        attn_width: heads x (query-key head dim + value head dim), what QK^T and
            AV multiply over (2h for plain multi-head attention; 0 means 2h).
        node_limit: a token is sent to at most this many nodes, once per node
            (DeepSeek-V3's node-limited routing, §2.1.2); 0: no limit.
        tied_embeddings: the output head reuses the input embedding.
        mtp_depth: multi-token prediction modules (DeepSeek-V3 §2.2): each adds
            one more layer, a 2h x h projection and an output head to the
            FLOPs; their parameters are not counted in ``params`` (the
            report's 671B leaves out the 14B MTP module).
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0
    kv_heads: int = 0
    gated: bool = False
    experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    expert_ffn: int = 0
    dense_layers: int = 0
    attn_params_per_layer: int = 0
    tied_embeddings: bool = False
    attn_width: int = 0
    node_limit: int = 0
    mtp_depth: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"GPT.{f} must be >= 1, got {getattr(self, f)}")
        if self.experts and not (0 < self.top_k <= self.experts and self.expert_ffn > 0):
            raise ValueError("a mixture of experts needs 0 < top_k <= experts and expert_ffn > 0")
        for f in ("ffn", "kv_heads", "experts", "top_k", "shared_experts", "expert_ffn",
                  "dense_layers", "attn_params_per_layer", "attn_width", "node_limit",
                  "mtp_depth"):
            if getattr(self, f) < 0:
                raise ValueError(f"GPT.{f} must be >= 0 (0: the default), got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}: "
                             "each head needs hidden/heads dimensions")
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"kv_heads {self.kv_heads} must divide heads {self.heads} "
                             "(each key/value head serves heads/kv_heads query heads): use "
                             f"heads that are a multiple of {self.kv_heads}")
        if self.dense_layers > self.layers:
            raise ValueError(f"dense_layers {self.dense_layers} exceeds the {self.layers} layers: "
                             f"use at least {self.dense_layers} layers")

    @property
    def d_ffn(self) -> int:
        return self.ffn or 4 * self.hidden

    def with_(self, **changes) -> GPT:
        return replace(self, **changes)


def attention_params(g: GPT) -> int:
    """q and output projections h x h, k and v h x (kv_heads * h/a) each (biases left out)."""
    if g.attn_params_per_layer:
        return g.attn_params_per_layer
    kv = (g.kv_heads or g.heads) * (g.hidden // g.heads)
    return 2 * g.hidden * g.hidden + 2 * g.hidden * kv


def mlp_params(h: int, ffn: int, gated: bool) -> int:
    """2 h ffn, or 3 h ffn for a gated (SwiGLU) MLP (Shazeer 2020)."""
    return (3 if gated else 2) * h * ffn


def layer_params(g: GPT, moe_layer: bool, active: bool) -> int:
    """One layer's parameters; ``active``: only those one token uses (top_k + shared experts)."""
    if not moe_layer:
        return attention_params(g) + mlp_params(g.hidden, g.d_ffn, g.gated)
    per_expert = mlp_params(g.hidden, g.expert_ffn, g.gated)
    n = (g.top_k if active else g.experts) + g.shared_experts
    return attention_params(g) + n * per_expert + g.hidden * g.experts  # + the router


def params(g: GPT, active: bool = False) -> int:
    """All parameters (embeddings included); ``active``: those one token touches.

    Megatron's count for a dense GPT, 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)),
    differs only by the biases and layer norms left out here.
    """
    moe = g.layers - g.dense_layers if g.experts else 0
    body = ((g.layers - moe) * layer_params(g, False, active)
            + moe * layer_params(g, True, active))
    emb = g.vocab * g.hidden * (1 if g.tied_embeddings else 2)
    return body + emb


def forward_flops_parts(g: GPT) -> dict[str, float]:
    """Forward FLOPs per token by kind: ``linear`` (the layers' weight matmuls),
    ``attention`` (QK^T and AV, 2 s attn_width = 4 s h per layer, not halved for
    causality) and ``head`` (the output projection, 2 h V).

    Each MTP module (DeepSeek-V3 §2.2.2) adds one layer of the last kind, its
    2h -> h projection and one more output head.
    """
    moe = g.layers - g.dense_layers if g.experts else 0
    dense_w = layer_params(g, False, True)
    moe_w = layer_params(g, True, True) - g.hidden * g.experts if g.experts else 0
    width = g.attn_width or 2 * g.hidden
    last_w = moe_w if moe else dense_w
    mtp = g.mtp_depth
    return {"linear": 2.0 * ((g.layers - moe) * dense_w + moe * moe_w
                             + mtp * (last_w + 2 * g.hidden * g.hidden)),
            "attention": 2.0 * (g.layers + mtp) * g.seq * width,
            "head": 2.0 * (1 + mtp) * g.hidden * g.vocab}


def forward_flops_per_token(g: GPT) -> float:
    """Forward FLOPs per token: 2 per active weight in the layers and the head,
    plus attention's QK^T and AV (``forward_flops_parts``).

    For a dense GPT this is 24 l h^2 (1 + s/(6h) + V/(16 l h)) / 3 per token
    (Narayanan et al. 2021, eq. 3, with their three passes: one forward and a
    backward twice as long).
    """
    return sum(forward_flops_parts(g).values())


def training_flops_by_kind(g: GPT, recompute: str = "none") -> dict[str, float]:
    """``forward_flops_parts`` x 3 (forward + a backward twice as long), the
    layers' parts x 4 with full recomputation (the head is not recomputed)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    layers = 4 if recompute == "full" else 3
    f = forward_flops_parts(g)
    return {"linear": layers * f["linear"], "attention": layers * f["attention"],
            "head": 3 * f["head"]}


def training_flops_per_token(g: GPT, recompute: str = "none") -> float:
    """Forward + backward (2x forward) + the recomputed forward.

    recompute "full" adds one forward of the layers (not of the head):
    Narayanan et al. 2021 eq. 3, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step.
    "selective" recomputes only attention's softmax and dropout, whose FLOPs the
    count leaves out (Korthikanti et al. 2022 §5). ``model_flops_per_token``
    (recompute "none") is what MFU counts.
    """
    return sum(training_flops_by_kind(g, recompute).values())


def model_flops_per_token(g: GPT) -> float:
    """6 N + 12 l s h per token: what MFU counts (PaLM, Chowdhery et al. 2022, App. B)."""
    return training_flops_per_token(g, "none")


# --- memory ------------------------------------------------------------------------
#: Mixed-precision Adam: bytes per parameter for the fp16 weights, their gradients
#: and the optimizer state K (fp32 master copy, momentum, variance), ZeRO §3.
WEIGHT_BYTES, GRAD_BYTES, ADAM_K = 2, 2, 12


def zero_model_state_bytes(psi: float, nd: int, stage: int, k: float = ADAM_K,
                           grad_bytes: float = GRAD_BYTES) -> float:
    """Per-GPU model states by the ZeRO paper (Rajbhandari et al. 2020, Fig. 1, §5).

    stage 0: (2 + 2 + K) Psi; 1 (P_os): 2Psi + 2Psi + K Psi/N_d;
    2 (P_os+g): 2Psi + (2 + K) Psi/N_d; 3 (P_os+g+p): (2 + 2 + K) Psi/N_d.
    ``grad_bytes`` replaces the second 2 (4: fp32 main gradients, as Megatron keeps them).
    """
    if nd < 1:
        raise ValueError(f"data-parallel degree N_d must be >= 1, got {nd}")
    w, g = WEIGHT_BYTES * psi, grad_bytes * psi
    o = k * psi
    if stage == 0:
        return w + g + o
    if stage == 1:
        return w + g + o / nd
    if stage == 2:
        return w + (g + o) / nd
    if stage == 3:
        return (w + g + o) / nd
    raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                               sp: bool = False, recompute: str = "none", *, ffn: int = 0,
                               gated: bool = False, kv_heads: int = 0) -> float:
    """Activation memory of one layer in bytes (Korthikanti et al. 2022, §4.1, Table 2).

    Their parts: 10 s b h outside the tensor-parallel regions (LayerNorm inputs,
    the two linear inputs, two dropout masks), split over t only with SP; inside
    them Q and K 4 s b h, V 2 s b h, the output projection's input 2 s b h, the
    MLP's GeLU input and second linear input 2 s b ffn each, and the scores
    5 a s^2 b. With ffn = 4h that is Table 2: none s b h (10 + 24/t + 5 a s/(h t))
    (with SP s b h (34/t + 5 a s/(h t))); selective s b h 34/t with SP
    (attention's softmax, dropout and AV recomputed); full 2 s b h (only the
    layer's input kept, /t with SP). ``kv_heads`` < a shrinks K and V
    (grouped-query attention); ``gated`` keeps SwiGLU's two inputs and the
    second linear's input, 3 x 2 s b ffn (Megatron's fused SwiGLU saves its input).
    """
    sbh = s * b * h
    if recompute == "full":
        return 2.0 * sbh / (t if sp else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    ffn = ffn or 4 * h
    kv = (kv_heads or a) / a
    inside = sbh * (4 + 4 * kv) + s * b * ffn * (6 if gated else 4)
    out = (10 * sbh + inside) / t if sp else 10 * sbh + inside / t
    if recompute == "none":
        out += 5.0 * a * s * s * b / t
    return out


def layer_activation_bytes(g: GPT, b: int, t: int = 1, sp: bool = False,
                           recompute: str = "none", moe: bool = False) -> float:
    """``activation_bytes_per_layer`` at ``g``'s shape: its MLP width, gating and KV heads.

    A MoE layer counts a token's top_k routed and shared experts as one MLP of
    their summed width; the token copies each routed expert keeps of its input
    are left out, and so is multi-head latent attention's own shape (MHA's count).
    """
    ffn = (g.top_k + g.shared_experts) * g.expert_ffn if moe else g.d_ffn
    return activation_bytes_per_layer(g.seq, b, g.hidden, g.heads, t, sp, recompute, ffn=ffn,
                                      gated=g.gated, kv_heads=g.kv_heads)


# --- pipeline stages ----------------------------------------------------------------
def chunk_sizes(layers: int, chunks: int, light_ends: bool = False) -> list[int]:
    """Layers per pipeline chunk: the numpy.array_split way (the first l mod chunks one
    longer); ``light_ends``: the first and last chunk one layer fewer, for the embedding
    and the head (Llama 3 §3.3.2 took one layer off its first and last stages)."""
    n = layers + 2 if light_ends and chunks > 1 else layers
    if chunks < 1 or chunks > layers:
        raise ValueError(f"cannot split {layers} layers into {chunks} chunks")
    q, extra = divmod(n, chunks)
    sizes = [q + (i < extra) for i in range(chunks)]
    if n != layers:
        sizes[0] -= 1
        sizes[-1] -= 1
    return sizes


def rank_layers(layers: int, p: int, v: int = 1, light_ends: bool = False) -> list[list[int]]:
    """The layers each of p ranks holds: l split into p v chunks (``chunk_sizes``),
    rank r holding chunks r, r + p, ... (Megatron's interleaved placement; v = 1:
    one contiguous stage a rank)."""
    if p < 1 or v < 1:
        raise ValueError(f"need p, v >= 1, got p={p}, v={v}")
    bounds = [0]
    for size in chunk_sizes(layers, p * v, light_ends):
        bounds.append(bounds[-1] + size)
    return [[k for c in range(r, p * v, p) for k in range(bounds[c], bounds[c + 1])]
            for r in range(p)]


# --- pipeline bubble ----------------------------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zb-h1", "zb-h2", "zb-v",
             "dualpipev", "dualpipe")
#: The schedules of 2p chunks in a V (rank r holds chunks r and 2p - 1 - r).
VEE = ("zb-v", "dualpipev")
#: The schedules of v chunks per rank (Megatron's virtual pipeline).
INTERLEAVED = ("interleaved", "interleaved-zb")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1, recompute: str = "none") -> float:
    """Idle time over ideal compute time of one pipeline flush.

    gpipe and 1f1b: (p-1)/m (Narayanan et al. 2021 §2.2.1; as a share of wall
    time that is (p-1)/(m+p-1)); interleaved with v chunks: (p-1)/(v m) (§2.2.2),
    for m >= p only (with fewer the fill takes about p v chunk times: refused).
    The zero-bubble schedules by Qi et al. 2024, Table 2: zb-h1 (p-1)(T_F + T_B
    - T_W), zb-h2 (p-1)(T_F + T_B - 2 T_W), over m (T_F + T_B + T_W); with
    T_F = T_B = T_W a third of 1F1B's and none. Table 2 assumes m >= p: with fewer
    micro-batches, p - m of the W's a stage would fill the cool-down with do not
    exist, and zb-h1's idle is (p - 1)(T_F + T_B - T_W) + (p - m) T_W (mpiring's
    schedule, simulated). interleaved-zb (ZB-H1 on v chunks
    per rank, mpiring's and torch's ScheduleInterleavedZeroBubble): zb-h1's over v,
    as interleaving divides 1F1B's (mpiring's schedule simulated: exact for m a
    multiple of p and T_W <= T_F + T_B). zb-v (ZB-V, 2p chunks in a V, m >= 2p):
    the lead alone, p - 1 chunk forwards, over m (T_F + T_B + T_W) of two chunks,
    (p - 1)/(6m); with B = 2, 3p - 2 chunk forwards (mpiring's schedule, simulated;
    Qi et al. give no formula in Table 2). dualpipev (DeepSeek's DualPipe cut in
    half, on ZB-V's V, m >= 2p; mpiring's and torch's ScheduleDualPipeV): the same
    lead with equal times, 3p - 4 chunk forwards with B = 2 (its generator,
    simulated: full backwards in the steady state, paired against the other arm's
    forwards, where ZB-V's split ones leave W's over). Full recomputation runs the
    forward again inside B (T_B = 2): zb-h1 is then half of 1F1B's, zb-h2 a
    quarter. dualpipe: (p/2 - 1)(F&B + B - 3W) over m (F + B) (DeepSeek-V3
    report, Table 2), where B is the full backward and W its weight half: with
    F = W = 1, B = 2 (3 recomputing) and F&B = F + B (the overlap hides
    communication, not compute) that is (p - 2)/(3m) ((p/2 - 1)/m recomputing).
    """
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p, m, v >= 1, got p={p}, m={m}, v={v}")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / m
    if schedule in INTERLEAVED and m < p:
        raise ValueError(f"{schedule} needs m >= p micro-batches, got m={m}, p={p}")
    if schedule == "interleaved":
        return (p - 1) / (v * m)
    # Unit times: F, B's input-gradient half (with the recomputed forward), W.
    f, b, w = 1.0, 2.0 if recompute == "full" else 1.0, 1.0
    if schedule == "zb-h1":
        return ((p - 1) * (f + b - w) + max(0, p - m) * w) / (m * (f + b + w))
    if schedule == "interleaved-zb":
        return (p - 1) * (f + b - w) / (v * m * (f + b + w))
    if schedule in VEE:
        if m < 2 * p:
            raise ValueError(f"{schedule} needs m >= 2p micro-batches, got m={m}, p={p}")
        # In chunk times (a chunk is half a rank's layers): the lead alone, p - 1 chunk
        # forwards, with equal times. With B = 2 (full recomputation) ZB-V's cool-down
        # B's outlast the W's that fill it, p - 1 + (2p - 1); DualPipeV's two less.
        if b == f or p == 1:
            idle = p - 1
        else:
            idle = 3 * p - 2 if schedule == "zb-v" else 3 * p - 4
        return idle / (2 * m * (f + b + w))
    if schedule == "zb-h2":
        return max(0.0, (p - 1) * (f + b - 2 * w)) / (m * (f + b + w))
    if schedule == "dualpipe":
        full = b + w  # DualPipe's B is the whole backward
        return max(0.0, (p / 2 - 1) * ((f + full) + full - 3 * w)) / (m * (f + full))
    raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")


def interleaved_warmup(p: int, m: int, v: int, rank: int = 0, zero_bubble: bool = False) -> int:
    """Chunk forwards ``rank`` runs before its first backward in interleaved 1F1B.

    Megatron's count (``get_pp_rank_microbatches``): (v - 1) g + 2 (p - 1 - rank),
    g the micro-batches of a round: p, or, when p does not divide m, the first
    of m // p rounds of near-equal size; at most all m v chunk forwards.
    ``zero_bubble``: the interleaved zero bubble's, (v - 1) g + (p - 1 - rank) (a
    split B comes back sooner; torch's ScheduleInterleavedZeroBubble).
    """
    if m < p:
        name = "the interleaved zero bubble" if zero_bubble else "interleaved 1F1B"
        raise ValueError(f"{name} needs m >= p micro-batches, got m={m}, p={p}")
    rounds = m // p
    g = -(-m // rounds)  # the first round is the largest
    return min(m * v, (v - 1) * g + (1 if zero_bubble else 2) * (p - 1 - rank))


def in_flight_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0) -> float:
    """Micro-batches' worth of its layers whose activations ``rank`` holds at its peak.

    GPipe keeps all m; 1F1B min(p - rank, m) (torch's Schedule1F1B warm-up); ZB-H1
    min(p, m) on every rank: rank r holds back r W's, and a micro-batch keeps its
    activations until its W (Qi et al. 2024: ZB-H1's peak is 1F1B's first stage's;
    mpiring's schedule, simulated, holds that on every stage), as does ZB-V in its 2p
    chunks of half the layers, and DualPipeV one chunk more (its generator, simulated);
    ZB-H2 about 2(p - rank) - 1 (Qi et al. 2024, Table 2: 2p - 1 on the
    first); DualPipe p + 1 at most on every rank (DeepSeek-V3 report, Table 2:
    PP + 1 chunks a device). Interleaved holds chunks of 1/v of the rank's
    layers: its warm-up plus the steady state's first forward, over v
    (``interleaved_warmup``); on rank 0 with p dividing m that is p + (p - 1)/v:
    p = 16, v = 4 holds 79 chunks, 19.75 where 1F1B holds 16. The interleaved zero
    bubble's shorter warm-up plus the rank's r held-back W's: (v - 1) g + p chunks on
    every rank, p micro-batches with p dividing m (its generator, simulated).
    """
    if schedule == "gpipe":
        return m
    if schedule in ("zb-h1", "zb-v"):  # ZB-V: 2p chunks of half a rank's layers
        return min(m, p)
    if schedule == "dualpipev":  # 2p + 1 chunks of half a rank's layers (m >= 2p)
        return min(m, p + 0.5)
    if schedule == "zb-h2":
        return min(m, 2 * (p - rank) - 1)
    if schedule == "dualpipe":
        return min(m, p + 1)
    if schedule == "interleaved":
        return min(m * v, interleaved_warmup(p, m, v, rank) + 1) / v
    if schedule == "interleaved-zb":
        return min(m * v, interleaved_warmup(p, m, v, rank, zero_bubble=True) + 1 + rank) / v
    return min(m, p - rank)


# --- utilisation ---------------------------------------------------------------------
def mfu(model_flops_per_token: float, tokens_per_s: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: model FLOPs per second over the cluster's peak (PaLM, App. B)."""
    return model_flops_per_token * tokens_per_s / (gpus * peak_flops)


def gpu_hours(tokens: float, tokens_per_s: float, gpus: int) -> float:
    """GPU-hours to train on ``tokens`` at ``tokens_per_s`` on ``gpus`` GPUs."""
    return tokens / tokens_per_s * gpus / 3600.0


@dataclass(frozen=True)
class Breakdown:
    """Where one step's time goes (seconds) and what each GPU holds (bytes)."""

    compute: float = 0.0
    elementwise: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    pp_comm: float = 0.0
    bubble: float = 0.0
    dp_exposed: float = 0.0
    dp_total: float = 0.0
    memory: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return (self.compute + self.elementwise + self.tp_comm + self.ep_comm + self.pp_comm
                + self.bubble + self.dp_exposed)

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute, "elementwise": self.elementwise, "tp_comm": self.tp_comm,
                "ep_comm": self.ep_comm, "pp_comm": self.pp_comm, "bubble": self.bubble,
                "dp_exposed": self.dp_exposed}
