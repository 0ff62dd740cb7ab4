"""How mpiring starts and reads its configuration, as a demanding user hits it.

Every bad setting (an argument of ``init``/``init_process_group`` or an
``MPIRING_*`` variable), and every setting the ranks must share but do not,
raises ``ConfigError`` on every rank before any communicator exists, naming the
setting and the fix. The bad value is given to ONE rank (the last) wherever the
launch allows it, as a hostfile's hosts or a per-rank ``-env`` would: that rank
alone failing used to leave the others waiting in init (or crash the job at
the first collective). ``init`` is called again after each refusal: a refused
init leaves nothing behind.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from conftest import ROOT, data
from mpi4py import MPI
from mpi_harness import scrubbed_env

import mpiring
from mpiring.backends.mpi import world_backend
from mpiring.comm import default
from mpiring.comm.communicator import Communicator
from mpiring.comm.start import KNOWN, REMOVED, ConfigError
from mpiring.runtime import pages
from mpiring.runtime.trace import FORMAT_VERSION


@pytest.fixture
def clean_env(monkeypatch):
    """No MPIRING_* variable but the harness's deadline: each test sets its own."""
    for name in list(os.environ):
        if name.startswith("MPIRING_") and name not in ("MPIRING_TIMEOUT",
                                                        "MPIRING_TEST_STACKS_DIR"):
            monkeypatch.delenv(name)
    return monkeypatch


def _refused_everywhere(world, match: str, **kwargs) -> str:
    """``mpiring.init(**kwargs)`` raises ConfigError matching ``match`` on this rank
    (which every rank checks), and the message says which rank when not all."""
    with pytest.raises(ConfigError, match=match) as info:
        mpiring.init(**kwargs)
    assert info.value.on_every_rank  # ends each rank alone: no MPI_Abort of the job
    return str(info.value)


def _sum_check(comm, world) -> None:
    """``comm`` still runs a correct all_reduce (against MPI's own Allreduce)."""
    x = data(comm.rank, 37, np.float64)
    want = np.empty_like(x)
    world.mpi_comm.Allreduce(x, want, op=MPI.SUM)
    np.testing.assert_array_equal(comm.all_reduce(x.copy(), algo="ring"), want)


# --- bad values of the variables, on one rank only ----------------------------------
BAD_VALUES = {
    # name: (value, what the message must contain). Each was silently read as the
    # default before (CHECK, LOG, HUGE_PAGES, STEADY_MALLOC), or raised on one rank
    # only, deep in the run or inside init while the others waited (the rest).
    "MPIRING_CHECK": ("maybe", r"MPIRING_CHECK='maybe': use 1 or 0"),
    "MPIRING_LOG": ("1", r"MPIRING_LOG='1': use 'steps'"),
    "MPIRING_HUGE_PAGES": ("off", r"MPIRING_HUGE_PAGES='off': use 1 .* or 0"),
    "MPIRING_STEADY_MALLOC": ("no", r"MPIRING_STEADY_MALLOC='no': use 1"),
    "MPIRING_TIMEOUT": ("5min", r"MPIRING_TIMEOUT='5min': give seconds"),
    "MPIRING_DESYNC": ("soon", r"MPIRING_DESYNC='soon': give the probe time in seconds"),
    "MPIRING_IDLE": ("busy", r"MPIRING_IDLE='busy': use one of spin, yield, sleep"),
    "MPIRING_PP_SHARED": ("2", r"MPIRING_PP_SHARED='2': use 1"),
    "MPIRING_CUDA_AWARE": ("maybe", r"MPIRING_CUDA_AWARE='maybe': use 1, 0 or auto"),
    # Misspelt and retired names: the deadline would have stayed at 300 s.
    "MPIRING_TIMOUT": ("10", r"MPIRING_TIMOUT is not a variable.*did you mean MPIRING_TIMEOUT"),
    "MPIRING_YIELD": ("1", r"MPIRING_YIELD is no longer read: use MPIRING_IDLE=yield"),
}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_a_bad_variable_on_one_rank_is_refused_on_every_rank(world, clean_env, name):
    value, match = BAD_VALUES[name]
    last = world.size - 1
    if name == "MPIRING_TIMEOUT":
        clean_env.setenv("MPIRING_TIMEOUT", "60")  # the harness's own, changed below
    if world.rank == last:
        clean_env.setenv(name, value)
    message = _refused_everywhere(world, match)
    if world.size > 1:
        assert f"(on r{last})" in message
    clean_env.delenv(name, raising=False)
    _sum_check(mpiring.init(), world)  # a refused init left nothing behind


