"""``plan --local``: measure this host's constants and mpiring's 2-rank steps, then compare.

One call runs, each as ``mpiexec -n RANKS python -m mpiring ...`` writing JSON:

* ``bench -c all_reduce -a ring``: alpha, beta by the ring's formula;
* ``bench-ddp --modes compute,ddp``: the DDP step and compute alone;
* ``bench-tp --blocks layer --modes mpiring``: one GPT block, TP over the ranks;
* ``bench-pp --modes 1f1b``: the GPT over the ranks as pipeline stages;

and, inside each of the three jobs, right before its bench and on all its ranks
at once, ``python -m mpiring plan --calibrate`` times every GEMM shape, attention
call and elementwise pass that any of the three runs does (``local_work.spec_for``):
the rates then share the cores, caches and load with the bench they price.
``rounds`` > 1 repeats the benches in alternating order, so a change in the
host's load shows up as a spread between the rounds instead of as a bias of
one layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Bench arguments per size: ``tiny`` checks the plumbing in seconds, ``default``
#: is the benchmark (the presets the benches use by default).
SIZES = {
    "tiny": {"bench": ["-b", "64K", "-e", "1M", "-f", "4", "-n", "5", "-w", "1"],
             "ddp": ["--preset", "tiny", "--batch-size", "2", "-n", "2", "-w", "1"],
             "tp": ["--widths", "64", "--tokens", "64", "-n", "2", "-w", "1"],
             "pp": ["--preset", "tiny", "--m", "2", "--mb-rows", "1", "-n", "2", "-w", "1"]},
    "default": {"bench": ["-b", "8K", "-e", "32M", "-f", "4", "-n", "10", "-w", "2"],
                "ddp": ["--preset", "comm", "-n", "6", "-w", "2"],
                "tp": ["--widths", "1024", "--tokens", "256", "-n", "7", "-w", "2"],
                "pp": ["--preset", "small", "--m", "8", "-n", "7", "-w", "2"]},
}
BENCHES = ("ddp", "tp", "pp")
_FIXED = {"bench": ["bench", "-c", "all_reduce", "-a", "ring"],
          "ddp": ["bench-ddp", "--modes", "compute,ddp", "--progress", "off"],
          "tp": ["bench-tp", "--blocks", "layer", "--modes", "mpiring"],
          "pp": ["bench-pp", "--modes", "1f1b", "--draw", ""]}


def bench_command(kind: str, size: str, ranks: int, out: str,
                  calibrate: tuple[str, str] | None = None) -> list[str]:
    """The argv of one bench run writing its rows to ``out``; with ``calibrate`` =
    (spec, result) the same job first runs the calibration of ``spec``."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    first = ["plan", "--calibrate", *calibrate, "--then"] if calibrate else []
    return ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpiring", *first, *_FIXED[kind],
            *SIZES[size][kind], "--json", out]


def _flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def pp_shape(size: str) -> tuple[str, int]:
    """bench-pp's preset and rows per micro-batch at ``size`` (its rows do not carry them)."""
    a = SIZES[size]["pp"]
    return _flag(a, "--preset", "small"), int(_flag(a, "--mb-rows", "2"))


def spec_for_size(size: str, ranks: int) -> dict:
    """The calibration spec of every shape the three benches run at ``size``."""
    from mpiring.tools.models.gpt import PRESETS
    from mpiring.tools.plan.local import run_works
    from mpiring.tools.plan.local_work import spec_for

    a = SIZES[size]
    preset = _flag(a["ddp"], "--preset", "comm")
    rows = {"ddp": [{"mode": "ddp", "preset": preset, "params": 1,
                     "seq_len": PRESETS[preset].seq_len,
                     "batch": int(_flag(a["ddp"], "--batch-size", "8"))}],
            "tp": [{"mode": "mpiring", "block": "layer", "width": int(w), "ranks": ranks,
                    "tokens": int(_flag(a["tp"], "--tokens", "256"))}
                   for w in _flag(a["tp"], "--widths", "1024").split(",")],
            "pp": [{"mode": "1f1b", "m": int(m)} for m in _flag(a["pp"], "--m", "8").split(",")]}
    pp_preset, mb_rows = pp_shape(size)
    spec = spec_for(run_works(rows, pp_preset=pp_preset, pp_mb_rows=mb_rows))
    # tiny checks the plumbing: two turns of each probe and a small stream suffice.
    return {**spec, "repeat": 2, "stream_mib": 4.0} if size == "tiny" else spec


def run_bench(kind: str, size: str, ranks: int, workdir: str, tag: str = "",
              timeout_s: float = 900.0, spec: str | None = None) -> tuple[list[dict], dict | None]:
    """Run one bench under mpiexec (one thread per rank), with the calibration of the
    ``spec`` file first in the same job; return its JSON rows and the calibration."""
    out = str(Path(workdir) / f"{kind}{tag}.json")
    cal = str(Path(workdir) / f"calib-{kind}{tag}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # bench-tp and bench-pp: one thread per rank
    cmd = bench_command(kind, size, ranks, out, (spec, cal) if spec else None)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed ({done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    with open(out) as f:
        rows = json.load(f)
    if not spec:
        return rows, None
    with open(cal) as f:
        return rows, json.load(f)


def measure_all(size: str = "default", ranks: int = 2, rounds: int = 1,
                workdir: str | None = None) -> dict:
    """The ring bench once, then ``rounds`` rounds of the three step benches,
    every other round in reverse order, each with its calibration in its job.
    Returns {"bench": rows, "runs": [{kind: rows}], "calib": [{kind: calibration}]}."""
    with tempfile.TemporaryDirectory() as tmp:
        wd = workdir or tmp
        Path(wd).mkdir(parents=True, exist_ok=True)
        spec = str(Path(wd) / "spec.json")
        with open(spec, "w") as f:
            json.dump(spec_for_size(size, ranks), f)
        ring, _ = run_bench("bench", size, ranks, wd)
        runs, calib, loads = [], [], []
        for i in range(rounds):
            order = BENCHES if i % 2 == 0 else BENCHES[::-1]
            got, loads_i = {}, {}
            for k in order:
                loads_i[k] = os.getloadavg()[0]
                got[k] = run_bench(k, size, ranks, wd, tag=f"-{i}", spec=spec)
            runs.append({k: got[k][0] for k in BENCHES})
            calib.append({k: got[k][1] for k in BENCHES})
            loads.append(loads_i)
    return {"bench": ring, "runs": runs, "calib": calib, "loads": loads, "size": size,
            "ranks": ranks,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)}
