r"""DDP communication hooks: what a bucket's gradient becomes on the wire.

``ddp.register_comm_hook(state, hook)`` replaces the reducer's plain AllReduce
of a bucket with ``hook(state, bucket)``, as in torch DDP. The hook gets a
``GradBucket`` whose ``buffer()`` holds this rank's gradients of the bucket,
*not yet divided* by the world size (the hook decides where to divide), and
returns the reduced mean gradient (a tensor like ``buffer()``, or a future with
``wait()``). It runs on the reducer's communication thread and must use
``bucket.comm``, the reducer's own communicator, for its collectives. The
state may also be None or the model's communicator, as torch's process-group
state is (``ddp.register_comm_hook(None, fp16_compress_hook)``): the hooks
always use ``bucket.comm``. Hooks run eagerly, outside any ``torch.compile``
graph: the reducer calls them from its thread after the gradients exist.

Built-in hooks, cheapest last, bytes sent per rank for a bucket of N float32
elements on K ranks (the ring sends (K-1)/K of a buffer per phase):

=====================  ==========================  =====================================
hook                   on the wire                 what it costs in accuracy
=====================  ==========================  =====================================
``allreduce_hook``     AllReduce, 2(K-1)/K 4N      none (the reducer's own path)
``fp16_compress_hook`` AllReduce, 2(K-1)/K 2N      fp16 rounding of the mean, no range
``bf16_compress_hook`` AllReduce, 2(K-1)/K 2N      bf16 rounding (8 bits), fp32 range
``topk_hook``          AllGather of k (index,      only the k largest |g| per rank per
                       value) pairs, (K-1) 8k      step; error feedback keeps the rest
``powerSGD_hook``      AllReduce of P (n r) and    rank-r approximation of every weight
                       Q (m r) per n x m matrix    matrix; error feedback, warm start
=====================  ==========================  =====================================

torch's ``fp16_compress_wrapper(hook)`` / ``bf16_compress_wrapper(hook)`` (run
any hook on the bucket cast to half precision) and ``noop_hook`` (no
communication, for headroom analysis) have namesakes here.
``torch.save(state)`` works as with torch's ``PowerSGDState``: the process
group is left out, and a loaded state resumes bit for bit where the new model
has the same buckets.

Division happens *before* the reduction wherever precision allows it (fp16,
bf16, top-k): the sum of K float16 gradients can overflow where the sum of K
gradients divided by K cannot. PowerSGD follows torch's ``powerSGD_hook``
(sum, then divide the small Q) so that the two give the same numbers.

Every state counts the bytes its hook sent (``state.bytes_sent``) so the bench
can print them. Hooks call the collectives with ``check=False``, as the reducer
does for its buckets: the layout was compared across ranks at construction and
every message size here is a function of it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO

__all__ = [
    "GradBucket",
    "HookState",
    "PowerSGDState",
    "TopKState",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "make_hook",
    "noop_hook",
    "powerSGD_hook",
    "ring_bytes_sent",
    "topk_hook",
    "torch_equivalent",
    "HOOKS",
]


class GradBucket:
    """One bucket as a hook sees it (method names as torch's ``dist.GradBucket``).

    Attributes:
        comm: the communicator to run the hook's collectives on (the reducer's
            own duplicate, safe to use from the communication thread).
        iteration: synced backward passes the reducer finished before this one.
    """

    def __init__(self, index: int, buffer: torch.Tensor, params: Sequence[torch.Tensor],
                 offsets: Sequence[int], is_last: bool, comm, iteration: int = 0, *,
                 whole: torch.Tensor | None = None, algo: str = DEFAULT_BUCKET_ALGO):
        self._index = index
        self._buffer = buffer
        # The reducer's flat bucket, its status tail after ``buffer`` (None: no tail);
        # ``allreduce_hook`` sums it whole and says so in ``_tail_summed``.
        self._whole, self._tail_summed = whole, False
        # The reducer's AllReduce algorithm: allreduce_hook sums in its order.
        self._algo = algo
        self._params = list(params)
        self._offsets = list(offsets)
        self._is_last = is_last
        self.comm = comm
        self.iteration = iteration

    def index(self) -> int:
        """Position of the bucket in launch order (0 first)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradients of the bucket (this rank's, not divided by K)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents with ``tensor`` (same length)."""
        self._buffer.copy_(tensor)

    def is_last(self) -> bool:
        """True for the last bucket reduced in an iteration."""
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the buffer's order."""
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """Per parameter, its gradient as a view into ``buffer()`` (parameter shape)."""
        return [self._buffer[off:off + p.numel()].view_as(p)
                for p, off in zip(self._params, self._offsets)]

    def offsets(self) -> list[int]:
        """Element offset of each parameter in ``buffer()``."""
        return list(self._offsets)


def ring_bytes_sent(n: int, itemsize: int, size: int, rank: int, phases: Sequence[str]) -> int:
    """Bytes this rank sends in a ring ReduceScatter/AllGather/AllReduce of ``n`` elements.

    In ReduceScatter rank r sends every chunk but its own; in AllGather every
    chunk but the one of its right neighbour. ``phases`` lists "rs" and/or "ag".
    """
    if size == 1:
        return 0
    bounds = chunk_bounds(n, size)
    total = 0
    for phase in phases:
        skip = rank if phase == "rs" else (rank + 1) % size
        total += (n - (bounds[skip][1] - bounds[skip][0])) * itemsize
    return total


class HookState:
    """Counters every built-in hook keeps (and the plain hooks' whole state)."""

    def __init__(self) -> None:
        self.bytes_sent = 0      # bytes this rank sent on the wire, all buckets
        self.dense_bytes = 0     # what the plain float AllReduce would have sent
        self.calls = 0

    def _count(self, comm, n: int, itemsize: int, phases=("rs", "ag")) -> None:
        self.bytes_sent += ring_bytes_sent(n, itemsize, comm.size, comm.rank, phases)

    def _count_dense(self, comm, bucket: GradBucket) -> None:
        buf = bucket.buffer()
        self.dense_bytes += ring_bytes_sent(buf.numel(), buf.element_size(), comm.size,
                                            comm.rank, ("rs", "ag"))
        self.calls += 1


def _all_reduce_mean_(state: Any, comm, buf: torch.Tensor,
                      dtype: torch.dtype | None = None,
                      algo: str = DEFAULT_BUCKET_ALGO) -> torch.Tensor:
    """Mean of ``buf`` over the ranks, in place, sent as ``dtype`` (divide first, then sum)."""
    if comm.size > 1:
        buf.div_(comm.size)
    if dtype is None or dtype == buf.dtype:
        wire = buf
    else:
        wire = buf.to(dtype)
    if comm.size > 1:
        # The reducer's algorithm (default: ring-seg on the bucket communicator's 1 MiB
        # segments), so that allreduce_hook gives bit for bit what no hook gives
        # (another algorithm sums in another order).
        comm.all_reduce(wire, op="sum", algo=algo, check=False)
    if isinstance(state, HookState):
        state._count(comm, wire.numel(), wire.element_size())
    if wire is not buf:
        buf.copy_(wire)
    return buf


def allreduce_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
    """The plain mean: divide by K, ring AllReduce. Same result as no hook, bit for bit."""
    if isinstance(state, HookState):
        state._count_dense(bucket.comm, bucket)
    comm, buf, whole = bucket.comm, bucket.buffer(), bucket._whole
    if whole is None or comm.size == 1:
        return _all_reduce_mean_(state, comm, buf, algo=bucket._algo)
    # A bucket with the reducer's status tail: summed with it in one AllReduce, as
    # without a hook. The gradients alone are shorter, so the ring would cut its
    # chunks elsewhere and sum some elements in another order (a last-bit difference).
    buf.div_(comm.size)  # the tail's counts are summed undivided
    comm.all_reduce(whole, op="sum", algo=bucket._algo, check=False)
    bucket._tail_summed = True  # run_comm_hook must not sum it again
    if isinstance(state, HookState):
        state._count(comm, buf.numel(), buf.element_size())
    return buf


def fp16_compress_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
    """Send the gradients as float16: half the bytes; divided by K before the cast and the sum."""
    if isinstance(state, HookState):
        state._count_dense(bucket.comm, bucket)
    return _all_reduce_mean_(state, bucket.comm, bucket.buffer(), torch.float16)


def bf16_compress_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
    """Send the gradients as bfloat16: half the bytes, float32's range, 8 bits of mantissa."""
    if isinstance(state, HookState):
        state._count_dense(bucket.comm, bucket)
    return _all_reduce_mean_(state, bucket.comm, bucket.buffer(), torch.bfloat16)


def noop_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
    """torch's ``debugging_hooks.noop_hook``: no communication at all, for headroom analysis.

    Each rank keeps its own gradient, undivided, as with torch's: the replicas
    drift apart, so use it only to time a step without its AllReduce.
    """
    return bucket.buffer()


def _wrap_in(dtype: torch.dtype, hook: Callable, state: Any, bucket: GradBucket) -> torch.Tensor:
    buf = bucket.buffer()
    # A bucket of its own over the cast copy, not buffer().copy_() as set_buffer does:
    # the inner hook must see (and send) float16/bfloat16, as torch's wrapper's does.
    inner = GradBucket(bucket.index(), buf.to(dtype), bucket.parameters(), bucket.offsets(),
                       bucket.is_last(), bucket.comm, bucket.iteration, algo=bucket._algo)
    calls = state.calls if isinstance(state, HookState) else None
    result = hook(state, inner)
    if hasattr(result, "wait"):
        result = result.wait()
        if isinstance(result, (list, tuple)):
            result = result[0]
    if calls is not None and state.calls > calls:
        # The inner hook counted the cast bucket as its dense baseline; the model's
        # dense AllReduce would have sent the bucket in its own dtype.
        comm = bucket.comm
        state.dense_bytes += (state.calls - calls) * (
            ring_bytes_sent(buf.numel(), buf.element_size(), comm.size, comm.rank, ("rs", "ag"))
            - ring_bytes_sent(buf.numel(), inner.buffer().element_size(), comm.size, comm.rank,
                              ("rs", "ag")))
    return buf.copy_(result.reshape(-1))


def fp16_compress_wrapper(hook: Callable) -> Callable:
    """torch's ``fp16_compress_wrapper``: run ``hook`` on the bucket cast to float16.

    ``fp16_compress_wrapper(powerSGD_hook)`` sends PowerSGD's P and Q as float16;
    the result is cast back to the bucket's dtype.
    """
    def fp16_compress_wrapper_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
        return _wrap_in(torch.float16, hook, state, bucket)

    fp16_compress_wrapper_hook.__qualname__ = f"fp16_compress_wrapper({_name(hook)})"
    return fp16_compress_wrapper_hook


def bf16_compress_wrapper(hook: Callable) -> Callable:
    """torch's ``bf16_compress_wrapper``: run ``hook`` on the bucket cast to bfloat16."""
    def bf16_compress_wrapper_hook(state: Any, bucket: GradBucket) -> torch.Tensor:
        return _wrap_in(torch.bfloat16, hook, state, bucket)

    bf16_compress_wrapper_hook.__qualname__ = f"bf16_compress_wrapper({_name(hook)})"
    return bf16_compress_wrapper_hook


def _name(hook: Callable) -> str:
    # The wrapped hook's name goes into the wrapper's __qualname__, which DDP compares
    # across ranks: fp16_compress_wrapper(a) on one rank and (b) on another differ.
    return getattr(hook, "__qualname__", None) or repr(hook)


# --- top-k sparsification ----------------------------------------------------------

class TopKState(HookState):
    """State of ``topk_hook``: the ratio kept and each bucket's error-feedback memory.

    Args:
        ratio: fraction of each bucket's elements each rank sends per step
            (k = ceil(ratio * N), at least 1).
        use_error_feedback: add what was not sent to the next step's gradient
            (without it top-k stalls on the small coordinates; with it every
            coordinate is sent eventually, Stich et al. 2018).
        start_iter: plain AllReduce for the first ``start_iter`` iterations.

    ``errors[b]`` is bucket b's held-back error, laid out as ``layouts[b]`` says:
    ``(id(p), offset, numel)`` per parameter. When DDP rebuilds its buckets,
    each parameter's error follows it into its new bucket.
    """

    def __init__(self, ratio: float = 0.01, use_error_feedback: bool = True, start_iter: int = 0):
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio={ratio}: keep a fraction in (0, 1] of each bucket")
        self.ratio = float(ratio)
        self.use_error_feedback = use_error_feedback
        self.start_iter = int(start_iter)
        self.errors: dict[int, torch.Tensor] = {}
        # The bucket index alone is not enough: DDP rebuilds its buckets after the
        # first synced backward, often reordering a bucket of the same size, and
        # the error would land on other parameters' coordinates.
        self.layouts: dict[int, tuple[tuple[int, int, int], ...]] = {}
        self._fresh: set[int] = set()               # buckets stored this iteration
        self._moved: dict[int, torch.Tensor] = {}   # id(p) -> its error, while remapping
        self.iter = 0

    def __getstate__(self) -> dict[str, Any]:
        # id(p) names a parameter only in this process: a saved layout keeps the
        # positions (offset, numel) and is bound again, by position, to the bucket of
        # the same index and the same positions in the process that loads it.
        state = dict(self.__dict__)
        state["layouts"] = {b: tuple((None, off, numel) for _, off, numel in layout)
                            for b, layout in self.layouts.items()}
        state["_fresh"], state["_moved"] = set(), {}
        return state

    def _take_error(self, bucket: GradBucket) -> torch.Tensor | None:
        """This bucket's held-back error, laid out like the bucket is now (or None)."""
        b, layout = bucket.index(), _layout_of(bucket)
        saved = self.layouts.get(b)
        if saved == layout:
            return self.errors[b]
        if saved is not None and _loaded(saved) and [x[1:] for x in saved] == [
                x[1:] for x in layout]:
            self.layouts[b] = layout  # a loaded state meets its bucket again
            return self.errors[b]
        stale = [old for old in self.errors if old not in self._fresh]
        for old in stale:
            # The buckets were rebuilt: split the errors kept under the old layout
            # by parameter, so that each new bucket takes its parameters' errors.
            err, old_layout = self.errors.pop(old), self.layouts.pop(old)
            if _loaded(old_layout):
                # Saved under a bucket layout this model does not have (restore the
                # DDP bucket layout with the state to keep it): nothing says which
                # parameter each position was.
                warnings.warn(f"TopKState: bucket {old}'s saved error feedback does not fit "
                              "this model's buckets; it restarts from zero", stacklevel=2)
                continue
            for pid, off, numel in old_layout:
                self._moved[pid] = err[off:off + numel]
        if not self._moved:
            return None
        buf = bucket.buffer()
        err = torch.zeros(buf.numel(), dtype=buf.dtype, device=buf.device)
        for pid, off, numel in layout:
            e = self._moved.pop(pid, None)
            if e is not None and e.numel() == numel:
                err[off:off + numel] = e
        return err

    def _keep_error(self, bucket: GradBucket, err: torch.Tensor | None) -> None:
        b = bucket.index()
        if err is None:
            self.errors.pop(b, None)
            self.layouts.pop(b, None)
        else:
            self.errors[b], self.layouts[b] = err, _layout_of(bucket)
            self._fresh.add(b)
        if bucket.is_last():  # the iteration is over: nothing is left to remap
            self._fresh.clear()
            self._moved.clear()


def _layout_of(bucket: GradBucket) -> tuple[tuple[int, int, int], ...]:
    return tuple((id(p), off, p.numel()) for p, off in zip(bucket.parameters(), bucket.offsets()))


def _loaded(layout: tuple) -> bool:
    """A layout from a pickled TopKState (positions only, not yet bound to parameters)."""
    return any(pid is None for pid, _, _ in layout)


def topk_hook(state: TopKState, bucket: GradBucket) -> torch.Tensor:
    """Each rank sends its k largest-magnitude (index, value) pairs; the sum is the mean estimate.

    The exchange uses the project's ring AllGather into fixed-size slots: rank r
    writes its k indices (int32) and k values into slot r of two K*k buffers,
    which are exactly chunk r under ``numpy.array_split`` bounds, so one
    ``all_gather`` each hands every rank every slot. Duplicate indices from
    different ranks add up (``index_add_``). A bucket too small for the sparse
    form to pay off (K k (4 + itemsize) >= 2 N itemsize) goes dense.
    """
    comm = bucket.comm
    buf = bucket.buffer()
    state._count_dense(comm, bucket)
    k_ranks, n = comm.size, buf.numel()
    k = max(1, math.ceil(state.ratio * n))
    dense = (state.iter < state.start_iter
             or k * k_ranks * (4 + buf.element_size()) >= 2 * n * buf.element_size())
    if bucket.is_last():
        state.iter += 1
    err = state._take_error(bucket) if state.use_error_feedback else None
    if dense:
        if err is not None:  # held back before a rebuild made this bucket dense: send it now
            buf.add_(err, alpha=k_ranks)
        state._keep_error(bucket, None)
        return _all_reduce_mean_(state, comm, buf)
    g = buf.div_(k_ranks)  # the mean's share of this rank: divide before adding up
    if err is not None:
        g.add_(err)
    idx = torch.topk(g.abs(), k, sorted=False).indices
    indices = torch.zeros(k_ranks * k, dtype=torch.int32, device=buf.device)
    values = torch.zeros(k_ranks * k, dtype=buf.dtype, device=buf.device)
    slot = slice(comm.rank * k, (comm.rank + 1) * k)
    indices[slot] = idx.to(torch.int32)
    values[slot] = g[idx]
    if state.use_error_feedback:
        # What this rank did not send this time is sent (added) next time.
        err = g.clone()
        err[idx] = 0
    state._keep_error(bucket, err if state.use_error_feedback else None)
    if k_ranks > 1:
        comm.all_gather(indices, check=False)
        comm.all_gather(values, check=False)
        state._count(comm, indices.numel(), indices.element_size(), ("ag",))
        state._count(comm, values.numel(), values.element_size(), ("ag",))
    out = buf.zero_()
    out.index_add_(0, indices, values)
    return out


# --- PowerSGD ----------------------------------------------------------------------

class PowerSGDState(HookState):
    """State of ``powerSGD_hook`` (Vogels et al., 2019), with torch's arguments and defaults.

    Args:
        process_group: None or the model's Communicator (torch's first
            argument; the hook always runs on ``bucket.comm``).
        matrix_approximation_rank: r, the rank of the approximation.
        start_powerSGD_iter: plain AllReduce for this many iterations first
            (> 1 with error feedback or warm start: the buckets are rebuilt
            after the first iteration).
        min_compression_rate: compress an n x m matrix only if
            n m > rate (n + m) r; smaller tensors (biases, norms) go uncompressed.
        use_error_feedback: carry each step's approximation error into the next.
        warm_start: start each step's power iteration from the last Q.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt.
        random_seed: seed for the first Q, the same on every rank.
        compression_stats_logging_frequency: accepted for torch's signature
            (``bytes_sent`` / ``dense_bytes`` are the statistics here).
        batch_tensors_with_same_shape: compress the matrices of one shape in
            one batched matmul (torch's option; the same numbers either way
            as torch gives for the same setting).
    """

    def __init__(self, process_group: Any = None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0.0,
                 random_seed: int = 0, compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False):
        super().__init__()
        if process_group is not None and not hasattr(process_group, "all_reduce"):
            raise TypeError(f"PowerSGDState: process_group={process_group!r}: pass None or the "
                            "model's mpiring.Communicator")
        self.process_group = process_group
        if matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank={matrix_approximation_rank}: use >= 1")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                f"start_powerSGD_iter={start_powerSGD_iter}: use at least 2 with error feedback "
                "or warm start (the buckets are rebuilt after the first iteration, and the "
                "per-bucket memories must start after that)")
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.compression_stats_logging_frequency = int(compression_stats_logging_frequency)
        self.batch_tensors_with_same_shape = bool(batch_tensors_with_same_shape)
        # The seeds for the first Qs come from one NumPy stream, drawn in bucket
        # order, so every rank draws the same Q without communicating.
        self.rng = np.random.RandomState(random_seed)
        self.errors: dict[int, torch.Tensor] = {}
        self.p_memory: dict[int, torch.Tensor] = {}
        self.q_memory: dict[int, torch.Tensor] = {}
        self.iter = 0

    def _next_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def __getstate__(self) -> dict[str, Any]:
        # torch's PowerSGDState leaves its process group out of a saved state; a
        # Communicator cannot be pickled either (MPI handles), and the hook never
        # uses it (it runs on bucket.comm), so torch.save(state) works with either.
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None  # torch sets its default group; the hook uses bucket.comm


