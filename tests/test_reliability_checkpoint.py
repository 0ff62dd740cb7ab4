"""Checkpoints you can trust: a checksum per file, checked on load; no silent fallback.

Runs on each rank of the test job in its own directory (no collective).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from mpiring.parallel.checkpoint import (
    CheckpointCorruptError,
    CheckpointWarning,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    training_state,
    verify_checkpoint,
)

MARK = torch.arange(1000, 1256, dtype=torch.float32)  # bytes easy to find in the file


def _save(d, step):
    return save_checkpoint(str(d), training_state(step, extra={"w": MARK + step}))


def _flip_tensor_byte(path, step):
    with open(path, "rb") as fh:
        raw = bytearray(fh.read())
    at = raw.find((MARK + step).numpy().tobytes())
    assert at > 0
    raw[at + 17] ^= 0x10  # one bit of one float in the tensor's bytes
    with open(path, "wb") as fh:
        fh.write(raw)


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size * 2 // 3)


def test_a_good_checkpoint_loads_and_its_tensors_are_exact(tmp_path):
    path = _save(tmp_path, 3)
    verify_checkpoint(path)
    torch.testing.assert_close(load_checkpoint(path)["extra"]["w"], MARK + 3, rtol=0, atol=0)


def test_a_flipped_tensor_byte_is_refused_naming_the_file(tmp_path):
    path = _save(tmp_path, 3)
    _flip_tensor_byte(path, 3)
    with pytest.raises(CheckpointCorruptError, match=r"^ckpt-000000003\.pt: damaged "
                                                     r"\((checksum mismatch|.*CRC)"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", [_truncate, _flip_tensor_byte])
def test_a_damaged_newest_is_named_and_the_previous_good_one_used_with_a_warning(tmp_path,
                                                                                 damage):
    good = _save(tmp_path, 4)
    newest = _save(tmp_path, 6)
    damage(newest, 6) if damage is _flip_tensor_byte else damage(newest)
    with pytest.warns(CheckpointWarning, match=r"ckpt-000000006\.pt: damaged .*; using the "
                                               r"previous good checkpoint, ckpt-000000004\.pt"):
        assert latest_checkpoint(str(tmp_path)) == good
    assert load_checkpoint(good)["step"] == 4


def test_no_usable_checkpoint_fails_instead_of_starting_at_step_0(tmp_path):
    only = _save(tmp_path, 5)
    _truncate(only)
    with pytest.raises(CheckpointCorruptError, match=r"^no usable checkpoint in .*: "
                                                     r"ckpt-000000005\.pt: damaged .*remove "
                                                     r"these files to start from step 0"):
        latest_checkpoint(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(str(empty)) is None  # a new run: nothing to resume


def test_garbage_under_a_checkpoint_name_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt-000000001.pt"
    path.write_bytes(b"PK\x03\x04" + os.urandom(300))
    with pytest.raises(CheckpointCorruptError, match=r"ckpt-000000001\.pt: damaged"):
        load_checkpoint(str(path))


def test_an_older_checkpoint_without_a_checksum_still_loads(tmp_path):
    path = tmp_path / "ckpt-000000002.pt"
    torch.save(training_state(2), str(path))  # as written before the checksum existed
    assert latest_checkpoint(str(tmp_path)) == str(path)
    assert load_checkpoint(str(path))["step"] == 2


def test_resume_with_every_checkpoint_damaged_fails_on_every_rank(world, tmp_path):
    from types import SimpleNamespace

    from mpiring.tools.train.checkpointing import Checkpointer, ResumeError

    d = str(tmp_path)
    if world.rank == 0:
        _truncate(_save(tmp_path, 7))
    d = world.control.bcast_json(d, root=0)  # rank 0's directory: only it lists the files
    with pytest.raises(ResumeError, match=r"resume failed: no usable checkpoint in .*"
                                          r"ckpt-000000007\.pt: damaged"):
        Checkpointer(d, resume=True).load(SimpleNamespace(comm=world))
