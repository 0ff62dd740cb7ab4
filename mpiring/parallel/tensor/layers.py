"""Megatron's column- and row-parallel linear layers on mpiring's collectives.

    Y = X A + b,  A = [A_1 ... A_K] (columns):  rank r computes Y_r = f(X) A_r + b_r
    Z = Y B + c,  B = [B_1; ...; B_K] (rows):   Z = g(sum_r Y_r B_r) + c

(Shoeybi et al. 2019, equations 2-3.) A transformer MLP is a column layer, GELU
and a row layer: one AllReduce in forward (``g``) and one in backward (``f``).
Weights are stored as torch's ``nn.Linear`` stores them, ``(out, in)``: a column
layer keeps rows of the weight, a row layer keeps columns.

Splits follow numpy.array_split over ``unit``-sized groups of features (``unit``
= head_dim splits attention heads whole) in each of ``blocks`` equal parts (3 for
a fused QKV weight, whose q, k and v are split separately): no size has to
divide by the number of ranks.

Initialisation draws the full weight exactly as ``nn.Linear`` does, from torch's
generator, then keeps this rank's slice: seeded alike, every tensor-parallel
size starts from the same full weights (and equals a plain ``nn.Linear``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from mpiring.comm.algos import ALGOS
from mpiring.core.chunking import chunk_bounds
from mpiring.core.errors import MismatchError
from mpiring.parallel.tensor.operators import (
    all_gather_forward_reduce_scatter_backward,
    all_gather_forward_split_backward,
    all_reduce_in_backward,
    all_reduce_in_forward,
    reduce_scatter_forward_all_gather_backward,
    split_forward_all_gather_backward,
    split_sizes,
)


def shard_ranges(n: int, parts: int, rank: int, blocks: int = 1,
                 unit: int = 1) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` feature ranges rank ``rank`` of ``parts`` holds of ``n`` features.

    ``n`` is ``blocks`` equal parts, each split by numpy.array_split over whole
    groups of ``unit`` features. Pure: the same on every rank.

    Raises:
        ValueError: ``n`` is not a multiple of ``blocks * unit``.
    """
    if blocks < 1 or unit < 1 or n % (blocks * unit):
        raise ValueError(f"{n} features cannot be cut into {blocks} block(s) of whole groups of "
                         f"{unit}: choose sizes with n % (blocks * unit) == 0")
    per = n // blocks
    lo, hi = chunk_bounds(per // unit, parts)[rank]
    return [(b * per + lo * unit, b * per + hi * unit) for b in range(blocks)]


def _take(t: torch.Tensor, dim: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)


def _check_comm(comm, algo: str, layer: str, calls: Sequence[str] = ("all_reduce",)) -> None:
    """Refuse a non-Communicator, or an ``algo`` that one of ``calls`` does not offer.

    ``calls``: the collectives ``layer`` (its configuration, as text) runs in
    forward and backward. Checked here, at construction: the Communicator would
    refuse the algorithm only at the first step, mid-forward or mid-backward.
    """
    if not (hasattr(comm, "all_reduce") and hasattr(comm, "size")):
        raise TypeError(f"comm={comm!r}: pass an mpiring Communicator (mpiring.init(), or "
                        "comm.split(...) for the tensor-parallel group)")
    if not isinstance(algo, str):
        raise TypeError(f"algo={algo!r}: pass the name of an algorithm, e.g. 'ring'")
    calls = list(dict.fromkeys(calls))  # in order, once each
    missing = [c for c in calls if algo not in ALGOS[c]]
    if missing:
        fits = [a for a in ALGOS[calls[0]] if all(a in ALGOS[c] for c in calls)]
        raise ValueError(f"algo={algo!r}: {layer} calls {', '.join(calls)}, and {algo!r} is not "
                         f"an algorithm of {' or '.join(missing)}: use one of {', '.join(fits)}")


def sequence_sizes(seq_len: int | None, comm) -> list[int] | None:
    """Each rank's rows of a sequence of ``seq_len`` tokens (None: an even split)."""
    return None if seq_len is None else split_sizes(seq_len, comm.size)


class SharesCommOnCopy:
    """Mixin for a module that holds its group's Communicator as ``self.comm``:
    ``copy.deepcopy`` (``torch.optim.swa_utils.AveragedModel``, an EMA or reference
    copy) shares the Communicator instead of copying it.

    A Communicator is a handle to a group of processes, not data: it cannot be
    copied (MPI's communicators do not pickle), and a copy of the model must talk
    over the same group, as the model's other ranks hold its other shards.
    """

    def __deepcopy__(self, memo):
        memo.setdefault(id(self.comm), self.comm)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        # nn.Module's own pickling state, deep-copied: what deepcopy does by default.
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new


class _ShardedLinear(SharesCommOnCopy, nn.Module):
    """Shared parts: the full layer's init, slicing and ``from_full``."""

    #: Which dimension of the (out, in) weight is split: 0 rows (column layer), 1 columns (row).
    split_dim = 0

    def __init__(self, in_features: int, out_features: int, comm, bias: bool, algo: str,
                 blocks: int, unit: int, dtype, device, full: nn.Linear | None,
                 layer: str, calls: Sequence[str]):
        super().__init__()
        _check_comm(comm, algo, layer, calls)
        self.in_features, self.out_features = in_features, out_features
        self.comm, self.algo = comm, algo
        split = out_features if self.split_dim == 0 else in_features
        self.ranges = shard_ranges(split, comm.size, comm.rank, blocks, unit)
        self.sizes = [sum(hi - lo for lo, hi in shard_ranges(split, comm.size, r, blocks, unit))
                      for r in range(comm.size)]
        if full is None:
            # Drawn whole so that the slice equals nn.Linear's at any number of ranks.
            full = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
        # dtype= and device= apply to a given full layer too (from_full): its slice is
        # converted, as nn.Linear(..., dtype=, device=) would have built it.
        # A slice of a frozen parameter stays frozen (fine-tuning freezes layers first).
        self.weight = nn.Parameter(self.shard("weight", full.weight).to(dtype=dtype, device=device),
                                   requires_grad=full.weight.requires_grad)
        if bias:
            self.bias = nn.Parameter(self.shard("bias", full.bias).to(dtype=dtype, device=device),
                                     requires_grad=full.bias.requires_grad)
        else:
            self.register_parameter("bias", None)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full parameter (or of its gradient) named ``name``."""
        if name == "bias" and self.split_dim == 1:
            return full.detach().clone()  # a row layer's bias is added after the sum: whole
        dim = 0 if name == "bias" else self.split_dim
        return _take(full.detach(), dim, self.ranges).clone()

    @classmethod
    def from_full(cls, full: nn.Linear, comm, **options):
        """This rank's slice of ``full`` (an ``nn.Linear``) as a parallel layer; ``dtype=``
        and ``device=`` in ``options`` convert the slice."""
        if not isinstance(full, nn.Linear):
            raise TypeError(f"from_full takes an nn.Linear, got {type(full).__name__}")
        return cls(full.in_features, full.out_features, comm, bias=full.bias is not None,
                   _full=full, **options)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, ranks={self.comm.size}, "
                f"local weight={tuple(self.weight.shape)}, algo={self.algo}")


class ColumnParallelLinear(_ShardedLinear):
    """``Y = X A + b`` with ``A``'s output columns split over the ranks of ``comm``.

    Args:
        in_features, out_features: the full layer's sizes.
        comm: the tensor-parallel Communicator.
        bias: a bias (split with the columns).
        gather_output: all-gather the output so every rank holds all of ``Y``
            (default: each keeps its columns, the input of a row layer).
        sequence_parallel: the input is this rank's rows of a sequence-first
            ``[s, b, h]`` tensor: all-gather it (reduce-scatter in backward)
            instead of ``f``. Pass ``seq_len`` to ``forward`` when ``s`` does not
            divide by the number of ranks.
        algo: the collectives' algorithm: one that every collective this
            configuration calls offers (checked here).
        blocks, unit: how the output features split (see ``shard_ranges``).
    """

    split_dim = 0

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, *,
                 algo: str = "ring", blocks: int = 1, unit: int = 1, dtype=None, device=None,
                 _full: nn.Linear | None = None):
        if gather_output and blocks != 1:
            raise ValueError("gather_output=True with blocks > 1 would interleave the blocks: "
                             "gather each block's output yourself, or use blocks=1")
        # What forward and backward (and a second derivative) will call.
        calls = ["all_gather", "reduce_scatter"] if sequence_parallel else ["all_reduce"]
        calls += ["all_gather"] if gather_output else []
        layer = (f"ColumnParallelLinear(sequence_parallel={sequence_parallel}, "
                 f"gather_output={gather_output})")
        super().__init__(in_features, out_features, comm, bias, algo, blocks, unit, dtype,
                         device, _full, layer, calls)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            try:
                x = all_gather_forward_reduce_scatter_backward(
                    x, self.comm, 0, sequence_sizes(seq_len, self.comm), self.algo)
            except MismatchError as exc:
                if seq_len is not None:
                    raise
                # Without seq_len the shards are taken as even: array_split shards of an
                # uneven length differ in size, which the AllGather's argument check finds
                # on every rank. Said with the fix rather than derived, because learning
                # the sizes would cost one more collective on every forward.
                raise MismatchError(
                    f"{exc}. ColumnParallelLinear(sequence_parallel=True) without seq_len "
                    "takes every rank's shard of the sequence to be the same length: if "
                    "the ranks hold an uneven split, pass forward(x, seq_len=s) with the "
                    "full sequence length s") from exc
        else:
            x = all_reduce_in_backward(x, self.comm, self.algo)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = all_gather_forward_split_backward(y, self.comm, -1, self.sizes, self.algo)
        return y


class RowParallelLinear(_ShardedLinear):
    """``Z = Y B + c`` with ``B``'s input rows split over the ranks; the partial sums are reduced.

    Args:
        in_features, out_features: the full layer's sizes.
        comm: the tensor-parallel Communicator.
        bias: a bias, whole on every rank and added once, after the reduction
            (added before it, it would count ``K`` times).
        input_is_parallel: the input is already this rank's features (a column
            layer's output); else it is split here (all-gather in backward).
        sequence_parallel: reduce-scatter the output along the sequence (dim 0
            of ``[s, b, h]``) instead of all-reducing it.
        algo: the collectives' algorithm.
        blocks, unit: how the input features split (see ``shard_ranges``).
    """

    split_dim = 1

    def __init__(self, in_features: int, out_features: int, comm, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, *,
                 algo: str = "ring", blocks: int = 1, unit: int = 1, dtype=None, device=None,
                 _full: nn.Linear | None = None):
        if not input_is_parallel and blocks != 1:
            raise ValueError("input_is_parallel=False with blocks > 1: split the input "
                             "yourself, or use blocks=1")
        # What forward and backward (and a second derivative) will call; under SP the
        # bias's gradient is summed by an AllReduce.
        calls = [] if input_is_parallel else ["all_gather"]
        calls += (["reduce_scatter", "all_gather"] + (["all_reduce"] if bias else [])
                  if sequence_parallel else ["all_reduce"])
        layer = (f"RowParallelLinear(input_is_parallel={input_is_parallel}, "
                 f"sequence_parallel={sequence_parallel}, bias={bias})")
        super().__init__(in_features, out_features, comm, bias, algo, blocks, unit, dtype,
                         device, _full, layer, calls)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_width(x)
        if not self.input_is_parallel:
            x = split_forward_all_gather_backward(x, self.comm, -1, self.sizes, self.algo)
        y = F.linear(x, self.weight)
        bias = self.bias
        if self.sequence_parallel:
            y = reduce_scatter_forward_all_gather_backward(y, self.comm, 0, None, self.algo)
            if bias is not None:
                # Each rank adds the bias to its own rows only: the full gradient is the sum.
                bias = all_reduce_in_backward(bias, self.comm, self.algo)
        else:
            y = all_reduce_in_forward(y, self.comm, self.algo)
        # Under autocast F.linear gives the autocast dtype while the bias keeps its own:
        # add it in y's dtype, as nn.Linear (bias inside the autocast GEMM) returns.
        return y if bias is None else y + bias.to(y.dtype)

    def _check_width(self, x: torch.Tensor) -> None:
        """Refuse an input of the wrong width on every rank, before the output's collective."""
        want = self.weight.shape[1] if self.input_is_parallel else self.in_features
        if x.shape[-1] == want:
            return
        if not self.input_is_parallel:
            takes = f"the layer (input_is_parallel=False) takes all {want}"
            hint = "pass the full input, the same on every rank"
        else:
            takes = f"this rank's rows of the weight take {want} of {self.in_features}"
            hint = ("for the full input, build the layer with input_is_parallel=False"
                    if x.shape[-1] == self.in_features and self.comm.size > 1 else
                    "pass this rank's features (a ColumnParallelLinear's output, split as "
                    "shard_ranges splits them)")
        error = ValueError(f"r{self.comm.rank}: RowParallelLinear: the input has "
                           f"{x.shape[-1]} features, {takes}: {hint}")
        # Found on this rank, maybe on it alone (a shard cut another way than array_split,
        # e.g. torch.chunk): refused through the argument check of the collective the
        # other ranks are about to enter, so every rank raises instead of waiting.
        self.comm.refuse("reduce_scatter" if self.sequence_parallel else "all_reduce", error)
