"""``python -m mpiring train`` whose rank 0 kills itself at a chosen point (for resume tests).

Usage: mpiexec -n K python tests/scripts/train_crashing.py RUN [-- RUN]...
  RUN: after-step:S|in-write:S|none TRAIN-ARGS...

The runs train one after the other in the same processes (each a fresh
``python -m mpiring train``: the job, model and data are built anew and
``--seed`` reseeds torch); a run that does not return 0 ends the job with its
exit code, and rank 0 prints ``train_crashing: run N returned 0`` after each
run that does. ``after-step:S``: SIGKILL at the end of step S (after any
checkpoint of that step). ``in-write:S``: between writing the temporary file
of step S's checkpoint and renaming it, exactly the crash the atomic write
must survive. ``none``: no crash (a crash ends the job, so only the last RUN
may crash). The hook lives here, in the tests, not in the library.
"""

import os
import signal
import sys
import time

from mpiring.backends.mpi import world_rank
from mpiring.cli import main
from mpiring.parallel import checkpoint as ck
from mpiring.tools.train.checkpointing import Checkpointer


def plan(run: list[str]) -> tuple[str, int, list[str]]:
    """(crash kind, step, train arguments) of one RUN."""
    kind, _, at = run[0].partition(":") if run else ("", "", "")
    if kind in ("after-step", "in-write") and at.isdigit() or kind == "none" and not at:
        return kind, int(at or 0), run[1:]
    raise SystemExit(f"{run[:1]!r}: use after-step:S, in-write:S or none")


plans, run = [], []
for arg in sys.argv[1:] + ["--"]:
    if arg == "--":
        plans.append(plan(run))
        run = []
    else:
        run.append(arg)
if any(k != "none" for k, _, _ in plans[:-1]):
    raise SystemExit("a crash ends the job: only the last RUN may crash")
kind, at = "none", 0  # the run in progress: what the hook reads


def die(*_args) -> None:
    sys.stderr.write(f"[r0] crash hook: killing myself at step {at} (t={time.time():.3f})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


on_step_end = Checkpointer.on_step_end


def crashing_step_end(self, job) -> None:
    mine = kind != "none" and job.comm.rank == 0 and job.step == at
    if mine and kind == "in-write":
        ck.os.replace = die  # the rename of this step's checkpoint never happens
    on_step_end(self, job)
    if mine and kind == "after-step":
        die()


Checkpointer.on_step_end = crashing_step_end
for number, (run_kind, run_at, args) in enumerate(plans, 1):
    kind, at = run_kind, run_at
    rc = main(args)
    if rc:
        sys.exit(rc)
    if world_rank() == 0:
        print(f"train_crashing: run {number} returned 0", flush=True)
