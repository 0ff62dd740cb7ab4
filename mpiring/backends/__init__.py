"""Backends move bytes; they know nothing about rings.

Each backend offers the point-to-point operations of the lecture's pseudocode
(``irecv``, ``send``, ``wait``, ``sendrecv``), ``group`` (NCCL needs a send and
its matching receive in one group), ``synchronize``, a cached ``scratch``
buffer, a small integer ``exchange`` used to check arguments across ranks, and
its library's own collectives (``native_*``) as baselines.
"""

BACKENDS = ("mpi", "nccl")
