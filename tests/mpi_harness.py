"""pytest under ``mpiexec -n K``: one readable report, and no run can hang.

* Fail fast: when a test fails on any rank (setup, call or teardown), that rank
  prints ``[r{rank}] FAILED {nodeid}`` with the traceback to stderr and aborts
  the whole MPI job with exit code 1. The other ranks would otherwise run on
  into the next test's collectives and wait forever for the failed one.
* Deadline: every test runs under a watchdog (``mpi_deadline`` in the ini, 60 s
  by default, or ``@pytest.mark.deadline(seconds)``). On expiry the rank prints
  ``[r{rank}] TIMEOUT {nodeid}`` and every thread's stack, then those of the
  other ranks on its host, then aborts the job. A second, C-level watchdog
  (faulthandler) exits the process even if Python itself is stuck.
* Every rank's stacks: the rank whose deadline fires first is often not the
  culprit (a rank stuck in C with the GIL held cannot run its own timer; the
  others then time out waiting for it). So each rank arms faulthandler on
  SIGUSR1, writing into a file of its own, and a rank that times out signals
  the other ranks of its host and prints what they wrote, each under
  ``[r{rank}] stacks of r{other}``.
* One report: ranks other than 0 drop pytest's terminal output; rank 0 prints
  the usual progress and summary.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import socket
import sys
import tempfile
import threading
import time

import pytest
from mpi4py import MPI

from mpiring.runtime import watchdog
from mpiring.runtime.watchdog import REPORT_GRACE

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
SIZE = WORLD.Get_size()
DEFAULT_DEADLINE = 60.0
#: The other ranks on this host: (rank, pid, file that SIGUSR1 dumps their stacks into).
_PEERS: list[tuple[int, int, str]] = []


def pytest_addoption(parser):
    parser.addini("mpi_deadline", "per-test deadline in seconds under MPI", default=str(DEFAULT_DEADLINE))


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config):
    config.addinivalue_line("markers", "deadline(seconds): per-test deadline under MPI")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "one_rank: a pure test (no communication, the same "
                            "on every rank): rank 0 runs it, the others wait without spinning")
    _arm_stack_dumps()
    _reports_to_the_terminal(config)
    if RANK != 0:
        # Rank 0 speaks for the job; the others report only their own failures.
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def _reports_to_the_terminal(config) -> None:
    """Point mpiring's own reports (a stall, a desync, an error on a thread) at the real stderr.

    mpiring writes them to fd 2 and aborts the job; pytest's capture holds fd 2 in a
    file that it reads back only when the test ends, which an abort never reaches, so
    the job would end with exit 124 and not a word. A copy of fd 2 taken while the
    capture is off is the terminal's (or the launcher's pipe).
    """
    # pytest configures its plugins with the capture suspended (it runs during conftest
    # loading and collection only); where it runs, it is suspended around the copy and
    # resumed, and where it does not, resuming would start it early and swallow the header.
    capman = config.pluginmanager.getplugin("capturemanager")
    running = getattr(getattr(capman, "_global_capturing", None), "_state", None) == "started"
    if running:
        capman.suspend_global_capture(in_=False)
    try:
        watchdog.REPORT_FD = os.dup(2)
    finally:
        if running:
            capman.resume_global_capture()


def _arm_stack_dumps() -> None:
    """SIGUSR1 makes this rank dump every thread's stack into a file of its own (collective)."""
    if SIZE == 1 or not hasattr(signal, "SIGUSR1"):
        return
    fd, path = tempfile.mkstemp(prefix=f"mpiring-test-stacks-r{RANK}-", suffix=".txt",
                                dir=os.environ.get("MPIRING_TEST_STACKS_DIR") or None)
    sink = os.fdopen(fd, "w")
    # In C, from the signal handler: works while this rank's Python is stuck.
    faulthandler.register(signal.SIGUSR1, file=sink, all_threads=True)
    atexit.register(_remove, path)  # an aborted job leaves its (small) files behind
    host = socket.gethostname()
    table = WORLD.allgather((host, os.getpid(), path))
    _PEERS[:] = [(r, pid, p) for r, (h, pid, p) in enumerate(table) if h == host and r != RANK]


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _peer_stacks() -> None:
    """Ask the other ranks of this host for their stacks and print them here."""
    asked = []
    for r, pid, path in _PEERS:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
            asked.append((r, pid, path))
    time.sleep(0.3)  # the dumps are written from the signal handlers, in C
    for r, pid, path in asked:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            text = f"(could not read {path}: {exc})\n"
        text = text or f"(nothing written; {_process_state(pid)})\n"
        sys.stderr.write(f"\n[r{RANK}] stacks of r{r} (pid {pid}), asked for when r{RANK} "
                         f"timed out:\n{text}")
    sys.stderr.flush()


