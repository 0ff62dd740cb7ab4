r"""Hierarchical alpha-beta model: collectives over a cluster of nodes, per link class.

``costmodel`` prices one flat ring on one link. A cluster has two link classes:
inside a node the GPUs talk over NVLink or PCIe (``Fabric.intra``), across
nodes over the node's NICs (``Fabric.nic``, one NIC's alpha and beta, shared by
the node's GPUs). With N nodes of G GPUs each (K = N G ranks):

    flat ring AllReduce      2(K-1) (alpha_x + M/(K beta_ring))
        every step waits for its slowest hop, so alpha_x is the NIC's alpha
        once the ring leaves the node, and beta_ring = min(beta_intra, NICs
        beta_nic / G): the ring's cross-node hops share the node's NICs.
    double binary tree       2 (d - 1 + S) (alpha + M/(S beta))
        NCCL's two trees (Sanders, Speck and Traeff 2009; NCCL 2.4), each
        carrying M/2 pipelined in S chunks, depth d = ceil(log2 K); an inner
        node of one tree receives two children's chunks per step. Large M:
        2M/beta, the ring's bandwidth term times K/(K-1); small M: 2 d alpha
        instead of the ring's 2(K-1) alpha.
    hierarchical AllReduce   RS(G, intra) + AR(N, NIC share) + AG(G, intra)
        ReduceScatter inside the node, AllReduce of each GPU's M/G across the
        nodes (all G GPUs at once, sharing the NICs), AllGather inside the node
        (Horovod's and NCCL's "hierarchical" path; Jia et al. 2018).

AllGather, ReduceScatter, Broadcast and point-to-point follow the same split.
Every function is pure: numbers in, seconds out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpiring.core.costmodel import AlphaBeta, ring_all_reduce, ring_reduce_scatter

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class Fabric:
    """The two link classes of a cluster.

    Attributes:
        intra: one GPU's link inside a node (NVLink/NVSwitch or PCIe), per direction.
        nic: one NIC's link across nodes, per direction.
        gpus_per_node: G.
        nics_per_node: NICs a node shares among its G GPUs.
    """

    intra: AlphaBeta
    nic: AlphaBeta
    gpus_per_node: int = 8
    nics_per_node: int = 8

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise ValueError("gpus_per_node and nics_per_node must be >= 1")

    def nic_share(self, gpus_using: int | None = None) -> AlphaBeta:
        """The cross-node link one GPU sees when ``gpus_using`` GPUs of its node send at once."""
        g = self.gpus_per_node if gpus_using is None else max(1, gpus_using)
        beta = self.nic.beta * min(1.0, self.nics_per_node / g)
        return AlphaBeta(self.nic.alpha, beta, source="nic-share")

    def link(self, k: int, span_nodes: bool) -> AlphaBeta:
        """The ring's bottleneck link for k ranks: NVLink inside a node, the NIC share across."""
        if not span_nodes:
            return self.intra
        share = self.nic_share()
        return AlphaBeta(max(self.intra.alpha, share.alpha), min(self.intra.beta, share.beta),
                         source="ring-across-nodes")


def tree_depth(k: int) -> int:
    """ceil(log2 K): the height of a balanced binary tree over K ranks."""
    return 0 if k <= 1 else math.ceil(math.log2(k))


def _tree_time(m: float, k: int, ab: AlphaBeta, chunks: int, passes: int) -> float:
    d = tree_depth(k)
    return passes * (d - 1 + chunks) * ab.time(m / chunks)


def best_tree_chunks(m: float, k: int, ab: AlphaBeta, passes: int = 2) -> int:
    """The S minimising (d-1+S)(alpha + M/(S beta)): S* = sqrt((d-1) M/(alpha beta)).

    The same optimum as ``costmodel.best_chunks`` for the pipelined chain, with
    the tree's depth d in place of the chain's K-1.
    """
    d = tree_depth(k)
    if d <= 1 or m <= 0 or ab.alpha <= 0:
        return 1 if d <= 1 or m <= 0 else max(1, int(m))
    s = math.sqrt((d - 1) * m / (ab.alpha * ab.beta))
    lo, hi = max(1, math.floor(s)), max(1, math.ceil(s))
    return min((lo, hi), key=lambda c: _tree_time(m, k, ab, c, passes))


def tree_all_reduce(m: float, k: int, ab: AlphaBeta, chunks: int | None = None) -> float:
    """NCCL's double binary tree: 2 (d - 1 + S)(alpha + M/(S beta)), S chunks.

    Reduce up, then broadcast down, each of the two trees carrying M/2; the
    busiest (inner) node of a tree receives two children's M/(2S) chunks per step,
    which is M/(S beta) on its link (Sanders et al. 2009, "Two-tree algorithms
    for full bandwidth broadcast, reduction and scan"). ``chunks=None`` uses the best S.
    """
    if k <= 1:
        return 0.0
    s = chunks or best_tree_chunks(m, k, ab)
    return _tree_time(m, k, ab, s, passes=2)


