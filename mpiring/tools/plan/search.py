"""The layout search: every (dp, tp, pp, b, schedule, ZeRO, recomputation) that fits, ranked.

tp stays inside a node (powers of two up to the GPUs per node, dividing the
heads and the key/value heads), pp runs over the divisors of GPUs / tp up to
the layer count (stages
split the layers the numpy.array_split way, so pp need not divide them; the
slowest stage, ceil(l/pp) layers, prices the layout), and
dp takes the rest of the cluster. A layout is kept when its memory per GPU
fits and the global batch splits into whole micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from mpiring.core import stepmodel as sm
from mpiring.core.steptime import Cluster, Layout, throughput

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout."""

    layout: Layout
    step_s: float
    tflops_per_gpu: float
    mfu: float
    memory_gb: float
    gpu_hours: float
    breakdown: sm.Breakdown

    def as_dict(self) -> dict:
        br = self.breakdown
        return {"layout": self.layout.describe(), "dp": self.layout.dp, "tp": self.layout.tp,
                "pp": self.layout.pp, "micro_batch": self.layout.micro_batch,
                "schedule": self.layout.schedule, "vpp": self.layout.vpp,
                "zero": self.layout.zero, "recompute": self.layout.recompute,
                "step_s": self.step_s, "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "memory_gb": self.memory_gb, "gpu_hours": self.gpu_hours,
                "time_s": br.parts(), "dp_total_s": br.dp_total,
                "memory_bytes": dict(br.memory)}


def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]


def _eps(g: sm.GPT, ranks: int) -> list[int]:
    """Expert-parallel degrees: powers of two dividing both the experts and dp x tp."""
    if not g.experts:
        return [1]
    return [e for e in _pow2_upto(min(g.experts, ranks)) if ranks % e == 0 and g.experts % e == 0]


def _vpps(per_rank: int) -> list[int]:
    """Interleaving depths for ``per_rank`` layers a rank: those that split them evenly
    (Megatron needs l / (p v) whole) and the powers of two, up to one layer a chunk.

    Deeper v shrinks the bubble and rank 0's activations but sends v times as often,
    so the best depth is found, not assumed.
    """
    return sorted({v for v in range(2, per_rank + 1) if per_rank % v == 0 or v & (v - 1) == 0})


