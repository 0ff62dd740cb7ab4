"""One rank sleeps inside a ring step; the others must report the stall and abort.

Usage: mpiexec -n K python stall.py [SLEEPER]   (deadline from MPIRING_TIMEOUT)

The sleeping rank's second ring send (reduce-scatter step 2) of all_reduce#4
sleeps for two minutes; its right neighbour then waits for it in that step.
"""

import sys
import time

import numpy as np

import mpiring

comm = mpiring.init()
sleeper = int(sys.argv[1]) if len(sys.argv) > 1 else comm.size // 2
x = np.ones(4096, dtype=np.float32)
for _ in range(3):  # all_reduce#1..3 run normally
    comm.all_reduce(x, algo="ring")

if comm.rank == sleeper:
    send = comm._be.send
    sends = [0]

    def slow_send(buf, dst):
        sends[0] += 1
        if sends[0] == 2:
            time.sleep(120)
        send(buf, dst)

    comm._be.send = slow_send

print(f"[r{comm.rank}] entering all_reduce#4 at {time.time():.3f}", flush=True)
comm.all_reduce(x, algo="ring")
print(f"[r{comm.rank}] all_reduce#4 returned: the stall was not detected", flush=True)
