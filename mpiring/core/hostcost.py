"""What one training step of the project's GPT costs on a CPU host, priced op by op.

The GPU model (``steptime``) prices compute as FLOPs / (peak x one efficiency)
and the memory-bound work as passes over Korthikanti's activation bytes. On a
CPU with one thread per rank neither constant carries over: a GEMM's rate
depends on its shape (and on the cache it fits in), and GELU's erf or
LayerNorm's two reductions run well below the streaming bandwidth. So the host
model lists the work a step does, each piece with the shape it runs at:

* ``linear_gemms``: the three matrix multiplies of every ``nn.Linear``
  (forward, input gradient, weight gradient), each with the operand layout
  autograd uses, so that each can be timed at exactly that shape;
* ``block_elementwise_bytes`` / ``model_elementwise_bytes``: the bytes the
  memory-bound passes of a block / of the embeddings, final norm and loss move;
* ``adamw_bytes``, ``bucket_copy_bytes``: the optimizer's and the DDP
  reducer's passes over every parameter;

and ``host_seconds`` adds them up with the rates measured on the host
(``mpiring.tools.plan.calibrate``). Every count is derived from the code it
prices (mpiring.tools.models.gpt, torch's autograd formulas); the derivation
is in each docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mpiring.core.chunking import chunk_bounds

#: Bytes per element: every run priced here is float32.
F32 = 4


@dataclass(frozen=True)
class Gemm:
    """One matrix multiply (m x k) @ (k x n), ``count`` times per step.

    ``layout`` is how autograd lays the operands out: "nt" is x @ W.t() (the
    forward), "nn" is g @ W (the input gradient), "tn" is g.t() @ x (the
    weight gradient). The same FLOPs run at different speeds in each.
    """

    m: int
    k: int
    n: int
    layout: str = "nt"
    count: int = 1

    @property
    def flops(self) -> float:
        """2 m k n per multiply (one multiply and one add per term), times ``count``."""
        return 2.0 * self.m * self.k * self.n * self.count

    @property
    def key(self) -> tuple[int, int, int, str]:
        return (self.m, self.k, self.n, self.layout)


def linear_gemms(tokens: int, fan_in: int, fan_out: int, count: int = 1) -> list[Gemm]:
    """The three GEMMs of ``y = x W^T + b`` on ``tokens`` rows, forward and backward.

    Forward (T x in) @ (in x out); backward dX = dY W: (T x out) @ (out x in),
    dW = dY^T X: (out x T) @ (T x in) (torch's AddmmBackward). 3 x 2 T in out FLOPs.
    """
    if min(tokens, fan_in, fan_out, count) < 1:
        raise ValueError(f"linear of {tokens} tokens, {fan_in} -> {fan_out}, x{count}: "
                         "every size must be >= 1")
    return [Gemm(tokens, fan_in, fan_out, "nt", count), Gemm(tokens, fan_out, fan_in, "nn", count),
            Gemm(fan_out, tokens, fan_in, "tn", count)]


def shard(n: int, tp: int) -> int:
    """The largest of ``tp`` parts of n (rank 0's, numpy.array_split's order): the
    rank the others wait for."""
    if tp < 1 or n < 0:
        raise ValueError(f"shard({n}, {tp}): need n >= 0 and tp >= 1")
    lo, hi = chunk_bounds(n, tp)[0]
    return hi - lo


def tp_widths(d: int, ffn: int, heads: int, tp: int = 1) -> tuple[int, int]:
    """(attention width, MLP width) on rank 0 of ``tp``: whole heads of d/heads each
    (mpiring's TensorParallelBlock splits QKV by heads), and ffn/tp MLP units."""
    if min(d, ffn, heads, tp) < 1 or d % heads:
        raise ValueError(f"d={d}, ffn={ffn}, heads={heads}, tp={tp}: need positive sizes "
                         "and heads dividing d")
    return d // heads * shard(heads, tp), shard(ffn, tp)


def block_gemms(tokens: int, d: int, attn: int, ffn: int, layers: int = 1) -> list[Gemm]:
    """A GPT block's linears on one rank: qkv d -> 3 attn, proj attn -> d, fc d -> ffn,
    out ffn -> d, with ``attn`` and ``ffn`` this rank's widths (``tp_widths``): the
    column-parallel linears keep their share of the outputs, the row-parallel ones
    of the inputs (Shoeybi et al. 2019, §3). Without TP, attn = d."""
    out: list[Gemm] = []
    for fan_in, fan_out in ((d, 3 * attn), (attn, d), (d, ffn), (ffn, d)):
        out += linear_gemms(tokens, fan_in, fan_out, layers)
    return out


def merge(gemms: Iterable[Gemm]) -> list[Gemm]:
    """The same shapes counted once each, with their counts added (order kept)."""
    seen: dict[tuple, Gemm] = {}
    for g in gemms:
        old = seen.get(g.key)
        seen[g.key] = g if old is None else Gemm(g.m, g.k, g.n, g.layout, old.count + g.count)
    return list(seen.values())


def block_elementwise_bytes(tokens: int, d: int, attn: int, ffn: int) -> float:
    """Bytes the memory-bound passes of one GPT block move, forward and backward (fp32).

    Counted per pass as elements read + written, with a = ``attn`` attention
    outputs, f = ``ffn`` MLP units and q = 3a QKV outputs on this rank
    (``tp_widths``; without TP a = d, f = 4d):

    forward   2 LayerNorms (read x, write y: 2Td each), 2 residual adds (3Td
              each), the heads' transpose back to (T, a) (2Ta), GELU (2Tf)
    backward  2 LayerNorms (read dy and x, write dx, reduce dgamma, dbeta:
              4Td each), 2 gradient sums where the residual stream forks (3Td
              each), GELU's derivative (read dy and x, write dx: 3Tf), the bias
              gradients (read dY once: T(q + d + f + d)), the transpose back
              (2Ta) and the QKV split's cat of dq, dk, dv (2Tq)

    in all T (26d + 4a + 6f + 3q) elements. The GEMMs' and attention's own reads
    and writes are in their measured times, not here.
    """
    if min(tokens, d, attn, ffn) < 1:
        raise ValueError("tokens, d, attn and ffn must be >= 1")
    a, f, q = attn, ffn, 3 * attn
    return F32 * tokens * (26 * d + 4 * a + 6 * f + 3 * q)


def model_elementwise_bytes(tokens: int, d: int, vocab: int) -> float:
    """Bytes of the passes outside the blocks: embeddings, final LayerNorm, loss (fp32).

    Token gather and position add (2Td + 3Td), their backward (index-add of dX
    into the table, 2Td; the positions' sum over the batch, Td), the final
    LayerNorm (2Td + 4Td), cross-entropy's log-softmax and its gradient (2TV +
    3TV) and the tied weight's two gradients added (3Vd): T(14d + 5V) + 3Vd.
    """
    if min(tokens, d, vocab) < 1:
        raise ValueError("tokens, d and vocab must be >= 1")
    return F32 * (tokens * (14 * d + 5 * vocab) + 3 * vocab * d)


def probe_bytes(tokens: int, d: int, ffn: int) -> float:
    """Bytes of the elementwise probe ``calibrate`` times: a LayerNorm forward and
    backward on (T, d) (6Td), GELU forward and backward on (T, ffn) (5T ffn) and
    an add on (T, d) (3Td), by the counts of ``block_elementwise_bytes``."""
    return F32 * tokens * (9 * d + 5 * ffn)


def adamw_bytes(n_params: int) -> float:
    """AdamW reads the parameter, gradient and both moments and writes the parameter
    and both moments: 7 x 4 bytes per fp32 parameter (Loshchilov and Hutter 2019,
    Algorithm 2; torch's fused kernel makes it one pass)."""
    return 7.0 * F32 * n_params


def bucket_copy_bytes(n_params: int) -> float:
    """The DDP reducer's passes over every gradient: copied into its bucket, divided
    by the ranks in place, copied back to ``.grad`` (mpiring.parallel.data): 3 x
    (read + write) x 4 bytes per fp32 parameter."""
    return 3 * 2.0 * F32 * n_params


def host_seconds(gemms: Iterable[Gemm], rate_of: Callable[[Gemm], float],
                 attention_s: float = 0.0, elementwise_bytes: float = 0.0,
                 elementwise_bw: float = 1.0, stream_bytes: float = 0.0,
                 stream_bw: float = 1.0) -> dict[str, float]:
    """Seconds of one rank's work: each GEMM's FLOPs over its shape's measured rate,
    attention as measured, the elementwise bytes over the probe's bandwidth and the
    whole-parameter passes (optimizer, buckets) over the streaming bandwidth."""
    if min(elementwise_bw, stream_bw) <= 0:
        raise ValueError("bandwidths must be positive")
    gemm = 0.0
    for g in gemms:
        rate = rate_of(g)
        if not rate > 0:
            raise ValueError(f"no positive FLOP rate for GEMM {g.key}: measure it first")
        gemm += g.flops / rate
    parts = {"gemm": gemm, "attention": attention_s,
             "elementwise": elementwise_bytes / elementwise_bw, "stream": stream_bytes / stream_bw}
    return {**parts, "total": sum(parts.values())}
