"""Backends move bytes; they know nothing about rings.

Each backend offers the point-to-point operations of the lecture's pseudocode
(``irecv``, ``send``, ``wait``, ``sendrecv``), ``group`` (NCCL needs a send and
its matching receive in one group), ``synchronize``, a cached ``scratch``
buffer, a small integer ``exchange`` used to check arguments across ranks, and
its library's own collectives (``native_*``) as baselines.
"""

BACKENDS = ("mpi", "nccl")

# One tag for all ring traffic: collectives on a communicator are issued in the
# same order on every rank and MPI never overtakes messages between two ranks
# with the same tag, so the steps cannot be confused.
TAG = 7
# The public point-to-point calls map the user's tag t to two MPI tags above the
# ring's, one for the message's descriptor and one for its data, so that neither
# can match the other nor a ring step.
P2P_TAG0 = TAG + 1
#: The largest user tag: MPI guarantees tags up to 32767.
MAX_TAG = (32767 - P2P_TAG0) // 2
