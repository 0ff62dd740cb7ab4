"""plan --local: this host's constants, mpiring's 2-rank DDP, TP and PP steps, predicted vs measured.

The plumbing is tested here on tiny sizes; the 20 % goal is a benchmark
(docs/planner.md), not a test: on a shared host the timings are noise at these sizes.
"""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, wait_quietly
from mpi_harness import scrubbed_env

from mpiring.core import stepmodel as sm
from mpiring.core.costmodel import AlphaBeta, ring_all_reduce
from mpiring.tools.plan import local, local_runs

AB = AlphaBeta(20e-6, 5e9)
RATE, BW = 2e10, 1e10


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


def test_adamw_is_seven_fp32_words_per_parameter():
    assert local.adamw_seconds(10**6, 28e6) == pytest.approx(1.0)


def _rows(d=128, tokens=128):
    ddp = {"mode": "ddp", "ranks": 2, "preset": "tiny", "params": 118528, "batch": 2,
           "seq_len": 32, "step_ms": 5.0, "comm_total_ms": 1.0}
    return {"ddp": [{**ddp, "mode": "compute", "step_ms": 2.0}, ddp,
                    {**ddp, "mode": "naive"}],
            "tp": [{"block": "layer", "mode": "mpiring", "width": d, "ranks": 2, "tokens": tokens,
                    "step_ms": 3.0}, {"block": "mlp", "mode": "mpiring", "width": d}],
            "pp": [{"mode": "1f1b", "m": 4, "step_ms": 7.0}, {"mode": "zb", "m": 4}]}


def test_compare_runs_prices_each_layout_by_hand():
    rows = local.compare_runs(_rows(), AB, pp_preset="tiny", pp_mb_rows=1, ranks=2, cores=2,
                              flop_rate=lambda m, k, n: RATE, mem_bw=BW)
    assert [r["run"] for r in rows] == ["compute alone", "DDP=2", "TP=2", "PP=2"]
    for r in rows:
        assert r["residual"] == pytest.approx((r["predicted_ms"] - r["measured_ms"])
                                              / r["measured_ms"])
    compute, ddp, tp, pp = rows
    # TP: 3 x forward FLOPs over 2 ranks, plus 4 fp32 ring AllReduces of the block's output.
    g = sm.GPT(1, 128, 2, 64, 1)
    want = (sm.training_flops_per_token(g) * 128 / 2 / RATE
            + 4 * ring_all_reduce(4.0 * 128 * 128, 2, AB))
    assert tp["predicted_ms"] == pytest.approx(want * 1e3)
    # DDP on 2 cores, 2 ranks: no free core for the comm thread, the reduction is all exposed.
    assert ddp["dp_exposed_ms"] == pytest.approx(ddp["dp_total_ms"]) and ddp["dp_total_ms"] > 0
    assert ddp["optimizer_ms"] == pytest.approx(28 * 118528 / BW * 1e3)
    more = local.compare_runs(_rows(), AB, pp_preset="tiny", pp_mb_rows=1, ranks=2, cores=8,
                              flop_rate=lambda m, k, n: RATE, mem_bw=BW)
    assert more[1]["dp_exposed_ms"] < ddp["dp_exposed_ms"]
    # PP: half the layers per stage, 1F1B's bubble (p-1)/m, sends of fp32 activations.
    assert pp["bubble_ms"] == pytest.approx(
        (pp["compute_ms"] / 4 + pp["pp_comm_ms"] / 4) * 1 / 4 * 4)
    assert pp["pp_comm_ms"] == pytest.approx(4 * 2 * AB.time(4.0 * 32 * 64) * 1e3)


@pytest.mark.deadline(240)
def test_plan_local_runs_the_benches_and_compares(world, tmp_path_factory):
    pytest.importorskip("torch")
    if world.rank == 0:
        out = tmp_path_factory.mktemp("local") / "local.json"
        proc = subprocess.run([sys.executable, "-m", "mpiring", "plan", "--local", "--local-size",
                               "tiny", "--rounds", "1", "--json", str(out)], cwd=ROOT,
                              env=scrubbed_env(), capture_output=True, text=True, timeout=200)
    wait_quietly(world)
    if world.rank != 0:
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(out.read_text())
    assert [r["run"] for r in got["rows"]] == ["compute alone", "DDP=2", "TP=2", "PP=2"]
    assert got["alpha_s"] > 0 and got["beta_Bps"] > 0 and got["cores"] >= 1
    for r in got["rows"]:
        assert r["measured_ms"] > 0 and r["predicted_ms"] > 0 and r["flop_rate"] > 0, r
        assert f"{r['predicted_ms']:.1f}" in proc.stdout
    assert "load" in proc.stdout and "ring fit" in proc.stdout
    assert subprocess.run([sys.executable, "-m", "mpiring", "plan", "--local", "a.json"],
                          cwd=ROOT, env=scrubbed_env(), capture_output=True).returncode == 2
