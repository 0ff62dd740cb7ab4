"""The vocabulary-parallel embedding: each rank owns a range of the vocabulary's rows.

    rows [lo, hi) on rank r  (numpy.array_split of num_embeddings over K ranks)
    out_r = E_r[id - lo] where lo <= id < hi, else 0;   out = g(sum_r out_r)

A token's vector lives on exactly one rank, so the sum over ranks (``g``'s
AllReduce, or a ReduceScatter along the sequence under sequence parallelism)
is the lookup in the full table. Backward needs no communication: the gradient
of the output is the same on every rank and each keeps its own rows'.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.tensor.layers import SharesCommOnCopy, _check_comm
from mpiring.parallel.tensor.operators import (
    all_reduce_in_forward,
    reduce_scatter_forward_all_gather_backward,
)


def vocab_range(num_embeddings: int, comm) -> tuple[int, int]:
    """``(lo, hi)``: the vocabulary rows this rank of ``comm`` owns."""
    return chunk_bounds(num_embeddings, comm.size)[comm.rank]


class VocabParallelEmbedding(SharesCommOnCopy, nn.Module):
    """``nn.Embedding`` with its rows (the vocabulary) split over the ranks of ``comm``.

    Args:
        num_embeddings, embedding_dim: the full table's sizes.
        comm: the tensor-parallel Communicator.
        sequence_parallel: the input ids are sequence-first ``[s, b]`` and the
            output is this rank's rows ``[s_r, b, h]`` (a ReduceScatter instead
            of the AllReduce).
        algo: the collectives' algorithm.

    The default initialisation is ``nn.Embedding``'s, drawn whole from torch's
    generator and sliced, so it is the same at every number of ranks.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm, *,
                 sequence_parallel: bool = False, algo: str = "ring", dtype=None, device=None,
                 _full: nn.Embedding | None = None):
        super().__init__()
        _check_comm(comm, algo, f"VocabParallelEmbedding(sequence_parallel={sequence_parallel})",
                    ["reduce_scatter", "all_gather"] if sequence_parallel else ["all_reduce"])
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.comm, self.algo, self.sequence_parallel = comm, algo, sequence_parallel
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, comm)
        if _full is None:
            _full = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device=device)
        # dtype= and device= apply to a given full table too (from_full).
        self.weight = nn.Parameter(self.shard("weight", _full.weight).to(dtype=dtype,
                                                                        device=device),
                                   requires_grad=_full.weight.requires_grad)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full table (or of its gradient)."""
        return full.detach()[self.vocab_start:self.vocab_end].clone()

    @classmethod
    def from_full(cls, full: nn.Embedding, comm, **options) -> VocabParallelEmbedding:
        """This rank's rows of ``full`` (an ``nn.Embedding``); ``dtype=`` and ``device=``
        in ``options`` convert them."""
        if not isinstance(full, nn.Embedding):
            raise TypeError(f"from_full takes an nn.Embedding, got {type(full).__name__}")
        # Options that change the lookup or its gradient, and that this layer does not
        # reproduce: refused, not dropped, so that it still equals the full module.
        # (scale_grad_by_freq would count the other ranks' ids, looked up as row 0.)
        unsupported = [name for name, on in (
            ("padding_idx", full.padding_idx is not None), ("max_norm", full.max_norm is not None),
            ("scale_grad_by_freq", full.scale_grad_by_freq), ("sparse", full.sparse)) if on]
        if unsupported:
            one = len(unsupported) == 1
            raise ValueError(f"{' and '.join(unsupported)} {'is' if one else 'are'} not supported "
                             "by VocabParallelEmbedding: build the full nn.Embedding without "
                             f"{'it' if one else 'them'}")
        return cls(full.num_embeddings, full.embedding_dim, comm, _full=full, **options)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # An id no rank owns would come back as a zero vector; nn.Embedding raises. Not
        # on a GPU: reading the bounds back would stop the stream every step.
        if (ids.device.type == "cpu" and ids.numel()
                and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings)):
            # The group's ranks should hold the same ids, but a bad batch may reach one
            # rank only: refused through the argument check of the collective below, so
            # that every rank raises rather than the others waiting for this one.
            self.comm.refuse("reduce_scatter" if self.sequence_parallel else "all_reduce",
                             IndexError(f"r{self.comm.rank}: VocabParallelEmbedding: ids span "
                                        f"[{int(ids.min())}, {int(ids.max())}], outside [0, "
                                        f"{self.num_embeddings}): pass token ids of the full "
                                        "vocabulary"))
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        # Ids of other ranks look up row 0 and are zeroed after: one gather, no branches.
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        if self.weight.shape[0]:
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:  # fewer vocabulary rows than ranks: this rank owns none
            out = self.weight.new_zeros((*ids.shape, self.embedding_dim)) + self.weight.sum()
        if self.sequence_parallel:
            return reduce_scatter_forward_all_gather_backward(out, self.comm, 0, None, self.algo)
        return all_reduce_in_forward(out, self.comm, self.algo)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, "
                f"{self.vocab_end}) of {self.comm.size} ranks, algo={self.algo}")
