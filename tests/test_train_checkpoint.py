"""train --checkpoint-dir/--checkpoint-every/--resume/--check-replicas: a run killed (after
a step, and in the middle of a checkpoint write) and resumed ends bit-identical to an
uninterrupted one; resume failures and diverged replicas raise on every rank."""

from __future__ import annotations

import argparse
import json
import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpiring.backends import control as wire  # noqa: E402
from mpiring.parallel import checkpoint as ck  # noqa: E402
from mpiring.tools.train.checkpointing import (  # noqa: E402
    Checkpointer,
    ReplicaCheck,
    ResumeError,
    callbacks_from_args,
    rng_state_json,
    set_rng_state_json,
)
from mpiring.tools.train.data import read_corpus  # noqa: E402
from mpiring.tools.train.loop import TrainConfig, TrainJob  # noqa: E402

STEPS = 8
# Dropout draws from torch's RNG, so a resume that did not restore it would differ.
# A first bucket of 128 floats holds just the final LayerNorm's weight and bias,
# which DDP's rebuild swaps: the ring sums those elements in another order unless
# the resumed run rebuilds the same buckets. Three ranks: with two, a + b is exact
# in any order.
TRAIN = ["-m", "mpiring", "train", "--mode", "ddp", "--preset", "tiny", "--steps", str(STEPS),
         "--batch-size", "2", "--max-data-mb", "0.1", "--val-batches", "1", "--no-progress",
         "--seed", "7", "--dropout", "0.1", "--first-bucket-mb", "0.0005"]
RANKS = 3


def final_state(directory: str) -> dict:
    return ck.load_checkpoint(os.path.join(directory, ck.checkpoint_name(STEPS)))


def assert_bit_identical(a: dict, b: dict) -> None:
    for part in ("model", "optimizer"):
        flat_a, flat_b = flatten(a[part]), flatten(b[part])
        assert flat_a.keys() == flat_b.keys()
        differ = [k for k in flat_a if not same(flat_a[k], flat_b[k])]
        assert not differ, f"{part} differs in {len(differ)} entries: {differ[:5]}"
    assert a["step"] == b["step"] == STEPS and a["sampler"] == b["sampler"]
    assert torch.equal(a["extra"]["losses_ranks"], b["extra"]["losses_ranks"])
    assert a["extra"]["ddp_layout"] == b["extra"]["ddp_layout"]
    # Python's and NumPy's generators start from OS entropy in each process and
    # nothing in training draws from them; torch's drives init and dropout.
    for ra, rb in zip(a["extra"]["rng_ranks"], b["extra"]["rng_ranks"], strict=True):
        assert json.loads(ra)["torch"] == json.loads(rb)["torch"]


def flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flatten(val, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flatten(val, f"{prefix}/{i}").items()}
    return {prefix: obj}


def same(x, y) -> bool:
    if torch.is_tensor(x):
        return torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
    return x == y


@pytest.mark.deadline(420)
@pytest.mark.timeout(420)
def test_killed_and_resumed_run_ends_bit_identical(world, rank0_subprocess, tmp_path, monkeypatch):
    """Uninterrupted 8 steps vs: checkpoints every 2, killed after step 5; resumed (from
    4) and killed while writing step 6's checkpoint; resumed again (from 4) to step 8."""
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    every = ["--checkpoint-dir", broken, "--checkpoint-every", "2"]

    # The uninterrupted run, then the run killed after step 5 (from step 0 again, a new
    # job, model and data; --seed reseeds torch) in the same three processes: a job's
    # start (every rank importing torch, on shared cores) costs more than its 8 steps.
    # Each resume below is a job of its own, so the bit-identical end still compares two
    # runs that share no process.
    crashing = ["tests/scripts/train_crashing.py"]
    rc, out, secs = rank0_subprocess(
        RANKS, crashing + ["none"] + TRAIN[2:] + ["--checkpoint-dir", whole, "--check-replicas", "4"]
        + ["--", "after-step:5"] + TRAIN[2:] + every, timeout=150) or (0, "", 0)
    if world.rank == 0:
        assert "train_crashing: run 1 returned 0" in out, out  # the uninterrupted run
        assert sorted(os.listdir(whole)) == [ck.checkpoint_name(STEPS)], out
        # Only the second run checkpoints at steps 2 and 4 (the first writes step 8 alone).
        assert rc != 0 and "killing myself at step 5" in out, out
        assert "checkpoint: step 4" in out and "checkpoint: step 6" not in out, out
        assert sorted(os.listdir(broken)) == [ck.checkpoint_name(2), ck.checkpoint_name(4)]

    rc, out, secs = rank0_subprocess(RANKS, crashing + ["in-write:6"] + TRAIN[2:] + every
                                     + ["--resume"], timeout=150) or (0, "", 0)
    if world.rank == 0:
        assert rc != 0 and "resume: step 4 from" in out and "killing myself at step 6" in out, out
        names = sorted(os.listdir(broken))
        # The temporary file of step 6 was complete and fsynced, but never renamed.
        assert names[0].startswith(".ckpt-000000006.pt.tmp-"), names
        assert names[1:] == [ck.checkpoint_name(2), ck.checkpoint_name(4)], names
        assert ck.latest_checkpoint(broken).endswith(ck.checkpoint_name(4))

    rc, out, secs = rank0_subprocess(RANKS, TRAIN + every + ["--resume"], timeout=150) or (0, "", 0)
    if world.rank == 0:
        assert rc == 0 and "resume: step 4 from" in out, out
        assert sorted(os.listdir(broken)) == [ck.checkpoint_name(s) for s in (2, 4, 6, 8)]
        assert_bit_identical(final_state(whole), final_state(broken))


