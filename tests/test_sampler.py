"""DistributedSampler: disjoint even shards, same shuffle on every rank, torch's semantics (pure)."""

from __future__ import annotations

import pytest
import torch.utils.data.distributed as tud

from mpiring.parallel.data.sampler import DistributedSampler


@pytest.mark.parametrize("n", [0, 1, 7, 10, 12])
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_indices_as_torch(n, k, drop_last, shuffle):
    data = list(range(n))
    for epoch in (0, 3):
        for r in range(k):
            ours = DistributedSampler(n, k, r, shuffle=shuffle, seed=5, drop_last=drop_last)
            theirs = tud.DistributedSampler(data, k, r, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            if n == 0 and not drop_last and k > 1:
                continue  # torch cannot pad an empty dataset either
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_shards_disjoint_cover_and_even():
    n, k = 103, 4
    shards = [list(DistributedSampler(n, k, r, seed=1, drop_last=True)) for r in range(k)]
    assert len({len(s) for s in shards}) == 1
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == (n // k) * k
    padded = [list(DistributedSampler(n, k, r, seed=1)) for r in range(k)]
    assert sorted({i for s in padded for i in s}) == list(range(n))


def test_epoch_changes_order_and_rank_checked():
    s = DistributedSampler(50, 2, 0, seed=0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="comm"):
        DistributedSampler(10)


def test_set_epoch_at_the_top_of_a_resumed_epoch_keeps_its_position():
    """torch's loop calls set_epoch(epoch) first thing: a restored position must survive it,
    and the resumed indices are the rest of the epoch torch's sampler would give."""
    n, k, r = 20, 2, 1
    theirs = tud.DistributedSampler(list(range(n)), k, r, seed=1)
    theirs.set_epoch(3)
    full = list(theirs)
    s = DistributedSampler(n, k, r, seed=1)
    s.load_state_dict({"seed": 1, "epoch": 3, "start": 4})
    s.set_epoch(3)
    assert list(s) == full[4:]
    s.set_epoch(4)  # a new epoch starts at its beginning
    theirs.set_epoch(4)
    assert s.start == 0 and list(s) == list(theirs)


@pytest.mark.parametrize("n", [12, 31])
@pytest.mark.parametrize("old,new", [(2, 4), (4, 2), (3, 2), (2, 3), (1, 4), (4, 3)])
@pytest.mark.parametrize("start", [0, 1, 3, 5])
def test_a_position_resumed_on_another_rank_count_skips_nothing(n, old, new, start):
    """start counts one rank's samples: resumed on another number of ranks it must
    point at the same place of the epoch's order. Every index the old ranks had not
    reached is read by the new ones, and at most new - 1 are read a second time."""
    before = [DistributedSampler(n, old, r, seed=5) for r in range(old)]
    for s in before:
        s.set_epoch(2)
        s.start = start
    used = [i for s in before for i in s.shard()[:start]]
    after = [DistributedSampler(n, new, r, seed=5) for r in range(new)]
    for s in after:
        s.load_state_dict(before[0].state_dict())
        s.set_epoch(2)
    rest = [i for s in after for i in s]
    order = before[0].global_indices()[:n]
    left = [i for i in order[min(start * old, n):]]
    assert set(left) <= set(rest)
    again = len(rest) - len(set(rest) - set(used))
    assert 0 <= again <= new - 1 + (after[0].total_size - n)


def test_a_state_without_the_rank_count_loads_as_before():
    s = DistributedSampler(20, 2, 0, seed=1)
    s.load_state_dict({"seed": 1, "epoch": 3, "start": 4})
    assert s.start == 4 and s.state_dict()["num_replicas"] == 2
