"""The conjugate operators of tensor parallelism, each a small autograd Function.

Megatron-LM (Shoeybi et al. 2019, section 3) calls the first two ``f`` and ``g``:
a column-parallel layer starts with ``f`` (identity forward, AllReduce of the
input gradient in backward) and a row-parallel layer ends with ``g`` (AllReduce
of the partial outputs in forward, identity backward). Sequence parallelism
(Korthikanti et al. 2022) splits ``g``'s AllReduce into its two halves: a
ReduceScatter along the sequence at the end of a row-parallel layer and an
AllGather at the start of the next column-parallel one, each with the other half
as its backward. Two more move a tensor in or out of the split along the last
(feature) dimension, for ``gather_output`` and ``input_is_parallel=False``.

    forward                      backward                       Megatron name
    identity                     AllReduce(sum)                 f
    AllReduce(sum)               identity                       g
    AllGather(dim)               ReduceScatter(dim)             g-bar (sequence)
    ReduceScatter(dim)           AllGather(dim)                 (row output, sequence)
    AllGather(dim)               keep own chunk                 gather_output
    keep own chunk               AllGather(dim)                 scatter the input

Every byte goes through the Communicator (``comm.all_reduce``/``all_gather``/
``reduce_scatter`` with the caller's ``algo``) on a detached contiguous copy, so
the operators run on both backends, are traced and deadline-checked. Splits
follow the collectives' numpy.array_split convention: rank r holds
``sizes[r]`` entries along ``dim``; uneven sizes are padded to the largest one
for the transfer (the flat collectives split by elements, not by rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpiring.core.chunking import chunk_bounds


def split_sizes(n: int, parts: int) -> list[int]:
    """Entries each of ``parts`` ranks holds of ``n`` (numpy.array_split: first n % parts get one more)."""
    return [hi - lo for lo, hi in chunk_bounds(n, parts)]


def _sizes(comm, x: torch.Tensor, dim: int, sizes: Sequence[int] | None, full: bool) -> list[int]:
    """Per-rank lengths along ``dim``; ``full``: ``x`` holds all of them (else rank's own)."""
    if sizes is None:
        # The full length is known: split it. Only the local one: assume an even split.
        return split_sizes(x.shape[dim], comm.size) if full else [x.shape[dim]] * comm.size
    sizes = [int(s) for s in sizes]
    if len(sizes) != comm.size or min(sizes) < 0:
        raise ValueError(f"sizes={sizes}: give one non-negative length per rank ({comm.size})")
    have = x.shape[dim]
    want = sum(sizes) if full else sizes[comm.rank]
    if have != want:
        raise ValueError(f"r{comm.rank}: the tensor has {have} entries along dim {dim}, sizes="
                         f"{sizes} say {want}: pass the sizes of the split that made it")
    return sizes


def _agreed_sizes(collective: str, comm, x, dim, sizes, full: bool) -> list[int]:
    """``_sizes``, where a tensor that does not fit (on this rank only, maybe) is refused
    through ``collective``'s argument check, so every rank raises, not this one alone."""
    try:
        return _sizes(comm, x, dim, sizes, full)
    except ValueError as exc:
        comm.refuse(collective, exc)
        raise


def _all_reduce(x: torch.Tensor, comm, algo: str) -> torch.Tensor:
    # A copy: the input may be saved by another backward or be a gradient in use.
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    comm.all_reduce(buf, op="sum", algo=algo)
    return buf


def _all_gather(x: torch.Tensor, comm, dim: int, sizes: list[int], algo: str) -> torch.Tensor:
    k, r = comm.size, comm.rank
    local = x.detach().movedim(dim, 0)
    width = max(sizes)
    # Rank r's rows go to slot r of a (K, width, ...) buffer: every slot has the
    # same size, so the collective's element-wise array_split puts each one whole.
    buf = local.new_zeros((k, width, *local.shape[1:]))
    buf[r, :sizes[r]] = local
    comm.all_gather(buf, algo=algo)
    if min(sizes) == width:
        full = buf.view(k * width, *local.shape[1:])
    else:
        full = torch.cat([buf[i, :sizes[i]] for i in range(k)])
    # Contiguous, as nn.Linear's output and Megatron's gather are: along the last
    # dim the moved view would refuse a caller's .view().
    return full.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, comm, dim: int, sizes: list[int], algo: str) -> torch.Tensor:
    k, r = comm.size, comm.rank
    full = x.detach().movedim(dim, 0)
    width = max(sizes)
    if min(sizes) == width:
        buf = full.clone(memory_format=torch.contiguous_format).view(k, width, *full.shape[1:])
    else:
        buf = full.new_zeros((k, width, *full.shape[1:]))
        start = 0
        for i, s in enumerate(sizes):
            buf[i, :s] = full[start:start + s]
            start += s
    comm.reduce_scatter(buf, op="sum", algo=algo)
    # A copy of this rank's slot only: keeping a view would keep all K slots alive,
    # which is the memory sequence parallelism exists to save.
    # One copy, laid out contiguously along ``dim`` (a moved view would refuse .view()).
    return buf[r, :sizes[r]].movedim(0, dim).clone(memory_format=torch.contiguous_format)


