"""Launch scripts refuse a hostfile that does not exist, before anything runs.

Every script under scripts/ that takes ``HOSTFILE`` must source
``scripts/_hostfile.sh`` first (before the environment set-up and any launch),
and no script may hand a hostfile to the launcher by itself.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPTS = Path(ROOT) / "scripts"


def code(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def runnable_scripts() -> list[Path]:
    # launch-recipes.sh is a page of examples that starts with `exit 0`.
    return [p for p in sorted(SCRIPTS.glob("*.sh"))
            if not p.name.startswith("_") and code(p)[:1] != ["exit 0"]]


def hostfile_scripts() -> list[Path]:
    return [p for p in runnable_scripts() if "HOSTFILE" in p.read_text()]


def test_demo_takes_a_hostfile():
    assert SCRIPTS / "demo.sh" in hostfile_scripts()


@pytest.mark.parametrize("script", hostfile_scripts(), ids=lambda p: p.name)
def test_the_check_comes_first(script):
    lines = code(script)
    check = next((i for i, line in enumerate(lines) if "_hostfile.sh" in line), None)
    assert check is not None, f"{script.name} uses HOSTFILE: source scripts/_hostfile.sh"
    for line in lines[:check]:
        assert not re.search(r"_venv\.sh|mpiexec|mpirun|python|pip", line), \
            f"{script.name}: '{line.strip()}' runs before the hostfile check"


def test_no_script_passes_a_hostfile_around_the_check():
    for script in runnable_scripts():
        for line in code(script):
            if re.search(r"\b(mpiexec|mpirun)\b", line):
                assert not re.search(r"\s(-f|--?hostfile|--?machinefile)\s", line), \
                    f"{script.name}: '{line.strip()}': use \"${{HOSTARGS[@]}}\" from _hostfile.sh"


def run(script: Path, hostfile: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOSTFILE": hostfile, "HOME": "/nonexistent"}
    return subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=20)


@pytest.mark.parametrize("script", hostfile_scripts(), ids=lambda p: p.name)
def test_bad_hostfiles_stop_the_script_with_the_fix(script, tmp_path):
    (tmp_path / "empty").write_text("# only a comment\n\n")
    for hostfile, says in ((str(tmp_path / "missing"), "does not exist: pass an existing file"),
                           (str(tmp_path), "is not a regular file"),
                           (str(tmp_path / "empty"), "lists no host")):
        proc = run(script, hostfile)
        assert proc.returncode == 2, (hostfile, proc.stdout, proc.stderr)
        assert f"scripts/{script.name}: hostfile '{hostfile}' {says}" in proc.stderr, proc.stderr
        assert proc.stdout == ""


def test_a_good_hostfile_becomes_an_absolute_launcher_argument(tmp_path):
    helper = SCRIPTS / "_hostfile.sh"
    show = f'source "{helper}"; printf "%s\\n" "${{HOSTARGS[@]}}"'
    for cwd, name in ((ROOT, "hostfiles/mpich-localhost"), (tmp_path, "hostfiles/mpich-localhost")):
        proc = subprocess.run(["bash", "-c", show], cwd=cwd, env={"HOSTFILE": name,
                              "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=20)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["-f", str(Path(ROOT) / name)]
    proc = subprocess.run(["bash", "-c", show], cwd=ROOT, env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0 and proc.stdout.strip() == "", "no HOSTFILE: no arguments"
