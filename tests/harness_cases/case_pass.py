"""A passing test file (run only by tests/test_harness.py) to check the one-report output."""

from mpi4py import MPI


def test_allreduce_of_ranks():
    size = MPI.COMM_WORLD.Get_size()
    assert MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank()) == size * (size - 1) // 2
