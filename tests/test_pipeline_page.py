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


def _mode(mode, step_ms, bubble, predicted, ideal_ms, busiest, predicted_busiest, peaks,
          idle=(), **common):
    """One mode's row; ``idle``: (idle_ms, predicted_idle_ms, idle_busiest_ms,
    predicted_idle_busiest_ms), where the page reads them."""
    row = {"mode": mode, "step_ms": step_ms, "bubble": bubble, "predicted": predicted,
           "ideal_ms": ideal_ms, "bubble_busiest": busiest, "predicted_busiest": predicted_busiest,
           "peak_act_mib": max(peaks), "peak_act_mib_per_stage": list(peaks), **common}
    row.update(zip(("idle_ms", "predicted_idle_ms", "idle_busiest_ms",
                    "predicted_idle_busiest_ms"), idle))
    return row


def _rows(m: int):
    common = {"m": m, "preset": "tiny", "mb_rows": 2, "ranks": 2}
    return [
        _mode("gpipe", 10.0, 0.30, 0.25, 9.0, 0.2, 0.2, (4.0, 3.0), **common),
        _mode("gpipe-recompute", 13.0, 0.3, 0.3, 12.0, 0.2, 0.2, (1.0, 1.5), **common),
        _mode("1f1b", 9.0, 0.20, 0.16, 8.0, 0.10, 0.08, (2.0, 0.75),
              idle=(1.8, 1.28, 0.9, 0.64), **common),
        _mode("1f1b-autograd", 9.6, 0.2, 0.16, 8.4, 0.1, 0.08, (2.0, 0.75), **common),
        _mode("zb", 8.0, 0.05, 0.04, 7.5, 0.03, 0.02, (2.0, 2.1),
              idle=(0.4, 0.3, 0.24, 0.15), **common),
        _mode("zb-cap", 8.5, 0.08, 0.07, 8.0, 0.05, 0.04, (2.0, 1.9),
              idle=(0.68, 0.56, 0.425, 0.32), **common),
        _mode("interleaved", 8.1, 0.12, 0.10, 7.8, 0.06, 0.05, (2.5, 1.0),
              idle=(1.0, 0.8, 0.5, 0.4), **common),
        _mode("interleaved-zb", 7.6, 0.05, 0.04, 7.3, 0.03, 0.02, (2.4, 2.2),
              idle=(0.45, 0.3, 0.2, 0.1), **common),
        _mode("zbv", 7.2, 0.04, 0.03, 7.0, 0.02, 0.01, (2.2, 2.0),
              idle=(0.45, 0.32, 0.18, 0.08), **common),
        _mode("dualpipev", 6.84, 0.03, 0.03, 6.8, 0.02, 0.01, (2.4, 2.3),
              idle=(0.4, 0.3, 0.09, 0.06), **common),
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
    assert ("| 1F1B, weight gradients added in the GEMM / by autograd: step (compute bound) "
            "| 0.94 (0.95) |") in table
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
    # Interleaved zero bubble against interleaved 1F1B: idle 0.2 / 0.5 ms (0.1 / 0.4).
    assert ("| interleaved zero bubble / interleaved 1F1B idle time of the busiest rank, "
            "measured (predicted) | 0.40 (0.25) |") in table
    assert ("| peak activations MiB, interleaved zero bubble / interleaved 1F1B (max over "
            "ranks) | 2.40 / 2.50 |") in table
    assert "| interleaved zero bubble / interleaved 1F1B step | 0.94 |" in table
    assert ("| ZB-V (2 stages per rank in a V) / 1F1B idle time of the busiest stage, measured "
            "(predicted) | 0.20 (0.12) |") in table
    assert "| ZB-V / 1F1B idle time of the worst rank, measured | 0.25 |" in table
    assert "| peak activations MiB, ZB-V / 1F1B (max over ranks) | 2.20 / 2.00 |" in table
    assert "| ZB-V / 1F1B step | 0.80 |" in table
    # DualPipeV against ZB-V: idle 0.09 / 0.18 ms of the busiest stage (0.06 / 0.08).
    assert ("| DualPipeV / ZB-V (the same stages and V) idle time of the busiest stage, "
            "measured (predicted) | 0.50 (0.75) |") in table
    assert "| peak activations MiB, DualPipeV / ZB-V (max over ranks) | 2.40 / 2.20 |" in table
    assert "| DualPipeV / ZB-V step | 0.95 |" in table


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


def _launch(gpipe_bubble: float, torch_ms: float | None) -> list[dict]:
    """A launch whose GPipe bubble and torch step differ from the others'."""
    rows = [dict(r) for r in _rows(4) if torch_ms is not None or r["mode"] != "torch-1f1b"]
    for r in rows:
        if r["mode"] == "gpipe":
            r["bubble"] = gpipe_bubble
        if r["mode"] == "torch-1f1b":
            r["step_ms"] = torch_ms
    return rows


def test_the_goals_of_every_launch_and_their_median(tmp_path):
    page = _page_module()
    runs = [_launch(0.30, 12.0), _launch(0.35, 10.0), _launch(0.26, 9.0)]
    table = "\n".join(page.across(runs))
    # GPipe's predicted bubble is 0.25: 1.20, 1.40, 1.04; 1F1B's step 9 ms against torch's.
    assert ("| GPipe bubble, measured / predicted (goal <= 1.10) | 1.20, 1.40, 1.04 "
            "(median 1.20) |") in table
    assert ("| 1F1B step / torch Schedule1F1B step (goal <= 0.9) | 0.75, 0.90, 1.00 "
            "(median 0.90) |") in table
    assert "| 1F1B bubble, measured / predicted (goal <= 1.10) | 1.25, 1.25, 1.25 " in table
    assert "the schedules' prediction" not in table  # only the goals' own rows
    # An even count takes the middle two's mean; a launch without a mode leaves its dash.
    table = "\n".join(page.across([_launch(0.30, 12.0), _launch(0.35, None)]))
    assert "| 1.20, 1.40 (median 1.30) |" in table
    assert "| 1F1B step / torch Schedule1F1B step (goal <= 0.9) | 0.75, - |" in table
    # The page: small.json first (printed), then small-2.json, small-3.json.
    for k, rows in enumerate(runs, start=1):
        name = "tiny" if k == 1 else f"tiny-{k}"
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    (tmp_path / "tiny.txt").write_text("the first launch's output\n")
    (tmp_path / "machine.json").write_text('{"cores": 2, "load_before": "0.5", "load_after": "0.7"}')
    text = page.page(str(tmp_path), "abc1234")
    assert "The goals in each of the run's 3 launches" in text
    assert "1.20, 1.40, 1.04 (median 1.20)" in text
    assert "| GPipe bubble, measured / predicted (goal <= 1.10) | 1.20 |" in text  # launch 1
    assert "the first launch's output" in text
    (tmp_path / "tiny-2.json").unlink()  # launches are numbered without a gap
    assert "launches" not in page.page(str(tmp_path), "abc1234")
