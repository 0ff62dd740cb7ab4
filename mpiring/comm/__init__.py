"""The Communicator: the public collectives and point-to-point calls, the argument
agreement across ranks, and the choice behind ``algo="auto"``."""

from mpiring.comm.communicator import ALGOS, REDUCING, Communicator

__all__ = ["ALGOS", "REDUCING", "Communicator"]
