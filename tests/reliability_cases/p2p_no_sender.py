"""A receive that nothing matches: the deadline ends the job, naming the peer and the tag.

Usage: mpiexec -n 2 python p2p_no_sender.py   (deadline from MPIRING_TIMEOUT)
Rank 1 waits for a message with tag 5 from rank 0; rank 0 sends with tag 6. Rank 1
posts a second receive (tag 7) before it waits: the report must name the one waited for.
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
    first = comm.irecv(x, 0, tag=5)
    comm.irecv(np.zeros(16, dtype=np.float32), 0, tag=7)
    first.wait()
print(f"[r{comm.rank}] the receive returned: the stall was not detected", flush=True)