# The readers used without init (a Communicator built directly, the page allocator, the
# malloc tuning) read "off", "maybe" and "no" as on before; now they refuse what init does.
READ_WITHOUT_INIT = {
    "MPIRING_CHECK": lambda world: Communicator(world_backend()),
    "MPIRING_HUGE_PAGES": lambda world: pages.zeros(1 << 21, torch.float32),
    "MPIRING_STEADY_MALLOC": lambda world: pages.steady_malloc(),
}


@pytest.mark.parametrize("name", list(READ_WITHOUT_INIT))
def test_a_bad_variable_is_refused_without_init_too(world, clean_env, name):
    value, match = BAD_VALUES[name]
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        READ_WITHOUT_INIT[name](world)


def test_a_variable_like_none_of_mpirings_is_ignored_with_a_warning(world, clean_env):
    # A user's own MPIRING_-prefixed name is no misspelling of a setting: said, not refused.
    clean_env.setenv("MPIRING_RUN_LABEL", "exp-7")
    with pytest.warns(UserWarning, match="MPIRING_RUN_LABEL is not a variable mpiring reads"):
        comm = mpiring.init()
    _sum_check(comm, world)
    clean_env.delenv("MPIRING_RUN_LABEL")


def test_every_variable_mpiring_reads_is_known():
    names = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "mpiring")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    names.update(re.findall(r"MPIRING_[A-Z0-9_]*[A-Z0-9]", fh.read()))
    assert names - set(KNOWN) - set(REMOVED) == set()
    with open(os.path.join(ROOT, "docs", "configuration.md")) as fh:
        documented = set(re.findall(r"`(MPIRING_[A-Z0-9_]+)`", fh.read()))
    assert set(KNOWN) <= documented | {"MPIRING_TEST_STACKS_DIR"}


@pytest.mark.deadline(120)
def test_a_torchrun_environment_is_refused_by_init(rank0_subprocess, monkeypatch):
    # Under torchrun each process is an MPI singleton: mpiring.init() gave size 1 on
    # every one of them and each trained alone, silently (init_process_group already
    # checked this; init did not). Two singletons, as torchrun would start them:
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = ("import os, mpiring\ntry:\n    c = mpiring.init()\n"
            "    print(f'TRAINS ALONE size {c.size}', flush=True)\n"
            "except mpiring.ConfigError as e:\n    print(f'REFUSED {e}', flush=True)\n")
    result = rank0_subprocess(1, ["-c", code], timeout=60)
    if result is not None:
        rc, out, _ = result
        assert rc == 0 and "TRAINS ALONE" not in out, out
        assert "REFUSED mpiring.init: WORLD_SIZE=2, but MPI gives this process world_size 1"\
            in out and "not torchrun" in out, out


def test_launcher_variables_that_agree_are_fine(world, clean_env):
    clean_env.setenv("WORLD_SIZE", str(world.size))  # what mpiring.run sets
    clean_env.setenv("RANK", str(world.rank))
    _sum_check(mpiring.init(), world)


# --- settings the ranks must share ---------------------------------------------------
def test_check_set_differently_on_one_rank_is_refused_before_a_crash(world, clean_env):
    # Before: the rank that checks sent its descriptor to ranks that did not expect
    # one: "Fatal error in internal_Allgather_c: Message truncated", the job dead.
    if world.size == 1:
        pytest.skip("needs two ranks")
    last = world.size - 1
    if world.rank == last:
        clean_env.setenv("MPIRING_CHECK", "0")
    message = _refused_everywhere(world, r"the ranks disagree on check")
    assert f"off (MPIRING_CHECK='0') on r{last}" in message
    assert "on (default) on r0" in message and "set MPIRING_CHECK the same" in message
    # The argument, rank-dependent, the same way.
    _refused_everywhere(world, r"disagree on check: .*check=True", check=world.rank == 0)
    # One backend for all (a rank on NCCL and one on MPI would wait on each other).
    if world.rank == last:
        _refused_everywhere(world, r"disagree on backend", backend="nccl")
    else:
        _refused_everywhere(world, r"disagree on backend")
    clean_env.delenv("MPIRING_CHECK", raising=False)
    comm = mpiring.init(check=False)
    assert comm.check is False
    _sum_check(comm, world)


@pytest.mark.parametrize("kwargs, match", [
    ({"check": "no"}, r"check='no': pass True or False"),  # a truthy string was "on"
    ({"log": "step"}, r"log='step': use 'steps'"),  # was silently no log
    ({"log": True}, r"log=True: use 'steps'"),
    ({"timeout": -1}, r"timeout=-1: give a non-negative number"),
    ({"timeout": "5 minutes"}, r"timeout='5 minutes' is not a number of seconds"),
    ({"backend": "gloo"}, r"unknown backend 'gloo': use one of mpi, nccl"),
    ({"trace": 3}, r"trace=3: give a directory"),
])
def test_bad_arguments_are_refused_on_every_rank(world, clean_env, kwargs, match):
    # The bad argument on the last rank only (the others pass good ones).
    _refused_everywhere(world, match, **(kwargs if world.rank == world.size - 1 else {}))


