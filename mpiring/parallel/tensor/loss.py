"""Cross-entropy over logits whose vocabulary is split over the ranks (Megatron's).

With ``z`` a token's logits split as ``[z_1 ... z_K]`` and ``t`` its target:

    m = max_r max(z_r)                     AllReduce(max): the global max, for stability
    S = sum_r sum(exp(z_r - m))            AllReduce(sum) \\ packed into one
    z_t = the target's logit (one rank)    AllReduce(sum) /   buffer: one call
    loss = log S - (z_t - m)

Backward is local: ``d loss / d z_r = softmax(z)_r - onehot(t)_r``, and each rank
has its own part of both. The full logits never exist on any rank.
"""

from __future__ import annotations

import torch

from mpiring.parallel.tensor.embedding import vocab_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, comm, vocab_size, algo):
        lo, hi = vocab_range(vocab_size, comm)
        if logits.shape[-1] != hi - lo:
            raise ValueError(f"r{comm.rank}: local logits have {logits.shape[-1]} classes, this "
                             f"rank owns [{lo}, {hi}) of vocab_size={vocab_size}: pass the "
                             "logits of this rank's vocabulary rows")
        if target.shape != logits.shape[:-1]:
            raise ValueError(f"target shape {tuple(target.shape)} does not match the logits' "
                             f"{tuple(logits.shape[:-1])}: one target per row of logits")
        z = logits.detach()
        if hi > lo:
            peak = z.amax(dim=-1).contiguous()
        else:  # this rank owns no classes: it does not raise the max
            peak = z.new_full(z.shape[:-1], float("-inf"))
        comm.all_reduce(peak, op="max", algo=algo)
        shifted = z - peak.unsqueeze(-1)
        outside = (target < lo) | (target >= hi)
        local = (target - lo).masked_fill(outside, 0)
        exp = shifted.exp()
        packed = torch.stack([exp.sum(dim=-1), torch.zeros_like(peak)])
        if hi > lo:
            packed[1] = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(packed, op="sum", algo=algo)
        sum_exp, target_logit = packed[0], packed[1]
        losses = sum_exp.log() - target_logit
        exp.div_(sum_exp.unsqueeze(-1))  # the softmax, kept for backward
        ctx.save_for_backward(exp, local, outside)
        ctx.count = losses.numel()
        return losses.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        if g.shape[-1]:
            hit = (~outside).to(g.dtype).unsqueeze(-1)
            g.scatter_add_(-1, local.unsqueeze(-1), -hit)
        return g * (grad / ctx.count), None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, comm, *,
                                 vocab_size: int | None = None,
                                 algo: str = "ring") -> torch.Tensor:
    """Mean cross-entropy of logits split by vocabulary over ``comm``; equals ``F.cross_entropy``.

    Args:
        local_logits: ``[..., V_r]``, this rank's classes (numpy.array_split of
            the vocabulary: a ``VocabParallelEmbedding``'s rows, or a column layer's
            output).
        target: ``[...]`` int64 class ids in ``[0, vocab_size)``.
        comm: the tensor-parallel Communicator.
        vocab_size: the full vocabulary (default: the local sizes summed, which
            costs one more small AllReduce).
        algo: the collectives' algorithm.

    Returns:
        The mean over all tokens, the same on every rank. Two AllReduces in
        forward (max, then the packed sums); none in backward.
    """
    if vocab_size is None:
        n = torch.tensor([local_logits.shape[-1]], dtype=torch.int64)
        vocab_size = int(comm.all_reduce(n, op="sum", algo=algo)[0])
    return _VocabParallelCrossEntropy.apply(local_logits, target, comm, vocab_size, algo)
