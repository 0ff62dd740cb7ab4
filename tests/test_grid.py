"""ProcessGrid: ranks and groups against Megatron's formula, on 1-5 ranks.

global rank = tp_rank + T * (dp_rank + D * pp_rank); a group along one axis is
every rank sharing the other two coordinates. Checked three ways: the pure
table against a hand-written golden one (Megatron's 16-GPU example), the
Communicators' members against the formula, and an all-reduce of the global
rank over each group against the sum of the members the formula names.
"""

from __future__ import annotations

import numpy as np
import pytest

from mpiring.parallel.grid import ProcessGrid, grid_coords, grid_groups, grid_rank


def layouts(world: int) -> list[tuple[int, int]]:
    return [(t, p) for t in range(1, world + 1) for p in range(1, world + 1) if world % (t * p) == 0]


def test_megatron_golden_table():
    # parallel_state.py's docstring: 16 GPUs, tp=2, pp=4 (so dp=2).
    g = grid_groups(16, tp=2, pp=4)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


@pytest.mark.parametrize("world", range(1, 13))
def test_groups_partition_the_world_and_follow_the_formula(world):
    for tp, pp in layouts(world):
        dp = world // (tp * pp)
        g = grid_groups(world, tp, pp)
        for axis, size in (("tp", tp), ("dp", dp), ("pp", pp)):
            assert sorted(r for grp in g[axis] for r in grp) == list(range(world))
            assert all(len(grp) == size for grp in g[axis])
        for r in range(world):
            t, d, p = grid_coords(r, tp, dp)
            assert grid_rank(t, d, p, tp, dp) == r == t + tp * (d + dp * p)
            assert [grid_rank(i, d, p, tp, dp) for i in range(tp)] in g["tp"]
            assert [grid_rank(t, i, p, tp, dp) for i in range(dp)] in g["dp"]
            assert [grid_rank(t, d, i, tp, dp) for i in range(pp)] in g["pp"]


def test_pure_table_rejects_a_layout_that_does_not_divide():
    with pytest.raises(ValueError, match=r"tp=2 x pp=2 = 4 does not divide the world of 6"):
        grid_groups(6, 2, 2)
    with pytest.raises(ValueError, match="tp=0"):
        grid_groups(4, 0, 1)


def check_grid(comm):
    k = comm.size
    for tp, pp in layouts(k):
        dp = k // (tp * pp)
        grid = ProcessGrid(comm, tp=tp, pp=pp)
        t, d, p = comm.rank % tp, (comm.rank // tp) % dp, comm.rank // (tp * dp)
        assert (grid.tp_rank, grid.dp_rank, grid.pp_rank) == (t, d, p)
        assert (grid.tp_size, grid.dp_size, grid.pp_size) == grid.shape == (tp, dp, pp)
        assert grid.rank_of(t, d, p) == comm.rank
        expect = {"tp": [i + tp * (d + dp * p) for i in range(tp)],
                  "dp": [t + tp * (i + dp * p) for i in range(dp)],
                  "pp": [t + tp * (d + dp * i) for i in range(pp)]}
        own = {"tp": t, "dp": d, "pp": p}
        for axis, members in expect.items():
            sub = getattr(grid, axis)
            assert getattr(grid, f"{axis}_ranks") == members
            assert sub.size == len(members)
            assert sub.rank == own[axis] == members.index(comm.rank)
            # The group really holds those ranks: the sum of their global ranks
            # (and of their squares, so that no other set of ranks matches).
            x = np.array([comm.rank, comm.rank ** 2 + 1], dtype=np.float64)
            sub.all_reduce(x, op="sum")
            assert x.tolist() == [sum(members), sum(m * m + 1 for m in members)], (axis, tp, pp)


def test_grid_ranks_and_groups(comm):
    check_grid(comm)


def test_grid_whole_world(world):
    # The launch's own size: run with -n 5 for an odd world.
    check_grid(world)


def test_bad_layout_raises_on_every_rank_before_any_split(comm):
    k = comm.size
    bad = next(t for t in range(2, 2 * k + 2) if k % t)
    before = dict(comm._calls)
    with pytest.raises(ValueError, match=rf"tp={bad} x pp=1 = {bad} does not divide the world of {k}"):
        ProcessGrid(comm, tp=bad)
    with pytest.raises(ValueError, match="pp=-1"):
        ProcessGrid(comm, tp=1, pp=-1)
    assert comm._calls.get("split") == before.get("split")
    comm.barrier()


def test_ranks_that_disagree_raise_everywhere(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks to disagree")
    tp = comm.size if comm.rank == 0 else 1
    with pytest.raises(ValueError, match="different layouts"):
        ProcessGrid(comm, tp=tp)
