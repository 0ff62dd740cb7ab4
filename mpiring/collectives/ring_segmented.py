r"""Segmented ring: the lecture's ring with every step cut into pipelined segments.

Same ring, same chunks, same 2(K-1) steps as ``all_reduce.py`` (the literal
version, kept as the reference). What changes is *how* a step moves its chunk:

1. **Segments.** Each chunk is cut into S segments of about ``segment_bytes``.
   A segment is the unit of sending, receiving and reducing: the scratch
   buffer is ``window`` segments, not a whole chunk, and a segment travels on
   as soon as it is reduced (see ``SEGMENT_BYTES`` for why they are large).
2. **Double-buffered receives.** Receives are posted ``window`` segments ahead
   (two by default) into a ring of small scratch slots, so while segment j is
   being added, segment j+1 is already on its way.
3. **One stream of steps.** ReduceScatter and AllGather use the same index rule
   (step t sends chunk (r-t-1) mod K and receives chunk (r-t-2) mod K, for
   t = 0 .. 2K-3), and the chunk received at step t is the chunk sent at step
   t+1. So as soon as segment j of step t is reduced it is sent on as segment
   j of step t+1 (``Isend``), without waiting for the rest of the chunk. The
   last ReduceScatter step flows straight into the first AllGather step::

       step t    :  recv seg0  add seg0  recv seg1  add seg1 ...
       step t+1  :            send seg0            send seg1 ...

4. **Reduce into the destination.** The add writes straight into the chunk of
   ``x`` (``ufunc(x_seg, slot, out=x_seg)``); AllGather segments arrive straight
   in place. No allocation or copy per call; no Python work per element.

Time per rank, with S segments per chunk of M/K elements::

    T ≈ (2(K-1) + S - 1) (alpha + M/(K S B))          (vs 2(K-1)(alpha + M/(KB)))

the pipeline fills once instead of at every step, at the price of S times more
messages; ``segment_bytes`` trades one against the other.

Ordering: all messages between two neighbours use one tag and MPI never
overtakes between a pair, so segments match in the order they were posted
(step by step, segment by segment) on both sides. A receive into a region of
``x`` that an earlier ``Isend`` of ours still reads is posted only after that
send completed. This needs a backend with ``isend``; on one without it (NCCL)
the literal ring runs instead.
"""

from __future__ import annotations

from mpiring.collectives.all_gather import ring_all_gather
from mpiring.collectives.reduce_scatter import ring_reduce_scatter
from mpiring.core.chunking import chunk_bounds, ring_neighbours, ring_step_indices
from mpiring.core.ops import finish, reducer
from mpiring.runtime.trace import clock

#: Default segment size. Every segment is one rendezvous (MPICH's single-copy
#: path: ready-to-send, the receiver copies, acknowledgement), and each needs the
#: peer to be scheduled, which can cost more than the cache misses that small,
#: cache-sized segments save (docs/design-notes.md). So segments are large:
#: messages up to 8 MiB travel in one piece per step; larger ones still stream,
#: step t+1 starting while step t is being received.
SEGMENT_BYTES = 4 << 20
#: Receives posted ahead of the one being reduced (2 = double buffering).
WINDOW = 2


def segmented_all_reduce(be, x, op: str, trace, segment_bytes: int = SEGMENT_BYTES,
                         window: int = WINDOW):
    """AllReduce ``x`` in place with the segmented ring (ReduceScatter then AllGather)."""
    if not hasattr(be, "isend"):
        ring_reduce_scatter(be, x, op, trace)
        return ring_all_gather(be, x, trace)
    _ring_stream(be, x, op, trace, 0, 2 * (be.size - 1), segment_bytes, window)
    if be.size == 1:
        finish(op, x, 1)
    return x


def segmented_reduce_scatter(be, x, op: str, trace, segment_bytes: int = SEGMENT_BYTES,
                             window: int = WINDOW):
    """ReduceScatter ``x`` in place; returns the bounds of chunk ``rank`` (fully reduced)."""
    if not hasattr(be, "isend"):
        return ring_reduce_scatter(be, x, op, trace)
    size = be.size
    _ring_stream(be, x, op, trace, 0, size - 1, segment_bytes, window)
    lo, hi = chunk_bounds(x.size, size)[be.rank]
    if size == 1:
        finish(op, x[lo:hi], 1)
    return lo, hi


