"""Edge cases a demanding user hits: preset overrides, layouts Megatron refuses,
batches that do not split, and traces cut short. Fast; no MPI."""

from __future__ import annotations

import argparse
import json
import warnings

import pytest
from test_pipeline_trace import write_trace
from test_timeline import _write_ring_trace

from mpiring.cli import main as cli_main
from mpiring.cli import plan as plan_cli
from mpiring.core import stepmodel as sm
from mpiring.runtime.trace import Tracer
from mpiring.tools import timeline
from mpiring.tools.plan import presets as pr
from mpiring.tools.plan.search import layouts, search


def test_deepseek_mla_is_resized_with_hidden_and_heads(capsys):
    # The preset's attention is MLA at h = 7168, a = 128 (187.1M a layer); at
    # h = 4096, a = 32 the same ranks give 39.1M (DeepSeek-V3 report §2.1.1).
    g = pr.reshape(pr.DEEPSEEK_V3, hidden=4096, heads=32)
    assert sm.attention_params(g) == pr._mla_params(4096, 32) == 39_059_456
    assert g.attn_width == 32 * (192 + 128)
    assert pr.reshape(pr.DEEPSEEK_V3, seq=2048).attn_params_per_layer == 187_105_280
    assert pr.reshape(pr.LLAMA31_405B, hidden=8192) == pr.LLAMA31_405B.with_(hidden=8192)
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    args = parser.parse_args(["--preset", "deepseek-v3", "--hidden", "4096", "--heads", "32"])
    assert plan_cli._problem(args)[0] == g  # what the CLI prices


def test_search_keeps_tp_dividing_the_key_value_heads():
    g = sm.GPT(4, 1024, 16, 512, 1000, kv_heads=2)
    tps = {lay.tp for lay in layouts(g, pr.selene(64), 512)}
    assert tps == {1, 2}  # Megatron asserts num_query_groups % tp == 0


def test_a_batch_no_layout_splits_names_the_dp_degrees():
    g = sm.GPT(2, 2048, 16, 2048, 51200)
    with pytest.raises(ValueError, match=r"dp can be 4, 8, 16, 32, 64 .* multiple of 4"):
        search(g, pr.selene(64), 7)


@pytest.mark.parametrize("changes,match", [
    ({"layers": 2}, "use at least 3 layers"),
    ({"heads": 4}, "use heads that are a multiple of 8"),
])
def test_preset_overrides_name_the_fix(changes, match):
    base = pr.DEEPSEEK_V3 if "layers" in changes else pr.LLAMA31_405B
    with pytest.raises(ValueError, match=match):
        base.with_(**changes)


# --- traces ---------------------------------------------------------------------------
def _cut_pipeline(tmp_path, keep: int):
    write_trace(tmp_path, "1f1b", 2, 4)  # 2 steps of 8 actions a rank
    path = tmp_path / "rank1.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:keep]) + "\n")


def test_a_pipeline_step_a_rank_did_not_finish_is_not_the_default(tmp_path):
    _cut_pipeline(tmp_path, -5)  # rank 1 ran 3 of step 2's 8 actions
    files = timeline.load(str(tmp_path))
    text = timeline.explain(files)
    # 1F1B, p = 2, m = 4: (p-1)/(m+p-1) = 20 % on both ranks, from the whole step 1.
    assert text.startswith("pipeline step 1 of 2") and "bubble 73" not in text
    assert text.count("bubble 20.0%") == 2 and "step 2 incomplete" in text
    asked = timeline.explain(files, "pipeline", 2)
    assert "incomplete: r1 ran 3 of its 8 F/B actions" in asked


def test_a_line_cut_short_at_the_end_is_dropped_with_a_warning(tmp_path):
    _write_ring_trace(tmp_path, 3, 9)
    path = tmp_path / "rank2.jsonl"
    path.write_text(path.read_text()[:-40])
    with pytest.warns(UserWarning, match=r"rank2.jsonl: line \d+ is cut short"):
        files = timeline.load(str(tmp_path))
    assert len(files) == 3 and files[2].records


@pytest.mark.parametrize("text,match", [
    ('{"type": "header", "rank": 0}\nhello\n{"type": "x"}\n', r"rank0.jsonl, line 2: not JSON"),
    ("[1, 2]\n", r"line 1: not a trace record"),
    ('{"type": "header"}\n', "header has no valid rank"),
])
def test_a_file_that_is_not_a_trace_is_named(tmp_path, text, match):
    (tmp_path / "rank0.jsonl").write_text(text)
    with pytest.raises(ValueError, match=match):
        timeline.load(str(tmp_path))


def test_a_trace_with_no_calls_says_so(tmp_path, capsys):
    for r in range(2):
        Tracer(r, str(tmp_path)).close()
    files = timeline.load(str(tmp_path))
    with pytest.raises(ValueError, match="no collective calls"):
        timeline.explain(files)
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="nothing to draw"):
        timeline.plot(files, str(tmp_path / "x.png"))


def test_the_cli_reads_a_cut_trace_and_warns_plainly(tmp_path, capsys):
    _write_ring_trace(tmp_path, 2, 4)
    path = tmp_path / "rank1.jsonl"
    path.write_text(path.read_text()[:-20])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI prints it, it does not raise
        assert cli_main(["trace", "merge", str(tmp_path), "-o", str(tmp_path / "t.json")]) == 0
    err = capsys.readouterr().err
    assert "mpiring trace merge: warning: rank1.jsonl: line" in err
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
