"""A failed or finished rank ends the job in seconds, with the default 300 s deadline.

Nested jobs (tests/reliability_cases/die.py) from rank 0: an uncaught exception
in the main thread or in another thread aborts the job naming the rank and the
exception; a rank that exits normally while the others wait for it is reported
by the watchdog (``mpiring.backends.lifecycle``, ``watchdog.watch_exits``).
"""

from __future__ import annotations

import ast
import os
import re
import time

import pytest
from conftest import Job

from mpiring.runtime.watchdog import EXIT_GRACE, STALL_EXIT_CODE, Activity, waiting_on_exited


def _ended_after(out: str, how: str, started: float) -> float:
    match = re.search(rf"\[r1\] leaving \({how}\) at iteration \d+ at (\d+\.\d+)", out)
    assert match, out
    return started - float(match.group(1))


def _job(n, how):
    # The default deadline: the end must not wait for it.
    return Job(n, ["tests/reliability_cases/die.py", how, "1", "5"], env={"MPIRING_TIMEOUT": "300"})


JOBS = {
    "test_an_uncaught_exception_aborts_the_job_naming_rank_and_exception[uncaught-3]":
        _job(3, "uncaught"),
    "test_an_uncaught_exception_aborts_the_job_naming_rank_and_exception[thread-2]":
        _job(2, "thread"),
    **{f"test_a_rank_that_exits_while_others_wait_is_reported[{how}-{n}]": _job(n, how)
       for how, n in (("finish", 3), ("sysexit", 4), ("raise", 2))},
    # Prints the segments it maps, then aborts.
    "test_an_aborted_job_leaves_no_mpich_segment_in_dev_shm": Job(2, ["-c", (
        "from mpi4py import MPI; from mpiring.backends.mpi import abort_world; "
        "MPI.COMM_WORLD.Barrier(); "
        "print('SEGMENTS', sorted({l.split()[-1] for l in open('/proc/self/maps') "
        "if '/dev/shm/mpich_shm_' in l}), flush=True); MPI.COMM_WORLD.Barrier(); "
        "abort_world(3)")]),
}


def _run(side_by_side, request, how):
    """This test's job (started with the file's others): rc, output, and how long after
    rank 1 left it ended."""
    result = side_by_side.run(request, JOBS)
    if result is None:
        return None
    rc, out, _ = result
    return rc, out, _ended_after(out, how, result.ended)


@pytest.mark.deadline(90)
@pytest.mark.parametrize("how,n,names", [
    ("uncaught", 3, r"\[r1\] uncaught RuntimeError: deliberate failure\n"),
    ("thread", 2, r"\[r1\] uncaught ValueError in thread 'worker': deliberate failure in a "
                  r"thread\n"),
], ids=["uncaught-3", "thread-2"])
def test_an_uncaught_exception_aborts_the_job_naming_rank_and_exception(
        side_by_side, request, how, n, names):
    result = _run(side_by_side, request, how)
    if result is None:
        return
    rc, out, seconds = result
    assert rc == 1, out
    assert re.search(names + rf"\[r1\] aborting the {n}-rank job \(exit 1\)", out), out
    assert "death was not noticed" not in out and "mpiring stall" not in out, out
    assert seconds < 10, f"the job ended {seconds:.1f} s after the exception:\n{out}"


@pytest.mark.deadline(90)
@pytest.mark.parametrize("how,n", [("finish", 3), ("sysexit", 4), ("raise", 2)])
def test_a_rank_that_exits_while_others_wait_is_reported(side_by_side, request, how, n):
    result = _run(side_by_side, request, how)
    if result is None:
        return
    rc, out, seconds = result
    assert rc == STALL_EXIT_CODE, out
    assert re.search(r"\[r[0-9]\] mpiring stall: all_reduce#\d+ \(algo ring, \d ranks\) .*"
                     r"\(deadline 300 s\)\n\[r[0-9]\] world rank 1 exited \d+\.\d s ago and "
                     r"will never join this call", out), out
    assert seconds < 10, f"the job ended {seconds:.1f} s after the exit:\n{out}"


def test_only_collectives_over_the_exited_rank_are_reported():
    def blocked(collective, world_ranks, since):
        act = Activity(0, len(world_ranks), world_ranks=world_ranks, watch=False)
        act.begin(collective, 1, "ring")
        act.blocked("Allgather", None)
        act.since = since
        return act

    t = 100.0
    over, other, p2p = blocked("all_reduce", [0, 1, 2], t), blocked("all_reduce", [0, 2], t), \
        blocked("recv", [0, 1], t)
    idle = blocked("all_reduce", [0, 1], 0.0)
    records = [over, other, p2p, idle]
    assert waiting_on_exited(t + 50, records, {}) == []
    assert waiting_on_exited(t + EXIT_GRACE / 2, records, {1: t}) == []  # within the grace
    assert waiting_on_exited(t + EXIT_GRACE + 0.1, records, {1: t}) == [(over, t, 1)]
    # The grace counts from the notice, not from the start of the wait.
    assert waiting_on_exited(t + EXIT_GRACE + 0.1, records, {1: t + 1}) == []


def test_abort_world_gives_the_launcher_time_to_forward_the_last_words(monkeypatch):
    # MPI_Abort right after a write could lose the write: the launcher kills the job
    # before reading the rank's pipe (mpiring.run's traceback vanished that way).
    from mpiring.backends import mpi as backend
    from mpiring.runtime.watchdog import REPORT_GRACE

    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def flush(self):
            events.append(("flush", self.name))

    class World:
        @staticmethod
        def Abort(code):
            events.append(("abort", code))

    monkeypatch.setattr(backend.sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(backend.sys, "stderr", Stream("stderr"))
    class Clock:  # mpi.py's own ``time``: other modules (and threads) keep the real sleep
        @staticmethod
        def sleep(s):
            events.append(("sleep", s))

        def __getattr__(self, name):
            return getattr(time, name)

    monkeypatch.setattr(backend, "time", Clock())
    monkeypatch.setattr(backend, "MPI", type("FakeMPI", (), {"COMM_WORLD": World}))
    monkeypatch.setattr(backend, "flush_all", lambda: events.append(("traces",)))
    backend.abort_world(3)
    assert events == [("traces",), ("flush", "stdout"), ("flush", "stderr"),
                      ("sleep", REPORT_GRACE), ("abort", 3)]


@pytest.mark.deadline(90)
def test_an_aborted_job_leaves_no_mpich_segment_in_dev_shm(side_by_side, request):
    # MPICH unlinks its /dev/shm segment at MPI_Finalize only: each aborted job (a
    # stall, an uncaught error, a failed test) left 2-4 MiB of the host's memory there.
    result = side_by_side.run(request, JOBS)
    if result is None:
        return
    rc, out, _ = result
    assert rc != 0, out
    # Found anywhere in a line: the two ranks' prints can reach the launcher's pipe as one.
    segments = {p for seen in re.findall(r"SEGMENTS (\[[^\]]*\])", out)
                for p in ast.literal_eval(seen)}
    if not segments:
        pytest.skip("this MPI maps no /dev/shm segment")
    assert not [p for p in segments if os.path.exists(p)], out
