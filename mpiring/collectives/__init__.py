"""The collectives, one file per algorithm, each written once against a backend.

A collective function takes a backend (``be``), a flat contiguous array and its
arguments; it calls only the backend's point-to-point operations
(``irecv``/``send``/``wait``/``sendrecv``) and ``scratch``, so the same code runs
over MPI and NCCL.
"""

from mpiring.collectives.all_gather import ring_all_gather
from mpiring.collectives.all_reduce import ring_all_reduce
from mpiring.collectives.broadcast import pipelined_broadcast
from mpiring.collectives.halving_doubling import halving_doubling_all_reduce
from mpiring.collectives.recursive_doubling import recursive_doubling_all_reduce
from mpiring.collectives.reduce import pipelined_reduce
from mpiring.collectives.reduce_scatter import ring_reduce_scatter
from mpiring.collectives.ring_segmented import (
    segmented_all_gather,
    segmented_all_reduce,
    segmented_reduce_scatter,
)

__all__ = [
    "halving_doubling_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "pipelined_broadcast",
    "pipelined_reduce",
    "recursive_doubling_all_reduce",
    "ring_reduce_scatter",
    "segmented_all_gather",
    "segmented_all_reduce",
    "segmented_reduce_scatter",
]
