"""Deadlines, the stall report, and a dead rank: the job ends, non-zero, and says why.

The failures themselves run in nested ``mpiexec`` jobs launched from rank 0
(tests/reliability_cases/); the other ranks wait without spinning.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from conftest import Job, data

import mpiring
from mpiring.runtime import watchdog
from mpiring.runtime.watchdog import STALL_EXIT_CODE, Activity, parse_timeout

# --- pure: deadlines and the report text ------------------------------------------------


def test_parse_timeout(monkeypatch):
    monkeypatch.delenv("MPIRING_TIMEOUT", raising=False)
    assert parse_timeout(None) == watchdog.DEFAULT_TIMEOUT == 300.0
    assert parse_timeout(2.5) == 2.5 and parse_timeout("7") == 7.0 and parse_timeout("7s") == 7.0
    assert parse_timeout(0) == 0.0 and parse_timeout("off") == 0.0
    assert parse_timeout(float("inf")) == 0.0
    monkeypatch.setenv("MPIRING_TIMEOUT", "12")
    assert parse_timeout(None) == 12.0
    monkeypatch.setenv("MPIRING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MPIRING_TIMEOUT='soon' is not a number of seconds"):
        parse_timeout(None)
    for bad in (-1, True, "nan", [3]):
        with pytest.raises(ValueError, match="seconds"):
            parse_timeout(bad)


def ring_activity(size=4, rank=1):
    act = Activity(rank, size, timeout=5, world_ranks=[0, 1, 2, 3][:size], watch=False)
    act.begin("all_reduce", 12, "ring")
    return act


def test_report_names_collective_step_and_peer():
    act = ring_activity()
    act.blocked("Wait", 0)
    text = act.report(at=act.since + 6.25)
    assert text.startswith("[r1] mpiring stall: all_reduce#12 (algo ring, 4 ranks) "
                           "reduce-scatter step 1/3: blocked 6.2 s in Wait, waiting for "
                           "data from r0 (deadline 5 s)\n"), text
    assert f"Aborting the job (exit {STALL_EXIT_CODE})" in text
    assert "MPIRING_TIMEOUT=SECONDS" in text


def test_a_stack_that_changes_while_read_still_gives_the_report(monkeypatch):
    # The report reads the blocked thread's stack from the monitor thread; if that
    # thread runs on meanwhile, a frame it left can read as garbage: CPython 3.11 once
    # gave a dict for f_back, and the AttributeError lost the report and ended the job.
    act = ring_activity()
    act.thread = threading.get_ident()
    act.blocked("Wait", 0)

    def torn(frame):
        raise AttributeError("'dict' object has no attribute 'f_lineno'")

    monkeypatch.setattr(watchdog.traceback, "format_stack", torn)
    text = act.report(at=act.since + 6.25)
    assert "blocked 6.2 s in Wait, waiting for data from r0" in text
    assert "its stack changed while it was being read" in text


def test_step_in_progress_follows_the_ring_phases():
    act = ring_activity()
    act.step("reduce-scatter", 0, 3)
    assert act.current_step() == "reduce-scatter step 2/3"
    act.step("reduce-scatter", 2, 3)
    assert act.current_step() == "all-gather step 1/3"
    act.step("all-gather", 1, 3)
    assert act.current_step() == "all-gather step 3/3"
    act.step("all-gather", 2, 3)
    assert act.current_step() == "after all-gather step 3/3 (finishing)"
    act.begin("broadcast", 3, "pipelined")
    assert act.current_step() == "broadcast step 1"
    act.step("broadcast", 0, 8)
    assert act.current_step() == "broadcast step 2/8"
    act.begin("all_reduce", 4, "native")
    assert act.current_step() == ""
    act.begin("all_reduce", 5, "recursive-doubling")  # an algorithm without a phase table
    assert act.current_step() == "first step"
    act.step("recursive-doubling", 1, 2)
    assert act.current_step() == "after recursive-doubling step 2/2"


def test_report_in_the_argument_check_and_with_world_ranks():
    act = Activity(0, 2, timeout=1, world_ranks=[1, 3], watch=False)
    act.begin("reduce", 2, "ring")
    act.blocked("Allgather", None)
    text = act.report(at=act.since + 2)
    assert "reduce#2 (algo ring, 2 ranks) argument check (before any data moves): blocked " \
           "2.0 s in Allgather, waiting for every rank of the 2-rank communicator" in text
    assert "some rank has not reached this call" in text
    act.blocked("Send", 1)
    assert "sending to r1 (world rank 3)" in act.report(at=act.since + 2)


def test_expired_only_past_the_deadline_and_only_while_blocked():
    a, b, off = ring_activity(), ring_activity(rank=2), ring_activity(rank=3)
    off.timeout = 0
    for act in (a, b, off):
        act.blocked("Wait", 0)
    t = a.since
    b.since = 0.0  # returned from its wait
    assert watchdog.expired(t + 4.9, [a, b, off]) == []
    assert watchdog.expired(t + 5.1, [a, b, off]) == [(a, t)]


def test_activity_forwards_steps_to_an_enabled_trace():
    got = []

    class Trace:
        enabled = True

        def step(self, *args, **kwargs):
            got.append((args, kwargs))

    act = ring_activity()
    assert act.steps_to(Trace()) is act and act.enabled
    act.step("reduce-scatter", 0, 3, dst=2)
    (args, fields), = got
    assert args == ("reduce-scatter", 0, 3) and fields["dst"] == 2
    assert fields["src"] is None and fields["bytes_sent"] == 0  # the other fields: defaults
    from mpiring.runtime.trace import NULL_CALL
    act.steps_to(NULL_CALL)
    act.step("reduce-scatter", 1, 3)
    assert not act.enabled and len(got) == 1


# --- in the job: per-communicator deadlines and live stamps -----------------------------

def test_timeout_is_per_communicator_and_inherited(world):
    sub = world.dup()
    sub.timeout = 42
    assert sub.timeout == 42.0 and world.timeout != 42.0
    assert sub.dup().timeout == 42.0
    half = sub.split(world.rank % 2, key=world.rank)
    assert half.timeout == 42.0
    assert sub._act is not world._act, "each communicator needs its own record"
    with pytest.raises(ValueError, match="seconds"):
        sub.timeout = -3


def test_init_takes_timeout(world, monkeypatch):
    monkeypatch.setenv("MPIRING_TIMEOUT", "77")
    assert mpiring.init().timeout == 77.0
    assert mpiring.init(timeout=5).timeout == 5.0


def test_a_wait_is_stamped_with_the_step_and_peer(world):
    """r0 arrives late; the others are seen blocked on their left neighbour."""
    comm = world.dup()
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    act, seen, stop = comm._act, [], threading.Event()

    def sample():
        while not stop.is_set():
            since = act.since
            if since and time.monotonic() - since > 0.05:
                seen.append((act.what, act.peer, act.report()))
                return
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    if comm.rank == 0:
        time.sleep(0.4)
    x = data(comm.rank, 1000, np.float32)
    comm.all_reduce(x, algo="ring", check=False)  # straight into the ring: the wait is a ring step
    stop.set()
    sampler.join()
    left = (comm.rank - 1) % comm.size
    if comm.rank != 0:
        assert seen, "a rank waiting for r0 must be seen blocked"
        what, peer, text = seen[0]
        assert what in ("Wait", "Sendrecv") and peer == left, seen
        assert re.search(rf"^\[r{comm.rank}\] mpiring stall: all_reduce#1 \(algo ring, "
                         rf"{comm.size} ranks\) (reduce-scatter|all-gather) step \d/\d+: "
                         rf"blocked \d\.\d s in {what}, waiting for data from r{left} ", text), text
    assert act.since == 0.0, "the stamp is cleared when the call returns"


def test_a_second_thread_on_a_dup_keeps_its_own_record(world):
    """The DDP communication thread's pattern: collectives on a dup() from another thread."""
    side = world.dup()
    out = {}

    def worker():
        y = data(side.rank, 300, np.float64, salt=1)
        for _ in range(5):
            side.all_reduce(y, op="max")
        out["y"], out["collective"] = y, side._act.collective

    thread = threading.Thread(target=worker)
    thread.start()
    x = data(world.rank, 200, np.float64)
    for _ in range(5):
        world.broadcast(x, root=0)
    thread.join()
    np.testing.assert_array_equal(x, data(0, 200, np.float64))
    expected = np.max([data(r, 300, np.float64, salt=1) for r in range(world.size)], axis=0)
    np.testing.assert_array_equal(out["y"], expected)
    assert out["collective"] == "all_reduce" and world._act.collective == "broadcast"


