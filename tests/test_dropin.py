"""The drop-in for torch.distributed users: mpiring.run, the process-group functions, torch's DDP.

The two stories of the issue run end to end: a torchrun-style GPT script under
``mpiexec -n 2 python -m mpiring.run`` as it is (torch DDP over gloo), and its
copy with only the import lines switched to mpiring; both train one model and
print the same losses.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

import mpiring
from mpiring.comm import default
from mpiring.parallel.data import DistributedDataParallel as DDP
from mpiring.parallel.data import DistributedSampler
from mpiring.run import VARIABLES, agreed_environment

GPT = Path(ROOT) / "tests" / "scripts" / "gpt_torchrun.py"
PORT = {  # the three import lines a torchrun script changes, and nothing else
    "import torch.distributed as dist": "import mpiring as dist",
    "from torch.nn.parallel import DistributedDataParallel as DDP":
        "from mpiring import DistributedDataParallel as DDP",
    "from torch.utils.data.distributed import DistributedSampler":
        "from mpiring import DistributedSampler",
}


@pytest.fixture
def pg(world):
    """The default group for one test, destroyed afterwards (every rank)."""
    comm = mpiring.init_process_group()
    yield comm
    mpiring.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


# --- the launcher's environment -------------------------------------------------------

def test_environment_comes_from_mpi(world):
    env = agreed_environment(world, {})
    assert (env["RANK"], env["WORLD_SIZE"]) == (str(world.rank), str(world.size))
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(world.local_rank),
                                                            str(world.local_size))
    table = world.control.allgather_json([env["MASTER_ADDR"], env["MASTER_PORT"]])
    assert all(row == table[0] for row in table) and 0 < int(env["MASTER_PORT"]) < 65536
    # Values that agree are kept: the user's own port, the same on every rank.
    kept = agreed_environment(world, {"RANK": str(world.rank), "MASTER_PORT": "29511"})
    assert kept["MASTER_PORT"] == "29511" and kept["RANK"] == str(world.rank)


@pytest.mark.parametrize("bad", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"])
def test_environment_that_disagrees_is_refused_on_every_rank(world, bad):
    last = world.size - 1  # one rank only is wrong: every rank must raise
    environ = {}
    if world.rank == last:
        environ = {"RANK": "0" if last else "1", "WORLD_SIZE": str(world.size + 1),
                   "LOCAL_RANK": str(world.local_rank + 7), "MASTER_PORT": "1"}
        environ = {bad: environ[bad]}
    if bad == "MASTER_PORT" and world.size == 1:
        assert agreed_environment(world, environ)["MASTER_PORT"] == "1"  # nobody disagrees
        return
    with pytest.raises(ValueError, match=rf"r{last}: {bad}=.*python -m mpiring.run"):
        agreed_environment(world, environ)


# --- init_process_group and the default communicator --------------------------------------

def test_process_group_functions(world):
    assert not mpiring.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        mpiring.get_rank()
    with pytest.raises(ValueError, match="init_process_group"):
        default.resolve(None, "DistributedDataParallel")
    comm = mpiring.init_process_group(backend="gloo")  # torch's CPU name: the MPI backend
    try:
        assert mpiring.is_initialized() and comm.backend == "mpi"
        assert (mpiring.get_rank(), mpiring.get_world_size()) == (world.rank, world.size)
        assert default.resolve(None) is comm and default.resolve(world) is world
        with pytest.raises(RuntimeError, match="already initialized"):
            mpiring.init_process_group()
    finally:
        mpiring.destroy_process_group()
    assert not mpiring.is_initialized()


@pytest.mark.parametrize("case", ["world_size", "rank", "WORLD_SIZE", "backend", "store"])
def test_init_process_group_refuses_what_it_cannot_honour(world, monkeypatch, case):
    last = world.size - 1
    kwargs = {}
    if case == "world_size":
        kwargs = {"world_size": world.size + 1}
    elif case == "rank" and world.rank == last:
        kwargs = {"rank": (world.rank + 1) % (world.size + 1)}
    elif case == "WORLD_SIZE" and world.rank == last:
        monkeypatch.setenv("WORLD_SIZE", str(world.size + 2))  # as under torchrun
    elif case == "backend":
        kwargs = {"backend": "ucc"}
    elif case == "store":
        kwargs = {"store": object()}
    match = {"backend": "backend='ucc'", "store": "store="}.get(case, rf"r{last} .*mpiring.run")
    with pytest.raises(ValueError, match=match):
        mpiring.init_process_group(**kwargs)
    assert not mpiring.is_initialized()


def test_defaults_follow_the_process_group(pg, world):
    sampler = DistributedSampler(range(23))
    assert (sampler.rank, sampler.num_replicas) == (world.rank, world.size)
    assert list(sampler) == list(torch.utils.data.DistributedSampler(
        range(23), num_replicas=world.size, rank=world.rank))
    model = DDP(mlp(), bucket_cap_mb=None)
    assert model.comm is pg and model.process_group is pg and model.reducer.comm is pg
    model.close()


def test_no_communicator_is_a_clear_error(world):
    with pytest.raises(ValueError, match=r"init_process_group\(\) first"):
        DDP(mlp())
    with pytest.raises(ValueError, match=r"DistributedSampler.*init_process_group"):
        DistributedSampler(10)


# --- torch's DDP signature ---------------------------------------------------------------

def test_positional_parameters_are_torch_s_in_torch_s_order():
    # init_sync sat after static_graph (keyword only) where torch 2.x has it sixth: a
    # torch call with process_group sixth gave mpiring's DDP the group as init_sync.
    import inspect

    theirs = list(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters)
    ours = [n for n, p in inspect.signature(DDP).parameters.items()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert ours == theirs[:len(ours)] and "static_graph" in ours
    with pytest.raises(TypeError, match="init_sync=.*pass process_group=... by name"):
        DDP(mlp(), None, None, 0, True, object())


def test_torch_signature_trains_like_the_old_call(comm):
    g = torch.Generator().manual_seed(comm.rank + 11)
    x, y = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g,
                                                                           dtype=torch.float64)
    old = DDP(mlp(), comm, bucket_cap_mb=120 / 2**20)
    # Positional in torch's order: device_ids, output_device, dim, broadcast_buffers,
    # init_sync, process_group, bucket_cap_mb, find_unused_parameters, check_reduction, ...
    new = DDP(mlp(), None, None, 0, True, True, comm, 120 / 2**20, False, False, True, True)
    assert new.device_ids is None and new.gradient_as_bucket_view and new.static_graph
    for model in (old, new):
        ((model(x) - y) ** 2).mean().backward()
    ref = mlp()
    for r in range(comm.size):
        gr = torch.Generator().manual_seed(r + 11)
        xr, yr = torch.randn(3, 4, generator=gr, dtype=torch.float64), torch.randn(
            3, 2, generator=gr, dtype=torch.float64)
        ((ref(xr) - yr) ** 2).mean().div(comm.size).backward()
    for p, q, t in zip(old.parameters(), new.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-12, atol=1e-14)
    assert list(new.state_dict()) == [f"module.{k}" for k in mlp().state_dict()]
    old.close()
    new.close()


@pytest.mark.parametrize("case", ["device_ids", "one-rank", "output_device", "two-comms",
                                  "torch-group", "cap"])
def test_bad_ddp_arguments_raise_on_every_rank(comm, world, case):
    last = comm.size - 1
    kwargs: dict = {"process_group": comm}
    if case == "device_ids":
        kwargs["device_ids"] = [0]
    elif case == "one-rank" and comm.rank == last:
        kwargs["device_ids"] = [comm.rank]
    elif case == "output_device":
        kwargs["output_device"] = 25.0  # the old third positional, bucket_cap_mb
    elif case == "two-comms":
        kwargs["comm"] = world if comm.size != world.size else comm.split(0)
    elif case == "torch-group":
        kwargs["process_group"] = object()
    elif case == "cap":
        kwargs["bucket_cap_mb"] = 0
    error = TypeError if case == "torch-group" else ValueError
    match = {"device_ids": "r0: device_ids=", "one-rank": rf"r{last}: device_ids=.*device_ids=None",
             "output_device": "output_device=25.0", "two-comms": "different communicators",
             "torch-group": "not a mpiring.Communicator", "cap": "positive"}[case]
    with pytest.raises(error, match=match):
        DDP(mlp(), **kwargs)


# --- the two stories, end to end ------------------------------------------------------------

def ported(tmp_path: Path) -> Path:
    text = GPT.read_text()
    for before, after in PORT.items():
        assert text.count(f"\n{before}  # port\n") == 1, before
        text = text.replace(f"\n{before}  # port\n", f"\n{after}  # port\n")
    path = tmp_path / "gpt_mpiring.py"
    path.write_text(text)
    return path


# Unanchored: the ranks share one pipe, and unbuffered, a line and its newline
# are two writes, so another rank's line can land between them.
NUMBER = r"[-+.0-9eE]+"
STEP = rf"step \d+ loss {NUMBER} norm {NUMBER}"
FINAL = rf"final r(\d) ({NUMBER}) keys (\d+)"


@pytest.mark.deadline(400)
def test_torchrun_script_and_its_port_train_one_model_with_equal_losses(rank0_subprocess,
                                                                        tmp_path):
    # Every rank calls rank0_subprocess (the others wait without spinning).
    results = [rank0_subprocess(2, ["-m", "mpiring.run", str(script)], timeout=180)
               for script in (GPT, ported(tmp_path))]
    if results[0] is None:
        return
    logs = []
    for rc, out, _ in results:
        assert rc == 0, out
        logs.append(out)
    for out in logs:
        steps = re.findall(STEP, out)
        assert len(steps) == 6, out  # one log: rank 0's, not one per rank
        assert "world 2 " in out, out
        finals = [m.groups() for m in re.finditer(FINAL, out)]
        assert sorted(r for r, _, _ in finals) == ["0", "1"] and finals[0][1:] == finals[1][1:], \
            f"the ranks did not train one model:\n{out}"
    torch_log, ours = (sorted(m.group(0) for m in re.finditer(f"{STEP}|{FINAL}", o)) for o in logs)
    assert torch_log == ours, f"torch DDP over gloo:\n{logs[0]}\nmpiring:\n{logs[1]}"


@pytest.mark.deadline(120)
def test_a_failing_rank_ends_the_job_fast_naming_it(rank0_subprocess, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n"
                      "    raise RuntimeError('rank one gives up')\ntime.sleep(100)\n")
    result = rank0_subprocess(2, ["-m", "mpiring.run", str(script)], timeout=60)
    if result is not None:
        rc, out, seconds = result
        assert rc != 0 and "[r1] mpiring.run:" in out and "rank one gives up" in out, out
        assert seconds < 50, f"the job took {seconds:.0f} s to end:\n{out}"


@pytest.mark.deadline(120)
def test_launcher_refuses_a_disagreeing_environment(rank0_subprocess, tmp_path):
    script = tmp_path / "never.py"
    script.write_text("print('the script ran')\n")
    code = (f"import os, sys; os.environ['WORLD_SIZE'] = '5'; from mpiring.run import main; "
            f"sys.exit(main([{str(script)!r}]))")
    result = rank0_subprocess(2, ["-c", code], timeout=60)
    if result is not None:
        rc, out, _ = result
        assert rc == 2 and "WORLD_SIZE=5 (MPI says 2)" in out and "the script ran" not in out, out
        assert out.count("disagrees with MPI") == 1, out  # said once, by rank 0


def test_usage():
    from mpiring.run import main

    assert main([]) == 2 and main(["--help"]) == 0
    assert set(VARIABLES) == {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                              "MASTER_ADDR", "MASTER_PORT"}
    assert sys.modules["mpiring.run"].USAGE.startswith("usage: mpiexec")
