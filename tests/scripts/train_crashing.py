"""``python -m mpiring train`` whose rank 0 kills itself at a chosen point (for resume tests).

Usage: mpiexec -n K python tests/scripts/train_crashing.py after-step:S|in-write:S TRAIN-ARGS...

``after-step:S``: SIGKILL at the end of step S (after any checkpoint of that
step). ``in-write:S``: between writing the temporary file of step S's
checkpoint and renaming it, exactly the crash the atomic write must survive.
The hook lives here, in the tests, not in the library.
"""

import os
import signal
import sys
import time

from mpiring.cli import main
from mpiring.parallel import checkpoint as ck
from mpiring.tools.train.checkpointing import Checkpointer

kind, _, at = sys.argv[1].partition(":")
if kind not in ("after-step", "in-write") or not at.isdigit():
    raise SystemExit(f"{sys.argv[1]!r}: use after-step:S or in-write:S")
at = int(at)


def die(*_args) -> None:
    sys.stderr.write(f"[r0] crash hook: killing myself at step {at} (t={time.time():.3f})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


on_step_end = Checkpointer.on_step_end


def crashing_step_end(self, job) -> None:
    mine = job.comm.rank == 0 and job.step == at
    if mine and kind == "in-write":
        ck.os.replace = die  # the rename of this step's checkpoint never happens
    on_step_end(self, job)
    if mine and kind == "after-step":
        die()


Checkpointer.on_step_end = crashing_step_end
sys.exit(main(sys.argv[2:]))
