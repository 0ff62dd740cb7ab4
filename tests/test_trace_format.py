"""Pure tests of the trace's formatting and files."""

import json

import pytest

from mpiring.runtime.trace import NULL_CALL, Tracer, fmt_bytes, fmt_step, read_trace

pytestmark = pytest.mark.one_rank  # pure: rank 0 runs them (tests/mpi_harness.py)


def test_fmt_bytes():
    assert fmt_bytes(12) == "12 B"
    assert fmt_bytes(4 << 20) == "4.0 MiB"
    assert fmt_bytes(1536) == "1.5 KiB"


def test_fmt_step_matches_the_documented_line():
    rec = {"rank": 1, "collective": "all_reduce", "call": 3, "phase": "reduce-scatter",
           "step": 1, "steps": 3, "send_chunk": 3, "dst": 2, "recv_chunk": 2, "src": 0,
           "bytes_sent": 4 << 20, "bytes_recv": 4 << 20, "t_start": 1.0, "t_end": 1.0012,
           "algo": "ring"}
    assert fmt_step(rec) == ("[r1] all_reduce#3 (ring) reduce-scatter 2/3 send c3->r2 "
                             "recv c2<-r0 4.0 MiB 1.2 ms")
    del rec["algo"]  # a record without one (older traces) still reads
    assert fmt_step(rec).startswith("[r1] all_reduce#3 reduce-scatter 2/3")


def test_disabled_tracer_hands_out_the_null_recorder(tmp_path):
    tracer = Tracer(0)
    assert not tracer.enabled
    assert tracer.call("all_reduce", 1, "ring") is NULL_CALL
    NULL_CALL.step("reduce-scatter", 0, 1)  # does nothing, raises nothing


def test_enabled_tracer_writes_json_lines(tmp_path):
    tracer = Tracer(2, str(tmp_path))
    call = tracer.call("broadcast", 5, "pipelined")
    call.step("broadcast", 0, 2, send_chunk=0, dst=3, bytes_sent=8, t_start=1.0, t_recv=1.5, t_end=2.0)
    tracer.close()
    lines = (tmp_path / "rank2.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["type"] == "header"
    step = json.loads(lines[1])
    assert step["collective"] == "broadcast" and step["call"] == 5 and step["wait_s"] == 0.5
    assert [r["type"] for r in read_trace(str(tmp_path))] == ["header", "step"]
