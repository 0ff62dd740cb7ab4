r"""Halving-doubling AllReduce (Rabenseifner): the ring's bytes in log2 K steps.

Recursive doubling (``recursive_doubling.py``) needs only log2 K steps but moves
the whole message in each; the ring moves only 2(K-1)/K of it but needs 2(K-1)
steps. Halving-doubling gets both: a ReduceScatter by *recursive halving*, then
an AllGather by *recursive doubling*, each log2 K steps. K = 4, buffer [A|B|C|D]::

    reduce-scatter (halving)                 all-gather (doubling)
    step 0, distance 2: r0<->r2, r1<->r3     step 0, distance 1: r0<->r1, r2<->r3
      r0,r1 keep [A|B], send [C|D]             r0 sends A, gets B  -> r0: [A|B]
      r2,r3 keep [C|D], send [A|B]             r2 sends C, gets D  -> r2: [C|D]
    step 1, distance 1: r0<->r1, r2<->r3     step 1, distance 2: r0<->r2, r1<->r3
      r0 keeps A (sends B), r1 keeps B ...     r0 sends [A|B], gets [C|D] -> all of it

    step | bytes each rank sends | what rank 0 then holds reduced
    -----+-----------------------+-------------------------------
     RS0 |        M/2            | [A|B] partly (2 of 4 ranks)
     RS1 |        M/4            | A, over all 4 ranks
     AG0 |        M/4            | A, B
     AG1 |        M/2            | A, B, C, D

Every step is one exchange with one partner (Sendrecv) followed, in the
ReduceScatter, by one add of the received half into the half we keep. Partners
always hold the same interval before a step, so both cut it at the same place.

K not a power of two: as in recursive doubling, the 2*rem lowest ranks fold in
pairs first (even r sends everything to r+1) and get the result back at the end.

Cost for M bytes, K = p a power of two::

    T = 2 log2(K) alpha + 2 (K-1)/K M/B + (K-1)/K M gamma

the ring's bandwidth term with recursive doubling's latency term (plus
2(alpha + M/B) for the fold and unfold when K is not a power of two).
"""

from __future__ import annotations

from mpiring.core.ops import finish, reducer
from mpiring.runtime.trace import clock


def halving_doubling_all_reduce(be, x, op: str, trace):
    """Reduce ``x`` over all ranks in place by recursive halving then doubling."""
    rank, size = be.rank, be.size
    if size == 1 or x.size == 0:
        finish(op, x, size)
        return x
    p = 1 << (size.bit_length() - 1)  # largest power of two <= K
    rem = size - p
    steps = p.bit_length() - 1
    reduce = reducer(op)
    buffer = be.scratch(x, x.size)
    tracing = trace.enabled
    now = clock if tracing else _zero
    item = x.itemsize

    def record(phase, i, n, t0, t1, dst=None, src=None, sent=None, got=None):
        """``sent``/``got``: the (start, end) elements sent and received; the trace keeps
        them so that explain can replay which part of the buffer each step moved."""
        if not tracing:  # the watchdog still learns which step finished
            trace.step(phase, i, n)
            return
        trace.step(phase, i, n, dst=dst, src=src,
                   bytes_sent=(sent[1] - sent[0]) * item if sent else 0,
                   bytes_recv=(got[1] - got[0]) * item if got else 0,
                   t_start=t0, t_recv=t1, t_end=clock(), send_range=sent, recv_range=got)

    # Fold: even ranks below 2*rem hand their data to the odd rank above them.
    vrank = rank - rem
    if rank < 2 * rem:
        t0 = now()
        if rank % 2 == 0:
            be.send(x, rank + 1)
            record("fold", 0, 1, t0, t0, dst=rank + 1, sent=(0, x.size))
            vrank = -1  # out until the unfold
        else:
            be.wait(be.irecv(buffer, rank - 1))
            t1 = now()
            reduce(x, buffer)
            record("fold", 0, 1, t0, t1, src=rank - 1, got=(0, x.size))
            vrank = rank // 2
    if vrank >= 0:
        def real(v: int) -> int:  # virtual rank -> rank
            return 2 * v + 1 if v < rem else v + rem

        lo, hi = 0, x.size
        kept = []  # (lo, hi) before each halving, to retrace them while doubling
        for i in range(steps):  # distance p/2, p/4, ..., 1
            d = p >> (i + 1)
            partner = real(vrank ^ d)
            mid = (lo + hi + 1) // 2
            kept.append((lo, hi))
            if vrank & d:  # upper half stays here, lower half goes
                (s0, s1), (lo, hi) = (lo, mid), (mid, hi)
            else:
                (s0, s1), (lo, hi) = (mid, hi), (lo, mid)
            t0 = now()
            be.sendrecv(x[s0:s1], partner, buffer[:hi - lo], partner)
            t1 = now()
            reduce(x[lo:hi], buffer[:hi - lo])
            record("reduce-scatter", i, steps, t0, t1, dst=partner, src=partner,
                   sent=(s0, s1), got=(lo, hi))
        finish(op, x[lo:hi], size)  # our block is final: divide once, before it spreads
        for i in range(steps):  # distance 1, 2, ..., p/2: the halvings in reverse
            d = 1 << i
            partner = real(vrank ^ d)
            plo, phi = kept[steps - 1 - i]
            r0, r1 = (plo, lo) if lo > plo else (hi, phi)  # the partner's half
            t0 = now()
            be.sendrecv(x[lo:hi], partner, x[r0:r1], partner)
            record("all-gather", i, steps, t0, now(), dst=partner, src=partner,
                   sent=(lo, hi), got=(r0, r1))
            lo, hi = plo, phi
    # Unfold: the odd ranks give the result back to the even ones that folded.
    if rank < 2 * rem:
        t0 = now()
        if rank % 2 == 0:
            be.wait(be.irecv(x, rank + 1))
            record("unfold", 0, 1, t0, now(), src=rank + 1, got=(0, x.size))
        else:
            be.send(x, rank - 1)
            record("unfold", 0, 1, t0, t0, dst=rank - 1, sent=(0, x.size))
    return x


def _zero() -> float:
    return 0.0
