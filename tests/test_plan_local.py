"""plan --local: this host's constants, mpiring's 2-rank DDP, TP and PP steps, predicted vs measured.

The plumbing is tested here on tiny sizes; the 20 % goal is a benchmark
(docs/planner.md), not a test: on a shared host the timings are noise at these sizes.
"""

import functools
import json
import os

import pytest
from conftest import ROOT, wait_quietly
from mpi_harness import scrubbed_env

from mpiring.cli import build_parser
from mpiring.core.costmodel import AlphaBeta, ring_all_reduce
from mpiring.tools.plan import calibrate, local, local_runs
from mpiring.tools.plan import local_work as lw

AB = AlphaBeta(20e-6, 5e9)
RATE, BW, SBW, ATT = 2e10, 1e10, 2e10, 1e-4


@pytest.mark.parametrize("ranks,threads,comm,cores,want", [
    (2, 1, 1, 4, 1.0), (2, 1, 1, 2, 0.0), (2, 1, 1, 3, 0.5), (1, 1, 1, 2, 1.0), (3, 2, 1, 16, 1.0),
    (2, 2, 1, 2, 0.0), (2, 1, 0, 8, 0.0)])
def test_cpu_overlap_is_the_free_cores_over_the_comm_threads(ranks, threads, comm, cores, want):
    assert local.cpu_overlap(ranks, threads, comm, cores) == want


def test_cpu_overlap_and_sizes_refuse_bad_input():
    with pytest.raises(ValueError, match=">= 1"):
        local.cpu_overlap(0, 1, 1, 2)
    with pytest.raises(ValueError, match="tiny, default"):
        local_runs.bench_command("tp", "huge", 2, "x.json")


def _rows(d=128, tokens=128):
    ddp = {"mode": "ddp", "ranks": 2, "preset": "tiny", "params": 118528, "batch": 2,
           "seq_len": 32, "step_ms": 5.0, "comm_total_ms": 1.0}
    return {"ddp": [{**ddp, "mode": "compute", "step_ms": 2.0}, ddp,
                    {**ddp, "mode": "naive"}],
            "tp": [{"block": "layer", "mode": "mpiring", "width": d, "ranks": 2, "tokens": tokens,
                    "step_ms": 3.0}, {"block": "mlp", "mode": "mpiring", "width": d}],
            "pp": [{"mode": "1f1b", "m": 4, "step_ms": 7.0}, {"mode": "zb", "m": 4}]}


def _flat_calibration(runs):
    """Every GEMM at RATE, attention ATT s a call, elementwise at BW, streaming at SBW."""
    spec = lw.spec_for(local.run_works(runs, pp_preset="tiny", pp_mb_rows=1))
    return {"gemm": {calibrate.gemm_key(g): RATE for g in spec["gemm"]},
            "attention": {calibrate.shape_key(a): ATT for a in spec["attention"]},
            "probe": {calibrate.shape_key(p): BW for p in spec["probe"]}, "stream_bw": SBW}


