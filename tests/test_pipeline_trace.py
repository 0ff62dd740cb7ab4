"""`trace explain` / `trace plot` of a pipeline run: a real traced run and synthetic traces.

The synthetic traces hold the validator's unit-cost simulation as if measured,
so the drawing must be the lecture's picture exactly and the bubble the
formula; the real run checks that what the runtime records is read back as
the schedule it ran.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile

import pytest
import torch
from conftest import wait_quietly

import mpiring
from mpiring.cli import main as cli_main
from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.pipeline import Schedule1F1B, ScheduleZeroBubble
from mpiring.parallel.pipeline.diagram import draw
from mpiring.parallel.pipeline.schedules import build, compute_only
from mpiring.parallel.pipeline.validate import simulate
from mpiring.runtime.trace import Tracer
from mpiring.tools import pipeline_trace, timeline


def write_trace(directory, name: str, p: int, m: int, *, steps: int = 2, replicas: int = 1,
                offset: float = 100.0, v: int = 1) -> list:
    """Files as the runtime writes them, with the unit-cost simulation as the times
    (``v`` stages per rank: the interleaved schedule)."""
    spans = simulate(build(name, p, m, v))
    length = max(row[-1].end for row in spans) + 1.0  # a gap of one unit between steps
    for d in range(replicas):
        for i, row in enumerate(spans):
            rank = i * replicas + d  # stage = rank // dp
            recs = [{"type": "header", "rank": rank, "wall_minus_clock": offset * rank}]
            for k in range(steps):
                for s in row:
                    t = k * length - offset * rank  # each rank's clock has its own origin
                    recs.append({"type": "event", "rank": rank, "name": str(s.action),
                                 "cat": "pipeline", "t_start": t + s.start, "t_end": t + s.end,
                                 "action": s.action.kind, "stage": s.action.stage,
                                 "mb": s.action.mb,
                                 "schedule": name, "microbatches": m, "replica": d})
            with open(directory / f"rank{rank}.jsonl", "w") as fh:
                fh.write("\n".join(json.dumps(r) for r in recs) + "\n")
    return spans


@pytest.mark.parametrize("name,p,m", [("gpipe", 3, 3), ("1f1b", 4, 8), ("zb", 2, 5)])
def test_explain_draws_the_simulated_schedule_exactly(tmp_path, name, p, m):
    spans = write_trace(tmp_path, name, p, m)
    text = timeline.explain(timeline.load(str(tmp_path)))
    assert text.startswith(f"pipeline step 2 of 2: {name}, {p} stages, {m} micro-batches")
    lines = text.splitlines()
    assert lines[1:1 + p] == draw(spans, width=150).splitlines()
    if name != "zb":
        formula = (p - 1) / (m + p - 1)
        assert all(f"bubble {formula:.0%}" in line for line in lines[1:1 + p])
        assert all(f"predicted {formula:.1%}" in line for line in lines[1 + p:1 + 2 * p])
    # Step 1 is there too, and a step that is not is a clear error.
    assert "pipeline step 1 of 2" in timeline.explain(timeline.load(str(tmp_path)), "pipeline", 1)
    with pytest.raises(ValueError, match="steps 1..2"):
        timeline.explain(timeline.load(str(tmp_path)), "pipeline", 3)


def test_explain_shows_the_last_training_step_not_the_eval_after_it(tmp_path):
    # A train run ends on eval(): forwards only, traced as "<schedule>.eval". The default
    # is the last step that trained; --call picks the eval.
    p, m = 2, 4
    write_trace(tmp_path, "1f1b", p, m)
    for rank in range(p):
        path = tmp_path / f"rank{rank}.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        t = max(r["t_end"] for r in recs if r["type"] == "event") + 1.0
        for k in range(m):  # one forward per micro-batch, one unit each, stages in turn
            start = t + k + rank
            recs.append({"type": "event", "rank": rank, "name": f"{rank}F{k}",
                         "cat": "pipeline", "t_start": start, "t_end": start + 1.0,
                         "action": "F", "stage": rank, "mb": k, "schedule": "1f1b.eval",
                         "microbatches": m, "replica": 0})
        path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    files = timeline.load(str(tmp_path))
    assert timeline.explain(files).startswith("pipeline step 2 of 3: 1f1b, 2 stages")
    assert pipeline_trace.explain(files, step=3).startswith("pipeline step 3 of 3: 1f1b.eval")
    assert pipeline_trace.title(files).startswith("pipeline 1f1b, m=4")


def test_explain_reads_several_stages_per_rank(tmp_path):
    # Interleaved: rank 0 runs 0F0 then 2F0, the same (kind, micro-batch) on another
    # stage: still one step, 4 stages on 2 ranks, and the prediction is the formula.
    spans = write_trace(tmp_path, "interleaved", 2, 4, v=2)
    files = timeline.load(str(tmp_path))
    found = pipeline_trace.steps(files)
    assert [s.index for s in found] == [1, 2] and found[1].stages == 4
    text = timeline.explain(files)
    assert text.startswith("pipeline step 2 of 2: interleaved, 4 stages on 2 ranks, "
                           "4 micro-batches")
    lines = text.splitlines()
    assert lines[1:3] == draw(spans, width=150).splitlines()
    formula = (2 - 1) / (2 * 4 + 2 - 1)
    assert "stages 0, 2 (r0): bubble" in text and f"predicted {formula:.1%}" in lines[3]


def test_explain_names_the_stages_of_a_v(tmp_path):
    # ZB-V: rank 0 holds stages 0 and 3 (both ends), rank 1 stages 1 and 2.
    write_trace(tmp_path, "zbv", 2, 4, v=2)
    text = timeline.explain(timeline.load(str(tmp_path)))
    assert text.startswith("pipeline step 2 of 2: zbv, 4 stages on 2 ranks")
    assert "stages 0, 3 (r0): bubble" in text and "stages 1, 2 (r1): bubble" in text


def test_replicas_are_drawn_apart(tmp_path):
    write_trace(tmp_path, "1f1b", 2, 4, replicas=2)
    files = timeline.load(str(tmp_path))
    found = [s for s in pipeline_trace.steps(files) if s.index == 2]
    assert [(s.replica, s.ranks) for s in found] == [(0, [0, 2]), (1, [1, 3])]
    text = timeline.explain(files)
    assert "(replica 0)" in text and "(replica 1)" in text
    assert ("pipeline", 2, "1f1b", 0, 4) in timeline.list_calls(files)


def test_the_cli_explains_and_plots(tmp_path, capsys):
    write_trace(tmp_path, "zb", 3, 4)
    assert cli_main(["trace", "explain", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("设备") == 3 and "[W" in out
    assert cli_main(["trace", "explain", str(tmp_path), "--list"]) == 0
    assert "pipeline#1 (zb) on 3 rank(s)" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    png = tmp_path / "pp.png"
    assert cli_main(["trace", "plot", str(tmp_path), "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_no_pipeline_is_a_clear_error(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(json.dumps({"type": "header", "rank": 0}) + "\n")
    with pytest.raises(ValueError, match="no pipeline actions"):
        timeline.explain(timeline.load(str(tmp_path)), "pipeline")


@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_a_real_run_reads_back_as_its_schedule(comm, name):
    directory = comm.control.bcast_json(
        tempfile.mkdtemp(prefix="mpiring-pp-trace-") if comm.rank == 0 else None)
    torch.manual_seed(0)
    full = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)]).double()
    lo, hi = chunk_bounds(4, comm.size)[comm.rank]
    stage = mpiring.PipelineStage(copy.deepcopy(full[lo:hi]), comm.rank, comm.size, comm)
    stage.comm.tracer = Tracer(comm.rank, directory)
    cls = Schedule1F1B if name == "1f1b" else ScheduleZeroBubble
    sched = cls(stage, 3, lambda o, t: ((o - t) ** 2).mean())
    x = torch.randn(6, 4, dtype=torch.float64)
    measured = []
    for _ in range(3):
        sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
        measured.append(list(sched.timeline))
    stage.comm.tracer.close()
    wait_quietly(comm)  # every rank's file is complete
    if comm.rank == 0:
        try:
            files = timeline.load(directory)
            found = pipeline_trace.steps(files)
            assert [s.index for s in found] == [1, 2, 3]
            progs = build(name, comm.size, 3)
            for s in found:
                assert s.ranks == list(range(comm.size)) and s.schedule == name
                assert not s.missing  # every rank ran all of it
                assert [[x.action for x in row] for row in s.spans] == \
                    [compute_only(p) for p in progs]
            # The spans the schedule kept (up to the rounding of wall-clock seconds).
            mine = [(x.action, x.end - x.start) for x in measured[-1]]
            got = [(x.action, x.end - x.start) for x in found[-1].spans[0]]
            assert [a for a, _ in got] == [a for a, _ in mine]
            assert all(abs(a - b) < 1e-6 for (_, a), (_, b) in zip(got, mine))
            text = timeline.explain(files)
            assert text.count("设备") == comm.size and "step 3 of 3" in text
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    wait_quietly(comm)
