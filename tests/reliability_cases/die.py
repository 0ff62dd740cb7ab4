"""One rank leaves in the middle of a loop of all_reduces; the job must end.

Usage: mpiexec -n K python die.py HOW [VICTIM] [ITER]
  HOW = kill: the victim SIGKILLs itself (the launcher sees a killed process)
  HOW = exit: the victim calls os._exit(0) (a silent exit, no error, no abort)
  HOW = raise: an uncaught exception that mpiring's hook does not see (the script
        put Python's own sys.excepthook back): the process ends, announcing its exit
  HOW = uncaught: an uncaught exception with mpiring's hook in place (aborts the job)
  HOW = thread: an uncaught exception in a second thread (aborts the job)
  HOW = sysexit: sys.exit(0) (a normal exit: atexit hooks run, the exit is announced)
  HOW = finish: the victim's loop ends early and its script returns normally
"""

import os
import signal
import sys
import threading
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
            sys.excepthook = sys.__excepthook__
            raise RuntimeError("deliberate failure")
        if how == "uncaught":
            raise RuntimeError("deliberate failure")
        if how == "thread":
            def fail():
                raise ValueError("deliberate failure in a thread")

            threading.Thread(target=fail, name="worker").start()
            time.sleep(60)
        if how == "finish":
            break
        if how == "sysexit":
            sys.exit(0)
        os._exit(0)
    comm.all_reduce(x, algo="ring")
    i += 1
if how == "finish" and comm.rank == victim:
    sys.exit(0)
print(f"[r{comm.rank}] loop ended after {i} all_reduces: the death was not noticed", flush=True)