# --- in-process: the callbacks on this job's ranks ------------------------------------------

_CORPUS: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def make_job(comm, **changes) -> TrainJob:
    if not _CORPUS:
        train_bytes, val_bytes, _ = read_corpus(100_000)
        _CORPUS["data"] = (train_bytes, val_bytes)
    cfg = dict(mode="ddp", preset="tiny", seq_len=16, batch_size=2, steps=4, seed=5,
               val_batches=1, dropout=0.1, bucket_mb=0.05, first_bucket_mb=0.01)
    cfg.update(changes)
    return TrainJob(comm, TrainConfig(**cfg), train_data=_CORPUS["data"][0],
                    val_data=_CORPUS["data"][1])


def shared_dir(world, tmp_path) -> str:
    """Rank 0's temporary directory, on every rank (the ranks share this host)."""
    return wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)


def params(job) -> list[torch.Tensor]:
    return [p.detach().clone() for p in job.model.parameters()]


def save_at_2_and_step_to_3(job, directory):
    """Two steps with a checkpoint at step 2, then step 3; the job closed. Returns the
    checkpointer, and step 3's parameters and losses (what a resume must reproduce)."""
    saver = Checkpointer(directory, every=2, verbose=False)
    for _ in range(2):
        job.train_step()
        saver.on_step_end(job)
    job.train_step()
    expected, expected_losses = params(job), list(job.losses)
    job.close()
    return saver, expected, expected_losses


def test_sharded_optimizer_checkpoint_resumes_the_same_run(world, tmp_path, monkeypatch):
    """zero1 on every rank of the job: save at step 2, go on to 3; a new job resumed from
    step 2 takes the same step 3 bit for bit. A rank that cannot load: error everywhere."""
    import torch._dynamo  # noqa: F401  (torch.optim's first use imports it: pay on every rank at once)

    d = shared_dir(world, tmp_path)
    job = make_job(world, optimizer="zero1")
    saver, expected, expected_losses = save_at_2_and_step_to_3(job, d)
    assert saver.saved and saver.saved[0][0] == 2

    resumed = make_job(world, optimizer="zero1")
    reader = Checkpointer(d, resume=True, verbose=False)
    reader.on_start(resumed)
    assert reader.resumed_from == 2 and resumed.step == 2 and resumed.sampler.start == 4
    resumed.train_step()
    for a, b in zip(expected, params(resumed), strict=True):
        assert torch.equal(a, b)
    assert resumed.losses == expected_losses, "each rank gets back its own loss history"

    if world.size > 1:
        real_load = ck.load_checkpoint

        def unreadable(path):
            raise OSError(2, "No such file or directory", path)

        monkeypatch.setattr(ck, "load_checkpoint", unreadable if world.rank == 1 else real_load)
        with pytest.raises(ResumeError, match=r"failed:\nr1: FileNotFoundError: .*No such file"):
            Checkpointer(d, resume=True, verbose=False).on_start(resumed)
    resumed.close()


