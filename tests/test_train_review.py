"""train's flags: what a run would silently not do, or fail at only after the run started,
is refused before it starts (or on every rank at once), with the fix named."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpiring.cli import build_parser  # noqa: E402
from mpiring.cli.train import _val_text, args_error, config_from_args, metrics_path_error  # noqa: E402
from mpiring.tools.train.checkpointing import Checkpointer, ResumeError, model_shape_error  # noqa: E402
from mpiring.tools.train.data import read_corpus  # noqa: E402
from mpiring.tools.train.loop import TrainConfig, TrainJob, train  # noqa: E402
from mpiring.tools.train.metrics import MetricsWriteError, MetricsWriter  # noqa: E402


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *flags])


def test_schedule_without_a_pipeline_is_refused_not_ignored():
    error = args_error(parse("--schedule", "gpipe"))
    assert error is not None and "--pp 2" in error and "--schedule" in error
    assert args_error(parse("--schedule", "gpipe", "--pp", "2")) is None
    assert args_error(parse()) is None
    assert config_from_args(parse()).schedule == "1f1b"  # the default still applies
    assert config_from_args(parse("--pp", "2", "--schedule", "zb")).schedule == "zb"


def test_negative_val_batches_and_hook_start_are_refused():
    for flag in ("--val-batches", "--hook-start"):
        with pytest.raises(SystemExit):
            parse(flag, "-1")
    for name in ("val_batches", "hook_start"):
        with pytest.raises(ValueError, match=f"{name}=-1"):
            TrainConfig(**{name: -1}).validate()
    TrainConfig(val_batches=0, hook_start=0).validate()


def test_summary_names_why_there_is_no_validation_loss():
    job = SimpleNamespace(val_set=range(100), data_comm=SimpleNamespace(size=2))
    assert _val_text(TrainConfig(val_batches=0), job, float("nan")) == \
        "no validation (--val-batches 0)"
    assert "raise --max-data-mb" in _val_text(TrainConfig(batch_size=64), job, float("nan"))
    assert _val_text(TrainConfig(batch_size=8), job, 1.25) == "val loss 1.250"


def test_metrics_path_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    assert "is a directory" in metrics_path_error(str(tmp_path))
    assert "does not exist" in metrics_path_error(str(tmp_path / "no" / "m.jsonl"))
    assert metrics_path_error(str(tmp_path / "m.jsonl")) is None
    assert "does not exist" in args_error(parse("--metrics", str(tmp_path / "no" / "m.jsonl")))


def test_metrics_open_failure_raises_on_every_rank_not_a_traceback(world, tmp_path):
    comm = world.split(world.rank, key=0)  # rank 0 of its own: opens, and tells no one
    job = SimpleNamespace(comm=comm, step=0)
    with pytest.raises(MetricsWriteError, match="writable file"):
        MetricsWriter(str(tmp_path), 1).on_start(job)  # a directory: open fails


def test_model_shape_change_on_resume_names_the_flags():
    saved = {"preset": "tiny", "d_model": None, "n_layers": None, "n_heads": None,
             "seq_len": None}
    assert model_shape_error(saved, TrainConfig(preset="tiny")) is None
    assert model_shape_error(saved, TrainConfig(preset="tiny", n_layers=2)) is None
    error = model_shape_error(saved, TrainConfig(preset="tiny", seq_len=16))
    assert "seq_len 32 -> 16" in error and "--seq-len 32" in error
    error = model_shape_error(saved, TrainConfig(preset="small"))
    assert "--preset tiny" in error


def test_resume_past_steps_or_of_another_model_shape_is_refused(world, tmp_path_factory):
    comm = world.split(world.rank, key=0)
    directory = str(tmp_path_factory.mktemp(f"r{world.rank}"))
    train_bytes, val_bytes, _ = read_corpus(60_000)
    cfg = dict(preset="tiny", seq_len=16, batch_size=2, val_batches=1, seed=1)
    first = TrainJob(comm, TrainConfig(steps=2, **cfg), train_data=train_bytes, val_data=val_bytes)
    train(first, callbacks=[Checkpointer(directory, verbose=False)])
    first.close()
    assert os.listdir(directory)
    second = TrainJob(comm, TrainConfig(steps=1, **cfg), train_data=train_bytes,
                      val_data=val_bytes)
    with pytest.raises(ResumeError, match="resume with --steps 2 or more"):
        Checkpointer(directory, resume=True, verbose=False).on_start(second)
    assert second.step == 0 and np.isfinite(second.evaluate(1))
    second.close()
    # Another model shape: one line naming the flag, not torch's size-mismatch list.
    third = TrainJob(comm, TrainConfig(steps=4, **{**cfg, "seq_len": 8}), train_data=train_bytes,
                     val_data=val_bytes)
    with pytest.raises(ResumeError, match="seq_len 16 -> 8.*--seq-len 16") as info:
        Checkpointer(directory, resume=True, verbose=False).on_start(third)
    assert "size mismatch" not in str(info.value)
    third.close()


@pytest.mark.parametrize("opts", [dict(mode="ps"), dict(mode="torch-ddp"),
                                  dict(comm_hook="fp16"), dict(comm_hook="topk")])
def test_global_batch_refuses_the_mode_or_hook_it_would_ignore(opts):
    with pytest.raises(ValueError, match="--batch-size instead of --global-batch"):
        TrainConfig(global_batch=16, **opts).validate()
    TrainConfig(batch_size=8, **opts).validate()  # without the grid they run as asked
    TrainConfig(global_batch=16, mode="naive").validate()


@pytest.mark.parametrize("flags", [("--mode", "ps"), ("--fsdp",)])
def test_grad_as_bucket_view_without_buckets_is_refused(flags):
    assert "leave --grad-as-bucket-view out" in args_error(parse("--grad-as-bucket-view", *flags))
    assert args_error(parse(*flags)) is None
    assert args_error(parse("--grad-as-bucket-view")) is None


@pytest.mark.parametrize("opts", [dict(lr=float("inf")), dict(lr=float("nan")), dict(lr=0.0),
                                  dict(max_data_mb=float("inf")), dict(max_data_mb=float("nan")),
                                  dict(max_data_mb=0.0)])
def test_non_finite_lr_or_data_size_is_refused_before_the_run(opts):
    (name, value), = opts.items()
    with pytest.raises(ValueError, match=f"{name}={value}: .*positive, finite"):
        TrainConfig(**opts).validate()
