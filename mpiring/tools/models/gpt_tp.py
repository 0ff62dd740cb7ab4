"""The project's GPT, tensor-parallel: Megatron's split of every block over a TP group.

    attention: ln1 -> qkv (column, q/k/v split by whole heads) -> this rank's heads
               -> proj (row) -> + x             one AllReduce forward, one backward
    MLP:       ln2 -> fc (column) -> GELU -> out (row) -> + x      the same again
    ends:      tok is a VocabParallelEmbedding; the tied head multiplies by this
               rank's vocabulary rows; the loss is vocab_parallel_cross_entropy

Activations run sequence-first, ``[t, b, d]``, as Megatron's do, so that under
``sequence_parallel`` a rank's tokens are one contiguous block: the residual
stream, LayerNorms and dropout then hold ``t/K`` tokens per rank, every block's
AllReduce becomes a ReduceScatter (row output) plus an AllGather (column input),
and the replicated parameters that see only local tokens (LayerNorms, the
position table, the row layers' biases) sum their gradients over the group in
backward (``f`` applied to the parameter itself).

``TensorParallelGPT(cfg, comm)`` draws the full ``GPT(cfg)`` from torch's
generator and keeps this rank's slices, so every TP size starts from the same
model; ``from_full(gpt, comm)`` slices an existing one. Parameter names are the
full model's, and ``shard(name, full_tensor)`` cuts any full parameter (or
gradient) to this rank's part.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from mpiring.parallel.tensor import (
    ColumnParallelLinear,
    RNGStreams,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_gather_forward_reduce_scatter_backward,
    all_reduce_in_backward,
    check_recompute,
    split_sizes,
    vocab_parallel_cross_entropy,
)
from mpiring.parallel.tensor.layers import SharesCommOnCopy
from mpiring.tools.models.gpt import GPT, GPTConfig


class _Replicated(SharesCommOnCopy, nn.Module):
    """A LayerNorm whose parameters sum their gradients over the group under sequence parallelism."""

    def __init__(self, full: nn.LayerNorm, comm, sequence_parallel: bool, algo: str):
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach().clone(),
                                   requires_grad=full.weight.requires_grad)
        self.bias = nn.Parameter(full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
        self.shape, self.eps = full.normalized_shape, full.eps
        self.comm, self.sp, self.algo = comm, sequence_parallel, algo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.sp:
            w, b = (all_reduce_in_backward(p, self.comm, self.algo) for p in (w, b))
        return F.layer_norm(x, self.shape, w, b, self.eps)


#: GPT's names for the tied output layer -> the parameter that holds it here.
TIED = {"head.weight": "tok.weight"}

#: Seed distance between two blocks' streams: a prime above the tensor stream's offset
#: plus any tensor-parallel rank, so no block's stream starts where another's does.
BLOCK_SEED_STRIDE = 10007


class TensorParallelBlock(nn.Module):
    """One pre-norm block with its heads and MLP columns split over ``comm``."""

    def __init__(self, full, cfg: GPTConfig, comm, sp: bool, algo: str, streams: RNGStreams,
                 hidden_dropout: float):
        super().__init__()
        hd = cfg.d_model // cfg.n_heads
        opts = dict(sequence_parallel=sp, algo=algo)
        self.ln1 = _Replicated(full.ln1, comm, sp, algo)
        self.qkv = ColumnParallelLinear.from_full(full.qkv, comm, blocks=3, unit=hd, **opts)
        self.proj = RowParallelLinear.from_full(full.proj, comm, unit=hd, **opts)
        self.ln2 = _Replicated(full.ln2, comm, sp, algo)
        self.fc = ColumnParallelLinear.from_full(full.fc, comm, **opts)
        self.out = RowParallelLinear.from_full(full.out, comm, **opts)
        self.head_dim, self.n_local = hd, self.qkv.weight.shape[0] // (3 * hd)
        self.attn_dropout, self.hidden_dropout = cfg.dropout, hidden_dropout
        self.streams, self.sp = streams, sp

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.hidden_dropout):
            return x
        # Replicated rows draw alike on every rank; a sequence shard is this rank's own.
        # The generator forked is that of x's device: on a GPU, dropout draws from CUDA's.
        with self.streams.fork("tensor" if self.sp else "shared", x.device):
            return F.dropout(x, self.hidden_dropout)

    def forward(self, x: torch.Tensor, seq_len: int) -> torch.Tensor:
        # Alike on every rank, before the block's first collective (see check_recompute).
        check_recompute(self.training and bool(self.attn_dropout or self.hidden_dropout))
        h = self.qkv(self.ln1(x), seq_len=seq_len)                 # [t, b, 3 * heads_r * hd]
        t, b = h.shape[:2]
        q, k, v = h.view(t, b, 3, self.n_local, self.head_dim).permute(2, 1, 3, 0, 4)
        if self.n_local:
            p = self.attn_dropout if self.training else 0.0
            with self.streams.fork("tensor", q.device):  # this rank's heads: masks of its own
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        else:  # fewer heads than ranks: this rank has none and adds nothing
            att = q
        # The width spelled out: with an empty batch (b == 0) a -1 is ambiguous.
        width = self.n_local * self.head_dim
        x = x + self._drop(self.proj(att.permute(2, 0, 1, 3).reshape(t, b, width)))
        return x + self._drop(self.out(F.gelu(self.fc(self.ln2(x), seq_len=seq_len))))


class TensorParallelGPT(SharesCommOnCopy, nn.Module):
    """``GPT`` split over the tensor-parallel group ``comm``.

    Args:
        cfg: the model's shape (``n_heads`` may be fewer than the ranks).
        comm: the tensor-parallel Communicator.
        sequence_parallel: Korthikanti et al.'s sequence parallelism.
        hidden_dropout: dropout after each residual branch (Megatron's; the
            project's GPT has none, so 0 keeps the two models equal).
        seed: the dropout streams' shared seed (block i's streams start from
            ``seed + BLOCK_SEED_STRIDE * i``).
        algo: the collectives' algorithm.
        full: the full model to slice (default: drawn from torch's generator).

    ``forward(idx)`` takes ``[b, t]`` tokens and returns ``[b, t, V_r]``: the
    logits of this rank's vocabulary rows; ``loss(logits, targets)`` their mean
    cross-entropy (the same on every rank).
    """

    def __init__(self, cfg: GPTConfig, comm, *, sequence_parallel: bool = False,
                 hidden_dropout: float = 0.0, seed: int = 0, algo: str = "ring",
                 full: GPT | None = None):
        super().__init__()
        full = GPT(cfg) if full is None else full
        self.cfg, self.comm, self.algo, self.sp = full.cfg, comm, algo, sequence_parallel
        self.tok = VocabParallelEmbedding.from_full(full.tok, comm, sequence_parallel=sequence_parallel,
                                                    algo=algo)
        self.pos = nn.Embedding.from_pretrained(full.pos.weight.detach().clone(),
                                                freeze=not full.pos.weight.requires_grad)
        # Streams of its own per block, from the block's index: one stream for the
        # whole model would hand each pipeline stage's first block the masks of stage
        # 0's first block (every rank builds the model from the same seed), and the
        # masks would change with the pipeline split.
        self.blocks = nn.ModuleList(
            TensorParallelBlock(b, self.cfg, comm, sequence_parallel, algo,
                                RNGStreams(seed + BLOCK_SEED_STRIDE * i, comm.rank),
                                hidden_dropout) for i, b in enumerate(full.blocks))
        self.ln_f = _Replicated(full.ln_f, comm, sequence_parallel, algo)

    @classmethod
    def from_full(cls, gpt: GPT, comm, **options) -> TensorParallelGPT:
        """This rank's slices of ``gpt``."""
        return cls(gpt.cfg, comm, full=gpt, **options)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len="
                             f"{self.cfg.seq_len}: build the model with a larger seq_len")
        x = self.tok(idx.t())                                       # [t (or t_r), b, d]
        pos = self.pos.weight
        if self.sp:
            pos = all_reduce_in_backward(pos, self.comm, self.algo)  # each rank's rows differ
            lo = sum(split_sizes(t, self.comm.size)[:self.comm.rank])
            x = x + pos[lo:lo + x.shape[0]].unsqueeze(1)
        else:
            x = x + pos[:t].unsqueeze(1)
        for block in self.blocks:
            x = block(x, t)
        h = self.ln_f(x)
        if self.sp:
            h = all_gather_forward_reduce_scatter_backward(h, self.comm, 0,
                                                           split_sizes(t, self.comm.size), self.algo)
        else:
            h = all_reduce_in_backward(h, self.comm, self.algo)
        # Tied head, batch-first [b, t, V_r]. The (d-wide) activations are transposed
        # before the GEMM, not the (V_r-wide) logits after it: the logits come out
        # contiguous, as GPT's do, so a caller's logits.view(-1, V_r) works.
        return F.linear(h.transpose(0, 1), self.tok.weight)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of this rank's logits (collective over the group)."""
        return vocab_parallel_cross_entropy(logits, targets, self.comm,
                                            vocab_size=self.cfg.vocab_size, algo=self.algo)

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full model's parameter (or gradient) ``name``
        (``head.weight``, GPT's name of the tied output layer, is ``tok.weight``'s)."""
        name = TIED.get(name, name)
        owner, _, leaf = name.rpartition(".")
        module = self.get_submodule(owner) if owner else self
        cut = getattr(module, "shard", None)
        return cut(leaf, full) if cut is not None and module is not self else full.detach().clone()

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Load the full ``GPT``'s ``state_dict()``: each rank keeps its part (``shard``).

        No communication: every rank reads the whole state. GPT's ``state_dict`` holds
        the tied weight twice (``tok.weight`` and ``head.weight``); ``tok.weight`` is
        loaded, and ``head.weight`` must be the same tensor's values.

        Raises:
            ValueError: ``head.weight`` differs from ``tok.weight`` (an untied output
                layer, which this model cannot hold).
        """
        state = dict(state)
        for alias, name in TIED.items():
            if alias in state and name in state and not torch.equal(state[alias], state[name]):
                raise ValueError(f"{alias} differs from {name}: TensorParallelGPT ties the "
                                 "output layer to the embedding; load a GPT whose output "
                                 "layer is tied")
            if alias in state:
                state.setdefault(name, state[alias])
                del state[alias]
        mine = {}
        for k, v in state.items():
            try:
                mine[k] = self.shard(k, v)
            except AttributeError:  # no such module: load_state_dict names the key (strict)
                mine[k] = v
        return self.load_state_dict(mine, strict=strict)

    def num_params(self) -> int:
        """This rank's trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
