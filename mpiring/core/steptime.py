"""One training step of a GPT on a cluster with a layout: the step model assembled.

Time per step is the sum of what cannot overlap (Narayanan et al. 2021, §3):

    compute        FLOPs per GPU / (peak x gemm_eff x (1 - comm_sm_fraction)); with
                   FP8 GEMMs the attention core and the output head stay in
                   16-bit and run at bf16_flops x bf16_eff instead
    elementwise    bytes the memory-bound ops touch / HBM bandwidth: passes x
                   Korthikanti's per-layer activation bytes at the layer's MLP
                   width (their 5as/h term only without flash attention)
    tp_comm        4 ring AllReduces of b s h per layer and micro-batch (2 forward,
                   2 backward; 6 with full recomputation), none overlapped
    ep_comm        MoE dispatch + combine all-to-alls, forward and backward,
                   minus the share the schedule overlaps (DualPipe hides the
                   pipeline sends with them)
    pp_comm        one activation and one gradient per micro-batch and stage
                   boundary, 1/t of it per GPU (Megatron's scatter/gather); v of
                   each when interleaved
    bubble         bubble_fraction(schedule) x the above per-micro-batch work
    dp_exposed     gradient reduction over d minus what hides behind the last
                   micro-batch's backward; ZeRO-3 gathers the parameters twice and
                   reduce-scatters the gradients in every micro-batch

Cluster constants (gemm_eff, elementwise passes) are inputs, fitted once per
GPU generation; the docs say on which published runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from mpiring.core import stepmodel as sm
from mpiring.core.costmodel import AlphaBeta, ring_all_reduce
from mpiring.core.netmodel import Fabric, collective_time

# The search prices thousands of layouts that share a gradient reduction (every b,
# schedule, ZeRO stage and recomputation of one dp x tp x pp x ep): price each once.
_collective = lru_cache(maxsize=1 << 16)(collective_time)


@dataclass(frozen=True)
class Cluster:
    """GPUs and links.

    Attributes:
        gpus: GPUs available.
        peak_flops: dense peak FLOP/s per GPU at the training precision.
        mem_bytes: usable memory per GPU.
        mem_bw: memory bandwidth per GPU, bytes/s.
        fabric: NVLink and NIC link classes, GPUs and NICs per node.
        gemm_eff: the share of peak the layers' matrix multiplies reach.
        elementwise_passes: how many times the memory-bound ops read or write each
            activation byte that Korthikanti et al. count, forward and backward.
        bf16_flops, bf16_eff: peak and achieved share for the ops kept in 16-bit
            when ``peak_flops`` is a lower precision's (FP8 GEMMs: attention
            core, output head; DeepSeek-V3 §3.3.1). 0: the same as peak_flops,
            gemm_eff.
    """

    name: str
    gpus: int
    peak_flops: float
    mem_bytes: float
    mem_bw: float
    fabric: Fabric
    gemm_eff: float = 0.75
    elementwise_passes: float = 10.0
    bf16_flops: float = 0.0
    bf16_eff: float = 0.0

    def with_(self, **changes) -> Cluster:
        return replace(self, **changes)


@dataclass(frozen=True)
class Layout:
    """How the job is spread: degrees, micro-batching, schedule, ZeRO, recomputation.

    Attributes:
        dp, tp, pp: data-, tensor- and pipeline-parallel degrees (ep splits the
            experts inside dp x tp, as DeepSeek-V3 does).
        micro_batch: sequences per micro-batch (b); global batch / (dp b) gives m.
        schedule, vpp: the pipeline schedule and virtual stages per rank.
        zero: ZeRO stage over dp (0-3). recompute: none, selective, full.
        sp: sequence parallelism. flash: attention without the s x s matrix in HBM.
        overlap_dp: share of the last micro-batch's backward the gradient
            reduction may hide behind (0: reduced after the flush).
        grad_bytes: bytes per gradient element, in memory and on the wire (4:
            fp32 main gradients, as Megatron keeps and reduces them).
        ep_overlap: share of the MoE all-to-all hidden behind compute.
        comm_sm_fraction: share of the GPU's cores kept for communication.
        a2a_bytes: bytes per hidden element in the MoE all-to-alls (dispatch and
            combine averaged: 1.5 for DeepSeek-V3's fp8 dispatch, bf16 combine).
        act_bytes: bytes per activation element in the TP AllReduces and the
            pipeline sends (2: bf16; 4 for fp32 runs).
        light_ends: the first and last pipeline chunk one layer fewer, for the
            embedding and the head (Llama 3 §3.3.2); False: numpy.array_split.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    schedule: str = "1f1b"
    vpp: int = 1
    zero: int = 0
    recompute: str = "none"
    sp: bool = False
    flash: bool = False
    overlap_dp: float = 0.0
    grad_bytes: int = 2
    ep: int = 1
    ep_overlap: float = 0.0
    comm_sm_fraction: float = 0.0
    a2a_bytes: float = 2.0
    act_bytes: float = 2.0
    light_ends: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def with_(self, **changes) -> Layout:
        return replace(self, **changes)

    def describe(self) -> str:
        extra = f" ep{self.ep}" if self.ep > 1 else ""
        v = f"x{self.vpp}" if self.vpp > 1 else ""
        return (f"dp{self.dp} tp{self.tp} pp{self.pp}{extra} b{self.micro_batch} "
                f"{self.schedule}{v} zero{self.zero} rc-{self.recompute}")


def check(g: sm.GPT, c: Cluster, lay: Layout, batch: int) -> int:
    """Validate the combination; return m, the micro-batches per step."""
    if min(lay.dp, lay.tp, lay.pp, lay.micro_batch, lay.ep, lay.vpp) < 1:
        raise ValueError(f"every degree must be >= 1: {lay.describe()}")
    if lay.gpus > c.gpus:
        raise ValueError(f"layout {lay.describe()} needs {lay.gpus} GPUs, the cluster has {c.gpus}")
    if batch % (lay.dp * lay.micro_batch):
        raise ValueError(f"global batch {batch} is not a multiple of dp x micro_batch = "
                         f"{lay.dp * lay.micro_batch}: change the batch or the micro-batch")
    if lay.pp > g.layers:
        raise ValueError(f"pp={lay.pp} exceeds the model's {g.layers} layers")
    m = batch // (lay.dp * lay.micro_batch)
    if lay.schedule in sm.INTERLEAVED:
        if lay.pp * lay.vpp > g.layers:
            raise ValueError(f"{lay.schedule} pp x vpp = {lay.pp * lay.vpp} chunks exceeds the "
                             f"model's {g.layers} layers: lower vpp")
        # Megatron refuses fewer (the micro-batches of a round must range in [PP, M]):
        # with m < p the fill alone takes about p v chunk times whatever v is.
        if m < lay.pp:
            one = "zb-h1" if lay.schedule == "interleaved-zb" else "1f1b"
            raise ValueError(f"{lay.schedule} needs m >= pp micro-batches, got m={m}, "
                             f"pp={lay.pp}: use a smaller micro-batch or dp, or {one}")
    elif lay.vpp > 1:
        raise ValueError(f"vpp={lay.vpp} is for schedule 'interleaved' or 'interleaved-zb', "
                         f"not {lay.schedule!r}")
    if lay.schedule in sm.VEE:
        if 2 * lay.pp > g.layers:
            raise ValueError(f"{lay.schedule} cuts the model into 2 pp = {2 * lay.pp} chunks, "
                             f"more than its {g.layers} layers: lower pp")
        # Below 2p the V is never full: ZB-V idles more than the lead (its generator);
        # DualPipeV does not run at all (DeepSeek's and torch's check).
        if m < 2 * lay.pp:
            raise ValueError(f"{lay.schedule} needs m >= 2 pp micro-batches, got m={m}, "
                             f"pp={lay.pp}: use a smaller micro-batch or dp, or zb-h1")
    if lay.schedule == "dualpipe":
        if not g.experts:
            raise ValueError("dualpipe is priced as DeepSeek-V3 runs it, hiding the MoE "
                             "all-to-alls: for a dense model use zb-h1 or interleaved")
        # DualPipe's own asserts (deepseek-ai/DualPipe, DualPipe.step): half of the
        # micro-batches enter from each end.
        if lay.pp % 2 or m % 2 or m < 2 * lay.pp:
            raise ValueError(f"dualpipe needs an even pp and an even m >= 2 pp micro-batches, "
                             f"got pp={lay.pp}, m={m}: change pp, the micro-batch or the batch")
    if lay.ep > 1 and not g.experts:
        raise ValueError("ep > 1 needs a mixture-of-experts model (experts > 0)")
    if lay.ep > 1 and ((lay.dp * lay.tp) % lay.ep or g.experts % lay.ep):
        raise ValueError(f"ep={lay.ep} must divide dp x tp = {lay.dp * lay.tp} and the "
                         f"{g.experts} experts: pick an ep that divides both")
    return m


@dataclass(frozen=True)
class _Rank:
    """What one pipeline rank holds, its parameters before the tp/ep split.

    ``layers`` and ``moe_layers`` are those one micro-batch runs through on it
    (every chunk of an interleaved rank; one of a DualPipe rank's two stages).
    """

    index: int
    layers: int
    moe_layers: int
    dense_params: float  # everything but the routed experts, embedding and head included
    expert_params: float


@lru_cache(maxsize=1024)
def _ranks(g: sm.GPT, pp: int, v: int, light_ends: bool, dual: bool = False,
           vee: bool = False) -> tuple[_Rank, ...]:
    """Every pipeline rank's share. Stage 0 holds the embedding, the last stage the head
    (or, tied, Megatron's copy of the embedding); with pp = 1 one stage holds both.

    ``dual`` (DualPipe): rank r holds stage r and stage p - 1 - r, one for each
    direction, so every stage's parameters sit on two ranks (DeepSeek-V3 report,
    Table 2: "Parameter 2x"). ``vee`` (ZB-V): 2p chunks, rank r holding chunks r and
    2p-1-r, which a micro-batch runs through both; rank 0 holds both ends (and, tied,
    one table).
    """
    routed = g.experts * sm.mlp_params(g.hidden, g.expert_ffn, g.gated)
    dense_w = sm.layer_params(g, False, False)
    moe_w = sm.layer_params(g, True, False) - routed if g.experts else 0
    table = g.vocab * g.hidden
    if vee:
        chunks = sm.rank_layers(g.layers, 2 * pp, 1, light_ends)
        out = []
        for r in range(pp):
            mine = chunks[r] + chunks[2 * pp - 1 - r]
            moe = sum(1 for i in mine if g.experts and i >= g.dense_layers)
            tables = (1 + (not g.tied_embeddings)) if r == 0 else 0
            out.append(_Rank(r, len(mine), moe,
                             (len(mine) - moe) * dense_w + moe * moe_w + tables * table,
                             moe * routed))
        return tuple(out)
    stages = sm.rank_layers(g.layers, pp, v, light_ends)
    out = []
    for r in range(pp):
        mine = [r, pp - 1 - r] if dual and pp - 1 - r != r else [r]
        per, moe_max, dense, expert = 0, 0, 0.0, 0.0
        for st in mine:
            moe = sum(1 for i in stages[st] if g.experts and i >= g.dense_layers)
            tables = (st == 0) + (st == pp - 1 and not (pp == 1 and g.tied_embeddings))
            dense += (len(stages[st]) - moe) * dense_w + moe * moe_w + tables * table
            expert += moe * routed
            per, moe_max = max(per, len(stages[st])), max(moe_max, moe)
        out.append(_Rank(r, per, moe_max, dense, expert))
    return tuple(out)


def _layout_ranks(g: sm.GPT, lay: Layout) -> tuple[_Rank, ...]:
    return _ranks(g, lay.pp, lay.vpp if lay.schedule in sm.INTERLEAVED else 1, lay.light_ends,
                  lay.schedule == "dualpipe", lay.schedule in sm.VEE)


def _copies(lay: Layout) -> int:
    """Ranks holding each stage's parameters per data-parallel replica: 2 under DualPipe."""
    return 2 if lay.schedule == "dualpipe" else 1


def _stage_layers(g: sm.GPT, lay: Layout) -> int:
    """Layers on the slowest stage, which sets the pipeline's pace: ceil(l/pp), not l/pp."""
    return max(r.layers for r in _layout_ranks(g, lay))


def _states(r: _Rank, lay: Layout) -> float:
    """One rank's model states by the ZeRO formulas: its dense part sharded over dp,
    its experts split over ep and sharded over their dp t / ep replicas; under
    DualPipe over twice as many, the stage's other copy being one more replica."""
    k = _copies(lay)
    states = sm.zero_model_state_bytes(r.dense_params / lay.tp, lay.dp * k, lay.zero,
                                       grad_bytes=lay.grad_bytes)
    if r.expert_params:
        states += sm.zero_model_state_bytes(r.expert_params / lay.ep,
                                            max(1, lay.dp * lay.tp // lay.ep) * k, lay.zero,
                                            grad_bytes=lay.grad_bytes)
    return states


def _stage_activations(g: sm.GPT, lay: Layout, r: _Rank, recompute: str) -> float:
    """Activation bytes of one micro-batch through rank ``r``'s layers, each at its own shape."""
    one = sm.layer_activation_bytes(g, lay.micro_batch, lay.tp, lay.sp, recompute)
    moe = (sm.layer_activation_bytes(g, lay.micro_batch, lay.tp, lay.sp, recompute, moe=True)
           if r.moe_layers else 0.0)
    return (r.layers - r.moe_layers) * one + r.moe_layers * moe


def memory(g: sm.GPT, lay: Layout, m: int) -> dict[str, float]:
    """Bytes on the fullest GPU: model states (ZeRO formulas) and activations (Korthikanti).

    Every pipeline rank is counted with its own layers, parameters and in-flight
    micro-batches: rank 0 holds the most micro-batches and the embedding, but with
    experts a later rank's expert states can outweigh them.
    """
    # Flash attention keeps no s x s scores: selective's count.
    rc = "selective" if lay.flash and lay.recompute == "none" else lay.recompute
    best, seen = None, set()
    for r in _layout_ranks(g, lay):
        # A later rank with the same share holds no more micro-batches: skip it.
        key = (r.layers, r.moe_layers, r.dense_params, r.expert_params)
        if key in seen:
            continue
        seen.add(key)
        held = sm.in_flight_microbatches(lay.schedule, lay.pp, m, lay.vpp, r.index)
        states, acts = _states(r, lay), _stage_activations(g, lay, r, rc) * held
        if best is None or states + acts > best[0] + best[1]:
            best = (states, acts)
    states, acts = best
    # ZeRO-3 gathers one unit (a layer, or the embedding) at a time: the unit in use
    # and the one prefetched are whole, and so is its gradient until it is reduce-scattered.
    buffers = (_largest_unit(g, lay) * (2 * sm.WEIGHT_BYTES + lay.grad_bytes)
               if lay.zero == 3 else 0.0)
    return {"model_states": states, "activations": acts, "buffers": buffers,
            "total": states + acts + buffers}


def _largest_unit(g: sm.GPT, lay: Layout) -> float:
    """Parameters one GPU holds of its largest layer or of the embedding, unsharded over dp."""
    units = [g.vocab * g.hidden / lay.tp]
    moe = g.layers - g.dense_layers if g.experts else 0
    if moe < g.layers:
        units.append(sm.layer_params(g, False, False) / lay.tp)
    if moe:
        routed = g.experts * sm.mlp_params(g.hidden, g.expert_ffn, g.gated)
        units.append((sm.layer_params(g, True, False) - routed) / lay.tp + routed / lay.ep)
    return max(units)


def _expert_params(g: sm.GPT) -> int:
    moe = g.layers - g.dense_layers
    return moe * g.experts * sm.mlp_params(g.hidden, g.expert_ffn, g.gated)


def _group_fabric(c: Cluster, stride: int) -> Fabric:
    """The links a group sees whose ranks are ``stride`` apart (Megatron's order: tp fastest)."""
    f = c.fabric
    local = max(1, f.gpus_per_node // stride)
    # Each GPU keeps its 1/G share of the node's NICs whatever the group's shape.
    return Fabric(f.intra, f.nic, local, max(1, round(f.nics_per_node * local / f.gpus_per_node)))


def _dp_fabric(c: Cluster, lay: Layout) -> Fabric:
    """The links one data-parallel group sees: its ranks are tp apart."""
    return _group_fabric(c, lay.tp)


def step_time(g: sm.GPT, c: Cluster, lay: Layout, batch: int) -> sm.Breakdown:
    """Seconds per step and their parts, and memory per GPU, for a global batch of sequences."""
    m = check(g, c, lay, batch)
    f = c.fabric
    s, b, h = g.seq, lay.micro_batch, g.hidden
    tokens = batch * s
    compute = compute_time(g, c, lay, tokens)
    # Memory-bound ops, per micro-batch and stage; recomputation repeats the forward's.
    rc = "selective" if lay.flash else "none"
    act = max(_stage_activations(g, lay, r, rc) for r in _layout_ranks(g, lay))
    redo = 4 / 3 if lay.recompute == "full" else 1.0
    layers = _stage_layers(g, lay)
    per_mb_elem = c.elementwise_passes * act * redo / c.mem_bw
    # Tensor parallel: 2 AllReduces forward and 2 backward per layer (Shoeybi et al.
    # 2019 §3), 2 more when the forward is recomputed; on NVLink inside the node.
    n_ar = 6 if lay.recompute == "full" else 4
    tp_link = f.intra if lay.tp <= f.gpus_per_node else f.link(lay.tp, True)
    per_mb_tp = n_ar * layers * ring_all_reduce(lay.act_bytes * s * b * h, lay.tp,
                                                                 tp_link)
    per_mb_pp = 0.0
    if lay.pp > 1:
        # Stage neighbours are tp x dp ranks apart (Megatron's order): once the pipeline
        # spans more than one node some boundary crosses one, and the slowest sets the pace.
        across = lay.gpus > f.gpus_per_node
        # Interleaved: a micro-batch crosses p v - 1 chunk boundaries, v per rank; ZB-V
        # 2p - 1, one of them inside rank p - 1.
        sends = lay.vpp if lay.schedule in sm.INTERLEAVED else 2 if lay.schedule in sm.VEE else 1
        per_mb_pp = 2 * sends * _p2p(lay.act_bytes * s * b * h / lay.tp, c, across)
    # Overlapped all-to-all still costs what the micro-batch's compute cannot cover.
    # DualPipe overlaps the pipeline sends in the same F&B pairs ("both all-to-all
    # and PP communication can be fully hidden", DeepSeek-V3 §3.2.1).
    ep = _ep_time(g, c, lay)
    hidden_pp = lay.schedule == "dualpipe"
    comm = ep + (per_mb_pp if hidden_pp else 0.0)
    per_mb_ep = max(comm * (1 - lay.ep_overlap), comm - compute / m) if comm else 0.0
    if hidden_pp:
        per_mb_pp = 0.0
    per_mb = compute / m + per_mb_elem + per_mb_tp + per_mb_ep + per_mb_pp
    bubble = sm.bubble_fraction(lay.schedule, lay.pp, m, lay.vpp, lay.recompute) * per_mb * m
    dp_total, dp_exposed = _dp_parts(_all_reduce_time(g, c, lay), lay, m, compute)
    return sm.Breakdown(compute=compute, elementwise=per_mb_elem * m, tp_comm=per_mb_tp * m,
                        ep_comm=per_mb_ep * m, pp_comm=per_mb_pp * m, bubble=bubble,
                        dp_exposed=dp_exposed, dp_total=dp_total, memory=memory(g, lay, m))


def compute_time(g: sm.GPT, c: Cluster, lay: Layout, tokens: float) -> float:
    """Seconds of matrix multiplies per GPU: FLOPs / (peak x efficiency x the SMs left).

    The linear layers run at ``peak_flops x gemm_eff``; attention's QK^T/AV and
    the output head at ``bf16_flops x bf16_eff`` (the same unless the cluster
    trains its GEMMs in FP8, which keeps those in BF16: DeepSeek-V3 §3.3.1).
    """
    kinds = sm.training_flops_by_kind(g, lay.recompute)
    sms = 1 - lay.comm_sm_fraction
    lo = c.peak_flops * c.gemm_eff * sms
    hi = (c.bf16_flops or c.peak_flops) * (c.bf16_eff or c.gemm_eff) * sms
    # The slowest stage's ceil(l/pp) layers set the pace; the head is still spread
    # over the stages (Megatron's last stage runs it: not modelled).
    stage = _stage_layers(g, lay) * lay.pp / g.layers
    return ((kinds["linear"] * stage / lo + (kinds["attention"] * stage + kinds["head"]) / hi)
            * tokens / lay.gpus)


def _p2p(nbytes: float, c: Cluster, across: bool) -> float:
    ab: AlphaBeta = c.fabric.nic_share() if across else c.fabric.intra
    return ab.time(nbytes)


def _ep_time(g: sm.GPT, c: Cluster, lay: Layout) -> float:
    """Dispatch + combine, forward and backward, per micro-batch: 4 all-to-alls per MoE layer.

    Each token goes to top_k experts; those on other nodes cross the NICs (all G
    GPUs of a node send at once). With node-limited routing a token crosses to
    at most ``node_limit`` nodes, once each, and is forwarded over NVLink there.
    """
    if lay.ep <= 1:
        return 0.0
    moe_layers = max(r.moe_layers for r in _layout_ranks(g, lay))
    g_node = c.fabric.gpus_per_node
    nodes = max(1, lay.ep // g_node)
    far = max(0.0, (lay.ep - g_node) / lay.ep)
    ib_copies = g.top_k * far
    if g.node_limit and nodes > 1:
        ib_copies = min(ib_copies, g.node_limit * (nodes - 1) / nodes)
    nbytes = g.seq * lay.micro_batch * g.hidden * lay.a2a_bytes
    one = (nbytes * ib_copies / c.fabric.nic_share().beta
           + nbytes * g.top_k * (1 - 1 / lay.ep) / c.fabric.intra.beta)
    return 4 * moe_layers * one


def _all_reduce_time(g: sm.GPT, c: Cluster, lay: Layout) -> float:
    """One AllReduce of the gradients (ZeRO-1/2's ReduceScatter + AllGather: the same bytes).

    The dense part (everything but the routed experts) is reduced over dp. Each
    GPU's experts/(pp ep) expert parameters are reduced over that expert's own
    replicas, dp t / ep of them, ep ranks apart: none once ep = dp t. Each
    pipeline rank reduces its own share; the slowest sets the time.
    """
    # DualPipe's two copies of a stage reduce their gradients together.
    k = _copies(lay)
    replicas = lay.dp * lay.tp // lay.ep * k
    shares = {(r.dense_params, r.expert_params) for r in _layout_ranks(g, lay)}
    # Every stage reduces at once and the slowest counts; a share no larger in both
    # parts than another's cannot be the slowest.
    shares = [a for a in shares if not any(b != a and b[0] >= a[0] and b[1] >= a[1]
                                           for b in shares)]
    times = []
    for dense, expert in shares:
        t = 0.0
        if expert and replicas > 1:
            t += _collective("all_reduce", expert / lay.ep * lay.grad_bytes, replicas,
                             _group_fabric(c, lay.ep))
        if lay.dp * k > 1:
            t += _collective("all_reduce", dense / lay.tp * lay.grad_bytes, lay.dp * k,
                             _dp_fabric(c, lay))
        times.append(t)
    return max(times)


def _dp_time(g: sm.GPT, c: Cluster, lay: Layout, m: int = 1) -> float:
    """Data-parallel traffic per step of m micro-batches (``_dp_parts``)."""
    return _dp_parts(_all_reduce_time(g, c, lay), lay, m, 0.0)[0]


def _dp_parts(ar: float, lay: Layout, m: int, compute: float) -> tuple[float, float]:
    """(all, exposed) seconds of data-parallel traffic a step, from ``ar``, one gradient AllReduce.

    ZeRO 0-2: one AllReduce a step, which may hide behind the last micro-batch's
    backward (``overlap_dp`` of it). ZeRO-3 reshards the parameters after each
    forward and backward (FSDP's default, DeepSpeed's stage 3), so every
    micro-batch all-gathers them twice and reduce-scatters its gradients:
    m (2 AG + RS) = 1.5 m AllReduces (the ZeRO paper's 1.5x counts one pass).
    Each forward gather hides only behind its forward (a third of the
    micro-batch's compute), the backward's gather and the ReduceScatter behind
    its backward (two thirds).
    """
    fwd = lay.overlap_dp * compute / (3 * m)
    if lay.zero == 3:
        # A ring AllReduce is a ReduceScatter then an AllGather over the same links.
        half = ar / 2
        return 1.5 * m * ar, m * (max(0.0, half - fwd) + max(0.0, 2 * half - 2 * fwd))
    return ar, max(0.0, ar - 2 * fwd)


def throughput(g: sm.GPT, c: Cluster, lay: Layout, batch: int) -> dict[str, float]:
    """Step time, tokens/s, achieved TFLOP/s per GPU (counting recomputation, as
    Narayanan et al. do), MFU and memory for one layout."""
    br = step_time(g, c, lay, batch)
    t = br.total
    tok = batch * g.seq / t
    hw = sm.training_flops_per_token(g, lay.recompute) * tok / lay.gpus
    return {"step_s": t, "tokens_per_s": tok, "tflops_per_gpu": hw / 1e12,
            "mfu": sm.mfu(sm.model_flops_per_token(g), tok, lay.gpus, c.peak_flops),
            "memory_gb": br.memory["total"] / 1e9, "breakdown": br}
