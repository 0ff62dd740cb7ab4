"""The trace tools on what a user really hands them: real traces of the all-reduce
algorithms and of sub-communicators, directories mixing runs, traces of another
version, huge traces, and the files `merge` and `plot` write."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
import warnings

import numpy as np
import pytest
from conftest import data, wait_quietly

from mpiring.cli import main as cli_main
from mpiring.core.chunking import all_gather_indices, chunk_bounds, reduce_scatter_indices
from mpiring.runtime.trace import Tracer
from mpiring.tools import pipeline_trace, timeline


def _ring(directory, k: int, *, ranks=None, peers=None, t: float = 0.0, call: int = 1,
          name=None, job=None) -> None:
    """A ring all_reduce of k ranks as the runtime writes it. ``ranks``: the world
    ranks that record it (default 0..k-1); the steps name peers in the ring's own
    numbering 0..k-1, as a sub-communicator's do. ``t``: its start (wall seconds).
    ``job``: the run's id in the headers, as init writes it (with k ranks)."""
    ranks = list(range(k)) if ranks is None else ranks
    bounds = chunk_bounds(4 * k + 1, k)
    for sub, r in enumerate(ranks):
        tracer = Tracer(r, str(directory), name=name(r) if name else None, job=job,
                        world=k if job else None)
        c = tracer.call("all_reduce", call, "ring")
        step_t = t - tracer_offset(directory, tracer)
        for phase, idx in (("reduce-scatter", reduce_scatter_indices),
                           ("all-gather", all_gather_indices)):
            for i in range(k - 1):
                s, rc = idx(sub, i, k)
                c.step(phase, i, k - 1, send_chunk=s, dst=(sub + 1) % k, recv_chunk=rc,
                       src=(sub - 1) % k, bytes_sent=4 * (bounds[s][1] - bounds[s][0]),
                       bytes_recv=4 * (bounds[rc][1] - bounds[rc][0]), t_start=step_t,
                       t_recv=step_t + 0.001, t_end=step_t + 0.002)
                step_t += 0.002
        tracer.close()


def tracer_offset(directory, tracer: Tracer) -> float:
    """The wall-minus-clock offset the tracer wrote in its header."""
    tracer.flush()
    with open(f"{directory}/{tracer._name}.jsonl") as fh:
        return json.loads(fh.readline())["wall_minus_clock"]


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# --- real runs -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def exchanges(world):
    """A real trace of recursive doubling and halving-doubling on every rank of the job."""
    tmp = world.control.bcast_json(
        tempfile.mkdtemp(prefix="mpiring-trace-review-") if world.rank == 0 else None)
    comm = world.dup()
    comm.tracer = Tracer(world.rank, tmp)
    for algo in ("recursive-doubling", "halving-doubling"):
        x = data(world.rank, 13, np.float64)
        comm.all_reduce(x, algo=algo)
        expected = sum(data(r, 13, np.float64) for r in range(world.size))
        assert np.array_equal(x, expected)  # the run was right: explain must say so
    comm.tracer.close()
    wait_quietly(world)
    yield tmp if world.rank == 0 else None
    wait_quietly(world)
    if world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def test_explain_does_not_call_a_correct_recursive_doubling_wrong(exchanges, world):
    if world.rank == 0 and world.size > 1:
        files = timeline.load(exchanges)
        text = timeline.explain(files, "all_reduce", 1)
        # Every message of recursive doubling is the whole buffer: one chunk, replayed.
        assert text.startswith(f"all_reduce#1 (recursive-doubling) on {world.size} ranks, "
                               "1 chunk(s)"), text
        assert text.endswith("result: as the collective promises"), text
        # Halving-doubling's steps say which elements moved: replayed and checked.
        text = timeline.explain(files, "all_reduce", 2)
        assert text.startswith(f"all_reduce#2 (halving-doubling) on {world.size} ranks, "), text
        assert text.endswith("result: as the collective promises"), text
    wait_quietly(world)


