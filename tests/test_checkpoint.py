"""Checkpoints: atomic writes, the newest complete one found, a crash mid-write leaves
the previous one intact, nothing read or written through a symlink; replica check."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ROOT, wait_quietly

torch = pytest.importorskip("torch")

from mpiring.parallel import checkpoint as ck  # noqa: E402
from mpiring.parallel.checkpoint import (  # noqa: E402
    ReplicaDivergenceError,
    check_replicas,
    latest_checkpoint,
    load_checkpoint,
    restore_training_state,
    save_checkpoint,
    training_state,
)


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = model(torch.randn(5, 4)).square().sum()
    loss.backward()
    opt.step()
    return model, opt


class Sampler:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def draws():
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_round_trip_restores_model_optimizer_sampler_and_rng(tmp_path):
    model, opt = model_and_optimizer()
    sampler = Sampler()
    sampler.position = 37
    path = save_checkpoint(str(tmp_path), training_state(12, model, opt, sampler,
                                                         extra={"loss": 1.5}))
    assert os.path.basename(path) == "ckpt-000000012.pt"
    expected = draws()

    fresh, fresh_opt = model_and_optimizer(seed=1)
    fresh_sampler = Sampler()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    state = load_checkpoint(latest_checkpoint(str(tmp_path)))
    assert restore_training_state(state, fresh, fresh_opt, fresh_sampler) == 12
    assert draws() == expected, "a resumed run must draw the same random numbers"
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh_sampler.position == 37 and state["extra"] == {"loss": 1.5}
    assert str(fresh_opt.state_dict()) == str(opt.state_dict())


def test_latest_skips_temporaries_symlinks_other_names_and_damaged_files(tmp_path):
    d = str(tmp_path)
    assert latest_checkpoint(d) is None and latest_checkpoint(d + "/missing") is None
    for step in (3, 10, 7):
        save_checkpoint(d, training_state(step))
    good = os.path.join(d, "ckpt-000000010.pt")
    with open(good, "rb") as fh:
        whole = fh.read()
    with open(os.path.join(d, "ckpt-000000011.pt"), "wb") as fh:
        fh.write(whole[: len(whole) // 2])  # a file cut short (no fsync before a power cut)
    with open(os.path.join(d, ".ckpt-000000012.pt.tmp-host-1-abcd"), "wb") as fh:
        fh.write(whole)
    os.symlink(good, os.path.join(d, "ckpt-000000013.pt"))
    with open(os.path.join(d, "ckpt-14.pt"), "wb") as fh:
        fh.write(whole)
    assert latest_checkpoint(d) == good
    assert load_checkpoint(good)["step"] == 10


def test_keep_prunes_older_checkpoints(tmp_path):
    for step in range(5):
        save_checkpoint(str(tmp_path), training_state(step), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003.pt", "ckpt-000000004.pt"]


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="non-negative integer 'step'"):
        save_checkpoint(str(tmp_path), {"model": 1})
    with pytest.raises(ValueError, match="keep at least 1"):
        save_checkpoint(str(tmp_path), training_state(1), keep=0)
    with pytest.raises(ValueError, match="step=-1"):
        training_state(-1)
    torch.save({"step": 1}, str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="not an mpiring checkpoint"):
        load_checkpoint(str(tmp_path / "other.pt"))


def test_a_failure_during_the_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    d = str(tmp_path)
    first = save_checkpoint(d, training_state(1, extra={"v": 1}))
    real_save = torch.save

    def failing_save(obj, fh):
        real_save(obj, fh)
        fh.flush()
        fh.truncate(100)  # half written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(d, training_state(2, extra={"v": 2}))
    assert os.listdir(d) == ["ckpt-000000001.pt"], "no temporary file may be left behind"
    assert latest_checkpoint(d) == first and load_checkpoint(first)["extra"] == {"v": 1}


def test_a_planted_symlink_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    d = tmp_path / "ckpts"
    d.mkdir()
    os.symlink(victim, d / "ckpt-000000005.pt")
    with pytest.raises(OSError, match="never read through a link"):
        load_checkpoint(str(d / "ckpt-000000005.pt"))
    path = save_checkpoint(str(d), training_state(5))
    assert victim.read_text() == "precious"
    assert not os.path.islink(path) and load_checkpoint(path)["step"] == 5


CRASH = textwrap.dedent("""
    import os, signal, sys, torch
    from mpiring.parallel import checkpoint as ck
    d = sys.argv[1]
    ck.save_checkpoint(d, ck.training_state(1, extra={"v": torch.arange(1000)}))
    real_save = torch.save
    def save_then_die(obj, fh):
        real_save(obj, fh)
        fh.flush()
        fh.truncate(fh.tell() // 2)
        print("dying in the middle of the write", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save = save_then_die
    ck.save_checkpoint(d, ck.training_state(2, extra={"v": torch.zeros(1000)}))
    print("unreachable", flush=True)
""")


@pytest.mark.deadline(90)
def test_a_process_killed_mid_write_leaves_the_previous_checkpoint(world, tmp_path):
    """A real crash: the writer SIGKILLs itself half-way through checkpoint 2."""
    if world.rank == 0:
        d = str(tmp_path)
        proc = subprocess.run([sys.executable, "-c", CRASH, d], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
        assert "dying in the middle" in proc.stdout
        names = sorted(os.listdir(d))
        assert names[0].startswith(".ckpt-000000002.pt.tmp-"), names  # the crash's leftover
        assert names[1:] == ["ckpt-000000001.pt"]
        path = latest_checkpoint(d)
        assert path.endswith("ckpt-000000001.pt")
        assert torch.equal(load_checkpoint(path)["extra"]["v"], torch.arange(1000))
        save_checkpoint(d, training_state(3))  # the writer is dead: its temporary goes
        assert sorted(os.listdir(d)) == ["ckpt-000000001.pt", "ckpt-000000003.pt"]
    wait_quietly(world)


def test_each_rank_resumes_its_own_random_stream(world, tmp_path):
    """Ranks seeded apart (nanoGPT's seed + rank) draw their own numbers after a resume
    when the state was gathered with comm=; the file is rank 0's, as a job writes it."""
    random.seed(100 + world.rank)
    np.random.seed(100 + world.rank)
    torch.manual_seed(100 + world.rank)
    draws()
    state = training_state(5, comm=world)
    expected = draws()
    assert len(state["rng_ranks"]) == world.size
    state["rng"] = state["rng_ranks"][0]  # what rank 0 writes into the file
    path = save_checkpoint(str(tmp_path), state)
    torch.manual_seed(7)
    assert restore_training_state(load_checkpoint(path), comm=world) == 5
    assert draws() == expected
    if world.size > 1:
        # The same file without comm= gives every rank rank 0's numbers, and a
        # checkpoint of one rank's state says so where the ranks should differ.
        restore_training_state(load_checkpoint(path))
        theirs = draws()
        del state["rng_ranks"]
        with pytest.warns(ck.CheckpointWarning, match="one rank's state"):
            restore_training_state(state, comm=world)
        assert draws() == theirs


# --- replicas ----------------------------------------------------------------------------

def test_identical_replicas_pass(comm):
    model, _ = model_and_optimizer(seed=3)
    check_replicas(model, comm, step=4)


def test_diverged_replica_is_named_on_every_rank(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    model, _ = model_and_optimizer(seed=3)
    odd = comm.size - 1
    if comm.rank == odd:
        with torch.no_grad():
            model[2].bias.add_(1e-7)
    with pytest.raises(ReplicaDivergenceError) as info:
        check_replicas(model, comm, step=4)
    text = str(info.value)
    agreeing = ", ".join(f"r{r}" for r in range(comm.size - 1))
    assert text.startswith(f"replicas diverged at step 4: r{odd} differ from r0 "
                           f"(agreeing: {agreeing})"), text
    assert f"\nr{odd}: 2.bias\n" in text, text


def test_different_models_are_named_by_tensor_count(world):
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(2, 2) for _ in range(2 if world.rank == 1 else 1)]
    with pytest.raises(ReplicaDivergenceError, match="tensor counts differ: r0=2 r1=4"):
        check_replicas(torch.nn.Sequential(*layers), world)


def test_check_replicas_accepts_a_raw_mpi_communicator(world):
    model, _ = model_and_optimizer(seed=5)
    check_replicas(model, world.mpi_comm)
    assert ck.checkpoint_name(7) == "ckpt-000000007.pt"
