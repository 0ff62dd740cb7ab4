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
import sys

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


# --- the launcher ----------------------------------------------------------------------

SCRIPT = """import json, os, sys
out = sys.argv[1]
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
with open(os.path.join(out, "r" + os.environ["RANK"] + ".json"), "w") as fh:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ[k] for k in keys}}, fh)
"""


@pytest.fixture
def launch(world, tmp_path, monkeypatch, capsys):
    """``launch(args) -> (status, rank 0's stderr, what the script saw)`` in this process."""
    import json

    from mpiring.run import VARIABLES, main

    script = tmp_path / "show.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out-r{world.rank}"
    out.mkdir()
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = {v: os.environ.pop(v) for v in VARIABLES if v in os.environ}

    def run(args):
        capsys.readouterr()
        args = [str(script) if a == "SCRIPT" else str(out) if a == "OUT" else a for a in args]
        try:
            status = main(args)
        finally:
            for v in VARIABLES:
                os.environ.pop(v, None)
            os.environ.update(saved)
        seen = out / f"r{world.rank}.json"
        shown = json.loads(seen.read_text()) if seen.exists() else None
        if seen.exists():
            seen.unlink()
        return status, capsys.readouterr().err, shown

    return run


def test_torchruns_process_options_are_checked_against_mpi(world, launch):
    local = world.local_size
    status, err, seen = launch(["--nproc-per-node", str(local), "--nnodes", "1", "--standalone",
                                "--master-port", "29517", "SCRIPT", "OUT", "--lr", "3e-4", "-x",
                                "--nproc-per-node", "9"])
    assert status == 0, err
    # Everything after the script is the script's, torchrun's option names included.
    assert seen["argv"][1:] == ["--lr", "3e-4", "-x", "--nproc-per-node", "9"]
    assert seen["env"]["RANK"] == str(world.rank) and seen["env"]["MASTER_PORT"] == "29517"
    assert seen["env"]["LOCAL_WORLD_SIZE"] == str(local)
    assert launch([f"--nproc_per_node={local}", "SCRIPT", "OUT"])[0] == 0
    # torchrun counts the devices for these; MPI has counted the processes already.
    assert launch(["--nproc-per-node", "gpu", "SCRIPT", "OUT"])[0] == 0

    status, err, seen = launch([f"--nproc_per_node={local + 1}", "SCRIPT", "OUT"])
    assert (status, seen) == (2, None)
    if world.rank == 0:  # said once, naming every rank
        assert err.count("disagree with MPI") == 1, err
        assert f"r{world.size - 1}: --nproc-per-node {local + 1} (MPI started {local} on this " \
               "host)" in err, err
    else:
        assert err == ""


@pytest.mark.parametrize("args,says", [
    (["--rdzv-backend", "c10d", "SCRIPT", "OUT"], "--rdzv-backend is not an option here"),
    (["--nproc-per-node", "two", "SCRIPT", "OUT"], "--nproc-per-node two: give a whole number"),
    (["--nproc-per-node"], "--nproc-per-node needs a value"),
    (["--standalone"], "no script to run"),
    (["no-such-script.py", "OUT"], "can't open file .*no-such-script.py.*: no such file"),
    (["-m", "mpiring_no_such_module.sub", "OUT"], "no module named 'mpiring_no_such_module.sub'"),
])
def test_a_command_line_that_cannot_run_is_one_message_and_status_2(world, launch, args, says):
    import re

    status, err, seen = launch(args)
    assert (status, seen) == (2, None), err
    if world.rank == 0:
        assert re.search(says, err) and "Traceback" not in err, err
    else:
        assert err == ""


# --- the bench commands ------------------------------------------------------------------

def _parse(argv):
    from mpiring.cli import build_parser

    return build_parser(argv[0]).parse_args(argv)


@pytest.mark.parametrize("argv,says", [
    (["bench", "-e", "4K", "--json", "no-such-folder/rows.json"], "folder 'no-such-folder' does"),
    (["bench", "--plot", "no-such-folder/busbw.png"], "folder 'no-such-folder' does not exist"),
    (["bench-ddp", "--json", "no-such-folder/x.json"], "folder 'no-such-folder' does not exist"),
    (["bench-fsdp", "--json", "no-such-folder/x.json"], "folder 'no-such-folder' does not exist"),
    (["bench-tp", "--json", "no-such-folder/x.json"], "folder 'no-such-folder' does not exist"),
    (["zero-bench", "--json", "no-such-folder/x.json"], "folder 'no-such-folder' does not exist"),
    (["hook-curves", "--out", "no-such-folder/curves"], "folder 'no-such-folder' does not exist"),
    (["bench", "-o", "foo"], "invalid choice: 'foo'"),
    (["bench", "--chunks", "0"], "--chunks: '0': use a whole number >= 1"),
    (["bench", "--root", "-1"], "--root: '-1': use a whole number >= 0"),
    (["zero-bench", "--steps", "0"], "--steps: '0': use a whole number >= 1"),
    (["check-cost", "--sizes", "0"], "size '0': give at least 1 byte"),
    (["check-cost", "--iters", "-5"], "--iters: '-5': use a whole number >= 0"),
])
def test_bad_flags_are_usage_errors_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                         argv, says):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_an_output_file_in_an_existing_folder_is_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _parse(["bench", "--json", "rows.json"]).json == "rows.json"
    assert _parse(["check-cost", "--sizes", "4K,1M"]).sizes == [4096, 1 << 20]


@pytest.mark.parametrize("argv,says", [
    (["allreduce", "--size", "3"], "--size 3 B is less than one float32 element"),
    (["allreduce", "--size", "1000G"], "more than its .* GiB of memory"),
    (["bench", "-c", "broadcast", "--root", "9"], r"--root 9: the job has ranks 0\.\."),
    (["bench", "-e", "1000G"], "more than its .* GiB of memory"),
    (["tune", "--margin", "nan", "--dry-run"], "--margin nan: give a fraction"),
    (["tune", "--margin", "-1", "--dry-run"], "--margin -1.0: give a fraction"),
])
def test_bad_values_are_refused_on_every_rank_before_any_measurement(world, argv, says):
    import re

    args = _parse(argv)
    with pytest.raises(ValueError) as exc:
        args._module.run(args)
    assert re.search(says, str(exc.value)), exc.value
    world.barrier()  # every rank got here: none is left in a measurement