def orthogonalize_(matrices: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of each (n, r) matrix in a (b, n, r) batch, in place.

    Gram-Schmidt for r <= 2 or half precision (QR needs float32), QR otherwise,
    as torch's PowerSGD does, so both produce the same Q.
    """
    r = matrices.shape[2]
    if r > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        q, _ = torch.linalg.qr(matrices)
        matrices.copy_(q)
        return
    for i in range(r):
        col = matrices[:, :, i:i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        col /= norm + epsilon if epsilon else norm
        if i + 1 < r:
            rest = matrices[:, :, i + 1:]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.Tensor:  # noqa: N802
    """Rank-r compression of every weight matrix M (n x m) of the bucket.

    One step of power iteration, shared by all ranks (the sums are linear)::

        M  += error                        (error feedback)
        P   = M Q;    AllReduce(P)         Q: last step's (warm start) or random
        P   = orthonormalise(P)
        Q   = M^T P;  AllReduce(Q); Q /= K
        M' = P Q^T                         the mean gradient's rank-r approximation
        error = M - M'

    Tensors that would not shrink by ``min_compression_rate`` (biases, norms,
    small matrices) are all-reduced as they are, in one buffer. The wire
    carries (n + m) r instead of n m per matrix.
    """
    comm = bucket.comm
    buf = bucket.buffer()
    state._count_dense(comm, bucket)
    k_ranks = comm.size
    if state.iter < state.start_powerSGD_iter:
        state._next_iter(bucket)
        return _all_reduce_mean_(state, comm, buf)
    b = bucket.index()
    n_total, device, dtype = buf.numel(), buf.device, buf.dtype
    if state.use_error_feedback:
        err = state.errors.get(b)
        if err is not None and err.numel() == n_total:
            buf.add_(err)
        before = buf.clone()
    compress, plain = [], []
    for g in bucket.gradients():
        # Columns named, not -1: a parameter of zero elements has no inferable -1
        # (torch's hook fails there); it becomes an empty matrix and goes plain.
        matrix = g.view(g.shape[0], math.prod(g.shape[1:])) if g.dim() > 0 else g.view(1, 1)
        n, m = matrix.shape
        r = min(n, m, state.matrix_approximation_rank)
        (compress if (n + m) * r * state.min_compression_rate < n * m else plain).append(
            (matrix, g, r))
    # torch's order: the matrices grouped by shape (shapes in order of first
    # appearance), one batch per shape or one matrix at a time. P and Q are laid
    # out, and the first random Qs drawn, in that order: in bucket order a bucket
    # whose shapes interleave (w1, w2, w1) gets other random Qs than torch's.
    by_shape: dict[torch.Size, list[torch.Tensor]] = {}
    for mat, _, _ in compress:
        by_shape.setdefault(mat.shape, []).append(mat)
    units: list[list[torch.Tensor]] = []
    for mats in by_shape.values():
        if state.batch_tensors_with_same_shape:
            units.append(mats)
        else:
            units.extend([mat] for mat in mats)
    ranks = [min(*mats[0].shape, state.matrix_approximation_rank) for mats in units]
    p_size = sum(len(mats) * mats[0].shape[0] * r for mats, r in zip(units, ranks))
    q_size = sum(len(mats) * mats[0].shape[1] * r for mats, r in zip(units, ranks))
    fresh = (not state.warm_start or b not in state.p_memory
             or state.p_memory[b].numel() != p_size or state.q_memory[b].numel() != q_size)
    if fresh:
        state.p_memory[b] = torch.empty(p_size, device=device, dtype=dtype)
        state.q_memory[b] = torch.empty(q_size, device=device, dtype=dtype)
    p_all, q_all = state.p_memory[b], state.q_memory[b]
    batches, ps, qs = [], [], []
    pi = qi = 0
    for mats, r in zip(units, ranks):
        count, (n, m) = len(mats), mats[0].shape
        # One matrix: a view of the bucket (bmm writes the result in place);
        # several: a stacked copy, written back after decompression.
        batches.append(mats[0].unsqueeze(0) if count == 1 else torch.stack(mats))
        ps.append(p_all[pi:pi + count * n * r].view(count, n, r))
        qs.append(q_all[qi:qi + count * m * r].view(count, m, r))
        pi += count * n * r
        qi += count * m * r
    if fresh:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(state.rng.randint(1_000_000_000))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                orthogonalize_(q, state.orthogonalization_epsilon)
    else:
        for q in qs:
            orthogonalize_(q, state.orthogonalization_epsilon)

    # Uncompressed tensors: one AllReduce of their concatenation.
    if plain:
        flat = torch.cat([g.reshape(-1) for _, g, _ in plain])
        if k_ranks > 1:
            comm.all_reduce(flat, op="sum", check=False)
            state._count(comm, flat.numel(), flat.element_size())
        flat.div_(k_ranks)
        pos = 0
        for _, g, _ in plain:
            g.copy_(flat[pos:pos + g.numel()].view_as(g))
            pos += g.numel()
    if compress:
        for batch, p, q in zip(batches, ps, qs):
            torch.bmm(batch, q, out=p)
        if k_ranks > 1:
            comm.all_reduce(p_all, op="sum", check=False)
            state._count(comm, p_all.numel(), p_all.element_size())
        for p in ps:
            orthogonalize_(p, state.orthogonalization_epsilon)
        for batch, p, q in zip(batches, ps, qs):
            torch.bmm(batch.transpose(1, 2), p, out=q)
        if k_ranks > 1:
            comm.all_reduce(q_all, op="sum", check=False)
            state._count(comm, q_all.numel(), q_all.element_size())
        q_all.div_(k_ranks)
        for mats, batch, p, q in zip(units, batches, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=batch)
            if len(mats) > 1:
                for mat, approx in zip(mats, batch):
                    mat.copy_(approx)
    if state.use_error_feedback:
        state.errors[b] = before - buf
    if not state.warm_start:
        state.p_memory.clear()
        state.q_memory.clear()
    state._next_iter(bucket)
    return buf


HOOKS: dict[str, Callable[[Any, GradBucket], Any] | None] = {
    "none": None,
    "allreduce": allreduce_hook,
    "fp16": fp16_compress_hook,
    "bf16": bf16_compress_hook,
    "topk": topk_hook,
    "powersgd": powerSGD_hook,
}


def make_hook(name: str, **options: Any) -> tuple[HookState | None, Callable | None]:
    """``(state, hook)`` for a built-in hook by name (the CLI's ``--comm-hook``).

    Options: ``ratio`` (topk), ``rank`` and ``start_iter`` (powersgd; start_iter
    also for topk).

    Raises:
        ValueError: unknown name.
    """
    if name not in HOOKS:
        raise ValueError(f"unknown comm hook {name!r}: use one of {', '.join(HOOKS)}")
    hook = HOOKS[name]
    if name == "none":
        return None, None
    if name == "topk":
        return TopKState(ratio=options.get("ratio", 0.01),
                         start_iter=options.get("start_iter", 0)), hook
    if name == "powersgd":
        return PowerSGDState(matrix_approximation_rank=options.get("rank", 1),
                             start_powerSGD_iter=max(2, options.get("start_iter", 2))), hook
    return HookState(), hook


def torch_equivalent(state: Any, hook: Callable) -> tuple[Any, Callable] | None:
    """mpiring's ``(state, hook)`` for a hook of torch's ``ddp_comm_hooks``, or None.

    torch's hooks call torch.distributed on its default process group, which
    mpiring's DDP does not use; their namesakes here give the same numbers on
    ``bucket.comm``: the default hooks (the state, a process group, becomes
    None), ``noop_hook``, ``powerSGD_hook`` (torch's ``PowerSGDState`` becomes
    this module's, with its settings, counters, memories and random stream),
    and ``fp16/bf16_compress_wrapper`` around any of these or around a hook of
    the user's own. Others (``batched_powerSGD_hook``, post-localSGD) have none.
    """
    module = getattr(hook, "__module__", None) or ""
    name = getattr(hook, "__name__", "")
    if not module.startswith("torch.distributed.algorithms.ddp_comm_hooks"):
        return None
    if name in ("fp16_compress_wrapper_hook", "bf16_compress_wrapper_hook"):
        # torch's wrapper is a closure over the hook it wraps: map that one.
        cells = dict(zip(hook.__code__.co_freevars,
                         (c.cell_contents for c in hook.__closure__ or ())))
        inner = cells.get("hook")
        if inner is None:
            return None
        mapped = torch_equivalent(state, inner)
        if mapped is None:
            if (getattr(inner, "__module__", None) or "").startswith("torch.distributed"):
                return None
            mapped = (state, inner)  # the user's own hook, written for bucket.comm
        wrap = fp16_compress_wrapper if name.startswith("fp16") else bf16_compress_wrapper
        return mapped[0], wrap(mapped[1])
    if module.endswith(".default_hooks") and name in (
            "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        return None, globals()[name]
    if module.endswith(".debugging_hooks") and name == "noop_hook":
        return None, noop_hook
    if module.endswith(".powerSGD_hook") and name == "powerSGD_hook":
        return _TorchPowerSGDState(state), powerSGD_hook
    return None


class _TorchPowerSGDState(PowerSGDState):
    """torch's PowerSGDState as powerSGD_hook here reads it: its settings, and its own
    memories and random stream (the same objects), its ``iter`` kept up to date, so that
    the user's object follows training (``torch.save(state)`` as with torch's DDP)."""

    def __init__(self, theirs: Any):
        if not all(hasattr(theirs, a) for a in ("matrix_approximation_rank", "rng", "iter",
                                                 "error_dict")):
            raise TypeError(f"powerSGD_hook's state is {type(theirs).__name__}: pass torch's "
                            "PowerSGDState (or mpiring's with mpiring's powerSGD_hook)")
        super().__init__(
            matrix_approximation_rank=theirs.matrix_approximation_rank,
            start_powerSGD_iter=theirs.start_powerSGD_iter,
            min_compression_rate=theirs.min_compression_rate,
            use_error_feedback=theirs.use_error_feedback, warm_start=theirs.warm_start,
            orthogonalization_epsilon=theirs.orthogonalization_epsilon,
            compression_stats_logging_frequency=theirs.compression_stats_logging_frequency,
            batch_tensors_with_same_shape=theirs.batch_tensors_with_same_shape)
        self.theirs = theirs
        # The stream's position, not only its seed: a state already used (or loaded)
        # draws its next Qs where torch's would. Memories in torch's layout: one flat
        # tensor per bucket, the matrices grouped by shape.
        self.rng, self.iter = theirs.rng, theirs.iter
        self.errors, self.p_memory = theirs.error_dict, theirs.p_memory_dict
        self.q_memory = theirs.q_memory_dict

    def _next_iter(self, bucket: GradBucket) -> None:
        super()._next_iter(bucket)
        self.theirs.iter = self.iter


def run_comm_hook(state: Any, hook: Callable, comm, bucket_index: int, flat: torch.Tensor,
                  numel: int, params: Sequence[torch.Tensor], offsets: Sequence[int],
                  is_last: bool, tail: int | None, iteration: int, *,
                  algo: str = DEFAULT_BUCKET_ALGO) -> None:
    """Reduce one reducer bucket through ``hook`` (called on the communication thread).

    The hook sees only the gradients (``flat[:numel]``); the reducer's status
    tail, if this bucket has one, is summed exactly with a plain AllReduce of
    its own, since a compressing hook would corrupt the counts it carries
    (``allreduce_hook`` sums it with the gradients instead, as the reducer does
    without a hook, so that the ring cuts the same chunks). The mean gradient
    ends up in ``flat[:numel]``.
    """
    buffer = flat[:numel]
    grad_bucket = GradBucket(bucket_index, buffer, params, offsets, is_last, comm, iteration,
                             whole=flat if tail is not None else None, algo=algo)
    try:
        result = hook(state, grad_bucket)
        if hasattr(result, "wait"):
            result = result.wait()
            if isinstance(result, (list, tuple)):
                result = result[0]
    except Exception as exc:
        # Raised on the communication thread, it reaches the user at the end of
        # backward as "communication thread failed: ..."; name the hook and the bucket,
        # and what the ranks where it did not raise are doing.
        raise RuntimeError(
            f"comm hook {_name(hook)!r} raised {type(exc).__name__} on bucket {bucket_index} "
            f"(rank {comm.rank}): {exc}. A rank where it did not raise waits in the hook's "
            "collectives: end the job (an uncaught exception aborts every rank)") from exc
    if not isinstance(result, torch.Tensor) or result.numel() != numel:
        raise TypeError(f"comm hook {getattr(hook, '__name__', hook)!r} returned "
                        f"{type(result).__name__} for bucket {bucket_index}: return the reduced "
                        f"gradient, a tensor of {numel} elements like bucket.buffer()")
    if result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result.reshape(-1))
    if tail is not None and comm.size > 1 and not grad_bucket._tail_summed:
        comm.all_reduce(flat[tail:], op="sum", check=False)
