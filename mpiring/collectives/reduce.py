r"""Ring Reduce to a root: the mirror image of the pipelined ring Broadcast.

The partial result travels right around the ring and ends at the root. Rank r
sits at position p = (r - root) mod K; position 1 starts, every later position
adds its own data to what it received and passes it on, the root adds last::

    p1 ──x1──▶ p2 ──x1+x2──▶ p3 ──x1+x2+x3──▶ root (adds x0)

Cut into S pipelined chunks, the cost is the same as the pipelined Broadcast,
(K-2+S)(alpha + N/(S B)), plus one reduction per chunk. ``chunks=1`` is the naive
ring. Only the root's buffer changes: the others add into a receive buffer, so
their input stays as it was (as with MPI_Reduce).
"""

from __future__ import annotations

from mpiring.core.chunking import chunk_bounds, ring_neighbours, ring_position
from mpiring.core.ops import finish, reducer
from mpiring.runtime.trace import clock


def pipelined_reduce(be, x, op: str, root: int, chunks: int, trace, phase: str = "reduce"):
    """Reduce ``x`` from every rank into the root's ``x``, ring-pipelined in ``chunks``."""
    rank, size = be.rank, be.size
    if size == 1:
        finish(op, x, size)
        return x
    left, right = ring_neighbours(rank, size)
    pos = ring_position(rank, root, size)
    segments = chunk_bounds(x.size, max(1, chunks))
    nsteps = len(segments)
    if pos == 1:  # the first position only sends its own data
        for s, (a, b) in enumerate(segments):
            t_start = clock()
            be.send(x[a:b], right)
            trace.step(phase, s, nsteps, send_chunk=s, dst=right,
                       bytes_sent=(b - a) * x.itemsize, t_start=t_start, t_recv=None,
                       t_end=clock())
        return x
    reduce = reducer(op)
    buffer = be.scratch(x, x.size)
    a, b = segments[0]
    req = be.irecv(buffer[a:b], left)
    for s, (a, b) in enumerate(segments):
        t_start = clock()
        be.wait(req)
        t_recv = clock()
        if s + 1 < nsteps:
            na, nb = segments[s + 1]
            req = be.irecv(buffer[na:nb], left)
        if pos == 0:  # the root: the finished partial lands in x
            reduce(x[a:b], buffer[a:b])
        else:  # pass on partial + own data; our x stays untouched
            reduce(buffer[a:b], x[a:b])
            be.send(buffer[a:b], right)
        trace.step(phase, s, nsteps, send_chunk=None if pos == 0 else s,
                   dst=None if pos == 0 else right, recv_chunk=s, src=left,
                   bytes_sent=0 if pos == 0 else (b - a) * x.itemsize,
                   bytes_recv=(b - a) * x.itemsize, t_start=t_start, t_recv=t_recv,
                   t_end=clock())
    if pos == 0:
        finish(op, x, size)
    return x
