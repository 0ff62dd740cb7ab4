"""Cross-entropy over logits whose vocabulary is split over the ranks (Megatron's).

With ``z`` a token's logits split as ``[z_1 ... z_K]`` over ``C`` classes and
``t`` its target:

    m = max_r max(z_r)                     AllReduce(max): the global max, for stability
    S = sum_r sum(exp(z_r - m))            \\
    z_t - m (on the rank that owns t)       > AllReduce(sum), packed into one buffer
    Z = sum_r sum(z_r - m)                 /   (Z only with label smoothing)
    loss = log S - (1 - e) (z_t - m) - (e / C) Z

which is ``F.cross_entropy(z, t, label_smoothing=e)``. Backward is local:
``d loss / d z_r = softmax(z)_r - (1 - e) onehot(t)_r - e / C``, and each rank
has its own part of every term. The full logits never exist on any rank.
Tokens whose target is ``ignore_index`` add nothing and are left out of the mean,
as in torch.
"""

from __future__ import annotations

import torch

from mpiring.parallel.tensor.embedding import vocab_range

REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, comm, vocab_size, algo, ignore_index, smoothing, reduction):
        lo, hi = vocab_range(vocab_size, comm)
        # Found on this rank, maybe on it alone: refused through the max AllReduce's
        # argument check below, so that every rank raises.
        if logits.shape[-1] != hi - lo:
            comm.refuse("all_reduce", ValueError(
                f"r{comm.rank}: local logits have {logits.shape[-1]} classes, this rank owns "
                f"[{lo}, {hi}) of vocab_size={vocab_size}: pass the logits of this rank's "
                "vocabulary rows"))
        if target.shape != logits.shape[:-1]:
            comm.refuse("all_reduce", ValueError(
                f"target shape {tuple(target.shape)} does not match the logits' "
                f"{tuple(logits.shape[:-1])}: one target per row of logits"))
        # 16-bit logits are summed in float32, as Megatron does: exp-sums over a
        # 50k vocabulary lose most of bfloat16's 8 bits. The gradient goes back
        # in the logits' dtype; the loss stays float32.
        z = logits.detach()
        if z.dtype in (torch.float16, torch.bfloat16):
            z = z.float()
        ctx.dtype = logits.dtype
        ignored = target == ignore_index
        # A target outside the vocabulary would be "owned" by no rank and give a
        # silently wrong loss: its flag rides in the max AllReduce's last slot, so
        # every rank raises together (the ranks' targets need not be identical).
        bad = ((target < 0) | (target >= vocab_size)) & ~ignored
        peak = z.new_full((target.numel() + 1,), float("-inf"))
        if hi > lo:  # a rank that owns no classes does not raise the max
            peak[:-1] = z.amax(dim=-1).reshape(-1)
        peak[-1] = 1.0 if bool(bad.any()) else 0.0
        comm.all_reduce(peak, op="max", algo=algo)
        if peak[-1] > 0:
            raise ValueError(f"a target is outside [0, {vocab_size}) and is not ignore_index="
                             f"{ignore_index} on some rank: pass class ids of the full "
                             "vocabulary")
        peak = peak[:-1].view(z.shape[:-1])
        shifted = z - peak.unsqueeze(-1)
        outside = (target < lo) | (target >= hi)
        local = (target - lo).masked_fill(outside, 0)
        exp = shifted.exp()
        # On the logits' device (and dtype): a buffer on torch's default device would
        # meet CUDA logits on the CPU, and the loss would come back there too.
        packed = z.new_zeros((3 if smoothing else 2, *peak.shape))
        packed[0] = exp.sum(dim=-1)
        if hi > lo:
            packed[1] = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
            if smoothing:
                packed[2] = shifted.sum(dim=-1)
        comm.all_reduce(packed, op="sum", algo=algo)
        losses = packed[0].log() - (1.0 - smoothing) * packed[1]
        if smoothing:
            losses -= (smoothing / vocab_size) * packed[2]
        losses = losses.masked_fill(ignored, 0.0)
        exp.div_(packed[0].unsqueeze(-1))  # the softmax, kept for backward
        ctx.save_for_backward(exp, local, outside, ignored)
        ctx.smoothing, ctx.vocab_size, ctx.reduction = smoothing, vocab_size, reduction
        if reduction == "none":
            return losses
        if reduction == "sum":
            return losses.sum()
        # torch's mean over the tokens that count: 0/0 = nan when every one is ignored.
        ctx.count = int((~ignored).sum())
        return losses.sum() / ctx.count if ctx.count else losses.sum() / 0.0

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph=True: this backward builds no graph
            raise RuntimeError("vocab_parallel_cross_entropy has no second derivative "
                               "(create_graph=True): its gradient would count as a constant")
        softmax, local, outside, ignored = ctx.saved_tensors
        g = softmax.clone()
        if g.shape[-1]:
            hit = (~outside).to(g.dtype).unsqueeze(-1) * (1.0 - ctx.smoothing)
            g.scatter_add_(-1, local.unsqueeze(-1), -hit)
            if ctx.smoothing:
                g -= ctx.smoothing / ctx.vocab_size
        if ctx.reduction == "none":
            scale = grad.unsqueeze(-1)
        elif ctx.reduction == "sum":
            scale = grad
        else:
            scale = grad / ctx.count if ctx.count else grad * float("nan")
        g = (g * scale).masked_fill(ignored.unsqueeze(-1), 0.0)
        return g.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, comm, *,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean",
                                 algo: str = "ring") -> torch.Tensor:
    """Cross-entropy of logits split by vocabulary over ``comm``; equals ``F.cross_entropy``.

    Args:
        local_logits: ``[..., V_r]``, this rank's classes (numpy.array_split of
            the vocabulary: a ``VocabParallelEmbedding``'s rows, or a column layer's
            output).
        target: ``[...]`` int64 class ids in ``[0, vocab_size)``, or ``ignore_index``.
        comm: the tensor-parallel Communicator.
        vocab_size: the full vocabulary (default: the local sizes summed, which
            costs one more small AllReduce).
        ignore_index: targets with this value add nothing and do not count in
            the mean (torch's default, -100).
        label_smoothing: torch's ``label_smoothing`` in ``[0, 1]``: the target
            is ``(1 - e)`` one-hot plus ``e`` spread evenly over the vocabulary.
        reduction: ``"mean"`` (over the tokens not ignored), ``"sum"`` or
            ``"none"`` (one loss per token, 0 where ignored; Megatron's form, for
            a loss mask of your own).
        algo: the collectives' algorithm.

    Returns:
        The reduced loss (or per-token losses), the same on every rank. Two
        AllReduces in forward (max, then the packed sums); none in backward.

    Raises:
        ValueError: on every rank, before the sums, if a target lies outside the
            vocabulary on any rank; at once for a bad ``reduction`` or smoothing.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: use one of {', '.join(REDUCTIONS)}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}: use a value in [0, 1]")
    if vocab_size is None:
        # Beside the logits: NCCL moves device memory only.
        n = torch.tensor([local_logits.shape[-1]], dtype=torch.int64, device=local_logits.device)
        vocab_size = int(comm.all_reduce(n, op="sum", algo=algo)[0])
    return _VocabParallelCrossEntropy.apply(local_logits, target, comm, vocab_size, algo,
                                            int(ignore_index), float(label_smoothing), reduction)