def _process_state(pid: int) -> str:
    """What the kernel says of a rank that did not answer: gone, a zombie (it exited), or
    its scheduler state and where in the kernel it waits (D: uninterruptible, as on I/O)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "the process is gone"
    try:
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip() or "-"
    except OSError:
        wchan = "?"
    return f"process state {state}, waiting in {wchan}"


def _abort(message: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(message)
    sys.stderr.flush()
    time.sleep(REPORT_GRACE)  # let the launcher forward the report before it kills the job
    from mpiring.backends.mpi import forget_shared_memory

    forget_shared_memory()  # else each aborted test run leaves MPICH's segment in /dev/shm
    WORLD.Abort(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and SIZE > 1:
        _abort(f"\n[r{RANK}] FAILED {item.nodeid} ({report.when})\n"
               f"{report.longreprtext}\n"
               f"[r{RANK}] aborting the {SIZE}-rank job so that no rank waits forever\n")


def _deadline(item) -> float:
    marker = item.get_closest_marker("deadline")
    if marker is not None:
        return float(marker.args[0])
    return float(item.config.getini("mpi_deadline"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = _deadline(item)

    capman = item.config.pluginmanager.getplugin("capturemanager")

    def expire():
        if capman is not None:  # pytest is capturing fd 2: give the report back to the terminal
            capman.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n[r{RANK}] TIMEOUT {item.nodeid}: still running after "
                         f"{seconds:.0f} s; stacks of every thread follow\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        _peer_stacks()
        _abort(f"[r{RANK}] aborting the {SIZE}-rank job after the deadline\n")

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    # Backstop in C: fires even if the Python timer thread cannot run.
    faulthandler.dump_traceback_later(seconds + 15, exit=True)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def _pure(item) -> bool:
    return SIZE > 1 and item.get_closest_marker("one_rank") is not None


def pytest_runtest_setup(item):
    # Four copies of a pure test on two cores take twice as long as one, and find nothing
    # the one does not.
    if _pure(item) and RANK != 0:
        pytest.skip("a pure test: rank 0 runs it")


def run_by_part_of_the_job(item) -> None:
    """Mark ``item`` as a test that only some ranks run (a sub-communicator's): every
    rank meets the others at its end. Call it on every rank, the members and the
    ranks that skip, for the same tests."""
    item._mpi_partial = True


def pytest_runtest_teardown(item, nextitem):
    if _pure(item):
        # The others wait for rank 0 here, sleeping between polls: a blocking MPI call
        # in the next test would spin on the cores rank 0 is computing on. (Under the
        # test's deadline: a rank 0 that hangs ends the job as any test does.)
        req = WORLD.Ibarrier()
        if RANK == 0:  # the last to come: the others are waiting already
            req.Wait()
        while not req.Test():
            time.sleep(0.002)
    elif getattr(item, "_mpi_partial", False):
        # A rank outside the test's group would run on into the next test and spin in
        # its first blocking call, on the cores the group computes on (with four ranks
        # on two cores, a K=1 test then ran at half speed), and its deadline would
        # count the group's time on every test it skipped. So every rank waits here,
        # sleeping between polls, until the group is done.
        req = WORLD.Ibarrier()
        while not req.Test():
            time.sleep(0.0005)


def pytest_sessionfinish(session, exitstatus):
    # Exit codes must agree: a rank whose tests all passed must not report
    # success while another one failed. (A failure already aborted the job;
    # this catches collection errors that differ between ranks.)
    if SIZE > 1:
        worst = WORLD.allreduce(int(exitstatus), op=MPI.MAX)
        if worst and not exitstatus:
            session.exitstatus = worst


def scrubbed_env() -> dict[str, str]:
    """The environment for a nested ``mpiexec``, without this job's launcher variables."""
    drop = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "MPIR_CVAR_", "I_MPI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    return env
