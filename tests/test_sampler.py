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
