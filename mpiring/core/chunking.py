"""Pure index arithmetic for the ring: chunk bounds and who sends what, when.

Nothing here talks to MPI; every function is a few lines of integer arithmetic
that the tests check exhaustively for small K.
"""

from __future__ import annotations

import functools
import operator


@functools.lru_cache(maxsize=4096)
def chunk_bounds(n: int, k: int) -> tuple[tuple[int, int], ...]:
    """Split ``n`` elements into ``k`` contiguous chunks, numpy.array_split style.

    The first ``n % k`` chunks get one extra element, so chunk sizes differ by at
    most one and a buffer with fewer elements than ranks gets empty tail chunks.

    Remembered per ``(n, k)``: a training loop or a benchmark repeats its sizes,
    and for small messages working the bounds out again is a visible share of
    the call. So the result is a tuple, shared by every caller.

    Returns:
        ``k`` pairs ``(start, stop)`` covering ``range(n)`` in order.
    """
    n, k = operator.index(n), operator.index(k)  # plain ints in the shared result
    if k < 1:
        raise ValueError(f"need at least one chunk, got k={k}")
    if n < 0:
        raise ValueError(f"element count must be >= 0, got {n}")
    base, extra = divmod(n, k)
    bounds = []
    start = 0
    for c in range(k):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """Return ``(left, right)``: the rank we receive from and the rank we send to."""
    return (rank - 1) % size, (rank + 1) % size


def reduce_scatter_indices(rank: int, step: int, size: int) -> tuple[int, int]:
    """Chunks rank ``rank`` sends and receives at ReduceScatter step ``step``.

    ``send = (rank - step - 1) mod K`` and ``recv = (rank - step - 2) mod K``.

    At step 0 every rank sends the chunk its left neighbour's left neighbour will
    finish on, so after the last step ``K-2`` the chunk received (and completed) is
    ``(rank - K) mod K = rank``: rank r ends holding chunk r fully reduced, which
    is the contract of ``Communicator.reduce_scatter``. The chunk a rank receives
    is exactly the one its left neighbour sends in the same step.
    """
    return (rank - step - 1) % size, (rank - step - 2) % size


def all_gather_indices(rank: int, step: int, size: int) -> tuple[int, int]:
    """Chunks rank ``rank`` sends and receives at AllGather step ``step``.

    ``send = (rank - step) mod K`` and ``recv = (rank - step - 1) mod K``: rank r
    starts by forwarding its own chunk r and then forwards whatever it received in
    the previous step; after ``K-1`` steps it has every chunk.
    """
    return (rank - step) % size, (rank - step - 1) % size


def ring_step_indices(rank: int, step: int, size: int) -> tuple[int, int]:
    """Chunks sent and received at ``step`` of ReduceScatter followed by AllGather.

    Steps ``0 .. K-2`` are ``reduce_scatter_indices``, steps ``K-1 .. 2K-3`` are
    ``all_gather_indices`` of ``step - (K-1)``; both are ``send = (rank - step - 1)
    mod K``, ``recv = (rank - step - 2) mod K``, so the AllGather starts by sending
    the chunk the ReduceScatter has just finished (the segmented ring streams
    straight from one into the other).
    """
    if step < size - 1:
        return reduce_scatter_indices(rank, step, size)
    return all_gather_indices(rank, step - (size - 1), size)


def ring_position(rank: int, root: int, size: int) -> int:
    """Distance from ``root`` to ``rank`` going right around the ring (root is 0)."""
    return (rank - root) % size


#: Per-message latency (s) and bandwidth (B/s) of a pipelined ring step: the
#: built-in values, fitted where ranks shared cores (a chunk handed on waits
#: until the next rank is scheduled, hence the large latency; see
#: docs/design-notes.md). ``python -m mpiring tune -c broadcast`` refits them
#: for your layout.
PIPELINE_ALPHA = 1.1e-4
PIPELINE_BETA = 7.0e9


def default_pipeline_chunks(nbytes: int, size: int, alpha: float = PIPELINE_ALPHA,
                            beta: float = PIPELINE_BETA) -> int:
    """The model's best number of pipeline chunks S for a broadcast or reduce of ``nbytes``.

    The cost model is ``(K-2+S)(alpha + N/(S beta))``; its optimum is
    ``S* = sqrt((K-2) N / (alpha beta))``, rounded to the better neighbouring
    integer, never more chunks than bytes. With two ranks there is nothing to
    overlap (S = 1).
    """
    if nbytes <= 0 or size <= 2:
        return 1
    from mpiring.core.costmodel import AlphaBeta, best_chunks

    return best_chunks(nbytes, size, AlphaBeta(alpha, beta), max_chunks=nbytes)
