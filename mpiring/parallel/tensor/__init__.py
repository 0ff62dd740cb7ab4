"""Tensor parallelism (Megatron-LM's column and row split) on mpiring's collectives.

    from mpiring.parallel.tensor import ColumnParallelLinear, RowParallelLinear
    fc = ColumnParallelLinear(d, 4 * d, tp_comm)        # f: AllReduce in backward
    out = RowParallelLinear(4 * d, d, tp_comm)          # g: AllReduce in forward
    y = out(F.gelu(fc(x)))                              # x and y replicated on the group

``operators`` holds the conjugate autograd Functions, ``layers`` the linear
layers, ``embedding`` and ``loss`` the vocabulary-parallel embedding and
cross-entropy, ``random`` the two dropout RNG streams.
"""

from __future__ import annotations

from mpiring.parallel.tensor.embedding import VocabParallelEmbedding, vocab_range
from mpiring.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_ranges
from mpiring.parallel.tensor.loss import vocab_parallel_cross_entropy
from mpiring.parallel.tensor.operators import (
    AllGatherForwardReduceScatterBackward,
    AllGatherForwardSplitBackward,
    AllReduceInBackward,
    AllReduceInForward,
    ReduceScatterForwardAllGatherBackward,
    SplitForwardAllGatherBackward,
    all_gather_forward_reduce_scatter_backward,
    all_gather_forward_split_backward,
    all_reduce_in_backward,
    all_reduce_in_forward,
    reduce_scatter_forward_all_gather_backward,
    split_forward_all_gather_backward,
    split_sizes,
)
from mpiring.parallel.tensor.random import (
    RNGStreams,
    check_recompute,
    checkpoint_contexts,
    get_rng_states,
    named_rng_streams,
    replay_rng_states,
    set_rng_states,
)

__all__ = [
    "AllGatherForwardReduceScatterBackward", "AllGatherForwardSplitBackward",
    "AllReduceInBackward", "AllReduceInForward", "ColumnParallelLinear", "RNGStreams",
    "ReduceScatterForwardAllGatherBackward", "RowParallelLinear",
    "SplitForwardAllGatherBackward", "VocabParallelEmbedding",
    "all_gather_forward_reduce_scatter_backward", "all_gather_forward_split_backward",
    "all_reduce_in_backward", "all_reduce_in_forward", "check_recompute", "checkpoint_contexts",
    "get_rng_states", "named_rng_streams", "reduce_scatter_forward_all_gather_backward",
    "replay_rng_states", "set_rng_states", "shard_ranges", "split_forward_all_gather_backward",
    "split_sizes", "vocab_parallel_cross_entropy", "vocab_range",
]
