r"""Recursive-doubling AllReduce: the latency-optimal algorithm for small messages.

The ring needs 2(K-1) steps, each paying the per-message latency alpha. For a
message of a few KiB alpha is all there is, so fewer steps win even if every
step moves the whole message. Recursive doubling pairs ranks at distance 1, 2,
4, ...; partners swap their whole buffers and both add, so after step s every
rank holds the sum over a block of 2^(s+1) ranks. K = 8::

    step 0 (distance 1):   r0<->r1   r2<->r3   r4<->r5   r6<->r7
    step 1 (distance 2):   r0<->r2   r1<->r3   r4<->r6   r5<->r7
    step 2 (distance 4):   r0<->r4   r1<->r5   r2<->r6   r3<->r7

    step | r0 holds after the step
    -----+---------------------------
      0  | x0+x1
      1  | x0+x1+x2+x3
      2  | x0+...+x7                  (every rank: the same sum)

Partners add the same two values (a+b on one side, b+a on the other), so every
rank ends with bit-identical results.

K not a power of two: let p be the largest power of two <= K and rem = K - p.
First the 2*rem lowest ranks *fold* in pairs: each even rank r sends its buffer
to r+1 and drops out. The p remaining ranks (renumbered 0..p-1) run recursive
doubling, and at the end each odd rank r < 2*rem sends the result back to r-1
(*unfold*). K = 5 (p = 4, rem = 1)::

    fold:     r0 ──▶ r1                      (r0 waits)
    doubling: among r1 r2 r3 r4              (2 steps)
    unfold:   r1 ──▶ r0

Cost, per rank on the critical path, for M bytes::

    T = (log2 p + 2[K != p]) (alpha + M / B)  +  log2 p * M * gamma

versus the ring's 2(K-1)(alpha + M/(K B)): fewer latencies (log2 K vs 2(K-1)),
but the whole message every step, so it loses once M/B outgrows alpha.
"""

from __future__ import annotations

from mpiring.collectives.folding import StepRecorder, fold, real_rank, unfold
from mpiring.core.ops import finish, reducer


def recursive_doubling_all_reduce(be, x, op: str, trace, phase: str = "doubling"):
    """Reduce ``x`` over all ranks in place by recursive doubling; every rank gets the result."""
    size = be.size
    if size > 1 and x.size > 0:
        p = 1 << (size.bit_length() - 1)  # largest power of two <= K
        rem = size - p
        reduce = reducer(op)
        buffer = be.scratch(x, x.size)
        step = StepRecorder(trace, x.itemsize)
        vrank = fold(be, x, buffer, reduce, rem, step)
        if vrank >= 0:
            steps = p.bit_length() - 1
            for s in range(steps):
                partner = real_rank(vrank ^ (1 << s), rem)
                t0 = step.now()
                be.sendrecv(x, partner, buffer, partner)
                t1 = step.now()
                reduce(x, buffer)
                step(phase, s, steps, t0, t1, dst=partner, src=partner, sent=x.size, got=x.size)
        unfold(be, x, rem, step)
    finish(op, x, size)
    return x
