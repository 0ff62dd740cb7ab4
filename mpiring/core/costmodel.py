r"""The lecture's alpha-beta cost model, fitted from a measured ping-pong.

A message of n bytes between two neighbours costs

    t(n) = alpha + n / beta            (alpha: latency in s, beta: bandwidth in B/s)

and a collective made of steps costs the sum over its sequential steps. With K
ranks and M (or N) bytes per rank the lecture's formulas are:

    ring AllReduce          2(K-1) (alpha + M/(K beta))
    ring ReduceScatter       (K-1) (alpha + M/(K beta))      (AllGather the same)
    naive ring Broadcast     (K-1) (alpha + N/beta)
    pipelined Broadcast    (K-2+S) (alpha + N/(S beta))       S chunks
    parameter server        2(K-1) (alpha + M/beta)           push + pull at the server
    recursive doubling      log2 K (alpha + M/beta)           (K a power of two)
    halving-doubling        2 log2 K alpha + 2(K-1)/K M/beta   (K a power of two)

The ring Reduce is the Broadcast run backwards and costs the same. The parameter
server's cost is set by its own link: in the push it receives a full M from each
of the K-1 other workers, in the pull it sends M to each of them, one after the
other.

The best pipeline depth minimises (K-2+S)(alpha + N/(S beta)); setting the
derivative in S to zero gives

    S* = sqrt((K-2) N / (alpha beta))

(for K = 2 there is nothing to overlap and S* = 1).

Everything here is a pure function of numbers: the tests check it on synthetic
data without MPI.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: nccl-tests' bus-bandwidth factors: busbw = algbw * factor(K). They turn the
#: algorithm bandwidth (bytes / time) into the bandwidth each link must carry, so
#: that one number compares across collectives and rank counts.
BUSBW_FACTORS = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "all_gather": lambda k: (k - 1) / k,
    "broadcast": lambda k: 1.0,
    "reduce": lambda k: 1.0,
}


def busbw_factor(collective: str, k: int) -> float:
    """nccl-tests' factor for ``collective`` on ``k`` ranks (0 when k == 1: nothing moves)."""
    if collective not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(BUSBW_FACTORS)}")
    return 0.0 if k <= 1 else float(BUSBW_FACTORS[collective](k))


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted point-to-point cost: ``alpha + n / beta`` seconds for n bytes.

    Attributes:
        alpha: latency per message in seconds.
        beta: bandwidth in bytes per second.
        fit_error: median relative error of the fit over the measured points.
        source: how it was measured ("pair", "ring", "synthetic"...).
    """

    alpha: float
    beta: float
    fit_error: float = 0.0
    source: str = ""

    def time(self, nbytes: float) -> float:
        """Seconds for one message of ``nbytes``."""
        return self.alpha + nbytes / self.beta

    def describe(self) -> str:
        """``alpha = 35.0 us, beta = 3.61 GB/s (median fit error 7%)``."""
        return (f"alpha = {self.alpha * 1e6:.1f} us, beta = {self.beta / 1e9:.2f} GB/s "
                f"(median fit error {self.fit_error * 100:.0f}%)")


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], *,
                   relative: bool = True, source: str = "") -> AlphaBeta:
    """Least-squares fit of ``t = alpha + n / beta`` to measured (size, time) points.

    Args:
        sizes: message sizes in bytes.
        times: one-way times in seconds (half a ping-pong round trip).
        relative: weight each point by 1/t, i.e. minimise relative errors. Plain
            least squares over a sweep from 8 B to 64 MiB is decided by the
            largest messages alone and can return a negative latency; weighting
            lets the small messages pin alpha and the large ones beta.
        source: a label kept in the result.

    Returns:
        The fit. A negative latency is clamped to 0 (bandwidth refitted through
        the origin).

    Raises:
        ValueError: fewer than two distinct sizes, non-positive times, or times
            that do not grow with size (measure larger messages).
    """
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if n.shape != t.shape or n.ndim != 1:
        raise ValueError("sizes and times must be 1-D sequences of the same length")
    if np.unique(n).size < 2:
        raise ValueError("need at least two distinct message sizes to fit alpha and beta")
    if (t <= 0).any() or not np.isfinite(t).all():
        raise ValueError("times must be positive and finite (seconds)")
    w = 1.0 / t if relative else np.ones_like(t)
    design = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    if alpha < 0:  # a latency cannot be negative: fit the slope alone
        alpha = 0.0
        inv_beta = float(np.sum(w * w * n * t) / np.sum(w * w * n * n))
    if inv_beta <= 0:
        raise ValueError("times do not grow with message size, so no bandwidth can be "
                         "fitted: include larger messages (1 MiB and up) in the ping-pong")
    model = alpha + n * inv_beta
    err = float(np.median(np.abs(model - t) / t))
    return AlphaBeta(float(alpha), float(1.0 / inv_beta), err, source)


# --- the lecture's formulas ----------------------------------------------------
def ring_all_reduce(m: float, k: int, ab: AlphaBeta) -> float:
    """2(K-1)(alpha + M/(K beta)): ReduceScatter then AllGather, K-1 steps each."""
    return 0.0 if k <= 1 else 2 * (k - 1) * ab.time(m / k)


def ring_reduce_scatter(m: float, k: int, ab: AlphaBeta) -> float:
    """(K-1)(alpha + M/(K beta))."""
    return 0.0 if k <= 1 else (k - 1) * ab.time(m / k)


ring_all_gather = ring_reduce_scatter


def ring_broadcast(n: float, k: int, ab: AlphaBeta) -> float:
    """(K-1)(alpha + N/beta): the whole message hop by hop."""
    return 0.0 if k <= 1 else (k - 1) * ab.time(n)


def pipelined_broadcast(n: float, k: int, s: int, ab: AlphaBeta) -> float:
    """(K-2+S)(alpha + N/(S beta)): S chunks in flight along K-1 links."""
    if s < 1:
        raise ValueError(f"chunks S must be >= 1, got {s}")
    return 0.0 if k <= 1 else (k - 2 + s) * ab.time(n / s)


def parameter_server(m: float, k: int, ab: AlphaBeta) -> float:
    """2(K-1)(alpha + M/beta): K-1 pushes into, then K-1 pulls out of, the server's link."""
    return 0.0 if k <= 1 else 2 * (k - 1) * ab.time(m)