def test_compare_runs_prices_each_layout_by_hand():
    runs = _rows()
    cal = _flat_calibration(runs)
    rows = local.compare_runs(runs, AB, cal, pp_preset="tiny", pp_mb_rows=1, ranks=2, cores=2)
    assert [r["run"] for r in rows] == ["compute alone", "DDP=2", "TP=2", "PP=2"]
    for r in rows:
        assert r["residual"] == pytest.approx((r["predicted_ms"] - r["measured_ms"])
                                              / r["measured_ms"])
    compute, ddp, tp, pp = rows
    # TP, d = 128, 2 heads over 2 ranks: a = 64, f = 256 per rank, 128 tokens in 2 windows.
    # GEMMs 3 x 2 T (d 3a + a d + d f + f d) = 6 x 128 x 98,304; one attention call;
    # elementwise T (26d + 4a + 6f + 3 x 3a) + the loss's 6 T d, fp32; 4 ring AllReduces.
    elem = 4 * 128 * (26 * 128 + 4 * 64 + 6 * 256 + 9 * 64 + 6 * 128)
    want = (6 * 128 * 98304 / RATE + ATT + elem / BW
            + 4 * ring_all_reduce(4.0 * 128 * 128, 2, AB))
    assert tp["predicted_ms"] == pytest.approx(want * 1e3)
    assert tp["gemm_rate"] == pytest.approx(RATE) and tp["host_attention_ms"] == ATT * 1e3
    # DDP on 2 cores, 2 ranks: no free core for the comm thread, the reduction is all exposed;
    # AdamW (28 B) and the reducer's copies (24 B) per parameter at the streaming rate.
    assert ddp["dp_exposed_ms"] == pytest.approx(ddp["dp_total_ms"]) and ddp["dp_total_ms"] > 0
    assert ddp["optimizer_ms"] == pytest.approx(28 * 118528 / SBW * 1e3)
    assert ddp["bucket_ms"] == pytest.approx(24 * 118528 / SBW * 1e3)
    assert compute["bucket_ms"] == 0 and compute["dp_total_ms"] == 0
    assert ddp["predicted_ms"] - compute["predicted_ms"] == pytest.approx(
        ddp["dp_exposed_ms"] + ddp["bucket_ms"])
    more = local.compare_runs(runs, AB, cal, pp_preset="tiny", pp_mb_rows=1, ranks=2, cores=8)
    assert more[1]["dp_exposed_ms"] < ddp["dp_exposed_ms"]
    # PP: each stage 1/2 of the whole model's priced work, 1F1B's bubble (p-1)/m, fp32 sends.
    whole = lw.price(lw.pp_work(64, 2, 2, 32, 256, 1, 4), cal)["compute"]
    assert pp["compute_ms"] == pytest.approx(whole / 2 * 1e3)
    assert pp["bubble_ms"] == pytest.approx(
        (pp["compute_ms"] / 4 + pp["pp_comm_ms"] / 4) * 1 / 4 * 4)
    assert pp["pp_comm_ms"] == pytest.approx(4 * 2 * AB.time(4.0 * 32 * 64) * 1e3)
    # Each bench's own calibration, by kind: a faster GEMM rate for TP alone moves TP alone.
    fast = {**cal, "gemm": {k: 2 * v for k, v in cal["gemm"].items()}}
    by_kind = local.compare_runs(runs, AB, {"ddp": cal, "tp": fast, "pp": cal}, pp_preset="tiny",
                                 pp_mb_rows=1, ranks=2, cores=2)
    assert by_kind[2]["host_gemm_ms"] == pytest.approx(tp["host_gemm_ms"] / 2)
    assert by_kind[1]["predicted_ms"] == ddp["predicted_ms"]


def test_a_shape_missing_from_the_calibration_is_named():
    runs = _rows()
    cal = _flat_calibration(runs)
    cal["gemm"].pop(next(iter(cal["gemm"])))
    with pytest.raises(ValueError, match="no gemm figure for .*spec_for"):
        local.compare_runs(runs, AB, cal, pp_preset="tiny", pp_mb_rows=1, ranks=2, cores=2)


def test_the_spec_covers_every_bench_shape_at_each_size():
    for size in local_runs.SIZES:
        spec = local_runs.spec_for_size(size, 2)
        assert spec["gemm"] and spec["attention"] and len(spec["probe"]) == 3
        assert all(a[1] >= 1 for a in spec["attention"])  # a rank never has 0 heads
    cmd = local_runs.bench_command("tp", "tiny", 2, "o.json", ("s.json", "c.json"))
    assert cmd[cmd.index("--then") - 3:cmd.index("--then") + 2] == [
        "--calibrate", "s.json", "c.json", "--then", "bench-tp"]
    assert local_runs.pp_shape("default") == ("small", 2)


def _plan(*argv: str) -> int:
    """``python -m mpiring plan ARGV`` in this process, without mpiring.cli.main around
    it: main turns an error into an abort of the whole job (here the test job, with its
    report lost in pytest's capture); here the error reaches pytest."""
    args = build_parser().parse_args(["plan", *argv])
    return args._module.run(args)


