"""Gradient buckets: which parameters are reduced together, and where they sit.

Pure functions (no torch, no MPI), so the assignment can be tested on its own.

The lecture's rules, as PyTorch DDP applies them:

* Parameters go into buckets in approximately *reverse* ``model.parameters()``
  order: backward produces gradients roughly from the last layer to the first,
  so the first bucket fills (and its AllReduce starts) while the earlier layers
  are still computing.
* The first bucket is small (``first_bucket_bytes``, 1 MiB by default) so that
  communication starts as early as possible; the others hold up to
  ``bucket_cap_bytes`` (25 MiB by default). Small buckets give more overlap but
  pay the per-collective latency more often; large ones the opposite.
* A parameter is never split across buckets (one bigger than the cap gets a
  bucket of its own), and a bucket holds one dtype on one device, because it is
  reduced as one flat buffer.
* After the first iteration the buckets are rebuilt once from the order in which
  gradients actually became ready (``order_from_observed``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

MIB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0
#: The buckets' AllReduce by default: the lecture's ring cut into segments
#: (``ring-seg``), on the reducer's own communicator with 1 MiB segments.
DEFAULT_BUCKET_ALGO = "ring-seg"
#: Segment size of the buckets' segmented ring: small enough that the receive
#: buffer is two segments (2 MiB) instead of a chunk of the largest bucket,
#: large enough that each segment's rendezvous is paid rarely
#: (docs/design-notes.md has the comparison).
BUCKET_SEGMENT_BYTES = 1 << 20


def compute_buckets(nbytes: Sequence[int], keys: Sequence[Hashable] | None = None, *,
                    bucket_cap_bytes: int = int(DEFAULT_BUCKET_CAP_MB * MIB),
                    first_bucket_bytes: int = int(DEFAULT_FIRST_BUCKET_MB * MIB),
                    order: Sequence[int] | None = None) -> list[list[int]]:
    """Assign parameters to buckets.

    Args:
        nbytes: size in bytes of each parameter, in registration
            (``model.parameters()``) order.
        keys: per parameter, what must be equal within a bucket (dtype and
            device); ``None`` means all equal.
        bucket_cap_bytes: a bucket is closed once it holds at least this much.
        first_bucket_bytes: the cap of the first bucket of each key.
        order: the order in which to fill buckets, a permutation of
            ``range(len(nbytes))``; default reverse registration order.

    Returns:
        Buckets as lists of parameter indices, each in fill order; the buckets
        are sorted by the position of their first parameter in ``order``, which
        is the order they are launched in.

    Raises:
        ValueError: ``order`` is not a permutation, or a cap is not positive.
    """
    n = len(nbytes)
    if keys is None:
        keys = [None] * n
    if len(keys) != n:
        raise ValueError(f"keys has {len(keys)} entries for {n} parameters: pass one per parameter")
    if bucket_cap_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket caps must be positive (got bucket_cap_bytes={bucket_cap_bytes}, "
                         f"first_bucket_bytes={first_bucket_bytes}): pass a size in bytes > 0")
    order = list(range(n - 1, -1, -1)) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}: every parameter exactly once")

    position = {index: pos for pos, index in enumerate(order)}
    closed: list[list[int]] = []
    open_buckets: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    limit: dict[Hashable, int] = {}
    for index in order:
        key = keys[index]
        bucket = open_buckets.setdefault(key, [])
        bucket.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + int(nbytes[index])
        # The first bucket of each key is the small one; every later one gets the cap.
        if open_bytes[key] >= limit.setdefault(key, first_bucket_bytes):
            closed.append(bucket)
            open_buckets[key] = []
            open_bytes[key] = 0
            limit[key] = bucket_cap_bytes
    closed.extend(b for b in open_buckets.values() if b)
    closed.sort(key=lambda b: position[b[0]])
    return closed


def bucket_offsets(bucket: Sequence[int], numels: Sequence[int]) -> tuple[list[int], int]:
    """Element offsets of each parameter of ``bucket`` in its flat buffer, and the total."""
    offsets, total = [], 0
    for index in bucket:
        offsets.append(total)
        total += int(numels[index])
    return offsets, total


def order_from_observed(observed: Sequence[int], n: int) -> list[int]:
    """A full fill order from the order in which gradients became ready.

    Parameters that never reported (unused in that iteration) follow in reverse
    registration order, so the result is always a permutation of ``range(n)``.
    Repeated or out-of-range indices are dropped.
    """
    seen: set[int] = set()
    out: list[int] = []
    for i in observed:
        i = int(i)
        if 0 <= i < n and i not in seen:
            seen.add(i)
            out.append(i)
    out.extend(i for i in range(n - 1, -1, -1) if i not in seen)
    return out


def describe_buckets(buckets: Sequence[Sequence[int]], nbytes: Sequence[int]) -> str:
    """One line: ``3 buckets: [0] 2 params 1.0 MiB, [1] ...``."""
    parts = [f"[{b}] {len(bucket)} params {sum(int(nbytes[i]) for i in bucket) / MIB:.1f} MiB"
             for b, bucket in enumerate(buckets)]
    return f"{len(buckets)} buckets: " + ", ".join(parts)