def _pow2_below(k: int) -> int:
    return 1 << (k.bit_length() - 1)


def recursive_doubling_all_reduce(m: float, k: int, ab: AlphaBeta) -> float:
    """(log2 p + 2[K != p])(alpha + M/beta), p the largest power of two <= K.

    Whole buffers swapped at distance 1, 2, 4...; a fold into and an unfold out
    of the power-of-two group when K is not one (``collectives/recursive_doubling.py``).
    """
    if k <= 1:
        return 0.0
    p = _pow2_below(k)
    return (p.bit_length() - 1 + (2 if k != p else 0)) * ab.time(m)


def halving_doubling_all_reduce(m: float, k: int, ab: AlphaBeta) -> float:
    """2 log2(p) alpha + 2(p-1)/p M/beta (+ 2(alpha + M/beta) when K is not a power of two).

    Rabenseifner: ReduceScatter by recursive halving, AllGather by recursive
    doubling: the ring's bytes in 2 log2 K steps (``collectives/halving_doubling.py``).
    """
    if k <= 1:
        return 0.0
    p = _pow2_below(k)
    t = 2 * (p.bit_length() - 1) * ab.alpha + 2 * (p - 1) / p * m / ab.beta
    return t + (2 * ab.time(m) if k != p else 0.0)


def best_chunks(n: float, k: int, ab: AlphaBeta, max_chunks: int | None = None) -> int:
    """The S that minimises the pipelined Broadcast time: S* = sqrt((K-2)N/(alpha beta)).

    The continuous optimum is rounded to whichever neighbouring integer the model
    prefers, and kept within ``1..max_chunks`` (a chunk needs at least one element).
    """
    if k <= 2 or n <= 0:
        return 1
    if ab.alpha <= 0:  # no latency: more chunks are always better
        best = max_chunks or max(1, int(n))
    else:
        s_star = math.sqrt((k - 2) * n / (ab.alpha * ab.beta))
        lo, hi = max(1, math.floor(s_star)), max(1, math.ceil(s_star))
        best = min((lo, hi), key=lambda s: pipelined_broadcast(n, k, s, ab))
    if max_chunks is not None:
        best = min(best, max_chunks)
    return max(1, best)


def predict(collective: str, algo: str, nbytes: float, k: int, ab: AlphaBeta,
            chunks: int | None = None) -> float | None:
    """The model's time for one measured row, or None when the model has no formula.

    Args:
        collective: all_reduce, reduce_scatter, all_gather, broadcast, reduce.
        algo: "ring", "pipelined" (needs ``chunks``), "recursive-doubling",
            "halving-doubling", or "ps" (all_reduce through a parameter server).
            Other algorithms (native, gloo, auto, ring-seg...) have no formula
            here: their schedule is the library's own or picked at run time.
        nbytes: the buffer size (M or N).
        k: ranks.
        chunks: S for "pipelined".
    """
    if algo == "ps" and collective == "all_reduce":
        return parameter_server(nbytes, k, ab)
    if algo == "recursive-doubling" and collective == "all_reduce":
        return recursive_doubling_all_reduce(nbytes, k, ab)
    if algo == "halving-doubling" and collective == "all_reduce":
        return halving_doubling_all_reduce(nbytes, k, ab)
    if algo == "ring":
        if collective == "all_reduce":
            return ring_all_reduce(nbytes, k, ab)
        if collective in ("reduce_scatter", "all_gather"):
            return ring_reduce_scatter(nbytes, k, ab)
        if collective in ("broadcast", "reduce"):
            return ring_broadcast(nbytes, k, ab)
    if algo == "pipelined" and collective in ("broadcast", "reduce") and chunks:
        return pipelined_broadcast(nbytes, k, int(chunks), ab)
    return None


