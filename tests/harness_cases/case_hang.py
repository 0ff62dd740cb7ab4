"""Deliberately hanging test (run only by tests/test_harness.py): rank 0 never joins a barrier."""

import time

import pytest
from mpi4py import MPI


@pytest.mark.deadline(3)
def test_rank0_hangs():
    if MPI.COMM_WORLD.Get_rank() == 0:
        time.sleep(3600)
    MPI.COMM_WORLD.Barrier()
