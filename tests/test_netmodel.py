"""Pure tests of the hierarchical network model: ring, double binary tree, two-level collectives."""

import math

import pytest

from mpiring.core import netmodel as nm
from mpiring.core.costmodel import AlphaBeta, ring_all_reduce, ring_reduce_scatter

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)

NVL = AlphaBeta(3e-6, 240e9)
NIC = AlphaBeta(7e-6, 22e9)
FAB = nm.Fabric(NVL, NIC, gpus_per_node=8, nics_per_node=4)


@pytest.mark.parametrize("k,d", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (16384, 14)])
def test_tree_depth_is_ceil_log2(k, d):
    assert nm.tree_depth(k) == d


def test_tree_all_reduce_is_the_formula_for_a_given_chunk_count():
    m, k, s = 3e6 + 7, 13, 5
    d = 4
    assert nm.tree_all_reduce(m, k, NIC, chunks=s) == pytest.approx(2 * (d - 1 + s) * NIC.time(m / s))
    assert nm.tree_broadcast(m, k, NIC, chunks=s) == pytest.approx((d - 1 + s) * NIC.time(m / s))
    assert nm.tree_all_reduce(m, 1, NIC) == 0.0


def test_best_tree_chunks_is_the_integer_optimum():
    m, k = 64e6, 1000
    best = nm.best_tree_chunks(m, k, NIC)
    brute = min(range(1, 5000), key=lambda s: nm.tree_all_reduce(m, k, NIC, chunks=s))
    assert best == brute


def test_tree_bandwidth_term_tends_to_2m_over_beta_and_latency_to_2d_alpha():
    k = 4096
    big = 1e13
    assert nm.tree_all_reduce(big, k, NIC) / (2 * big / NIC.beta) == pytest.approx(1, rel=0.01)
    # One tiny message: one chunk, two passes of depth d.
    assert nm.tree_all_reduce(1.0, k, NIC) == pytest.approx(2 * 12 * NIC.time(1.0))
    assert ring_all_reduce(1.0, k, NIC) > 300 * nm.tree_all_reduce(1.0, k, NIC)


def test_crossover_grows_with_k_and_is_where_the_two_meet():
    prev = 0.0
    for k in [8 * 2**i for i in range(12)]:  # 8 .. 16384
        m = nm.tree_ring_crossover(k, NIC)
        assert m is not None and m > prev, k
        assert nm.tree_all_reduce(m * 0.99, k, NIC) < ring_all_reduce(m * 0.99, k, NIC)
        assert nm.tree_all_reduce(m * 1.02, k, NIC) > ring_all_reduce(m * 1.02, k, NIC)
        prev = m
    assert nm.tree_ring_crossover(2, NIC) is None


def test_one_node_hierarchical_is_the_flat_ring_on_nvlink():
    for coll in nm.COLLECTIVES:
        for k in (1, 2, 5, 8):
            m = 1e6 + 13
            assert nm.hierarchical(coll, m, k, FAB) == pytest.approx(nm.ring(coll, m, k, NVL))
            assert nm.flat_ring(coll, m, k, FAB) == pytest.approx(nm.ring(coll, m, k, NVL))


def test_hierarchical_all_reduce_is_rs_ar_ag():
    m, k = 256e6, 24  # 3 nodes of 8
    share = AlphaBeta(NIC.alpha, NIC.beta * 4 / 8)
    want = 2 * ring_reduce_scatter(m, 8, NVL) + ring_all_reduce(m / 8, 3, share)
    assert nm.hierarchical("all_reduce", m, k, FAB) == pytest.approx(want)
    # The flat ring is held to the NIC share at every one of its 2(K-1) steps.
    flat = 2 * (k - 1) * (NIC.alpha + m / k / share.beta)
    assert nm.flat_ring("all_reduce", m, k, FAB) == pytest.approx(flat)
    assert nm.hierarchical("all_reduce", m, k, FAB) < nm.flat_ring("all_reduce", m, k, FAB)


def test_nic_share_and_p2p():
    assert FAB.nic_share().beta == pytest.approx(NIC.beta / 2)  # 4 NICs for 8 GPUs
    assert FAB.nic_share(2).beta == pytest.approx(NIC.beta)  # never more than one NIC each
    assert nm.p2p(1e6, FAB, across_nodes=False) == pytest.approx(NVL.time(1e6))
    assert nm.p2p(1e6, FAB, across_nodes=True, senders_per_node=8) == pytest.approx(
        NIC.alpha + 1e6 / (NIC.beta / 2))


def test_best_is_the_minimum_and_gather_has_no_tree():
    for coll in nm.COLLECTIVES:
        for k in (3, 64, 1000):
            for m in (8.0, 1e5, 1e9):
                times = [nm.collective_time(coll, m, k, FAB, a) for a in nm.ALGORITHMS]
                assert nm.collective_time(coll, m, k, FAB) == min(times)
    assert nm.tree("all_gather", 1e6, 64, FAB) == nm.flat_ring("all_gather", 1e6, 64, FAB)


@pytest.mark.parametrize("args,match", [
    (("all_reduce", 1.0, 0), "ranks"),
    (("all_reduce", -1.0, 4), "bytes"),
    (("alltoall", 1.0, 4), "unknown collective"),
])
def test_bad_input_names_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        nm.collective_time(*args, FAB, algo="hierarchical" if args[0] == "alltoall" else "best")
    with pytest.raises(ValueError, match="unknown algo"):
        nm.collective_time("all_reduce", 1.0, 4, FAB, algo="butterfly")
    with pytest.raises(ValueError, match=">= 1"):
        nm.Fabric(NVL, NIC, gpus_per_node=0)


def test_tree_wins_small_messages_at_scale_ring_at_eight():
    # The ring's 2(K-1) alpha: at 16,384 ranks a 1 MiB AllReduce is latency-bound.
    k = 16384
    assert nm.tree_all_reduce(2**20, k, NIC) < ring_all_reduce(2**20, k, NIC) / 10
    assert math.isfinite(nm.tree_ring_crossover(8, NIC))
