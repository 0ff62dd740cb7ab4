"""The host cost model's pure formulas (mpiring.core.hostcost), by hand, and its probes' plumbing."""

import pytest

from mpiring.core import hostcost as hc
from mpiring.core import stepmodel as sm

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)


def test_a_linear_is_three_gemms_in_autograds_layouts():
    fwd, dx, dw = hc.linear_gemms(5, 3, 7)
    assert (fwd.key, dx.key, dw.key) == ((5, 3, 7, "nt"), (5, 7, 3, "nn"), (7, 5, 3, "tn"))
    assert fwd.flops == dx.flops == dw.flops == 2 * 5 * 3 * 7
    assert hc.linear_gemms(5, 3, 7, count=4)[0].flops == 4 * 210
    with pytest.raises(ValueError, match=">= 1"):
        hc.linear_gemms(0, 3, 7)


def test_shards_are_rank_zeros_array_split_part():
    assert [hc.shard(5, 2), hc.shard(4, 2), hc.shard(0, 3), hc.shard(7, 1)] == [3, 2, 0, 7]
    assert hc.tp_widths(64, 256, 1, 2) == (64, 128)  # one head cannot be split: rank 0 has it
    assert hc.tp_widths(128, 512, 4, 3) == (64, 171)  # 2 of 4 heads of 32, ceil(512 / 3)
    assert hc.tp_widths(512, 2048, 8, 1) == (512, 2048)
    with pytest.raises(ValueError, match="heads dividing d"):
        hc.tp_widths(100, 400, 3, 2)
    with pytest.raises(ValueError):
        hc.shard(4, 0)


def test_block_gemms_are_the_step_models_linear_flops():
    # d = 2, a = 2, f = 8, T = 3: 3 passes x 2 T (d 3a + a d + d f + f d) = 6 * 3 * 48 = 864.
    assert sum(g.flops for g in hc.block_gemms(3, 2, 2, 8)) == 864
    g = sm.GPT(1, 48, 3, 16, 1)
    assert sum(x.flops for x in hc.block_gemms(10, 48, 48, 192)) == pytest.approx(
        10 * sm.training_flops_by_kind(g)["linear"])
    assert len(hc.block_gemms(3, 2, 2, 8, layers=5)) == 12
    assert hc.block_gemms(3, 2, 2, 8, layers=5)[0].count == 5


def test_merge_adds_the_counts_of_one_shape():
    a, b = hc.Gemm(2, 3, 4, "nt", 2), hc.Gemm(2, 3, 4, "nn")
    merged = hc.merge([a, b, hc.Gemm(2, 3, 4, "nt", 3)])
    assert [(g.key, g.count) for g in merged] == [(a.key, 5), (b.key, 1)]


def test_elementwise_byte_counts_by_hand():
    # T (26d + 4a + 6f + 3q), q = 3a: 2 (78 + 12 + 72 + 27) = 378 elements of 4 bytes.
    assert hc.block_elementwise_bytes(2, 3, 3, 12) == 4 * 378
    # T (14d + 5V) + 3Vd = 2 (42 + 25) + 45 = 179 elements.
    assert hc.model_elementwise_bytes(2, 3, 5) == 4 * 179
    assert hc.probe_bytes(2, 3, 12) == 4 * 2 * (27 + 60)
    assert hc.adamw_bytes(10) == 280 and hc.bucket_copy_bytes(10) == 240
    with pytest.raises(ValueError):
        hc.block_elementwise_bytes(2, 3, 0, 12)


def test_host_seconds_adds_each_part_over_its_rate():
    gemms = [hc.Gemm(10, 10, 10), hc.Gemm(10, 10, 20, "nn", 2)]
    rates = {"nt": 1e3, "nn": 2e3}
    got = hc.host_seconds(gemms, lambda g: rates[g.layout], attention_s=0.5,
                          elementwise_bytes=300.0, elementwise_bw=100.0, stream_bytes=50.0,
                          stream_bw=25.0)
    assert got["gemm"] == pytest.approx(2000 / 1e3 + 8000 / 2e3)
    assert (got["attention"], got["elementwise"], got["stream"]) == (0.5, 3.0, 2.0)
    assert got["total"] == pytest.approx(6.0 + 0.5 + 3.0 + 2.0)
    with pytest.raises(ValueError, match="measure it first"):
        hc.host_seconds(gemms, lambda g: 0.0)
    with pytest.raises(ValueError, match="positive"):
        hc.host_seconds(gemms, lambda g: 1.0, elementwise_bw=0.0)


def test_calibration_times_the_layouts_it_names():
    torch = pytest.importorskip("torch")
    from mpiring.tools.plan import calibrate

    for layout in ("nt", "nn", "tn"):
        a, b = calibrate.gemm_operands(6, 4, 5, layout)
        assert (a @ b).shape == (6, 5)
        assert a.is_contiguous() == (layout != "tn") and b.is_contiguous() == (layout != "nt")
    with pytest.raises(ValueError, match="nt, nn or tn"):
        calibrate.gemm_operands(2, 2, 2, "tt")
    spec = {"gemm": [[16, 8, 4, "nt"], [4, 16, 8, "tn"]], "attention": [[1, 2, 8, 4]],
            "probe": [[8, 4, 16]], "stream_mib": 0.25}
    got = calibrate.calibrate(None, spec, repeat=2)
    assert set(got["gemm"]) == {"16x8x4:nt", "4x16x8:tn"} and set(got["probe"]) == {"8x4x16"}
    assert got["attention"]["1x2x8x4"] > 0 and got["stream_bw"] > 0 and got["ranks"] == 1
    assert all(v > 0 for v in got["gemm"].values())
    assert torch.get_num_threads() >= 1


def test_two_calibrations_combine_as_one_stretch_of_time():
    from mpiring.tools.plan import calibrate

    def cal(rate, att, bw):
        return {"gemm": {"g": rate}, "attention": {"a": att}, "probe": {"p": bw},
                "stream_bw": bw, "ranks": 1, "seconds": 1.0, "spread": 0.0}
    got = calibrate.combine(cal(100.0, 1.0, 10.0), cal(300.0, 3.0, 30.0))
    # Equal work in each: 1/100 + 1/300 seconds for 2 units is a rate of 150.
    assert got["gemm"]["g"] == pytest.approx(150.0) and got["attention"]["a"] == 2.0
    assert got["probe"]["p"] == pytest.approx(15.0) and got["stream_bw"] == pytest.approx(15.0)
    assert got["per_rank"][0]["gemm"]["g"] == pytest.approx(150.0) and got["seconds"] == 2.0
