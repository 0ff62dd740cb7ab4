"""Deliberately failing test (run only by tests/test_harness.py): rank 1 fails an assertion."""

from mpi4py import MPI


def test_rank1_fails():
    MPI.COMM_WORLD.Barrier()
    assert MPI.COMM_WORLD.Get_rank() != 1, "deliberate failure on rank 1"


def test_never_reached():
    # The other ranks must not sit here waiting for rank 1 forever.
    MPI.COMM_WORLD.Barrier()