def test_calls_of_sub_communicators_are_named_as_such(world, tmp_path_factory):
    """Two tensor-parallel groups each count their own all_reduce#1, and their steps name
    peers within the group: explain must say so, not "a rank's file is missing"."""
    if world.size < 4:
        if world.rank == 0:  # the same, written as two 2-rank groups would
            tmp = tmp_path_factory.mktemp("groups")
            _ring(tmp, 2, ranks=[0, 1])
            _ring(tmp, 2, ranks=[2, 3])
            _check_groups(tmp, 4, 2)
        wait_quietly(world)
        return
    tmp = world.control.bcast_json(
        tempfile.mkdtemp(prefix="mpiring-trace-groups-") if world.rank == 0 else None)
    sub = world.split(color=world.rank // 2, key=world.rank)
    sub.tracer = Tracer(world.rank, tmp)
    sub.all_reduce(data(world.rank, 9, np.float32), algo="ring")
    sub.tracer.close()
    wait_quietly(world)
    if world.rank == 0:
        try:
            _check_groups(tmp, world.size - world.size % 2, 2, recorded=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    wait_quietly(world)


def _check_groups(directory, nranks: int, k: int, recorded: bool = False) -> None:
    files = timeline.load(str(directory))
    if recorded:  # the trace says which group each call ran on: one group is replayed
        assert timeline.explain(files, "all_reduce").endswith("result: as the collective "
                                                              "promises")
    else:  # steps that do not say their group (an older trace): refused, saying why
        with pytest.raises(ValueError, match=f"several communicators of {k} rank"):
            timeline.explain(files, "all_reduce")
    assert list(timeline.group_sizes(files).values()) == [k]
    # A recorded trace also lists each group (test_trace_groups checks those lines).
    assert list_output(directory)[0] == (f"all_reduce#1 (ring) on {nranks} rank(s) in groups "
                                         f"of {k} (one call per group)")


def list_output(directory) -> list[str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["trace", "explain", str(directory), "--list"]) == 0
    return out.getvalue().splitlines()


# --- bad input -----------------------------------------------------------------------
def test_files_of_two_runs_in_one_directory(tmp_path):
    _ring(tmp_path, 4, t=time.time() - 60)  # an earlier 4-rank run ...
    _ring(tmp_path, 2, t=time.time())  # ... then a 2-rank one overwrote rank0 and rank1
    with pytest.warns(UserWarning, match=r"2 separate runs.*rank2.jsonl, rank3.jsonl"):
        files = timeline.load(str(tmp_path))
    with pytest.raises(ValueError, match="rings of different sizes.*different runs"):
        timeline.explain(files)


def test_files_of_two_runs_are_told_apart_by_their_job_ids(tmp_path):
    # The same overwrite at the same moment: no gap in time to see, the ids tell.
    _ring(tmp_path, 4, t=time.time(), job="aaaa")
    _ring(tmp_path, 2, t=time.time(), job="bbbb")
    with pytest.raises(ValueError, match=r"files of 2 runs: rank0.jsonl, rank1.jsonl \(run "
                       r"bbbb, 2 ranks\); rank2.jsonl, rank3.jsonl \(run aaaa, 4 ranks\)"):
        timeline.load(str(tmp_path))


def test_a_rank_s_missing_file_is_named(tmp_path):
    _ring(tmp_path, 4, t=time.time(), job="aaaa", ranks=[0, 1, 3])
    with pytest.warns(UserWarning, match=r"rank\(s\) 2 of the run's 4 have no file here"):
        timeline.load(str(tmp_path))


def test_one_run_is_not_taken_for_two(tmp_path):
    _ring(tmp_path, 3, t=time.time())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline.load(str(tmp_path))


def test_two_files_of_one_rank_are_refused(tmp_path):
    _ring(tmp_path, 2)
    _ring(tmp_path, 2, name=lambda r: f"old-rank{r}")
    with pytest.raises(ValueError, match="both rank 0's trace.*different runs"):
        timeline.load(str(tmp_path))


@pytest.mark.parametrize("edit,match", [
    (lambda h, s: (dict(h, version=3), s), "format version 3"),
    (lambda h, s: (h, {k: v for k, v in s.items() if k != "algo"}), "step record has no algo"),
    (lambda h, s: (h, dict(s, t_start="soon")), "non-numeric t_start"),
], ids=["newer-version", "no-algo", "text-time"])
def test_a_trace_of_another_version_is_a_message_not_a_traceback(tmp_path, capsys, edit,
                                                                  match):
    _ring(tmp_path, 2)
    for r in range(2):
        path = tmp_path / f"rank{r}.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        header, step = edit(lines[0], lines[1])
        _write(path, [header, step] + lines[2:])
    for action in (["explain"], ["merge", "-o", str(tmp_path / "t.json")],
                   ["plot", "-o", str(tmp_path / "t.png")]):
        assert cli_main(["trace", *action, str(tmp_path)]) == 2
        assert match in capsys.readouterr().err


def test_a_missing_output_folder_is_a_message(tmp_path, capsys):
    _ring(tmp_path / "t", 2)
    assert cli_main(["trace", "merge", str(tmp_path / "t"), "-o",
                     str(tmp_path / "no" / "t.json")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_a_pipeline_with_a_rank_file_missing_is_refused(tmp_path):
    from test_pipeline_trace import write_trace

    write_trace(tmp_path, "1f1b", 3, 4)
    (tmp_path / "rank1.jsonl").unlink()  # stage 1
    with pytest.raises(ValueError, match=r"no trace file holds pipeline stage\(s\) 1"):
        timeline.explain(timeline.load(str(tmp_path)))
    (tmp_path / "rank0.jsonl").unlink()
    with pytest.raises(ValueError, match=r"stage\(s\) 0, 1 \(the files hold stages 2\)"):
        pipeline_trace.steps(timeline.load(str(tmp_path)))
    write_trace(tmp_path, "1f1b", 2, 4)
    path = tmp_path / "rank1.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + lines[1].replace('"stage"', '"st"') + "\n")
    with pytest.raises(ValueError, match="rank1.jsonl: an event record has no stage"):
        timeline.load(str(tmp_path))
    for p in tmp_path.iterdir():
        p.unlink()
    write_trace(tmp_path, "1f1b", 2, 4, replicas=2)  # rank1 = replica 1's stage 0
    (tmp_path / "rank2.jsonl").unlink()  # replica 0's stage 1
    with pytest.raises(ValueError, match=r"stage\(s\) 1 of replica 0"):
        pipeline_trace.steps(timeline.load(str(tmp_path)))


# --- what merge and plot write ---------------------------------------------------------
def test_merge_writes_strict_json_with_chrome_fields(tmp_path):
    """A diverged run's loss is NaN: the file must still load in a browser's JSON.parse
    (which has no NaN), and every span has the fields chrome://tracing needs."""
    d = tmp_path / "t"
    _ring(d, 2)
    with open(d / "rank0.jsonl", "a") as fh:
        fh.write(json.dumps({"type": "event", "rank": 0, "name": "train.step", "cat": "train",
                             "t_start": 1.0, "t_end": 2.0, "loss": math.nan,
                             "hist": [math.inf, 1.0]}) + "\n")
        fh.write(json.dumps({"type": "p2p", "rank": 0, "op": "send", "call": 1, "peer": 1,
                             "tag": 3, "bytes": 64, "dtype": "float32", "t_start": 1.5,
                             "t_end": 1.6}) + "\n")
    out = tmp_path / "trace.json"
    assert cli_main(["trace", "merge", str(d), "-o", str(out)]) == 0

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    doc = json.loads(out.read_text(), parse_constant=no_constants)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for e in spans:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= set(e), e
        assert isinstance(e["ts"], float) and e["dur"] >= 0
    step = next(e for e in spans if e["cat"] == "train")
    assert step["args"]["loss"] == "nan" and step["args"]["hist"] == ["inf", 1.0]
    # Point-to-point messages are on the timeline too, on their own track.
    sends = [e for e in spans if e["cat"] == "p2p"]
    assert [e["name"] for e in sends] == ["send ->r1 tag 3"] and sends[0]["args"]["bytes"] == 64
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names[(0, sends[0]["tid"])] == "p2p"


def test_only_reducing_steps_get_a_reduction(tmp_path):
    """A broadcast root's send-only step has reduce_s (its send time): not a reduction."""
    tracer = Tracer(0, str(tmp_path))
    c = tracer.call("broadcast", 1, "pipelined")
    c.step("broadcast", 0, 1, send_chunk=0, dst=1, bytes_sent=8, t_start=1.0, t_recv=1.0,
           t_end=1.5)
    tracer.close()
    tracer = Tracer(1, str(tmp_path))
    c = tracer.call("broadcast", 1, "pipelined")
    c.step("broadcast", 0, 1, recv_chunk=0, src=0, bytes_recv=8, t_start=1.0, t_recv=1.4,
           t_end=1.5)
    c = tracer.call("reduce", 1, "pipelined")
    c.step("reduce", 0, 1, recv_chunk=0, src=0, bytes_recv=8, t_start=2.0, t_recv=2.4,
           t_end=2.5)
    tracer.close()
    spans = timeline.tracks(timeline.load(str(tmp_path)))
    reductions = [(s["rank"], s["cat"]) for s in spans if s["kind"] == "reduce"]
    assert reductions == [(1, "reduce")]


def test_plot_draws_a_large_trace_in_few_artists(tmp_path, monkeypatch):
    """One broken_barh per row and look: per span, matplotlib re-ran autoscale over
    every earlier bar, O(n^2) (10k spans took 4 minutes)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    for r in range(2):
        recs = [{"type": "header", "rank": r, "wall_minus_clock": 0.0}]
        for i in range(300):
            for j, phase in enumerate(("reduce-scatter", "all-gather")):
                t = i * 1e-3 + j * 4e-4
                recs.append({"type": "step", "rank": r, "collective": "all_reduce",
                             "call": i + 1, "algo": "ring", "phase": phase, "step": 0,
                             "steps": 1, "send_chunk": 1 - r if j == 0 else r, "dst": 1 - r,
                             "recv_chunk": r if j == 0 else 1 - r, "src": 1 - r,
                             "bytes_sent": 4, "bytes_recv": 4, "t_start": t,
                             "t_end": t + 3e-4, "wait_s": 1e-4, "reduce_s": 1e-4})
        _write(tmp_path / f"rank{r}.jsonl", recs)
    files = timeline.load(str(tmp_path))
    nspans = len(timeline.tracks(files))
    assert nspans >= 2 * 300 * 4  # calls, steps, reductions
    drawn = []
    real = Axes.broken_barh
    monkeypatch.setattr(Axes, "broken_barh",
                        lambda self, xr, *a, **k: drawn.append(len(xr)) or real(self, xr, *a, **k))
    t0 = time.perf_counter()
    timeline.plot(files, str(tmp_path / "big.png"))
    assert (tmp_path / "big.png").read_bytes()[:4] == b"\x89PNG"
    assert sum(drawn) == nspans and len(drawn) <= 8, len(drawn)
    assert time.perf_counter() - t0 < 60


def test_explain_picks_the_second_call_of_a_name(tmp_path, capsys):
    """--list shows "all_reduce#1 (2nd)" (a DDP bucket communicator and its parent both
    count all_reduce#1): --nth 2 explains that one, not the first again."""
    _ring(tmp_path, 3, t=time.time())
    first = {f"rank{r}.jsonl": (tmp_path / f"rank{r}.jsonl").read_text() for r in range(3)}
    _ring(tmp_path, 3, t=time.time() + 0.1)  # the same name again, 4 elements more per call
    for name, text in first.items():
        second = (tmp_path / name).read_text().splitlines(keepends=True)[1:]
        second = [json.dumps(dict(json.loads(x), bytes_sent=100, bytes_recv=100)) + "\n"
                  for x in second]
        (tmp_path / name).write_text(text + "".join(second))
    assert list_output(tmp_path) == ["all_reduce#1 (ring) on 3 rank(s)",
                                     "all_reduce#1 (2nd) (ring) on 3 rank(s)"]
    capsys.readouterr()
    assert cli_main(["trace", "explain", str(tmp_path), "--call", "1", "--nth", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("all_reduce#1 (2nd) (ring) on 3 ranks, 3 chunk(s), 100 B per message")
    assert out.rstrip().endswith("result: as the collective promises")
    assert cli_main(["trace", "explain", str(tmp_path), "--call", "1", "--nth", "3"]) == 2
    assert "no traced call matches collective=None call=1 nth=3" in capsys.readouterr().err


def test_a_missing_rank_file_of_a_two_rank_ring_is_named(tmp_path):
    _ring(tmp_path, 2)
    (tmp_path / "rank1.jsonl").unlink()
    with pytest.raises(ValueError, match=r"name rank\(s\) 1, which have no records"):
        timeline.explain(timeline.load(str(tmp_path)))
