"""Pure tests of the alpha-beta cost model: fitting on synthetic data, the lecture's formulas."""

import math

import numpy as np
import pytest

from mpiring.core import costmodel as cm

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)

AB = cm.AlphaBeta(alpha=20e-6, beta=5e9)
SIZES = [8 * 4**i for i in range(12)]  # 8 B .. 32 MiB


def test_fit_recovers_exact_parameters():
    times = [AB.time(n) for n in SIZES]
    fit = cm.fit_alpha_beta(SIZES, times)
    assert fit.alpha == pytest.approx(AB.alpha, rel=1e-9)
    assert fit.beta == pytest.approx(AB.beta, rel=1e-9)
    assert fit.fit_error == pytest.approx(0, abs=1e-9)


def test_relative_fit_pins_latency_under_noise_where_plain_least_squares_cannot():
    rng = np.random.default_rng(0)
    times = [AB.time(n) * (1 + 0.1 * rng.standard_normal()) for n in SIZES]
    rel = cm.fit_alpha_beta(SIZES, times)
    plain = cm.fit_alpha_beta(SIZES, times, relative=False)
    assert rel.alpha == pytest.approx(AB.alpha, rel=0.2)
    assert rel.beta == pytest.approx(AB.beta, rel=0.2)
    # Unweighted, the 32 MiB point decides everything and alpha is far off.
    assert abs(plain.alpha - AB.alpha) > abs(rel.alpha - AB.alpha)
    assert 0.0 <= rel.fit_error < 0.2


def test_negative_latency_is_clamped_and_bandwidth_refitted():
    sizes = [1e6, 2e6, 4e6]
    times = [n / 1e9 - 1e-5 for n in sizes]  # a line through a negative intercept
    fit = cm.fit_alpha_beta(sizes, times)
    assert fit.alpha == 0.0
    assert fit.beta == pytest.approx(1e9, rel=0.02)


@pytest.mark.parametrize("sizes,times,match", [
    ([8, 8], [1e-6, 1e-6], "two distinct"),
    ([8, 16], [1e-6, 0.0], "positive"),
    ([8, 16], [2e-6, 1e-6], "do not grow"),
    ([8, 16, 32], [1e-6, 2e-6], "same length"),
])
def test_fit_rejects_bad_input_with_the_fix(sizes, times, match):
    with pytest.raises(ValueError, match=match):
        cm.fit_alpha_beta(sizes, times)


def test_lecture_formulas():
    m, k = 64 << 20, 4
    a, b = AB.alpha, AB.beta
    assert cm.ring_all_reduce(m, k, AB) == pytest.approx(2 * (k - 1) * (a + m / (k * b)))
    assert cm.ring_reduce_scatter(m, k, AB) == pytest.approx((k - 1) * (a + m / (k * b)))
    assert cm.ring_all_gather(m, k, AB) == cm.ring_reduce_scatter(m, k, AB)
    assert cm.ring_broadcast(m, k, AB) == pytest.approx((k - 1) * (a + m / b))
    assert cm.pipelined_broadcast(m, k, 8, AB) == pytest.approx((k - 2 + 8) * (a + m / (8 * b)))
    assert cm.parameter_server(m, k, AB) == pytest.approx(2 * (k - 1) * (a + m / b))
    # S = 1 is the naive ring; large S approaches N/B (plus latency).
    assert cm.pipelined_broadcast(m, k, 1, AB) == pytest.approx(cm.ring_broadcast(m, k, AB))
    zero_latency = cm.AlphaBeta(0.0, b)
    assert cm.pipelined_broadcast(m, k, 10_000, zero_latency) == pytest.approx(m / b, rel=1e-3)
    for f in (cm.ring_all_reduce, cm.ring_broadcast, cm.parameter_server):
        assert f(m, 1, AB) == 0.0
    with pytest.raises(ValueError, match="chunks"):
        cm.pipelined_broadcast(m, k, 0, AB)


@pytest.mark.parametrize("k", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [4096, 1 << 20, 64 << 20])
def test_best_chunks_is_the_brute_force_optimum(k, n):
    s = cm.best_chunks(n, k, AB)
    brute = min(range(1, 5000), key=lambda t: cm.pipelined_broadcast(n, k, t, AB))
    assert cm.pipelined_broadcast(n, k, s, AB) == pytest.approx(
        cm.pipelined_broadcast(n, k, brute, AB))
    if k > 2:
        assert abs(s - math.sqrt((k - 2) * n / (AB.alpha * AB.beta))) <= 1
    else:
        assert s == 1  # two ranks: one link, nothing to overlap
    assert cm.best_chunks(n, k, AB, max_chunks=2) <= 2