def segmented_all_gather(be, x, trace, segment_bytes: int = SEGMENT_BYTES,
                         window: int = WINDOW):
    """AllGather ``x`` in place (rank r provides chunk r) with the segmented ring."""
    if not hasattr(be, "isend"):
        return ring_all_gather(be, x, trace)
    _ring_stream(be, x, "sum", trace, be.size - 1, 2 * (be.size - 1), segment_bytes, window)
    return x


def _ring_stream(be, x, op, trace, first: int, stop: int, segment_bytes: int,
                 window: int) -> None:
    """Run ring steps ``first <= t < stop`` (t < K-1: ReduceScatter, else AllGather)."""
    rank, size = be.rank, be.size
    if size == 1 or x.size == 0 or stop <= first:
        return
    left, right = ring_neighbours(rank, size)
    rs_steps = size - 1
    bounds = chunk_bounds(x.size, size)
    biggest = bounds[0][1] - bounds[0][0]  # chunk 0 is never smaller than another
    nseg = max(1, -(-biggest * x.itemsize // max(1, segment_bytes)))
    # seg[c][j]: bounds of segment j of chunk c (array_split inside the chunk).
    seg = [[(a + p, a + q) for p, q in chunk_bounds(b - a, nseg)] for a, b in bounds]
    total = (stop - first) * nseg
    # A receive into x may be posted only once our Isend from that region has
    # been posted (and then completed); that holds for window <= K * nseg.
    window = max(1, min(window, size * nseg))
    slot_len = seg[0][0][1] - seg[0][0][0]
    if first < rs_steps:
        scratch = be.scratch(x, window * slot_len)
        slots = [scratch[i * slot_len:(i + 1) * slot_len] for i in range(window)]
        reduce = reducer(op)
        avg = op == "avg"
    trace = trace.ring(bounds, x.itemsize, left, right)
    sends = [None] * total  # Isend request per message, by index m = (t - first) * nseg + j
    recvs = [None] * total
    tracing = trace.enabled
    t_step = t_wait = 0.0

    posted = 0  # receives are posted strictly in message order (one tag, no overtaking)

    def post_until(stop: int, now: bool = False) -> None:
        nonlocal posted
        while posted < stop and post_recv(posted, now):
            posted += 1

    def post_recv(m: int, now: bool) -> bool:
        t, j = divmod(m, nseg)
        t += first
        a, b = seg[ring_step_indices(rank, t, size)[1]][j]
        if t < rs_steps:  # ReduceScatter: into a scratch slot, added afterwards
            recvs[m] = be.irecv(slots[m % window][:b - a], left)
            return True
        prev = m - rs_steps * nseg  # our Isend that read this region one lap earlier
        if prev >= 0 and sends[prev] is not None:
            if not now and not be.test(sends[prev]):
                return False  # post it when it is waited for, not stall on it ahead of time
            be.wait_send(sends[prev], right)
            sends[prev] = None
        recvs[m] = be.irecv(x[a:b], left)  # AllGather: straight into place
        return True

    c = ring_step_indices(rank, first, size)[0]  # the first step's own chunk
    for j in range(nseg):
        a, b = seg[c][j]
        sends[j] = be.isend(x[a:b], right)
    post_until(min(window, total))
    for m in range(total):
        t, j = divmod(m, nseg)
        t += first
        if tracing and j == 0:
            t_step, t_wait = clock(), 0.0
        t0 = clock() if tracing else 0.0
        if posted <= m:  # an AllGather receive that post_recv deferred
            post_until(m + 1, now=True)
        be.wait(recvs[m])
        recvs[m] = None
        if tracing:
            t_wait += clock() - t0
        a, b = seg[ring_step_indices(rank, t, size)[1]][j]
        if t < rs_steps:
            reduce(x[a:b], slots[m % window][:b - a])
            if t == rs_steps - 1 and avg:  # chunk finished: divide before it travels on
                finish(op, x[a:b], size)
        if t + 1 < stop:  # what we just received is what we send at the next step
            sends[m + nseg] = be.isend(x[a:b], right)
        post_until(min(m + window + 1, total))
        if j == nseg - 1:  # the step's last segment is in: the step is done
            phase, i = ("reduce-scatter", t) if t < rs_steps else ("all-gather", t - rs_steps)
            trace.chunk_step(phase, i, rs_steps, *ring_step_indices(rank, t, size),
                             t_step, t_step + t_wait)
    be.wait_sends([s for s in sends if s is not None], right)
