r"""Ring Broadcast from a root, naive and pipelined.

The ring starts at the root and runs right; rank r sits at position
p = (r - root) mod K. Naive (``algo="ring"``): the whole message hops from
position to position, each hop waiting for the previous one to finish::

    root ──N──▶ p1 ──N──▶ p2 ──N──▶ p3          T = (K-1) N / B

Pipelined (``algo="pipelined"``): cut the message into S chunks; as soon as p1
has chunk 0 it forwards it while receiving chunk 1, so every link is busy::

    time ─▶   t1    t2    t3    t4    t5    t6
    root→p1   s0    s1    s2    s3
    p1→p2           s0    s1    s2    s3
    p2→p3                 s0    s1    s2    s3

    T = (K-2+S) N / (S B)  →  N / B  as S grows (plus (K-2+S) alpha latency)

Chunks arrive straight in place: no receive buffer. The receive for chunk s+1
is posted before chunk s is forwarded, so forwarding and receiving overlap.
On MPI (a backend with ``isend``) the default streams the pipeline: every
receive is posted up front and every forward is an ``isend``, so a rank never
waits for its own forward before taking the next chunk (``_streamed``; the
loop in ``pipelined_broadcast`` is the lecture's, and runs with
``stream=False``, on NCCL, and for one chunk).
"""

from __future__ import annotations

from mpiring.core.chunking import chunk_bounds, ring_neighbours, ring_position
from mpiring.runtime.trace import clock


def pipelined_broadcast(be, x, root: int, chunks: int, trace, phase: str = "broadcast",
                        stream: bool = True):
    """Broadcast ``x`` from ``root`` along the ring in ``chunks`` pipelined pieces.

    ``chunks=1`` is the naive ring broadcast. The loop below is the lecture's,
    one chunk at a time per rank; with ``stream=True`` (the default) and a
    backend that has ``isend`` (MPI), several chunks go through
    ``_streamed``, which keeps every chunk in flight at once.
    """
    rank, size = be.rank, be.size
    if size == 1:
        return x
    left, right = ring_neighbours(rank, size)
    pos = ring_position(rank, root, size)
    last = pos == size - 1
    segments = chunk_bounds(x.size, max(1, chunks))
    nsteps = len(segments)
    if stream and nsteps > 1 and hasattr(be, "isend"):
        return _streamed(be, x, segments, pos, left, right, trace, phase)
    if pos == 0:  # the root only sends
        for s, (a, b) in enumerate(segments):
            t_start = clock()
            be.send(x[a:b], right)
            trace.step(phase, s, nsteps, send_chunk=s, dst=right,
                       bytes_sent=(b - a) * x.itemsize, t_start=t_start,
                       t_recv=None, t_end=clock())
        return x
    a, b = segments[0]
    req = be.irecv(x[a:b], left)
    for s, (a, b) in enumerate(segments):
        t_start = clock()
        be.wait(req)
        t_recv = clock()
        if s + 1 < nsteps:  # post the next receive before forwarding this chunk
            na, nb = segments[s + 1]
            req = be.irecv(x[na:nb], left)
        if not last:
            be.send(x[a:b], right)
        trace.step(phase, s, nsteps, send_chunk=None if last else s,
                   dst=None if last else right, recv_chunk=s, src=left,
                   bytes_sent=0 if last else (b - a) * x.itemsize,
                   bytes_recv=(b - a) * x.itemsize, t_start=t_start, t_recv=t_recv,
                   t_end=clock())
    return x


def _streamed(be, x, segments, pos: int, left: int, right: int, trace, phase: str):
    """The same pipeline with every chunk in flight at once (backends with ``isend``).

    The loop above waits for each forward to finish before it takes the next
    chunk: one chunk per rank moves at a time, and every chunk costs a full
    round of Python and scheduling. Here the root starts all its sends at once,
    the other ranks post a receive for every chunk up front (chunks land in
    place, so no buffer is needed) and forward each chunk with ``isend`` as
    soon as it is complete, waiting for the forwards only at the end. Same
    messages, same order (MPI keeps the order between two ranks), the same
    (K-2+S)(alpha + N/(S beta)) shape with a smaller alpha, since no rank waits
    for its own forward before taking the next chunk.
    """
    nsteps = len(segments)
    last = pos == be.size - 1
    if pos == 0:
        t_start = clock()
        sends = [be.isend(x[a:b], right) for a, b in segments]
        for s, ((a, b), req) in enumerate(zip(segments, sends)):
            be.wait_send(req, right)
            t_end = clock()
            trace.step(phase, s, nsteps, send_chunk=s, dst=right,
                       bytes_sent=(b - a) * x.itemsize, t_start=t_start, t_recv=None,
                       t_end=t_end)
            t_start = t_end
        return x
    recvs = [be.irecv(x[a:b], left) for a, b in segments]
    sends = []
    for s, (a, b) in enumerate(segments):
        t_start = clock()
        be.wait(recvs[s])
        t_recv = clock()
        if not last:
            sends.append(be.isend(x[a:b], right))
        trace.step(phase, s, nsteps, send_chunk=None if last else s,
                   dst=None if last else right, recv_chunk=s, src=left,
                   bytes_sent=0 if last else (b - a) * x.itemsize,
                   bytes_recv=(b - a) * x.itemsize, t_start=t_start, t_recv=t_recv,
                   t_end=clock())
    if sends:
        be.wait_sends(sends, right)
    return x
