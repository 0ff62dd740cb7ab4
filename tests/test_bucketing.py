"""Bucket assignment and the distributed sampler, without MPI (pure functions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpiring.parallel.data.bucketing import (
    MIB,
    bucket_offsets,
    compute_buckets,
    describe_buckets,
    order_from_observed,
)

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)


def test_reverse_order_small_first_bucket_then_cap():
    # 6 parameters of 1, 2, 3, 4, 5, 6 MiB in registration order.
    sizes = [k * MIB for k in range(1, 7)]
    buckets = compute_buckets(sizes, bucket_cap_bytes=8 * MIB, first_bucket_bytes=1 * MIB)
    # Reverse order: 5 (6 MiB) alone closes the small first bucket; then 4+3 (5+4 >= 8)
    # then 2+1+0 (3+2+1 < 8, closed at the end).
    assert buckets == [[5], [4, 3], [2, 1, 0]]


def test_parameter_larger_than_cap_is_never_split():
    sizes = [10, 100 * MIB, MIB]
    buckets = compute_buckets(sizes, bucket_cap_bytes=MIB, first_bucket_bytes=MIB)
    assert buckets == [[2], [1], [0]]
    assert sorted(i for b in buckets for i in b) == [0, 1, 2]


def test_one_key_per_bucket_and_first_bucket_per_key():
    sizes = [4] * 6
    keys = ["f32", "f16", "f32", "f16", "f32", "f16"]
    buckets = compute_buckets(sizes, keys, bucket_cap_bytes=8, first_bucket_bytes=4)
    for b in buckets:
        assert len({keys[i] for i in b}) == 1
    # Each key gets its own small first bucket; launch order follows the fill order.
    assert buckets == [[5], [4], [3, 1], [2, 0]]


def test_explicit_order_and_launch_order():
    sizes = [4] * 4
    buckets = compute_buckets(sizes, bucket_cap_bytes=8, first_bucket_bytes=8, order=[0, 2, 1, 3])
    assert buckets == [[0, 2], [1, 3]]


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [0, 1, 3]])
def test_order_must_be_a_permutation(order):
    with pytest.raises(ValueError, match="permutation"):
        compute_buckets([4, 4, 4], order=order)


def test_caps_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        compute_buckets([4], bucket_cap_bytes=0)


def test_offsets_and_description():
    offsets, total = bucket_offsets([2, 0], [3, 5, 7])
    assert offsets == [0, 7] and total == 10
    assert describe_buckets([[2, 0]], [MIB, 0, MIB]).startswith("1 buckets: [0] 2 params 2.0 MiB")


def test_order_from_observed_appends_unused_in_reverse():
    assert order_from_observed([3, 1, 1, 9], 5) == [3, 1, 4, 2, 0]
    assert order_from_observed([], 3) == [2, 1, 0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 6000),
       st.integers(1, 6000), st.lists(st.integers(0, 2), min_size=30, max_size=30))
def test_every_parameter_once_one_key_caps_respected(sizes, cap, first, key_pool):
    keys = key_pool[:len(sizes)]
    buckets = compute_buckets(sizes, keys, bucket_cap_bytes=cap, first_bucket_bytes=first)
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))
    position = {i: p for p, i in enumerate(reversed(range(len(sizes))))}
    assert [position[b[0]] for b in buckets] == sorted(position[b[0]] for b in buckets)
    seen_key: set = set()
    for b in buckets:
        assert len({keys[i] for i in b}) == 1
        limit = cap if keys[b[0]] in seen_key else first
        seen_key.add(keys[b[0]])
        # Closed as soon as it reached its limit: without its last parameter it was below.
        assert sum(sizes[i] for i in b[:-1]) < limit
