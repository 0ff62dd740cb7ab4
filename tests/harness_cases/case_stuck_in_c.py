"""Deliberately hanging test (run only by tests/test_harness.py): rank 0 is stuck in C
with the GIL held, so its own deadline timer cannot run; rank 1 waits in a barrier."""

import pytest
from mpi4py import MPI


def hold_the_gil_in_c() -> int:
    return sum(range(10**13))  # one C call: no other thread of this rank runs meanwhile


@pytest.mark.deadline(3)
def test_rank0_stuck_in_c():
    if MPI.COMM_WORLD.Get_rank() == 0:
        hold_the_gil_in_c()
    MPI.COMM_WORLD.Barrier()
