"""One rank leaves in the middle of a loop of all_reduces; the job must end.

Usage: mpiexec -n K python die.py HOW [VICTIM] [ITER]
  HOW = kill: the victim SIGKILLs itself (the launcher sees a killed process)
  HOW = exit: the victim calls os._exit(0) (a silent exit, no error, no abort)
"""

import os
import signal
import sys
import time

import numpy as np

import mpiring

how = sys.argv[1]
comm = mpiring.init()
victim = int(sys.argv[2]) if len(sys.argv) > 2 else 1
when = int(sys.argv[3]) if len(sys.argv) > 3 else 20
x = np.ones(1 << 14, dtype=np.float32)
start = time.monotonic()
i = 0
while time.monotonic() - start < 100:  # a bound, in case the death goes unnoticed
    if comm.rank == victim and i == when:
        print(f"[r{comm.rank}] leaving ({how}) at iteration {i} at {time.time():.3f}", flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raise":
            raise RuntimeError("deliberate failure")
        if how == "sysexit":
            sys.exit(0)
        os._exit(0)
    comm.all_reduce(x, algo="ring")
    i += 1
print(f"[r{comm.rank}] loop ended after {i} all_reduces: the death was not noticed", flush=True)