# --- nested jobs: a stall and a dead rank end the whole job -----------------------------

def _stamp(out: str, pattern: str) -> float:
    match = re.search(pattern + r" at (\d+\.\d+)", out)
    assert match, out
    return float(match.group(1))


#: The nested jobs: a rank that sleeps in a collective, one that is killed, one that raises
#: (plain ``python``, no abort); a 3 s deadline where the test waits for it.
JOBS = {
    "test_a_rank_sleeping_inside_a_collective_is_reported_and_the_job_aborts":
        Job(4, ["tests/reliability_cases/stall.py", "2"], env={"MPIRING_TIMEOUT": "3"}),
    "test_a_killed_rank_ends_the_job_non_zero_within_30_s":
        Job(4, ["tests/reliability_cases/die.py", "kill", "1", "20"]),
    "test_a_rank_that_leaves_silently_is_caught_by_the_deadline":
        Job(3, ["tests/reliability_cases/die.py", "raise", "1", "5"], env={"MPIRING_TIMEOUT": "3"}),
}


@pytest.mark.deadline(90)
def test_a_rank_sleeping_inside_a_collective_is_reported_and_the_job_aborts(
        side_by_side, request):
    result = side_by_side.run(request, JOBS)
    if result is None:
        return
    rc, out, _ = result
    ended = result.ended
    assert rc == STALL_EXIT_CODE, out
    reports = re.findall(r"\[r(\d)\] mpiring stall: all_reduce#4 \(algo ring, 4 ranks\) "
                         r"(reduce-scatter|all-gather) step (\d)/3: blocked (\d+\.\d) s in "
                         r"(Wait|Sendrecv), waiting for data from r(\d) \(deadline 3 s\)", out)
    assert reports, out
    for rank, phase, step, waited, _, peer in reports:
        assert int(peer) == (int(rank) - 1) % 4, out  # each waits for its left neighbour
        assert float(waited) >= 3.0
        if rank == "3":  # r2 stalls in its second send: r3 waits in that very step
            assert (phase, step) == ("reduce-scatter", "2"), out
    assert "[r2] mpiring stall" not in out, "the sleeping rank is not blocked in MPI"
    assert "stall.py\", line" in out, "the report shows where the stalled thread is"
    seconds = ended - _stamp(out, r"\[r0\] entering all_reduce#4")
    assert 3.0 <= seconds < 15.0, f"ended {seconds:.1f} s after entering:\n{out}"