def test_init_takes_a_timedelta_and_strings_of_seconds(world, clean_env):
    assert mpiring.init(timeout=datetime.timedelta(minutes=2)).timeout == 120.0
    assert mpiring.init(timeout="45s").timeout == 45.0
    clean_env.setenv("MPIRING_CHECK", " OFF ")
    assert mpiring.init().check is False


# --- trace files ---------------------------------------------------------------------
def test_a_trace_directory_one_rank_cannot_create_is_refused_on_every_rank(world, clean_env):
    last = world.size - 1
    with tempfile.TemporaryDirectory() as tmp:
        blocker = os.path.join(tmp, "a-file")
        open(blocker, "w").close()
        # The last rank's "directory" lies under a plain file (a typo, another host's
        # path); the others' are fine. Before: the last rank raised inside init, the
        # others waited for it in the next collective of init, for ever.
        trace = os.path.join(blocker, "trace") if world.rank == last else \
            os.path.join(tmp, "trace")
        message = _refused_everywhere(world, r"cannot write this rank's trace file", trace=trace)
        if world.size > 1:
            assert f"(on r{last})" in message
        clean_env.setenv("MPIRING_TRACE", trace)
        _refused_everywhere(world, r"MPIRING_TRACE=.*Not a directory")


def _records(path):
    with open(path, "rb") as fh:
        raw = fh.read()
    assert b"\0" not in raw
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def test_init_twice_with_one_trace_directory_keeps_every_record(world, clean_env):
    # e.g. mpiring.init() and then init_process_group() with MPIRING_TRACE set. Before:
    # the second init truncated each rank's file while the first kept writing from
    # its own offset, so one overwrote the other's records (7 of 10 left, no error).
    tmp = tempfile.mkdtemp()
    a = mpiring.init(trace=tmp)
    x = data(world.rank, 1000, np.float64)
    want = np.empty_like(x)
    world.mpi_comm.Allreduce(x, want, op=MPI.SUM)
    np.testing.assert_array_equal(a.all_reduce(x.copy(), algo="ring"), want)
    clean_env.setenv("MPIRING_TRACE", tmp)
    b = mpiring.init()
    for comm in (b, a, b):
        np.testing.assert_array_equal(comm.all_reduce(x.copy(), algo="ring"), want)
    a.tracer.flush()
    b.tracer.flush()
    records = _records(os.path.join(tmp, f"rank{world.rank}.jsonl"))
    steps = 2 * (world.size - 1)  # reduce-scatter and all-gather, K-1 steps each
    assert [r["type"] for r in records].count("header") == 1
    assert len([r for r in records if r["type"] == "step"]) == 4 * steps
    # The header names the run (rank 0's id, on every rank) and its rank count.
    header = records[0]
    assert header["version"] == FORMAT_VERSION and header["world"] == world.size
    assert len(set(world.mpi_comm.allgather(header["job"]))) == 1
    a.tracer.close()
    b.tracer.close()


def test_a_second_job_on_the_same_trace_directory_is_refused(world, clean_env):
    # Before: the second job truncated the first one's files and both wrote into
    # them; each job's trace came out mixed. Here the "first job" holding the last
    # rank's file is a plain process (another mpiexec would not be told apart).
    last = world.size - 1
    tmp = tempfile.mkdtemp()
    holder = None
    if world.rank == last:
        code = ("import sys; from mpiring.runtime.trace import Tracer; "
                f"t = Tracer({world.rank}, {tmp!r}); print('ready', flush=True); "
                "sys.stdin.read()")
        holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=scrubbed_env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "ready"
    try:
        message = _refused_everywhere(world, r"being written by another running process.*"
                                             r"give each job its own directory", trace=tmp)
        if world.size > 1:
            assert f"(on r{last})" in message
    finally:
        if holder is not None:
            holder.communicate(timeout=30)
    # Once that job has ended the directory is free again.
    comm = mpiring.init(trace=tmp)
    _sum_check(comm, world)
    comm.tracer.close()


# --- init_process_group, as torch.distributed's users call it ------------------------
@pytest.mark.parametrize("case", ["device_id", "init_method", "url_world_size", "float_rank",
                                  "timeout"])