def _split(x: torch.Tensor, comm, dim: int, sizes: list[int]) -> torch.Tensor:
    start = sum(sizes[:comm.rank])
    return x.detach().narrow(dim, start, sizes[comm.rank]).clone(
        memory_format=torch.contiguous_format)


class AllReduceInBackward(torch.autograd.Function):
    """Megatron's ``f``: forward is the identity, backward all-reduces (sums) the gradient.

    At the input of a column-parallel layer: each rank's input gradient covers
    only its output columns; the full gradient is their sum.
    """

    @staticmethod
    def forward(ctx, x, comm, algo):
        ctx.comm, ctx.algo = comm, algo
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Each backward is its partner operator, applied: a second derivative
        # (create_graph=True) then runs the partner's own backward, not a detached sum.
        return AllReduceInForward.apply(grad, ctx.comm, ctx.algo), None, None


class AllReduceInForward(torch.autograd.Function):
    """Megatron's ``g``: forward all-reduces (sums) the partial outputs, backward is the identity.

    At the output of a row-parallel layer: every rank's product covers its rows
    of the weight; the output is their sum and its gradient is the same on all.
    """

    @staticmethod
    def forward(ctx, x, comm, algo):
        ctx.comm, ctx.algo = comm, algo
        return _all_reduce(x, comm, algo)

    @staticmethod
    def backward(ctx, grad):
        return AllReduceInBackward.apply(grad, ctx.comm, ctx.algo), None, None


class AllGatherForwardReduceScatterBackward(torch.autograd.Function):
    """Sequence parallel -> tensor parallel: AllGather along ``dim``; ReduceScatter in backward.

    The gathered tensor feeds a column-parallel layer, so every rank's gradient
    of it is partial: backward sums them and hands each rank its own rows.
    """

    @staticmethod
    def forward(ctx, x, comm, dim, sizes, algo):
        sizes = _agreed_sizes("all_gather", comm, x, dim, sizes, full=False)
        ctx.comm, ctx.dim, ctx.sizes, ctx.algo = comm, dim, sizes, algo
        return _all_gather(x, comm, dim, sizes, algo)

    @staticmethod
    def backward(ctx, grad):
        return (ReduceScatterForwardAllGatherBackward.apply(grad, ctx.comm, ctx.dim, ctx.sizes,
                                                            ctx.algo), None, None, None, None)


class ReduceScatterForwardAllGatherBackward(torch.autograd.Function):
    """Tensor parallel -> sequence parallel: ReduceScatter along ``dim``; AllGather in backward.

    The row-parallel output under sequence parallelism: half of ``g``'s
    AllReduce, each rank keeping its rows of the sum.
    """

    @staticmethod
    def forward(ctx, x, comm, dim, sizes, algo):
        sizes = _agreed_sizes("reduce_scatter", comm, x, dim, sizes, full=True)
        ctx.comm, ctx.dim, ctx.sizes, ctx.algo = comm, dim, sizes, algo
        return _reduce_scatter(x, comm, dim, sizes, algo)

    @staticmethod
    def backward(ctx, grad):
        return (AllGatherForwardReduceScatterBackward.apply(grad, ctx.comm, ctx.dim, ctx.sizes,
                                                            ctx.algo), None, None, None, None)


