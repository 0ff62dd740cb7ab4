"""Trace merge, plot and explain: on a trace recorded here under MPI, and on synthetic ones."""

import json
import os
import shutil
import tempfile
import time

import numpy as np
import pytest
from conftest import data, wait_quietly

from mpiring.backends.control import bcast_json
from mpiring.cli import main as cli_main
from mpiring.core.chunking import all_gather_indices, chunk_bounds, reduce_scatter_indices
from mpiring.runtime.trace import Tracer
from mpiring.tools import timeline

BCAST_ROOT = 1  # not rank 0, so the replay shows whose data spread; rank 0 alone on one rank


@pytest.fixture(scope="module")
def recorded(world):
    """A real trace of every ring collective (and two DDP-like events) on all ranks of the job.

    Returns the directory on rank 0 and None elsewhere.
    """
    mpi = world.mpi_comm
    tmp = bcast_json(mpi, tempfile.mkdtemp(prefix="mpiring-trace-test-") if world.rank == 0 else None)
    comm = world.dup()
    comm.tracer = Tracer(world.rank, tmp)
    n = 37  # not a multiple of the rank count: uneven chunks
    x = data(world.rank, n, np.float32)
    t0 = time.perf_counter()
    comm.all_reduce(x, algo="ring")
    comm.reduce_scatter(data(world.rank, n, np.float32), algo="ring")
    comm.all_gather(data(world.rank, n, np.float32), algo="ring")
    comm.broadcast(data(world.rank, n, np.float32), root=BCAST_ROOT % world.size, algo="pipelined",
                   chunks=3)
    comm.reduce(data(world.rank, n, np.float32), root=world.size - 1, algo="pipelined", chunks=2)
    t1 = time.perf_counter()
    comm.tracer.event("backward", "backward", t0, t1)
    comm.tracer.event("bucket 0", "bucket", t0, (t0 + t1) / 2, bytes=148)
    comm.tracer.close()
    mpi.Barrier()
    yield tmp if world.rank == 0 else None
    mpi.Barrier()
    if world.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _explain_replays_every_recorded_collective(recorded, world):
    files = timeline.load(recorded)
    assert sorted(f.rank for f in files) == list(range(world.size))
    listed = [(c, n) for c, n, _, _, _ in timeline.list_calls(files)]
    if world.size == 1:  # one rank: nothing moves, nothing is traced
        assert listed == []
        return
    assert listed == [("all_reduce", 1), ("reduce_scatter", 1), ("all_gather", 1),
                      ("broadcast", 1), ("reduce", 1)]
    for coll, _ in listed:
        text = timeline.explain(files, coll)
        assert text.endswith("result: as the collective promises"), text
    text = timeline.explain(files, "all_reduce")
    k = world.size
    assert text.count("reduce-scatter step") == k - 1 and text.count("all-gather step") == k - 1
    _, ranks, snaps = timeline.replay(files, "all_reduce")
    everyone = frozenset(ranks)
    after_rs = snaps[k - 1][2]  # the lecture: after K-1 steps rank r holds chunk r reduced
    for r in ranks:
        assert after_rs[r][r] == everyone
        assert sum(c == everyone for c in after_rs[r]) == 1
    # Step 1 of the ring, as the lecture draws it: r sends chunk r-1 to r+1.
    step1 = snaps[1][1]
    assert step1 == [f"r{r} c{(r - 1) % k}->r{(r + 1) % k}" for r in range(k)]
    _, _, bsnaps = timeline.replay(files, "broadcast")
    assert all(cell == frozenset([BCAST_ROOT]) for row in bsnaps[-1][2].values() for cell in row)
    assert len(bsnaps[0][2][0]) == 3  # three pipeline chunks


def _merge_nests_steps_in_calls_and_aligns_ranks(recorded, world):
    doc = timeline.chrome_trace(timeline.load(recorded))
    json.dumps(doc)  # serialisable
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == \
        {f"rank {r}" for r in range(world.size)}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in xs)
    events = [e for e in xs if e["cat"] in ("backward", "bucket")]
    assert len(events) == 2 * world.size
    if world.size == 1:
        return
    calls = [e for e in xs if " " in e["name"] and "#" in e["name"]]
    steps = [e for e in xs if "step" not in e["name"] and "/" in e["name"]]
    assert len(calls) == 5 * world.size
    for s in steps:  # every step sits inside a call span on the same row
        assert any(c["pid"] == s["pid"] and c["tid"] == s["tid"] and c["ts"] <= s["ts"] + 1e-6
                   and s["ts"] + s["dur"] <= c["ts"] + c["dur"] + 1e-3 for c in calls), s
    # Events get their own tracks, not the collectives' one.
    coll_tids = {(c["pid"], c["tid"]) for c in calls}
    assert not coll_tids & {(e["pid"], e["tid"]) for e in events}
    # Ranks are aligned: every rank's first all_reduce step starts within a second of the others.
    firsts = [min(c["ts"] for c in calls if c["pid"] == r) for r in range(world.size)]
    assert max(firsts) - min(firsts) < 1e6