def test_doubling_algorithms():
    m = 1 << 20
    assert cm.recursive_doubling_all_reduce(m, 4, AB) == pytest.approx(2 * (AB.alpha + m / AB.beta))
    assert cm.recursive_doubling_all_reduce(m, 5, AB) == pytest.approx(4 * (AB.alpha + m / AB.beta))
    assert cm.halving_doubling_all_reduce(m, 8, AB) == pytest.approx(
        6 * AB.alpha + 2 * 7 / 8 * m / AB.beta)
    assert cm.halving_doubling_all_reduce(m, 3, AB) == pytest.approx(
        2 * AB.alpha + m / AB.beta + 2 * (AB.alpha + m / AB.beta))
    assert cm.recursive_doubling_all_reduce(m, 1, AB) == cm.halving_doubling_all_reduce(m, 1, AB) == 0
    # Few KiB: fewer latencies win; many MiB: the ring's bytes win.
    small, big = 1024, 64 << 20
    assert cm.recursive_doubling_all_reduce(small, 8, AB) < cm.ring_all_reduce(small, 8, AB)
    assert cm.recursive_doubling_all_reduce(big, 8, AB) > cm.ring_all_reduce(big, 8, AB)
    assert cm.predict("all_reduce", "halving-doubling", m, 4, AB) == \
        cm.halving_doubling_all_reduce(m, 4, AB)


def test_predict_dispatches_by_collective_and_algo():
    m, k = 1 << 20, 4
    assert cm.predict("all_reduce", "ring", m, k, AB) == cm.ring_all_reduce(m, k, AB)
    assert cm.predict("reduce", "ring", m, k, AB) == cm.ring_broadcast(m, k, AB)
    assert cm.predict("broadcast", "pipelined", m, k, AB, chunks=4) == \
        cm.pipelined_broadcast(m, k, 4, AB)
    assert cm.predict("all_reduce", "ps", m, k, AB) == cm.parameter_server(m, k, AB)
    assert cm.predict("all_reduce", "native", m, k, AB) is None
    assert cm.predict("all_reduce", "gloo", m, k, AB) is None
    assert cm.prediction_error(1.5, 1.0) == pytest.approx(0.5)
    assert cm.prediction_error(1.0, None) is None
    assert cm.model_fields(1.5e-6, 1e-6) == {"model_us": pytest.approx(1.0),
                                             "model_err": pytest.approx(0.5)}
    assert cm.model_fields(1.0, None) == {"model_us": None, "model_err": None}


def test_busbw_factors_match_nccl_tests():
    assert cm.busbw_factor("all_reduce", 4) == 1.5
    assert cm.busbw_factor("reduce_scatter", 4) == 0.75
    assert cm.busbw_factor("all_gather", 2) == 0.5
    assert cm.busbw_factor("broadcast", 8) == 1.0
    assert cm.busbw_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        cm.busbw_factor("alltoall", 4)


@pytest.mark.parametrize("k", [2, 3, 4, 16])
def test_lecture_traffic_ring_about_2m_ps_server_k_times(k):
    m = 1000.0
    ring = cm.expected_traffic("ring", m, k)
    ps = cm.expected_traffic("ps", m, k)
    assert ring["worker_sent"] == pytest.approx(2 * (k - 1) * m / k)
    assert ring["worker_sent"] < 2 * m
    assert ps["server_recv"] == ps["server_sent"] == (k - 1) * m
    assert ps["worker_sent"] == m
    assert cm.expected_traffic("ps-ring", m, k)["server_recv"] == m
    with pytest.raises(ValueError, match="unknown method"):
        cm.expected_traffic("tree", m, k)


def test_memory_bound():
    copy, add = 10e9, 5e9
    # All ranks on their own core: AllReduce busbw <= 1 / (1/copy + 1/(2 add)).
    roomy = cm.MemoryBound(copy, add, cores=4)
    assert cm.membw_busbw_bound("all_reduce", 4, roomy) == pytest.approx(1 / (1 / copy + 1 / (2 * add)))
    # Four ranks on two cores: half of that.
    tight = cm.MemoryBound(copy, add, cores=2)
    assert cm.membw_busbw_bound("all_reduce", 4, tight) == pytest.approx(
        cm.membw_busbw_bound("all_reduce", 4, roomy) / 2)
    # AllGather only copies: (K-1)/K S per rank at memcpy speed -> busbw <= copy.
    assert cm.membw_busbw_bound("all_gather", 4, roomy) == pytest.approx(copy)
    # Broadcast: every non-root copies N; on enough cores, busbw <= copy.
    assert cm.membw_busbw_bound("broadcast", 2, roomy) == pytest.approx(copy)
    assert cm.membw_busbw_bound("all_reduce", 1, roomy) is None
    assert "memcpy 10.0 GB/s" in roomy.describe()
