"""A receive that nothing matches: the deadline ends the job, naming the peer and the tag.

Usage: mpiexec -n 2 python p2p_no_sender.py   (deadline from MPIRING_TIMEOUT)
Rank 1 waits for a message with tag 5 from rank 0; rank 0 sends with tag 6.
"""

import time

import numpy as np

import mpiring

comm = mpiring.init()
x = np.zeros(16, dtype=np.float32)
print(f"[r{comm.rank}] entering at {time.time():.3f}", flush=True)
if comm.rank == 0:
    comm.isend(x, 1, tag=6)
    time.sleep(120)
else:
    comm.recv(x, 0, tag=5)
print(f"[r{comm.rank}] the receive returned: the stall was not detected", flush=True)