def prediction_error(measured: float, predicted: float | None) -> float | None:
    """(measured - predicted) / predicted; positive when the run was slower than the model."""
    if predicted is None or predicted <= 0:
        return None
    return (measured - predicted) / predicted


def model_fields(measured: float, predicted: float | None) -> dict[str, float | None]:
    """A bench row's ``model_us`` and ``model_err`` for a call that took ``measured`` s."""
    return {"model_us": predicted * 1e6 if predicted is not None else None,
            "model_err": prediction_error(measured, predicted)}


# --- traffic: what the lecture says each rank sends ---------------------------------
def expected_traffic(method: str, m: float, k: int) -> dict[str, float]:
    """Bytes the lecture predicts per worker and at the server for one gradient sync.

    Args:
        method: "ring" (ring AllReduce), "ps" (star parameter server: every
            worker pushes M to the server and pulls M back) or "ps-ring"
            (Reduce + Broadcast along the ring).
        m: gradient bytes per worker.
        k: ranks; the server (rank 0) is also a worker.

    Returns:
        ``worker_sent``, ``worker_recv`` (the busiest worker other than the
        server), ``server_sent``, ``server_recv``.
    """
    if k <= 1:
        return dict.fromkeys(("worker_sent", "worker_recv", "server_sent", "server_recv"), 0.0)
    if method == "ring":
        per = 2 * (k - 1) * m / k  # about 2M, whatever K
        return {"worker_sent": per, "worker_recv": per, "server_sent": per, "server_recv": per}
    if method == "ps":
        return {"worker_sent": m, "worker_recv": m,
                "server_sent": (k - 1) * m, "server_recv": (k - 1) * m}
    if method == "ps-ring":
        # Reduce: every rank but the root sends M once, every rank but the first
        # one after the root receives M; Broadcast: the mirror image. The busiest
        # worker (K >= 3) sends and receives 2M; the server M each way.
        busiest = 2 * m if k >= 3 else m
        return {"worker_sent": busiest, "worker_recv": busiest, "server_sent": m, "server_recv": m}
    raise ValueError(f"unknown method {method!r}: use ring, ps or ps-ring")


# --- the memory-bandwidth bound on one host ---------------------------------------
@dataclass(frozen=True)
class MemoryBound:
    """What a single core can move, and how many cores the job's ranks share.

    Attributes:
        copy_bw: single-core memcpy bandwidth, bytes/s.
        reduce_bw: single-core ``dst += src`` bandwidth, bytes of ``dst`` per second.
        cores: cores the ranks on this host share (min(ranks per host, CPUs)).
    """

    copy_bw: float
    reduce_bw: float
    cores: int

    def describe(self) -> str:
        return (f"single-core memcpy {self.copy_bw / 1e9:.1f} GB/s, add "
                f"{self.reduce_bw / 1e9:.1f} GB/s, {self.cores} core(s) shared by the ranks")


def _work_per_byte(collective: str, k: int) -> tuple[float, float, float, float]:
    """(copied, reduced) bytes per byte of buffer: in total, and on the busiest rank."""
    f = (k - 1) / k
    if collective == "all_reduce":
        return 2 * (k - 1), k - 1, 2 * f, f
    if collective == "reduce_scatter":
        return k - 1, k - 1, f, f
    if collective == "all_gather":
        return k - 1, 0.0, f, 0.0
    if collective == "broadcast":
        return k - 1, 0.0, 1.0, 0.0
    if collective == "reduce":
        return k - 1, k - 1, 1.0, 1.0
    raise ValueError(f"unknown collective {collective!r}")


def membw_busbw_bound(collective: str, k: int, bound: MemoryBound) -> float | None:
    """The highest busbw one host's memory system allows, in bytes/s (None for K = 1).

    On one host every byte a rank "sends" is a copy from its memory into the
    receiver's, made by a CPU core; every byte it reduces is one pass of an add.
    Counting the least work any algorithm must do for a buffer of S bytes (each
    transferred byte copied once, each reduced byte added once), at single-core
    memcpy and add speed:

        T >= max( total work / cores , work of the busiest rank )

    and busbw = factor * S / T gives the bound. Examples: AllReduce moves
    2(K-1)/K S and adds (K-1)/K S per rank, so with K ranks on C >= K cores the
    bound is 1 / (1/copy + 1/(2 add)); with 4 ranks on 2 cores, half that.
    A library that copies twice (through a shared-memory bounce buffer) can
    reach at most about half of the bound.
    """
    if k <= 1:
        return None
    copied, reduced, copied_1, reduced_1 = _work_per_byte(collective, k)
    total = copied / bound.copy_bw + reduced / bound.reduce_bw
    busiest = copied_1 / bound.copy_bw + reduced_1 / bound.reduce_bw
    seconds_per_byte = max(total / max(1, min(k, bound.cores)), busiest)
    return busbw_factor(collective, k) / seconds_per_byte