@pytest.mark.deadline(90)
def test_a_killed_rank_ends_the_job_non_zero_within_30_s(side_by_side, request):
    result = side_by_side.run(request, JOBS)
    if result is None:
        return
    rc, out, _ = result
    ended = result.ended
    assert rc != 0, out
    assert "death was not noticed" not in out, out
    seconds = ended - _stamp(out, r"\[r1\] leaving \(kill\) at iteration 20")
    assert seconds < 30, f"the job ended {seconds:.1f} s after the kill:\n{out}"


@pytest.mark.deadline(90)
def test_a_rank_that_leaves_silently_is_caught_by_the_deadline(side_by_side, request):
    """An uncaught exception in plain ``python`` ends one rank without MPI_Abort: the
    launcher keeps the others, which wait in the next call's argument check."""
    result = side_by_side.run(request, JOBS)
    if result is None:
        return
    rc, out, _ = result
    ended = result.ended
    assert rc == STALL_EXIT_CODE, out
    assert "RuntimeError: deliberate failure" in out
    assert re.search(r"\[r[02]\] mpiring stall: all_reduce#6 \(algo ring, 3 ranks\) argument "
                     r"check \(before any data moves\): blocked \d+\.\d s in Allgather, waiting "
                     r"for every rank of the 3-rank communicator", out), out
    seconds = ended - _stamp(out, r"\[r1\] leaving \(raise\) at iteration 5")
    assert seconds < 15, f"the job ended {seconds:.1f} s after the exit:\n{out}"