def test_init_process_group_refuses_on_every_rank(world, clean_env, case):
    last = world.size - 1
    bad = world.rank == last
    kwargs = {
        # A bad value on one rank raised there before init, and the other ranks
        # waited in init for it.
        "device_id": {"device_id": "cuda:0"} if bad else {},
        "init_method": {"init_method": 29500} if bad else {},
        # torch reads rank and world_size from the URL's query too.
        "url_world_size": {"init_method": f"tcp://127.0.0.1:1?world_size={world.size + 1}"},
        # int(2.5) == 2 used to make a fractional rank "agree".
        "float_rank": {"rank": world.rank + 0.5} if bad else {},
        "timeout": {"timeout": datetime.timedelta(seconds=-5)} if bad else {},
    }[case]
    match = {"device_id": r"device_id='cuda:0': give a torch.device",
             "init_method": r"init_method=29500: give a URL string",
             "url_world_size": rf"init_method's world_size={world.size + 1}",
             "float_rank": rf"r{last} .* got rank={last + 0.5}",
             "timeout": r"timeout=-5.0: give a non-negative number"}[case]
    with pytest.raises(ConfigError, match=match):
        mpiring.init_process_group(**kwargs)
    assert not mpiring.is_initialized()


def test_init_process_group_as_torch_users_call_it_and_again_after_destroy(world, clean_env):
    for _ in range(2):
        comm = mpiring.init_process_group(
            "gloo", init_method=f"env://?rank={world.rank}&world_size={world.size}",
            timeout=datetime.timedelta(seconds=90), world_size=world.size, rank=world.rank)
        try:
            assert comm.timeout == 90.0 and default.default_comm() is comm
            _sum_check(comm, world)
        finally:
            mpiring.destroy_process_group()


# --- MPI's own state: thread level, finalized, not initialized (fresh jobs) -----------
_NESTED = {
    # mpi4py at a thread level below MULTIPLE: mpiring's monitor thread called MPI
    # beside the main thread regardless (a race inside MPI). Refused on both ranks.
    "single": ("import mpi4py; mpi4py.rc.thread_level = 'single'\n"
               "import mpiring\n"
               "try:\n    mpiring.init()\n"
               "except mpiring.ConfigError as e:\n    print(f'REFUSED {e}', flush=True)\n"),
    # init after MPI.Finalize: MPICH printed "Attempting to use an MPI routine ...
    # after finalizing MPICH" and the process died.
    "finalized": ("from mpi4py import MPI\nimport mpiring\nmpiring.init(); MPI.Finalize()\n"
                  "try:\n    mpiring.init()\n"
                  "except RuntimeError as e:\n    print(f'REFUSED {e}', flush=True)\n"),
    # mpi4py told not to initialize MPI: init does it, at THREAD_MULTIPLE.
    "uninitialized": ("import mpi4py; mpi4py.rc.initialize = False\n"
                      "import numpy as np, mpiring\n"
                      "c = mpiring.init(); x = np.arange(5.0) * (c.rank + 1)\n"
                      "c.all_reduce(x, algo='ring'); print(f'SUM {x.tolist()}', flush=True)\n"),
    # A rank that never reaches init (it failed before it, when no hook is installed
    # yet to end the job): the others waited in init for ever (here: 30 s, then the
    # job went on). Now the deadline covers init's exchange.
    "late": ("import time\nfrom mpi4py import MPI\nimport mpiring\n"
             "if MPI.COMM_WORLD.Get_rank() == 1:\n    time.sleep(30)\n"
             "mpiring.init(); print('INIT DONE', flush=True)\n"),
}


@pytest.mark.deadline(120)
@pytest.mark.parametrize("case", list(_NESTED))
def test_init_against_mpi_state(rank0_subprocess, monkeypatch, case):
    if case == "late":
        monkeypatch.setenv("MPIRING_TIMEOUT", "3")
    result = rank0_subprocess(2, ["-c", _NESTED[case]], timeout=60)
    if result is None:
        return
    rc, out, seconds = result
    if case == "late":
        assert rc == 124 and seconds < 25, (rc, seconds, out)
        # The time waited, not the deadline: past 3 s by however late the wait noticed
        # (3.1 s on a busy host).
        assert re.search(r"\[r0\] mpiring stall: mpiring\.init: blocked 3\.\d s in Allgather",
                         out), out
        assert "INIT DONE" not in out
    elif case == "single":
        assert rc == 0, out
        assert out.count("REFUSED mpiring.init: MPI runs at thread level THREAD_SINGLE") == 2
        assert "mpi4py.rc.thread_level" in out
    elif case == "finalized":
        assert rc == 0, out
        assert out.count("REFUSED mpiring.init: MPI was already finalized") == 2
    else:
        assert rc == 0, out
        assert out.count("SUM [0.0, 3.0, 6.0, 9.0, 12.0]") == 2