def _cli_merge_plot_explain(recorded, world, tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert cli_main(["trace", "merge", recorded, "-o", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert cli_main(["trace", "plot", recorded, "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert cli_main(["trace", "explain", recorded, "--list"]) == 0
    assert cli_main(["trace", "explain", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


# The checks read files on rank 0; the other ranks sleep meanwhile instead of
# spinning in the next collective and taking rank 0's core.
def test_explain_replays_every_recorded_collective(recorded, world):
    try:
        if recorded is not None:
            _explain_replays_every_recorded_collective(recorded, world)
    finally:
        wait_quietly(world)


def test_merge_nests_steps_in_calls_and_aligns_ranks(recorded, world):
    try:
        if recorded is not None:
            _merge_nests_steps_in_calls_and_aligns_ranks(recorded, world)
    finally:
        wait_quietly(world)


def test_cli_merge_plot_explain(recorded, world, tmp_path, capsys):
    try:
        if recorded is not None:
            _cli_merge_plot_explain(recorded, world, tmp_path, capsys)
    finally:
        wait_quietly(world)


# --- synthetic traces (no MPI) ---------------------------------------------------
def _write_ring_trace(directory, k, n, collective="all_reduce", drop_rank=None):
    """The step records a ring all_reduce/all_gather on k ranks would write."""
    bounds = chunk_bounds(n, k)
    t = 0.0
    for r in range(k):
        if r == drop_rank:
            continue
        tracer = Tracer(r, str(directory))
        call = tracer.call(collective, 1, "ring")
        phases = []
        if collective == "all_reduce":
            phases.append(("reduce-scatter", reduce_scatter_indices))
        phases.append(("all-gather", all_gather_indices))
        for phase, indices in phases:
            for i in range(k - 1):
                s, rc = indices(r, i, k)
                call.step(phase, i, k - 1, send_chunk=s, dst=(r + 1) % k, recv_chunk=rc,
                          src=(r - 1) % k, bytes_sent=4 * (bounds[s][1] - bounds[s][0]),
                          bytes_recv=4 * (bounds[rc][1] - bounds[rc][0]), t_start=t,
                          t_recv=t + 0.5, t_end=t + 1)
                t += 1
        tracer.close()


@pytest.mark.parametrize("k", [2, 3, 5])
def test_explain_synthetic_ring(tmp_path, k):
    _write_ring_trace(tmp_path, k, 10)
    text = timeline.explain(timeline.load(str(tmp_path)))
    assert text.startswith(f"all_reduce#1 (ring) on {k} ranks, {k} chunk(s)")
    assert text.endswith("result: as the collective promises")


def test_explain_all_gather_starts_with_own_chunk_only(tmp_path):
    _write_ring_trace(tmp_path, 3, 9, collective="all_gather")
    _, _, snaps = timeline.replay(timeline.load(str(tmp_path)))
    assert snaps[0][2][1] == [None, frozenset([1]), None]
    assert snaps[-1][2][1] == [frozenset([0]), frozenset([1]), frozenset([2])]


def test_missing_rank_file_is_named(tmp_path):
    _write_ring_trace(tmp_path, 3, 9, drop_rank=2)
    with pytest.raises(ValueError, match="sub-communicator|missing"):
        timeline.explain(timeline.load(str(tmp_path)))


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no trace files"):
        timeline.load(str(tmp_path))
    (tmp_path / "x.jsonl").write_text(json.dumps({"type": "step"}) + "\n")
    with pytest.raises(ValueError, match="no header"):
        timeline.load(str(tmp_path))
    os.unlink(tmp_path / "x.jsonl")
    _write_ring_trace(tmp_path, 2, 4)
    with pytest.raises(ValueError, match="the trace has: all_reduce#1"):
        timeline.explain(timeline.load(str(tmp_path)), "broadcast")


def test_plot_window(tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "trace"
    _write_ring_trace(trace, 2, 4)  # steps 1 s apart: the trace spans 2 s
    files = timeline.load(str(trace))
    timeline.plot(files, str(tmp_path / "w.png"), window=(500.0, 1500.0))
    assert (tmp_path / "w.png").exists()
    with pytest.raises(ValueError, match="nothing recorded"):
        timeline.plot(files, str(tmp_path / "x.png"), window=(5000.0, 6000.0))


def test_calls_with_the_same_name_on_two_communicators_stay_apart(tmp_path):
    # A DDP bucket communicator and its parent both count all_reduce#1.
    for r in range(2):
        tracer = Tracer(r, str(tmp_path))
        for _ in range(2):
            call = tracer.call("all_reduce", 1, "ring")
            for phase, (s, rc) in (("reduce-scatter", (1 - r, r)), ("all-gather", (r, 1 - r))):
                call.step(phase, 0, 1, send_chunk=s, dst=1 - r, recv_chunk=rc, src=1 - r,
                          bytes_sent=4, bytes_recv=4, t_start=0.0, t_recv=0.0, t_end=0.0)
        tracer.close()
    files = timeline.load(str(tmp_path))
    assert [(c, n, i) for c, n, _, i, _ in timeline.list_calls(files)] == \
        [("all_reduce", 1, 0), ("all_reduce", 1, 1)]
    assert timeline.explain(files).endswith("result: as the collective promises")