class AllGatherForwardSplitBackward(torch.autograd.Function):
    """AllGather along ``dim`` (a replicated result); backward keeps this rank's chunk.

    ``gather_output=True`` of a column-parallel layer: the gathered output's
    gradient is the same on every rank, so no communication is needed back.
    """

    @staticmethod
    def forward(ctx, x, comm, dim, sizes, algo):
        sizes = _agreed_sizes("all_gather", comm, x, dim, sizes, full=False)
        ctx.comm, ctx.dim, ctx.sizes, ctx.algo = comm, dim, sizes, algo
        return _all_gather(x, comm, dim, sizes, algo)

    @staticmethod
    def backward(ctx, grad):
        return (SplitForwardAllGatherBackward.apply(grad, ctx.comm, ctx.dim, ctx.sizes, ctx.algo),
                None, None, None, None)


class SplitForwardAllGatherBackward(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` (no communication); backward all-gathers.

    A replicated input entering a row-parallel layer (``input_is_parallel=False``).
    """

    @staticmethod
    def forward(ctx, x, comm, dim, sizes, algo):
        # No collective here to carry an error to the other ranks: a caller that knows
        # the next one refuses a bad width through it first (RowParallelLinear does).
        sizes = _sizes(comm, x, dim, sizes, full=True)
        ctx.comm, ctx.dim, ctx.sizes, ctx.algo = comm, dim, sizes, algo
        return _split(x, comm, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        return (AllGatherForwardSplitBackward.apply(grad, ctx.comm, ctx.dim, ctx.sizes, ctx.algo),
                None, None, None, None)


# --- the functional forms the layers call ------------------------------------------
def all_reduce_in_backward(x: torch.Tensor, comm, algo: str = "ring") -> torch.Tensor:
    """``f``: identity; the gradient is summed over ``comm`` in backward."""
    return AllReduceInBackward.apply(x, comm, algo)


def all_reduce_in_forward(x: torch.Tensor, comm, algo: str = "ring") -> torch.Tensor:
    """``g``: the sum of ``x`` over ``comm``; the gradient passes through."""
    return AllReduceInForward.apply(x, comm, algo)


def all_gather_forward_reduce_scatter_backward(x: torch.Tensor, comm, dim: int = 0,
                                               sizes: Sequence[int] | None = None,
                                               algo: str = "ring") -> torch.Tensor:
    """The chunks of every rank concatenated along ``dim`` (``sizes``: each rank's length,
    default an even split); backward reduce-scatters the gradient."""
    return AllGatherForwardReduceScatterBackward.apply(x, comm, dim, sizes, algo)


def reduce_scatter_forward_all_gather_backward(x: torch.Tensor, comm, dim: int = 0,
                                               sizes: Sequence[int] | None = None,
                                               algo: str = "ring") -> torch.Tensor:
    """This rank's chunk along ``dim`` of the sum over ``comm`` (``sizes`` default:
    numpy.array_split); backward all-gathers the gradient."""
    return ReduceScatterForwardAllGatherBackward.apply(x, comm, dim, sizes, algo)


def all_gather_forward_split_backward(x: torch.Tensor, comm, dim: int = -1,
                                      sizes: Sequence[int] | None = None,
                                      algo: str = "ring") -> torch.Tensor:
    """Every rank's chunk concatenated along ``dim``; backward keeps this rank's chunk."""
    return AllGatherForwardSplitBackward.apply(x, comm, dim, sizes, algo)


def split_forward_all_gather_backward(x: torch.Tensor, comm, dim: int = -1,
                                      sizes: Sequence[int] | None = None,
                                      algo: str = "ring") -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim``; backward all-gathers the gradient."""
    return SplitForwardAllGatherBackward.apply(x, comm, dim, sizes, algo)
