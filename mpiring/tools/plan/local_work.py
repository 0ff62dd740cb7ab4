"""What each of the three local benches computes, as ``hostcost`` work, and its price.

``ddp_work``, ``tp_work`` and ``pp_work`` list one rank's GEMMs (shape and
layout), attention calls, elementwise bytes and whole-parameter passes for the
step each bench times; ``spec_for`` is the union of their shapes, the list
``calibrate`` measures; ``price`` turns a work list and a calibration into
seconds. The same calibration prices every run: no constant belongs to one run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpiring.core.hostcost import (
    F32,
    Gemm,
    adamw_bytes,
    block_elementwise_bytes,
    block_gemms,
    bucket_copy_bytes,
    host_seconds,
    linear_gemms,
    merge,
    model_elementwise_bytes,
    tp_widths,
)
from mpiring.tools.plan.calibrate import gemm_key, shape_key

#: The benches' attention windows: bench-tp's GPT block runs 64-token windows, d/64 heads.
TP_WINDOW = 64


@dataclass(frozen=True)
class Work:
    """One rank's work in one timed step.

    Attributes:
        gemms: every GEMM, shapes merged.
        attention: (batch, heads, seq, head size, calls) of causal attention.
        probe: (tokens, d, ffn) at which the elementwise bandwidth is measured.
        elementwise_bytes: bytes the memory-bound passes move.
        optimizer_bytes: AdamW's pass over the parameters (0: no optimizer step).
        bucket_bytes: the DDP reducer's copies (0: no reducer).
    """

    gemms: tuple[Gemm, ...]
    attention: tuple[tuple[int, int, int, int, int], ...]
    probe: tuple[int, int, int]
    elementwise_bytes: float
    optimizer_bytes: float = 0.0
    bucket_bytes: float = 0.0
    notes: dict = field(default_factory=dict)


def gpt_work(d: int, layers: int, heads: int, seq: int, vocab: int, rows: int, tp: int = 1,
             head: bool = True, repeat: int = 1) -> Work:
    """``layers`` GPT blocks (and, with ``head``, the embeddings, final norm, output
    layer and loss) on ``rows`` windows of ``seq`` tokens, ``repeat`` times."""
    t = rows * seq
    attn, ffn = tp_widths(d, 4 * d, heads, tp)
    gemms = block_gemms(t, d, attn, ffn, layers * repeat)
    elem = layers * block_elementwise_bytes(t, d, attn, ffn)
    if head:
        gemms += linear_gemms(t, d, vocab, repeat)
        elem += model_elementwise_bytes(t, d, vocab)
    hd = d // heads
    return Work(tuple(merge(gemms)), ((rows, attn // hd, seq, hd, layers * repeat),),
                (t, d, ffn), elem * repeat)


def ddp_work(d: int, layers: int, heads: int, seq: int, vocab: int, batch: int, params: int,
             reducer: bool) -> Work:
    """bench-ddp's step on one rank: the whole GPT on ``batch`` windows, AdamW over
    every parameter, and with ``reducer`` the DDP bucket copies."""
    w = gpt_work(d, layers, heads, seq, vocab, batch)
    return Work(w.gemms, w.attention, w.probe, w.elementwise_bytes, adamw_bytes(params),
                bucket_copy_bytes(params) if reducer else 0.0)


def tp_work(d: int, tokens: int, tp: int) -> Work:
    """bench-tp's GPT block on one rank of ``tp``: forward and backward of the block on
    ``tokens`` tokens in 64-token windows, plus its loss y.pow(2).mean() (read and write
    (T, d) forward, 3 passes backward: 6 T d elements)."""
    rows = max(1, tokens // TP_WINDOW)
    w = gpt_work(d, 1, max(1, d // 64), TP_WINDOW, 1, rows, tp, head=False)
    loss = 6 * F32 * rows * TP_WINDOW * d
    return Work(w.gemms, w.attention, w.probe, w.elementwise_bytes + loss)


def pp_work(d: int, layers: int, heads: int, seq: int, vocab: int, mb_rows: int, m: int) -> Work:
    """bench-pp's 1F1B step, the whole model over all ``m`` micro-batches (the step
    model gives each of the ``pp`` stages 1/pp of it); no optimizer step."""
    return gpt_work(d, layers, heads, seq, vocab, mb_rows, repeat=m)


def spec_for(works) -> dict:
    """The calibration spec (``calibrate`` module) measuring every shape in ``works``."""
    gemm, att, probe = {}, {}, {}
    for w in works:
        for g in w.gemms:
            gemm[g.key] = [g.m, g.k, g.n, g.layout]
        for a in w.attention:
            att[a[:4]] = list(a[:4])
        probe[w.probe] = list(w.probe)
    return {"gemm": list(gemm.values()), "attention": list(att.values()),
            "probe": list(probe.values()), "stream_mib": 64.0}


def price(work: Work, calib: dict, oncore: bool = False) -> dict[str, float]:
    """Seconds of one rank's step by part, from the calibration's rates; with each
    rank's own figures ("per_rank") the slowest rank's, as the benches time a step
    by its slowest rank. A shape the calibration lacks is a ValueError naming it.

    ``oncore``: each rank's CPU-time rates over its share of a core during the
    bench (``bench_share``): the work at the speed of a held core, stretched by
    the load the bench saw, instead of by the load the calibration saw.
    """
    if oncore:
        rows, shares = calib.get("per_rank") or [calib], calib.get("bench_share")
        if not shares or len(shares) != len(rows) or any("oncore" not in r for r in rows):
            raise ValueError("oncore pricing needs a calibration from plan --calibrate ... --then")
        return max((_stretch(_price_one(work, r["oncore"]), sh) for r, sh in zip(rows, shares)),
                   key=lambda p: p["compute"] + p["optimizer"] + p["bucket"])
    if calib.get("per_rank"):
        return max((_price_one(work, r) for r in calib["per_rank"]),
                   key=lambda p: p["compute"] + p["optimizer"] + p["bucket"])
    return _price_one(work, calib)


def _stretch(p: dict[str, float], share: float) -> dict[str, float]:
    if not 0 < share:
        raise ValueError(f"a share of a core must be positive, got {share}")
    f = 1 / min(1.0, share)  # a share above 1 is the comm thread's: the step's core is whole
    return {k: (v * f if k in _SECONDS else v / f) for k, v in p.items()}


_SECONDS = ("gemm", "attention", "elementwise", "compute", "optimizer", "bucket")


def _price_one(work: Work, calib: dict) -> dict[str, float]:
    def lookup(part: str, key: str) -> float:
        try:
            return calib[part][key]
        except KeyError:
            raise ValueError(f"the calibration has no {part} figure for {key}: measure "
                             f"the run's spec (local_work.spec_for)") from None

    att = sum(a[4] * lookup("attention", shape_key(a[:4])) for a in work.attention)
    bw = lookup("probe", shape_key(work.probe))
    host = host_seconds(work.gemms, lambda g: lookup("gemm", gemm_key(g)), att,
                        work.elementwise_bytes, bw)
    gemm_flops = sum(g.flops for g in work.gemms)
    return {"gemm": host["gemm"], "attention": att, "elementwise": host["elementwise"],
            "compute": host["total"], "optimizer": work.optimizer_bytes / calib["stream_bw"],
            "bucket": work.bucket_bytes / calib["stream_bw"],
            "gemm_rate": gemm_flops / host["gemm"] if host["gemm"] else 0.0,
            "elementwise_bw": bw}