@pytest.mark.deadline(240)
def test_plan_local_runs_the_benches_and_compares(world, tmp_path_factory, monkeypatch, capfd):
    pytest.importorskip("torch")
    if world.rank == 0:
        # The command runs in this process: a process of its own would first import
        # torch again, seconds on a loaded host. The benches it launches are nested jobs
        # as before, so they get the environment a fresh process would pass on, without
        # this job's launcher.
        env = scrubbed_env()
        for key in set(os.environ) - set(env):
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(ROOT)
        # Each bench job under a deadline of its own (the command's default is 15 min).
        monkeypatch.setattr(local_runs, "run_bench",
                            functools.partial(local_runs.run_bench, timeout_s=150))
        out = tmp_path_factory.mktemp("local") / "local.json"
        rc = _plan("--local", "--local-size", "tiny", "--rounds", "1", "--json", str(out))
        printed = capfd.readouterr()
    wait_quietly(world)
    if world.rank != 0:
        return
    assert rc == 0, printed.out + printed.err
    stdout = printed.out
    got = json.loads(out.read_text())
    assert [r["run"] for r in got["rows"]] == ["compute alone", "DDP=2", "TP=2", "PP=2"]
    # A busy machine can push the ring rows' latency fit below zero, which the fit clamps
    # to 0 (costmodel.fit_alpha_beta): the bandwidth is what must come out.
    assert got["alpha_s"] >= 0 and got["beta_Bps"] > 0 and got["cores"] >= 1
    for cal in got["calib"][0].values():  # each bench's, timed on both ranks of its job
        assert cal["ranks"] == 2 and min(cal["gemm"].values()) > 0 and cal["stream_bw"] > 0
        assert len(cal["bench_share"]) == 2 and min(cal["bench_share"]) > 0
        assert min(cal["oncore"]["gemm"].values()) > 0
    for r in got["rows"]:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["flop_rate"] > 0, r
        assert r["oncore_predicted_ms"] > 0, r
        assert f"{r['predicted_ms']:.1f}" in stdout
    assert "load" in stdout and "ring fit" in stdout
    assert _plan("--local", "a.json") == 2
    assert "--local takes no file or BENCH_JSON DDP_JSON" in capfd.readouterr().err


def test_each_ranks_own_calibration_prices_the_slowest_rank():
    runs = _rows()
    cal = _flat_calibration(runs)
    slow = {**cal, "gemm": {k: v / 3 for k, v in cal["gemm"].items()}}
    work = lw.tp_work(128, 128, 2)
    got = lw.price(work, {**cal, "per_rank": [cal, slow]})
    assert got == lw.price(work, slow) and got["gemm"] == pytest.approx(
        3 * lw.price(work, cal)["gemm"])


def test_oncore_pricing_stretches_the_cpu_rates_by_the_benchs_share_of_a_core():
    runs = _rows()
    cal = _flat_calibration(runs)
    work = lw.tp_work(128, 128, 2)
    rank = {**cal, "oncore": cal}
    both = {**cal, "per_rank": [rank, rank], "bench_share": [1.0, 0.5]}
    got, flat = lw.price(work, both, oncore=True), lw.price(work, cal)
    # The rank with half a core is the slowest: every second doubles, every rate halves.
    assert got["compute"] == pytest.approx(2 * flat["compute"])
    assert got["gemm_rate"] == pytest.approx(flat["gemm_rate"] / 2)
    # A share above 1 (the comm thread's CPU time) is a whole core, not a faster one.
    over = lw.price(work, {**both, "bench_share": [1.6, 1.2]}, oncore=True)
    assert over["compute"] == pytest.approx(flat["compute"])
    with pytest.raises(ValueError, match="plan --calibrate"):
        lw.price(work, cal, oncore=True)
    rows = local.compare_runs(runs, AB, {**both, "bench_share": [0.5, 0.5]}, pp_preset="tiny",
                              pp_mb_rows=1, ranks=2, cores=2, oncore=True)
    base = local.compare_runs(runs, AB, cal, pp_preset="tiny", pp_mb_rows=1, ranks=2, cores=2)
    assert rows[0]["compute_ms"] == pytest.approx(2 * base[0]["compute_ms"])
