"""An mpiring call that never completes, under pytest (run only by tests/test_harness.py).

mpiring reports the stall on fd 2 and aborts the job; pytest captures fd 2 into a
file that an abort never reads back, so the harness must point the report elsewhere.
"""

import numpy as np
import pytest

import mpiring


@pytest.mark.deadline(40)  # later than mpiring's own deadline: its report must come first
def test_rank0_waits_for_a_message_never_sent():
    comm = mpiring.init(backend="mpi", timeout=2)
    if comm.rank == 0:
        comm.recv(np.zeros(4), 1, tag=7)
    comm.barrier()