@pytest.mark.deadline(240)
@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "tp2xpp2"])
def test_tp_dropout_streams_resume_the_same_run(world, subcomms, tmp_path, pp):
    """train --tp 2 with dropout: every TP dropout draws from the blocks' RNG streams, not
    from torch's generator, so the checkpoint must hold them, or a resumed step 3 redraws
    step 1's masks. Save at step 2, go on to 3; a job resumed from step 2 takes the same
    step 3 bit for bit (the job train --tp builds: make_job)."""
    from mpiring.tools.train.job3d import make_job as make_train_job

    comm = subcomms[2 * pp]
    if comm is None:
        pytest.skip(f"rank {world.rank} is not in the {2 * pp}-rank group")
    make_job(comm)  # fills the corpus cache
    cfg = TrainConfig(mode="ddp", preset="tiny", seq_len=16, batch_size=2, steps=4, seed=5,
                      val_batches=1, dropout=0.1, tp=2, pp=pp)

    def new_job():
        return make_train_job(comm, cfg, train_data=_CORPUS["data"][0],
                              val_data=_CORPUS["data"][1])

    d = wire.bcast_json(comm, str(tmp_path) if comm.rank == 0 else None)
    job = new_job()
    saver, expected, expected_losses = save_at_2_and_step_to_3(job, d)

    resumed = new_job()
    Checkpointer(d, resume=True, verbose=False).on_start(resumed)
    assert resumed.step == 2
    resumed.train_step()
    # Step 3's loss (NaN off the last pipeline stage, on both), then every parameter.
    np.testing.assert_array_equal(resumed.losses[-1], expected_losses[-1])
    for a, b in zip(expected, params(resumed), strict=True):
        assert torch.equal(a, b)
    resumed.close()


def test_resume_on_another_world_size_is_refused_on_every_rank(world, subcomms, tmp_path):
    if world.size < 3:
        pytest.skip("needs 3 ranks")
    d = shared_dir(world, tmp_path)
    job = make_job(world)
    job.train_step()
    Checkpointer(d, verbose=False).save(job)
    job.close()
    sub = subcomms[2]
    if sub is not None:
        small = make_job(sub)
        with pytest.raises(ResumeError, match=f"r0: .*written by {world.size} ranks, this run has 2"):
            Checkpointer(d, resume=True, verbose=False).on_start(small)
        small.close()
    # An empty directory: nothing to resume, start from step 0.
    empty = wire.bcast_json(world, str(tmp_path / "empty") if world.rank == 0 else None)
    fresh = make_job(world)
    assert Checkpointer(empty, resume=True, verbose=False).load(fresh) is None and fresh.step == 0
    fresh.close()


def test_check_replicas_names_the_diverged_rank_on_every_rank(world):
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    job = make_job(world, mode="ps")
    check = ReplicaCheck(every=2)
    job.step = 1
    check.on_step_end(job)           # not due
    job.step = 2
    check.on_step_end(job)           # due, replicas agree
    assert check.checks == 1
    odd = world.size - 1
    if world.rank == odd:
        with torch.no_grad():
            job.model.ln_f.bias.add_(1e-6)
    job.step = 4
    with pytest.raises(ck.ReplicaDivergenceError) as info:
        check.on_step_end(job)
    text = str(info.value)
    assert text.startswith(f"replicas diverged at step 4: r{odd} differ from r0"), text
    assert f"\nr{odd}: ln_f.bias\n" in text, text
    job.close()


# --- without communication ---------------------------------------------------------------------

def test_rng_states_round_trip_as_json():
    text = rng_state_json()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    set_rng_state_json(text)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_flags_are_checked_before_anything_runs():
    def args(**kw):
        base = dict(checkpoint_dir=None, checkpoint_every=None, checkpoint_keep=None,
                    resume=False, check_replicas=None)
        return argparse.Namespace(**{**base, **kw})

    assert callbacks_from_args(args()) == []
    with pytest.raises(ValueError, match="--checkpoint-every, --resume need.* --checkpoint-dir"):
        callbacks_from_args(args(checkpoint_every=2, resume=True))
    with pytest.raises(ValueError, match="every 0 steps: give at least 1"):
        callbacks_from_args(args(checkpoint_dir="d", checkpoint_every=0))
    with pytest.raises(ValueError, match="keep at least 1"):
        callbacks_from_args(args(checkpoint_dir="d", checkpoint_keep=0))
    with pytest.raises(ValueError, match="check replicas every 0 steps"):
        callbacks_from_args(args(check_replicas=0))
    check, saver = callbacks_from_args(args(checkpoint_dir="d", checkpoint_every=3, resume=True,
                                            check_replicas=5))
    assert isinstance(check, ReplicaCheck) and isinstance(saver, Checkpointer)
    assert (saver.every, saver.resume, check.every) == (3, True, 5)
