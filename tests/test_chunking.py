"""Pure tests of the ring's index arithmetic: no MPI involved."""

import numpy as np
import pytest

from mpiring.core.chunking import (
    all_gather_indices,
    chunk_bounds,
    default_pipeline_chunks,
    reduce_scatter_indices,
    ring_neighbours,
    ring_position,
)

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 6, 7, 100, 1001])
def test_chunk_bounds_match_array_split(n, k):
    bounds = chunk_bounds(n, k)
    parts = np.array_split(np.arange(n), k)
    assert [b - a for a, b in bounds] == [len(p) for p in parts]
    assert [list(range(a, b)) for a, b in bounds] == [p.tolist() for p in parts]


def test_chunk_bounds_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one chunk"):
        chunk_bounds(3, 0)
    with pytest.raises(ValueError, match=">= 0"):
        chunk_bounds(-1, 2)


def simulate_ring_reduce_scatter(k):
    """Run the schedule symbolically: each rank's chunks hold sets of contributors."""
    held = [[{r} for _ in range(k)] for r in range(k)]
    for step in range(k - 1):
        sent = {}
        for r in range(k):
            send, _ = reduce_scatter_indices(r, step, k)
            sent[(r + 1) % k] = (send, set(held[r][send]))
        for r in range(k):
            _, recv = reduce_scatter_indices(r, step, k)
            chunk, contributors = sent[r]
            assert chunk == recv, "the chunk received must be the one the left neighbour sent"
            held[r][recv] |= contributors
    return held


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8])
def test_reduce_scatter_schedule_leaves_rank_r_with_chunk_r_complete(k):
    held = simulate_ring_reduce_scatter(k)
    for r in range(k):
        assert held[r][r] == set(range(k))


@pytest.mark.parametrize("k", [2, 3, 4, 5, 8])
def test_all_gather_schedule_delivers_every_chunk_once(k):
    have = [{r} for r in range(k)]
    received = [[] for _ in range(k)]
    for step in range(k - 1):
        sent = {}
        for r in range(k):
            send, _ = all_gather_indices(r, step, k)
            assert send in have[r], "a rank may only forward a chunk it already has"
            sent[(r + 1) % k] = send
        for r in range(k):
            _, recv = all_gather_indices(r, step, k)
            assert sent[r] == recv
            received[r].append(recv)
            have[r].add(recv)
    for r in range(k):
        assert have[r] == set(range(k))
        assert sorted(received[r]) == sorted(set(range(k)) - {r})


def test_neighbours_and_positions():
    assert ring_neighbours(0, 4) == (3, 1)
    assert ring_neighbours(3, 4) == (2, 0)
    assert [ring_position(r, 2, 4) for r in range(4)] == [2, 3, 0, 1]


def test_default_pipeline_chunks():
    assert default_pipeline_chunks(0, 4) == 1
    assert default_pipeline_chunks(10 << 20, 2) == 1  # two ranks: nothing to pipeline
    # the model's S* = sqrt((K-2) N / (alpha beta)): 10 MiB, 4 ranks, alpha*beta = 1 MB
    assert default_pipeline_chunks(10 << 20, 4, alpha=1e-3, beta=1e9) == 5
    assert default_pipeline_chunks(10 << 20, 4) >= default_pipeline_chunks(10 << 20, 3)
    assert default_pipeline_chunks(3, 4) == 1


def test_chunk_bounds_are_remembered_and_cannot_be_changed():
    import numpy as np

    first = chunk_bounds(1001, 4)
    assert chunk_bounds(1001, 4) is first  # worked out once per (n, k)
    assert isinstance(first, tuple) and all(type(a) is int for pair in first for a in pair)
    with pytest.raises(TypeError):
        first[0] = (0, 1)  # shared by every caller: immutable
    assert chunk_bounds(np.int64(1001), np.int64(4)) == first
    with pytest.raises(TypeError):
        chunk_bounds(10.5, 2)
