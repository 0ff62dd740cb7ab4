r"""Ring AllReduce = ReduceScatter + AllGather (the lecture's key identity).

    AllReduce(x) = AllGather(ReduceScatter(x))

ReduceScatter leaves rank r with chunk r reduced over all ranks; AllGather then
circulates the finished chunks until every rank has all of them::

    after RS:   r0:[c0*,  . ,  . ,  . ]   r1:[ . , c1*,  . ,  . ]   ...
    after AG:   r0:[c0*, c1*, c2*, c3*]   r1:[c0*, c1*, c2*, c3*]   ...

Each of the 2(K-1) steps moves M/K elements per rank, so every rank sends

    2(K-1) M / K  ≈  2M                          (independent of K)

and the time is 2(K-1)(alpha + M/(K B)): bandwidth-optimal, with a latency term
that grows with K (see ``recursive_doubling`` for small messages).
"""

from __future__ import annotations

from mpiring.collectives.all_gather import ring_all_gather
from mpiring.collectives.reduce_scatter import ring_reduce_scatter


def ring_all_reduce(be, x, op: str, trace):
    """Reduce ``x`` over all ranks in place with the ring; every rank gets the result."""
    ring_reduce_scatter(be, x, op, trace)
    ring_all_gather(be, x, trace)
    return x
