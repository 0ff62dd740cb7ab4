"""scripts/pipeline_page.py: the goals table computed from a run's rows."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _page_module():
    spec = importlib.util.spec_from_file_location(
        "pipeline_page", os.path.join(ROOT, "scripts", "pipeline_page.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(m: int):
    common = {"m": m, "preset": "tiny", "mb_rows": 2, "ranks": 2}
    return [
        {"mode": "gpipe", "step_ms": 10.0, "bubble": 0.30, "predicted": 0.25, "ideal_ms": 9.0,
         "bubble_busiest": 0.2, "predicted_busiest": 0.2,
         "peak_act_mib": 4.0, "peak_act_mib_per_stage": [4.0, 3.0], **common},
        {"mode": "gpipe-recompute", "step_ms": 13.0, "bubble": 0.3, "predicted": 0.3,
         "bubble_busiest": 0.2, "predicted_busiest": 0.2, "ideal_ms": 12.0, "peak_act_mib": 1.5, "peak_act_mib_per_stage": [1.0, 1.5], **common},
        {"mode": "1f1b", "step_ms": 9.0, "bubble": 0.20, "predicted": 0.16, "ideal_ms": 8.0,
         "bubble_busiest": 0.10, "predicted_busiest": 0.08, "idle_ms": 1.8,
         "predicted_idle_ms": 1.28, "idle_busiest_ms": 0.9, "predicted_idle_busiest_ms": 0.64,
         "peak_act_mib": 2.0, "peak_act_mib_per_stage": [2.0, 0.75], **common},
        {"mode": "zb", "step_ms": 8.0, "bubble": 0.05, "predicted": 0.04, "ideal_ms": 7.5,
         "bubble_busiest": 0.03, "predicted_busiest": 0.02, "idle_ms": 0.4,
         "predicted_idle_ms": 0.3, "idle_busiest_ms": 0.24, "predicted_idle_busiest_ms": 0.15,
         "peak_act_mib": 2.1, "peak_act_mib_per_stage": [2.0, 2.1], **common},
        {"mode": "zb-cap", "step_ms": 8.5, "bubble": 0.08, "predicted": 0.07, "ideal_ms": 8.0,
         "bubble_busiest": 0.05, "predicted_busiest": 0.04, "idle_ms": 0.68,
         "predicted_idle_ms": 0.56, "idle_busiest_ms": 0.425, "predicted_idle_busiest_ms": 0.32,
         "peak_act_mib": 2.0, "peak_act_mib_per_stage": [2.0, 1.9], **common},
        {"mode": "interleaved", "step_ms": 8.1, "bubble": 0.12, "predicted": 0.10,
         "ideal_ms": 7.8, "bubble_busiest": 0.06, "predicted_busiest": 0.05,
         "peak_act_mib": 2.5, "peak_act_mib_per_stage": [2.5, 1.0], **common},
        {"mode": "zbv", "step_ms": 7.2, "bubble": 0.04, "predicted": 0.03, "ideal_ms": 7.0,
         "bubble_busiest": 0.02, "predicted_busiest": 0.01, "idle_ms": 0.45,
         "predicted_idle_ms": 0.32, "idle_busiest_ms": 0.18, "predicted_idle_busiest_ms": 0.08,
         "peak_act_mib": 2.2, "peak_act_mib_per_stage": [2.2, 2.0], **common},
        {"mode": "torch-1f1b", "step_ms": 12.0, "bubble": None, "predicted": None,
         "peak_act_mib": None, **common},
    ]


def test_goals_are_the_ratios_of_the_rows():
    page = _page_module()
    table = "\n".join(page.goals(_rows(4)))
    assert "| GPipe bubble, measured / predicted (goal <= 1.10) | 1.20 |" in table
    assert "| 1F1B bubble, measured / predicted (goal <= 1.10) | 1.25 |" in table
    # ZB-H1 in idle time: 0.24 / 0.9 ms, where the shares of the steps give 0.03 / 0.10.
    assert "| ZB-H1 / 1F1B idle time of the busiest stage, measured (goal <= 0.5) | 0.27 |" \
        in table
    assert "| ZB-H1, the same, the schedules' prediction | 0.23 |" in table
    assert "| ZB-H1 / 1F1B idle time of the worst rank, measured (predicted) | 0.22 (0.23) |" \
        in table
    assert "| peak activations MiB, ZB-H1 / 1F1B (max over stages) | 2.10 / 2.00 |" in table
    assert ("| ZB-H1 within 1F1B's peak (zb-cap) / 1F1B idle time of the busiest stage, "
            "measured (goal <= 0.5) | 0.47 |") in table
    assert "| zb-cap, the same, the schedules' prediction | 0.50 |" in table
    assert "| zb-cap / 1F1B idle time of the worst rank, measured | 0.38 |" in table
    assert "| peak activations MiB, zb-cap / 1F1B (max over stages) | 2.00 / 2.00 |" in table
    assert ("| as shares of each step: ZB-H1 / 1F1B and zb-cap / 1F1B bubble, busiest stage "
            "| 0.30 / 0.50 |") in table
    assert "| 1F1B step / torch Schedule1F1B step (goal <= 0.9) | 0.75 |" in table
    assert "| torch step / 1F1B's simulated compute bound | 1.50 |" in table
    # Recomputation: one micro-batch (GPipe's peak / m) plus m stage inputs, per stage;
    # tiny: 2 rows x 32 tokens, int64 ids on stage 0, 64 float32 after.
    one_input = [2 * 32 * 8 / 2**20, 2 * 32 * 4 * 64 / 2**20]
    pred = max(p / 4 + 4 * i for p, i in zip([4.0, 3.0], one_input))
    assert f"| GPipe recompute peak MiB, measured / m inputs + one micro-batch | 1.50 / {pred:.2f} |" \
        in table
    assert "| GPipe recompute step / GPipe step | 1.30 |" in table
    assert "| interleaved 1F1B (2 stages per rank) bubble, measured / predicted | 1.20 |" in table
    assert "| interleaved / 1F1B bubble, measured (predicted) | 0.60 (0.62) |" in table
    assert "| interleaved / 1F1B step | 0.90 |" in table
    assert ("| ZB-V (2 stages per rank in a V) / 1F1B idle time of the busiest stage, measured "
            "(predicted) | 0.20 (0.12) |") in table
    assert "| ZB-V / 1F1B idle time of the worst rank, measured | 0.25 |" in table
    assert "| peak activations MiB, ZB-V / 1F1B (max over ranks) | 2.20 / 2.00 |" in table
    assert "| ZB-V / 1F1B step | 0.80 |" in table


def test_a_missing_mode_leaves_a_dash(tmp_path):
    page = _page_module()
    rows = [r for r in _rows(8) if r["mode"] != "torch-1f1b"]
    table = "\n".join(page.goals(rows))
    assert "| 1F1B step / torch Schedule1F1B step (goal <= 0.9) | - |" in table
    (tmp_path / "tiny.json").write_text(json.dumps(rows))
    (tmp_path / "tiny.txt").write_text("the bench's output\n")
    (tmp_path / "machine.json").write_text('{"cores": 2, "load_before": "0.5", "load_after": "0.7"}')
    text = page.page(str(tmp_path), "abc1234")
    assert "commit `abc1234`; 2 cores" in text and "## tiny" in text
    assert "the bench's output" in text and "## small" not in text


@pytest.mark.parametrize("stage", [0, 1])
def test_stage_input_sizes(stage):
    page = _page_module()
    want = 2 * 64 * (8 if stage == 0 else 4 * 256) / 2**20
    assert page._input_mib("small", 2, stage) == want
