"""Shared fixtures. The MPI harness (fail fast, deadlines, one report) is in mpi_harness."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np
import pytest
from mpi_harness import *  # noqa: F401,F403  (registers the harness hooks)
from mpi_harness import run_by_part_of_the_job, scrubbed_env

import mpiring

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="session")
def world():
    """A Communicator over every rank of the test job."""
    return mpiring.init(backend="mpi")


_SUBS: dict[int, object] = {}


@pytest.fixture(scope="session")
def subcomms(world):
    """``k -> Communicator`` over ranks 0..k-1 (None on the other ranks), k = 1..4."""
    if not _SUBS:
        for k in WORLD_SIZES:
            _SUBS[k] = world.split(0 if world.rank < k else None, key=world.rank) if k <= world.size else None
    return _SUBS


@pytest.fixture(params=WORLD_SIZES, ids=lambda k: f"K{k}")
def comm(request, subcomms, world):
    """A Communicator of K ranks, for K in 1..4: sub-communicators of the test job.

    Ranks outside the sub-communicator skip the test (they have nothing to do);
    if the job has fewer than K ranks every rank skips it.
    """
    k = request.param
    if k > world.size:
        pytest.skip(f"needs {k} ranks, the job has {world.size}")
    if k < world.size:
        run_by_part_of_the_job(request.node)
    sub = subcomms[k]
    if sub is None:
        pytest.skip(f"rank {world.rank} is not in the {k}-rank sub-communicator")
    return sub


_MADE: list = []  # the pipeline stages and schedules made, in order (_made())


def _made() -> list:
    """Every PipelineStage and PipelineSchedule built from now on, appended as made (the
    classes' __init__ wrapped once, when a test module has imported the pipeline)."""
    runtime = sys.modules.get("mpiring.parallel.pipeline.runtime")
    if runtime is not None and not getattr(runtime, "_tests_track", False):
        from mpiring.parallel.pipeline.stage import PipelineStage

        for cls in (PipelineStage, runtime.PipelineSchedule):
            def tracked(self, *args, _init=cls.__init__, **kwargs):
                _init(self, *args, **kwargs)
                _MADE.append(self)
            cls.__init__ = tracked
        runtime._tests_track = True
    return _MADE


@pytest.fixture(autouse=True)
def _pipelines_given_back():
    """Free the pipeline schedules and stages a test made: each takes communicators of
    its own (a duplicate, a transport's, a shared window's), MPI has about 2048 per
    process, and a suite of tests that leave theirs ran out. Schedules go before their
    stages; every rank that made one reaches this teardown (a failed test aborts the
    job first, when it has more than one rank), and freeing twice is a no-op."""
    made = _made()
    start = len(made)
    yield
    new, made[start:] = made[start:], []
    for obj in reversed(new):
        obj.free()


def wait_quietly(world, poll: float = 0.05) -> None:
    """Barrier that sleeps instead of spinning, so a subprocess gets the CPU cores."""
    req = world.mpi_comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


class Finished(tuple):
    """A nested job's ``(rc, output, seconds)``, and ``ended``: the wall-clock time it
    ended at, for a test that reads it while later jobs still run."""

    ended: float

    def __new__(cls, rc: int, out: str, seconds: float):
        self = super().__new__(cls, (rc, out, seconds))
        self.ended = time.time()
        return self


def run_mpiexec(n: int, args: list[str], timeout: float,
                env: dict[str, str] | None = None) -> Finished:
    """Run ``mpiexec -n n python ARGS`` in a clean environment (plus ``env``); return
    (rc, output, seconds)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = "mpiexec"
    cmd = [mpiexec, "-n", str(n), sys.executable, *args]
    t0 = time.monotonic()
    # A nested test job that is aborted on purpose cannot remove its harness
    # files (see mpi_harness._arm_stack_dumps): they go here, removed afterwards.
    stacks = tempfile.TemporaryDirectory(prefix="mpiring-nested-")
    env = {**scrubbed_env(), **(env or {}), "MPIRING_TEST_STACKS_DIR": stacks.name}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        return Finished(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"") + (exc.stderr or b"")
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return Finished(-9, out + f"\n<timed out after {timeout} s>", time.monotonic() - t0)
    finally:
        stacks.cleanup()


@pytest.fixture
def rank0_subprocess(world):
    """Run a nested mpiexec from rank 0 while the other ranks wait without spinning.

    Returns a function with ``run_mpiexec``'s signature; on ranks other than 0 it
    returns None, so the test asserts only on rank 0.
    """
    def run(n, args, timeout):
        result = run_mpiexec(n, args, timeout) if world.rank == 0 else None
        wait_quietly(world)
        return result

    return run


class Job(NamedTuple):
    """A nested ``mpiexec -n n python ARGS`` (see ``run_mpiexec``)."""

    n: int
    args: list[str]
    timeout: float = 60
    env: dict[str, str] | None = None


class SideBySide:
    """A test file's nested jobs, started together on rank 0; each test reads its own.

    A nested job mostly waits: for its ranks' imports, for a deadline or a probe to
    pass, for the launcher to forward an abort. One after another, such jobs left the
    cores idle for most of the minute and a half they took; side by side they fill
    that time with each other's work. Every timing a test asserts is the job's own
    (``Finished.ended``, its ``seconds``), so the jobs' order does not matter.
    """

    #: Jobs at once: more spend the waits on each other's imports and progress.
    WIDTH = 4

    def __init__(self, world):
        self.world = world
        self.futures: dict = {}
        self.pool = None

    def run(self, request, jobs: dict[str, Job]):
        """The result of ``jobs[request.node.name]`` on rank 0, None on the others.

        The first call starts every job of ``jobs`` whose test was collected (so
        ``-k`` runs only the jobs it selects); the other ranks wait without spinning.
        """
        name = request.node.name
        if name not in jobs:
            raise KeyError(f"no nested job for {name}; jobs: {sorted(jobs)}")
        result = None
        if self.world.rank == 0:
            if self.pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self.pool = ThreadPoolExecutor(self.WIDTH, thread_name_prefix="nested-job")
            wanted = {item.name for item in request.session.items
                      if item.module is request.module}
            for key, job in jobs.items():
                if key in wanted and key not in self.futures:
                    self.futures[key] = self.pool.submit(run_mpiexec, job.n, job.args,
                                                         job.timeout, job.env)
            result = self.futures[name].result()
        wait_quietly(self.world)
        return result

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def side_by_side(world):
    """This test file's ``SideBySide`` nested jobs."""
    jobs = SideBySide(world)
    yield jobs
    jobs.close()


def data(rank: int, n: int, dtype, op: str = "sum", salt: int = 0) -> np.ndarray:
    """Rank- and index-dependent test data whose reductions are exact in every dtype.

    Small integers (0..6, or 1..3 for prod) so that sums and products over 4
    ranks fit int8/uint8/float16/bfloat16 exactly; any chunk in the wrong place
    or any missing contribution changes the result.
    """
    idx = np.arange(n, dtype=np.int64)
    if op == "prod":
        vals = (idx * 5 + rank * 3 + salt) % 3 + 1
    else:
        vals = (idx * 5 + rank * 3 + salt) % 7
    return vals.astype(np.float64).astype(dtype)


OPS = ("sum", "avg", "max", "min", "prod")
FLOATS = ("float16", "bfloat16", "float32", "float64")


def np_dtype(name: str):
    """The NumPy dtype for a canonical dtype name (ml_dtypes' for bfloat16)."""
    from mpiring.core.buffers import BFLOAT16

    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def sizes(k: int) -> list[int]:
    """Element counts for K ranks: empty, fewer than K, one per rank, uneven, larger and uneven."""
    return sorted({0, 1, max(k - 1, 0), k, 3 * k + 1, 1000 + k})
