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

Partners combine the same two values, and both put the lower rank's operand
first (``ufunc(lower, upper)``), so every rank ends with bit-identical results:
``a+b`` and ``b+a`` are equal in IEEE arithmetic, but ``max(0.0, -0.0)`` and
``max(-0.0, 0.0)`` (or ``max`` of two NaNs) are not, they return the first operand.

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

from mpiring.core.ops import finish, ufunc
from mpiring.runtime.trace import clock


def recursive_doubling_all_reduce(be, x, op: str, trace, phase: str = "doubling"):
    """Reduce ``x`` over all ranks in place by recursive doubling; every rank gets the result."""
    rank, size = be.rank, be.size
    if size > 1 and x.size > 0:
        p = 1 << (size.bit_length() - 1)  # largest power of two <= K
        rem = size - p
        combine = ufunc(op)
        buffer = be.scratch(x, x.size)
        # Small messages are this algorithm's domain: with tracing off, no clock reads.
        step = _Recorder(trace, x.size * x.itemsize)
        # Fold: even ranks below 2*rem hand their data to the odd rank above them.
        if rank < 2 * rem:
            if rank % 2 == 0:
                t0 = step.now()
                be.send(x, rank + 1)
                step("fold", 0, 1, t0, t0, dst=rank + 1)
                vrank = -1  # out until the unfold
            else:
                t0 = step.now()
                be.wait(be.irecv(buffer, rank - 1))
                t1 = step.now()
                combine(buffer, x, out=x)  # the lower rank's operand first, as below
                step("fold", 0, 1, t0, t1, src=rank - 1)
                vrank = rank // 2
        else:
            vrank = rank - rem
        if vrank >= 0:
            steps = p.bit_length() - 1
            for s in range(steps):
                vpartner = vrank ^ (1 << s)
                partner = 2 * vpartner + 1 if vpartner < rem else vpartner + rem
                t0 = step.now()
                be.sendrecv(x, partner, buffer, partner)
                t1 = step.now()
                # Both partners compute ufunc(lower rank's x, upper rank's x): with the
                # operands in each rank's own order, max/min of 0.0 and -0.0 (or of two
                # NaNs) would leave the partners holding different bits.
                if partner > rank:
                    combine(x, buffer, out=x)
                else:
                    combine(buffer, x, out=x)
                step(phase, s, steps, t0, t1, dst=partner, src=partner)
        # Unfold: the odd ranks give the result back to the even ones that folded.
        if rank < 2 * rem:
            t0 = step.now()
            if rank % 2 == 0:
                be.wait(be.irecv(x, rank + 1))
                step("unfold", 0, 1, t0, step.now(), src=rank + 1)
            else:
                be.send(x, rank - 1)
                step("unfold", 0, 1, t0, t0, dst=rank - 1)
    finish(op, x, size)
    return x


class _Recorder:
    """``trace.step`` with this algorithm's fields; clock reads only when tracing."""

    __slots__ = ("trace", "nbytes", "now")

    def __init__(self, trace, nbytes: int):
        self.trace = trace
        self.nbytes = nbytes
        self.now = clock if trace.enabled else _zero

    def __call__(self, phase, i, n, t0, t1, dst=None, src=None):
        if not self.trace.enabled:  # the watchdog still learns which step finished
            self.trace.step(phase, i, n)
            return
        self.trace.step(phase, i, n, dst=dst, src=src,
                        bytes_sent=self.nbytes if dst is not None else 0,
                        bytes_recv=self.nbytes if src is not None else 0,
                        t_start=t0, t_recv=t1, t_end=clock())


def _zero() -> float:
    return 0.0