def tree_broadcast(n: float, k: int, ab: AlphaBeta, chunks: int | None = None) -> float:
    """Pipelined double binary tree Broadcast: (d - 1 + S)(alpha + N/(S beta))."""
    if k <= 1:
        return 0.0
    s = chunks or best_tree_chunks(n, k, ab, passes=1)
    return _tree_time(n, k, ab, s, passes=1)


def ring(collective: str, m: float, k: int, ab: AlphaBeta) -> float:
    """The lecture's flat ring for ``collective`` on one link class.

    Broadcast is the pipelined chain at its best S (``costmodel.best_chunks``).
    """
    from mpiring.core.costmodel import best_chunks, pipelined_broadcast

    if collective == "all_reduce":
        return ring_all_reduce(m, k, ab)
    if collective in ("reduce_scatter", "all_gather"):
        return ring_reduce_scatter(m, k, ab)
    if collective == "broadcast":
        return pipelined_broadcast(m, k, best_chunks(m, k, ab), ab) if k > 1 else 0.0
    raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")


def _split(k: int, fabric: Fabric) -> tuple[int, int]:
    """(GPUs per node used, nodes) for k ranks packed onto whole nodes."""
    g = min(k, fabric.gpus_per_node)
    return g, math.ceil(k / g)


def flat_ring(collective: str, m: float, k: int, fabric: Fabric) -> float:
    """One ring over all K ranks: its slowest hop sets every step."""
    g, nodes = _split(k, fabric)
    return ring(collective, m, k, fabric.link(k, nodes > 1))


def hierarchical(collective: str, m: float, k: int, fabric: Fabric) -> float:
    """Two-level: inside the node over ``intra``, across nodes over the NIC share.

    AllReduce = RS(G) + AR(N) of M/G + AG(G); ReduceScatter = RS(N) of M across
    nodes first then RS(G) of M/N (each GPU's slice), AllGather its mirror;
    Broadcast = pipelined across node leaders, then inside each node.
    """
    g, nodes = _split(k, fabric)
    if nodes == 1:
        return ring(collective, m, g, fabric.intra)
    across = fabric.nic_share(g)
    if collective == "all_reduce":
        return (ring_reduce_scatter(m, g, fabric.intra) + ring_all_reduce(m / g, nodes, across)
                + ring_reduce_scatter(m, g, fabric.intra))
    if collective in ("reduce_scatter", "all_gather"):
        # G concurrent rings across nodes, one per local rank, each on M/G of the buffer.
        return ring_reduce_scatter(m / g, nodes, across) + ring_reduce_scatter(m / nodes, g, fabric.intra)
    if collective == "broadcast":
        return ring("broadcast", m, nodes, fabric.nic_share(1)) + ring("broadcast", m, g, fabric.intra)
    raise ValueError(f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}")


def tree(collective: str, m: float, k: int, fabric: Fabric) -> float:
    """NCCL's tree across nodes with a chain inside each node (NCCL's tree topology).

    Only AllReduce and Broadcast have a tree; AllGather and ReduceScatter fall
    back to the flat ring, as in NCCL.
    """
    g, nodes = _split(k, fabric)
    link = fabric.link(k, nodes > 1)
    if collective == "all_reduce":
        return tree_all_reduce(m, k, link)
    if collective == "broadcast":
        return tree_broadcast(m, k, link)
    return flat_ring(collective, m, k, fabric)


ALGORITHMS = {"ring": flat_ring, "tree": tree, "hierarchical": hierarchical}


def collective_time(collective: str, m: float, k: int, fabric: Fabric, algo: str = "best") -> float:
    """Seconds for ``collective`` of M bytes per rank on k ranks; ``best`` = the fastest algo."""
    if k < 1:
        raise ValueError(f"ranks must be >= 1, got {k}")
    if m < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {m}")
    if algo == "best":
        return min(f(collective, m, k, fabric) for f in ALGORITHMS.values())
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown algo {algo!r}: use best, {', '.join(ALGORITHMS)}")
    return ALGORITHMS[algo](collective, m, k, fabric)


def p2p(nbytes: float, fabric: Fabric, across_nodes: bool, senders_per_node: int = 1) -> float:
    """One point-to-point message: NVLink inside a node, a NIC share across."""
    ab = fabric.nic_share(senders_per_node) if across_nodes else fabric.intra
    return ab.time(nbytes)


def tree_ring_crossover(k: int, ab: AlphaBeta, lo: float = 1.0, hi: float = 2.0**40) -> float | None:
    """The largest message (bytes) at which the tree AllReduce still beats the ring on k ranks.

    Below it the tree's 2 d alpha wins over the ring's 2(K-1) alpha; above it the
    ring's (K-1)/K bandwidth term wins. None when the ring wins even at ``lo``
    (K <= 2: both are one exchange) or the tree wins up to ``hi``.
    """
    def tree_wins(m: float) -> bool:
        return tree_all_reduce(m, k, ab) < ring_all_reduce(m, k, ab)

    if k <= 2 or not tree_wins(lo):
        return None
    if tree_wins(hi):
        return hi
    for _ in range(200):  # bisection on log(m): the sign changes once
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if tree_wins(mid) else (lo, mid)
        if hi / lo < 1.001:
            break
    return lo
