r"""The process grid: one rank per (tp, dp, pp) coordinate, in Megatron's order.

3D training puts every rank at one point of a T x D x P grid. Tensor parallel
varies fastest, so the T ranks of a tensor-parallel group are neighbours (one
host, where the all-reduce of every layer is cheapest), then data parallel,
then pipeline (Megatron-LM's order ``tp-dp-pp``)::

    global rank = tp_rank + T * (dp_rank + D * pp_rank),   D = world / (T P)

    world 8, T=2, P=2 (so D=2):     pp 0            pp 1
                                 dp0   dp1       dp0   dp1
                          tp 0:   0     2         4     6
                          tp 1:   1     3         5     7

    tp groups: {0,1} {2,3} {4,5} {6,7}   (same dp and pp)
    dp groups: {0,2} {1,3} {4,6} {5,7}   (same tp and pp)
    pp groups: {0,4} {1,5} {2,6} {3,7}   (same tp and dp)

A group along one axis is every rank that shares the other two coordinates.
Each is made with ``comm.split``, which is collective: every rank splits the
three axes in the same order (tp, dp, pp), each rank ordered by its global rank.
"""

from __future__ import annotations

from mpiring.core.errors import MismatchError

__all__ = ["ProcessGrid", "grid_coords", "grid_groups", "grid_rank"]

AXES = ("tp", "dp", "pp")


def _check_layout(world: int, tp: int, pp: int) -> int:
    """dp for this layout; ValueError naming the sizes if it does not divide the world."""
    for name, v in (("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"ProcessGrid: {name}={v!r}: give a positive integer")
    if world % (tp * pp):
        raise ValueError(f"ProcessGrid: tp={tp} x pp={pp} = {tp * pp} does not divide the "
                         f"world of {world} ranks: choose tp and pp whose product divides "
                         f"{world} (dp = world / (tp * pp))")
    return world // (tp * pp)


def grid_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """The global rank at a coordinate: ``tp_rank + tp * (dp_rank + dp * pp_rank)``."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def grid_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """``(tp_rank, dp_rank, pp_rank)`` of a global rank (the inverse of ``grid_rank``)."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def grid_groups(world: int, tp: int = 1, pp: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every axis, as lists of global ranks (pure: no communication).

    Returns:
        ``{"tp": [...], "dp": [...], "pp": [...]}``: each a list of groups, each
        group its members in increasing rank order.

    Raises:
        ValueError: ``tp * pp`` does not divide ``world``.
    """
    dp = _check_layout(world, tp, pp)
    sizes = {"tp": tp, "dp": dp, "pp": pp}
    groups: dict[str, dict[tuple, list[int]]] = {a: {} for a in AXES}
    for r in range(world):
        c = dict(zip(AXES, grid_coords(r, tp, dp)))
        for a in AXES:
            others = tuple(c[b] for b in AXES if b != a)
            groups[a].setdefault(others, []).append(r)
    out = {a: sorted(groups[a].values()) for a in AXES}
    assert all(len(g) == sizes[a] for a in AXES for g in out[a])
    return out


class ProcessGrid:
    """The tensor-, data- and pipeline-parallel communicators of this rank.

    ``grid = mpiring.ProcessGrid(comm, tp=2, pp=2)`` on 8 ranks gives dp = 2;
    ``grid.tp`` is the Communicator over this rank's tensor-parallel group (its
    rank there is ``grid.tp_rank``), and likewise ``grid.dp`` and ``grid.pp``.

    Args:
        comm: the Communicator over every rank of the job.
        tp: tensor-parallel size T (fastest-varying).
        pp: pipeline-parallel size P (slowest).

    Attributes:
        world_size, rank: of ``comm``.
        tp_size, dp_size, pp_size: T, D = world / (T P), P.
        tp_rank, dp_rank, pp_rank: this rank's coordinates.
        tp, dp, pp: Communicators over this rank's group along each axis.
        tp_ranks, dp_ranks, pp_ranks: the global ranks of those groups.

    Raises:
        ValueError: on every rank, before any split, when T P does not divide
            the world, T or P is not a positive integer, or ranks passed
            different layouts.
    """

    def __init__(self, comm, tp: int = 1, pp: int = 1):
        error = None
        try:
            dp = _check_layout(comm.size, tp, pp)
        except ValueError as exc:
            error, dp = exc, 0
        if comm.size > 1:
            # Every rank must build the same grid, or the splits below pair ranks
            # wrongly: agree on (tp, pp) first, through the control channel.
            table = comm.control.allgather_json([repr(tp), repr(pp), error is not None])
            if error is None and any(t[:2] != table[0][:2] for t in table):
                diff = ", ".join(f"r{r}: tp={t[0]} pp={t[1]}" for r, t in enumerate(table))
                error = MismatchError(f"ProcessGrid: ranks passed different layouts ({diff}): "
                                      "pass the same tp and pp on every rank")
            elif error is None and any(t[2] for t in table):
                bad = [r for r, t in enumerate(table) if t[2]]
                error = ValueError(f"ProcessGrid: rank(s) {bad} rejected the layout "
                                   f"tp={tp} pp={pp}; no rank went on")
        if error is not None:
            raise error
        self.world_size, self.rank = comm.size, comm.rank
        self.tp_size, self.dp_size, self.pp_size = tp, dp, pp
        self.tp_rank, self.dp_rank, self.pp_rank = grid_coords(comm.rank, tp, dp)
        groups = grid_groups(comm.size, tp, pp)
        # The color names the group: the coordinates on the other two axes.
        colors = {"tp": self.dp_rank + dp * self.pp_rank,
                  "dp": self.tp_rank + tp * self.pp_rank,
                  "pp": self.tp_rank + tp * self.dp_rank}
        for axis in AXES:  # the same order on every rank: split is collective
            color = colors[axis]
            sub = comm.split(color, key=comm.rank)
            mine = next(g for g in groups[axis] if comm.rank in g)
            setattr(self, axis, sub)
            setattr(self, f"{axis}_ranks", mine)

    def free(self) -> None:
        """Collective: give back the three groups' communicators (the grid is done)."""
        for axis in AXES:
            getattr(self, axis).free()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(tp_size, dp_size, pp_size)``."""
        return self.tp_size, self.dp_size, self.pp_size

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The global rank at a coordinate of this grid."""
        return grid_rank(tp_rank, dp_rank, pp_rank, self.tp_size, self.dp_size)

    def __repr__(self) -> str:
        return (f"ProcessGrid(tp={self.tp_size}, dp={self.dp_size}, pp={self.pp_size}; rank "
                f"{self.rank} at tp={self.tp_rank} dp={self.dp_rank} pp={self.pp_rank})")