def layouts(g: sm.GPT, c: Cluster, batch: int, *, flash: bool = True,
            overlap_dp: float = 1.0) -> list[Layout]:
    """Every layout of exactly ``c.gpus`` GPUs the search considers (memory not yet checked)."""
    out = []
    for tp in _pow2_upto(c.fabric.gpus_per_node):
        # Megatron splits whole heads and key/value groups (it asserts both divide tp).
        if g.heads % tp or (g.kv_heads and g.kv_heads % tp) or c.gpus % tp:
            continue
        rest = c.gpus // tp
        for pp in (p for p in range(1, min(rest, g.layers) + 1) if rest % p == 0):
            dp = rest // pp
            scheds = [("1f1b", 1)] if pp == 1 else [
                ("1f1b", 1), ("zb-h1", 1),
                *((s, v) for v in _vpps(g.layers // pp) for s in ("interleaved", "interleaved-zb"))]
            if pp > 1 and 2 * pp <= g.layers:
                scheds += [("zb-v", 1), ("dualpipev", 1)]
            if g.experts and pp % 2 == 0:
                scheds.append(("dualpipe", 1))
            for b, (sched, v), zero, rc, ep in product(MICRO_BATCHES, scheds, range(4), RECOMPUTE,
                                                       _eps(g, dp * tp)):
                if batch % (dp * b) or (zero and dp == 1):
                    continue
                m = batch // (dp * b)
                if sched in sm.INTERLEAVED and m < pp:
                    continue  # Megatron refuses m < p (steptime.check)
                if sched in sm.VEE and m < 2 * pp:
                    continue  # the V is never full (steptime.check)
                if sched == "dualpipe" and (m % 2 or m < 2 * pp):
                    continue  # DualPipe's own asserts (steptime.check)
                if flash and rc == "selective":  # flash attention keeps no s x s scores: = none
                    continue
                # DualPipe's point is hiding the all-to-all (DeepSeek-V3 §3.2.1).
                out.append(Layout(dp=dp, tp=tp, pp=pp, micro_batch=b, schedule=sched, vpp=v,
                                  zero=zero, recompute=rc, sp=tp > 1, flash=flash,
                                  overlap_dp=overlap_dp, ep=ep,
                                  ep_overlap=1.0 if sched == "dualpipe" else 0.0))
    return out


def search(g: sm.GPT, c: Cluster, batch: int, tokens: float = 0.0, top: int = 5,
           **kw) -> list[Candidate]:
    """The ``top`` fastest layouts that fit in memory (fastest first, the leanest of a tie).

    Args:
        g: the model. c: the cluster (all ``c.gpus`` are used).
        batch: global batch in sequences. tokens: a token budget for GPU-hours (0: none).
        top: how many to return. kw: passed to ``layouts`` (flash, overlap_dp).

    Raises:
        ValueError: no layout fits; the message says how much memory the leanest needs.
    """
    if batch < 1:
        raise ValueError(f"global batch must be >= 1 sequence, got {batch}")
    if top < 1:
        raise ValueError(f"top must be >= 1 layout, got {top}")
    found, leanest = [], None
    for lay in layouts(g, c, batch, **kw):
        r = throughput(g, c, lay, batch)
        if leanest is None or r["memory_gb"] < leanest[0]:
            leanest = (r["memory_gb"], lay)
        if r["memory_gb"] * 1e9 > c.mem_bytes:
            continue
        hours = sm.gpu_hours(tokens, r["tokens_per_s"], lay.gpus) if tokens else 0.0
        found.append(Candidate(lay, r["step_s"], r["tflops_per_gpu"], r["mfu"], r["memory_gb"],
                               hours, r["breakdown"]))
    if not found:
        if leanest is None:
            raise ValueError(_no_split(g, c, batch))
        raise ValueError(f"no layout fits in {c.mem_bytes / 1e9:.0f} GB per GPU: the leanest "
                         f"({leanest[1].describe()}) needs {leanest[0]:.1f} GB; add GPUs or "
                         "shrink the model or the sequence")
    # Layouts the model prices within 0.01 % of each other are ties (ZeRO 0-2 and b
    # often are): the leanest comes first, and of a layout that differs only in ZeRO
    # stage or micro-batch at that time only the leanest is kept, so the rows differ.
    found.sort(key=lambda x: (_tie(x.step_s), x.memory_gb))
    out, seen = [], set()
    for x in found:
        lay = x.layout
        key = (_tie(x.step_s), lay.dp, lay.tp, lay.pp, lay.ep, lay.schedule, lay.vpp,
               lay.recompute)
        if key not in seen:
            seen.add(key)
            out.append(x)
    return out[:top]


def _no_split(g: sm.GPT, c: Cluster, batch: int) -> str:
    """Why no layout splits ``batch``, naming the data-parallel degrees there are."""
    # tp = 1, pp = 1 always splits the GPUs, so there is at least dp = gpus.
    dps = sorted({lay.dp for lay in layouts(g, c, c.gpus * max(MICRO_BATCHES))})
    return (f"no layout of {c.gpus} GPUs splits a batch of {batch} sequences: dp x "
            f"micro-batch must divide it, and dp can be {', '.join(map(str, dps))} here "
            f"(tp a power of two up to {c.fabric.gpus_per_node} dividing the {g.heads} heads, "
            f"pp up to the {g.layers} layers); use a batch that is a multiple of {dps[0]}, "
            "or change --gpus")


def _tie(seconds: float) -> float:
    """Step time to 4 significant digits: the model's precision is far coarser."""
    return float(f"{seconds:.4g}")
