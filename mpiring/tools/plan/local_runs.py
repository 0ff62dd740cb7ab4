"""``plan --local``: measure this host's constants and mpiring's 2-rank steps, then compare.

One call runs, each as ``mpiexec -n RANKS python -m mpiring ...`` writing JSON:

* ``bench -c all_reduce -a ring``: alpha, beta by the ring's formula;
* ``bench-ddp --modes compute,ddp``: the DDP step and compute alone;
* ``bench-tp --blocks layer --modes mpiring``: one GPT block, TP over the ranks;
* ``bench-pp --modes 1f1b``: the GPT over the ranks as pipeline stages;

and times, in this process, a matrix multiply of each run's own shape with the
threads each rank gets (the FLOP rate). ``rounds`` > 1 repeats the benches in
alternating order, so a change in the host's load shows up as a spread
between the rounds instead of as a bias of one layout.
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
    "default": {"bench": ["-b", "256K", "-e", "64M", "-f", "4", "-n", "10", "-w", "2"],
                "ddp": ["--preset", "comm", "-n", "6", "-w", "2"],
                "tp": ["--widths", "1024", "--tokens", "256", "-n", "7", "-w", "2"],
                "pp": ["--preset", "small", "--m", "8", "-n", "7", "-w", "2"]},
}
BENCHES = ("ddp", "tp", "pp")
_FIXED = {"bench": ["bench", "-c", "all_reduce", "-a", "ring"],
          "ddp": ["bench-ddp", "--modes", "compute,ddp", "--progress", "off"],
          "tp": ["bench-tp", "--blocks", "layer", "--modes", "mpiring"],
          "pp": ["bench-pp", "--modes", "1f1b", "--draw", ""]}


def bench_command(kind: str, size: str, ranks: int, out: str) -> list[str]:
    """The argv of one bench run writing its rows to ``out``."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    return ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpiring", *_FIXED[kind],
            *SIZES[size][kind], "--json", out]


def run_bench(kind: str, size: str, ranks: int, workdir: str, tag: str = "",
              timeout_s: float = 900.0) -> list[dict]:
    """Run one bench under mpiexec (one thread per rank) and return its JSON rows."""
    out = str(Path(workdir) / f"{kind}{tag}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # bench-tp and bench-pp: one thread per rank
    cmd = bench_command(kind, size, ranks, out)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed ({done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def measure_all(size: str = "default", ranks: int = 2, rounds: int = 1,
                workdir: str | None = None) -> dict:
    """The ring bench once, then ``rounds`` rounds of the three step benches,
    every other round in reverse order. Returns {"bench": rows, "runs": [{kind: rows}]}."""
    with tempfile.TemporaryDirectory() as tmp:
        wd = workdir or tmp
        Path(wd).mkdir(parents=True, exist_ok=True)
        ring = run_bench("bench", size, ranks, wd)
        runs = []
        for i in range(rounds):
            order = BENCHES if i % 2 == 0 else BENCHES[::-1]
            runs.append({k: run_bench(k, size, ranks, wd, tag=f"-{i}") for k in order})
    return {"bench": ring, "runs": runs, "size": size, "ranks": ranks,
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)}
