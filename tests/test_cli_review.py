"""Review of the launcher, the bench commands and the checkpoint helpers: what a user hits.

Checkpoints: ``keep`` never deletes the file it has just written (a resume from an
older step after a damaged newest one), and a state that ``load_checkpoint``
cannot read back is refused at the save, not reported as damage at the resume.
Launcher: torchrun's own options before the script, and a missing script or
module, are one clear message and exit status 2 on every rank, not a traceback
per rank. Bench commands: bad values are refused before anything is measured.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpiring.parallel.checkpoint import (  # noqa: E402
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    training_state,
)


def _damage(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as fh:
        fh.write(data)


# --- checkpoints ---------------------------------------------------------------------

def test_keep_never_deletes_the_checkpoint_just_written(tmp_path):
    d = str(tmp_path)
    model = torch.nn.Linear(3, 2)
    save_checkpoint(d, training_state(4, model))
    _damage(save_checkpoint(d, training_state(10, model)))
    with pytest.warns(UserWarning, match="ckpt-000000010.pt: damaged"):
        resumed = latest_checkpoint(d)
    assert resumed.endswith("ckpt-000000004.pt")
    # The run goes on from step 4 and saves step 5 keeping one checkpoint: that one.
    with torch.no_grad():
        model.weight.add_(torch.arange(6.0).reshape(2, 3))
    path = save_checkpoint(d, training_state(5, model), keep=1)
    assert os.path.exists(path), sorted(os.listdir(d))
    assert sorted(os.listdir(d)) == ["ckpt-000000005.pt", "ckpt-000000010.pt"]
    with pytest.warns(UserWarning, match="ckpt-000000010.pt: damaged"):
        assert latest_checkpoint(d) == path
    assert torch.equal(load_checkpoint(path)["model"]["weight"], model.weight.detach())


@pytest.mark.parametrize("extra", [{"best": np.float64(1.5)}, {"rows": np.arange(3)}])
def test_a_state_load_cannot_read_is_refused_at_the_save(tmp_path, extra):
    d = str(tmp_path)
    first = save_checkpoint(d, training_state(1, extra={"best": 2.5}))
    with pytest.raises(ValueError, match=r"ckpt-000000002.pt not written: .*numpy.*"
                                         r"Convert NumPy values"):
        save_checkpoint(d, training_state(2, extra=extra))
    assert os.listdir(d) == ["ckpt-000000001.pt"], "no temporary file may be left behind"
    assert latest_checkpoint(d) == first and load_checkpoint(first)["extra"] == {"best": 2.5}
