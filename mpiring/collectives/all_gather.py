r"""Ring AllGather: phase two of the lecture's Ring AllReduce.

Rank r starts with chunk r (for AllReduce: the chunk ReduceScatter finished on
it). At step i (0 <= i <= K-2) it forwards chunk (r-i) mod K to its right
neighbour and receives chunk (r-i-1) mod K from its left one, in one Sendrecv::

        r0 ──▶ r1 ──▶ r2 ──▶ r3
        ▲                     │
        └─────────────────────┘

    step | r0 sends/recvs | r1 sends/recvs | r2 sends/recvs | r3 sends/recvs
    -----+----------------+----------------+----------------+---------------
      0  |   c0  /  c3    |   c1  /  c0    |   c2  /  c1    |   c3  /  c2
      1  |   c3  /  c2    |   c0  /  c3    |   c1  /  c0    |   c2  /  c1
      2  |   c2  /  c1    |   c3  /  c2    |   c0  /  c3    |   c1  /  c0

Each chunk arrives straight in its final place: no receive buffer, no copy.
Per rank: (K-1) messages of M/K elements, time (K-1)(alpha + M/(K B)).

The lecture's pseudocode::

    for i in 0 .. K-2:
        SendRecv(local_chunk[send_chunk], local_chunk[recv_chunk])
"""

from __future__ import annotations

from mpiring.core.chunking import all_gather_indices, chunk_bounds, ring_neighbours
from mpiring.runtime.trace import clock


def ring_all_gather(be, x, trace, phase: str = "all-gather"):
    """Fill every chunk of ``x`` from the rank that owns it; rank r provides chunk r."""
    rank, size = be.rank, be.size
    if size == 1:
        return x
    bounds = chunk_bounds(x.size, size)
    left, right = ring_neighbours(rank, size)
    trace = trace.ring(bounds, x.itemsize, left, right)
    for i in range(size - 1):
        send_chunk, recv_chunk = all_gather_indices(rank, i, size)
        s0, s1 = bounds[send_chunk]
        r0, r1 = bounds[recv_chunk]
        t_start = clock()
        be.sendrecv(x[s0:s1], right, x[r0:r1], left)
        trace.chunk_step(phase, i, size - 1, send_chunk, recv_chunk, t_start, clock())
    return x
