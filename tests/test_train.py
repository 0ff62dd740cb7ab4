"""The training job: the same global batch gives the same loss curve on 1 and K ranks,
in every mode, and the ``train`` command runs all four modes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpiring.tools.train.data import Windows, read_corpus
from mpiring.tools.train.loop import MODES, TrainConfig, TrainJob, train

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
_CORPUS: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_REFERENCE: dict[str, list[float]] = {}


def corpus() -> tuple[np.ndarray, np.ndarray]:
    # Every rank reads the same interpreter's files: identical bytes, no broadcast needed.
    if not _CORPUS:
        train_bytes, val_bytes, _ = read_corpus(150_000)
        _CORPUS["data"] = (train_bytes, val_bytes)
    return _CORPUS["data"]


@pytest.fixture(scope="module")
def solo(world):
    """A one-rank communicator on every rank (for the single-process reference)."""
    # torch.optim imports torch._dynamo on first use (seconds of CPU): let every
    # rank pay for it now, side by side, rather than one after another inside
    # tests that wait for each other.
    import torch._dynamo  # noqa: F401

    return world.split(world.rank, key=0)


def test_corpus_split_by_file_and_windows():
    train_bytes, val_bytes = corpus()
    assert train_bytes.size > 100_000 and val_bytes.size > 1000
    w = Windows(train_bytes, 16)
    x, y = w.batch([0, 3])
    assert x.shape == y.shape == (2, 16)
    assert (x[:, 1:] == y[:, :-1]).all() and int(y[1, -1]) == int(train_bytes[3 * 16 + 16])


@pytest.mark.parametrize("mode", ["ddp", "naive", "ps"])
def test_same_global_batch_same_loss_curve_on_1_and_k_ranks(solo, comm, mode):
    if mode != "ddp" and comm.size != 3:
        pytest.skip("naive and ps are compared on 3 ranks (uneven)")
    train_bytes, val_bytes = corpus()
    common = dict(preset="tiny", steps=4, lr=3e-3, seed=3, val_batches=1, log_every=2,
                  bucket_mb=0.05, first_bucket_mb=0.01)
    job = TrainJob(comm, TrainConfig(mode=mode, batch_size=GLOBAL_BATCH // comm.size, **common),
                   train_data=train_bytes, val_data=val_bytes)
    result = train(job)
    job.close()
    if "losses" not in _REFERENCE:  # one single-rank run serves every K and mode
        ref_job = TrainJob(solo, TrainConfig(mode="ddp", batch_size=GLOBAL_BATCH, **common),
                           train_data=train_bytes, val_data=val_bytes)
        _REFERENCE["losses"] = train(ref_job).losses
        ref_job.close()
    assert result.losses[-1] < result.losses[0]
    np.testing.assert_allclose(result.losses, _REFERENCE["losses"], rtol=2e-4)
    assert job.step == 4 and len(result.step_times) == 4 and np.isfinite(result.val_loss)


def test_job_state_round_trip_continues_the_same_run(solo):
    train_bytes, val_bytes = corpus()
    cfg = dict(preset="tiny", seq_len=16, batch_size=4, lr=3e-3, seed=4, val_batches=1)
    whole = TrainJob(solo, TrainConfig(steps=4, **cfg), train_data=train_bytes, val_data=val_bytes)
    expected = train(whole).losses
    whole.close()
    first = TrainJob(solo, TrainConfig(steps=2, **cfg), train_data=train_bytes, val_data=val_bytes)
    train(first)
    state = first.state_dict()
    first.close()
    assert state["sampler"]["start"] == 8 and state["step"] == 2
    second = TrainJob(solo, TrainConfig(steps=4, **cfg), train_data=train_bytes, val_data=val_bytes)
    second.load_state_dict(state)
    np.testing.assert_allclose(train(second).losses, expected, rtol=1e-6)
    second.close()


def test_fused_adamw_by_default_same_losses_as_the_plain_one(solo):
    from mpiring.cli import build_parser
    from mpiring.cli.train import config_from_args
    from mpiring.tools.train.loop import fused_adamw_available

    if not fused_adamw_available("cpu"):
        pytest.skip("this torch has no fused AdamW on the CPU")
    train_bytes, val_bytes = corpus()
    cfg = dict(preset="tiny", seq_len=16, batch_size=4, steps=3, lr=3e-3, seed=5, val_batches=1)
    losses = {}
    for fused in (True, False):
        job = TrainJob(solo, TrainConfig(fused_adamw=fused, **cfg), train_data=train_bytes,
                       val_data=val_bytes)
        assert bool(job.optimizer.param_groups[0].get("fused")) is fused
        losses[fused] = train(job).losses
        job.close()
    assert losses[True][-1] < losses[True][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    parser = build_parser()
    assert config_from_args(parser.parse_args(["train"])).fused_adamw is True
    assert config_from_args(parser.parse_args(["train", "--no-fused-adamw"])).fused_adamw is False


def test_train_command_runs_every_mode(world, capsys, tmp_path):
    from mpiring.cli import main

    trace = str(tmp_path / "trace")
    for mode in MODES:
        args = ["train", "--mode", mode, "--preset", "tiny", "--steps", "3", "--batch-size", "2",
                "--max-data-mb", "0.3", "--val-batches", "1", "--no-progress"]
        if mode == "ddp":
            args += ["--trace", trace]
        assert main(args) == 0
    out = capsys.readouterr().out
    if world.rank == 0:
        for mode in MODES:
            assert f"train: mode={mode} backend=mpi ranks={world.size}" in out
        assert out.count("median step") == len(MODES) and "val loss" in out
    with open(os.path.join(trace, f"rank{world.rank}.jsonl")) as fh:
        names = {json.loads(line).get("name") for line in fh}
    assert {"ddp.all_reduce", "ddp.backward", "train.step"} <= names


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(mode="allgather").validate()
    with pytest.raises(ValueError, match="preset"):
        TrainConfig(preset="huge").validate()
