r"""Ring ReduceScatter: phase one of the lecture's Ring AllReduce.

K ranks on a ring, each holding a buffer of M elements cut into K chunks
(numpy.array_split bounds). Every rank sends to its right neighbour and receives
from its left one::

        r0 ──▶ r1 ──▶ r2 ──▶ r3
        ▲                     │
        └─────────────────────┘

At step i (0 <= i <= K-2) rank r sends chunk (r-i-1) mod K and receives chunk
(r-i-2) mod K, which it adds into its own copy. K = 4:

    step | r0 sends/recvs | r1 sends/recvs | r2 sends/recvs | r3 sends/recvs
    -----+----------------+----------------+----------------+---------------
      0  |   c3  /  c2    |   c0  /  c3    |   c1  /  c0    |   c2  /  c1
      1  |   c2  /  c1    |   c3  /  c2    |   c0  /  c3    |   c1  /  c0
      2  |   c1  /  c0    |   c2  /  c1    |   c3  /  c2    |   c0  /  c3

After K-1 steps rank r holds chunk r reduced over all K ranks (every chunk
visited every rank once on its way round). Per rank: (K-1) messages of M/K
elements, time (K-1)(alpha + M/(K B)).

The loop is the lecture's pseudocode, line for line::

    for i in 0 .. K-2:
        Irecv(buffer, recv_chunk); Send(local_chunk[send_chunk]); Wait(recv)
        local_chunk[recv_chunk] += buffer
"""

from __future__ import annotations

from mpiring.core.chunking import chunk_bounds, reduce_scatter_indices, ring_neighbours
from mpiring.core.ops import finish, reducer
from mpiring.runtime.trace import clock


def ring_reduce_scatter(be, x, op: str, trace, phase: str = "reduce-scatter"):
    """Reduce ``x`` over the ring in place; rank r ends with chunk r fully reduced.

    Args:
        be: backend (point-to-point: irecv, send, wait; scratch).
        x: flat contiguous array, the same length on every rank.
        op: reduction op name (see ``mpiring.core.ops``).
        trace: a ``CallTrace``; records one entry per step when tracing is on.
    """
    rank, size = be.rank, be.size
    bounds = chunk_bounds(x.size, size)
    if size > 1:
        left, right = ring_neighbours(rank, size)
        reduce = reducer(op)
        # One receive buffer per call (cached by the backend), never one per step;
        # chunk 0 is the largest (array_split puts the extra elements first).
        buffer = be.scratch(x, bounds[0][1] - bounds[0][0])
        trace = trace.ring(bounds, x.itemsize, left, right)
        for i in range(size - 1):
            send_chunk, recv_chunk = reduce_scatter_indices(rank, i, size)
            s0, s1 = bounds[send_chunk]
            r0, r1 = bounds[recv_chunk]
            incoming = buffer[: r1 - r0]
            t_start = clock()
            req = be.irecv(incoming, left)
            be.send(x[s0:s1], right)
            be.wait(req)
            t_recv = clock()
            reduce(x[r0:r1], incoming)
            trace.chunk_step(phase, i, size - 1, send_chunk, recv_chunk, t_start, t_recv)
    lo, hi = bounds[rank]
    finish(op, x[lo:hi], size)
    return lo, hi
