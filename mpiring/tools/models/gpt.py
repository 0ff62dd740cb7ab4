"""A small GPT-style decoder in plain PyTorch: byte tokens in, next-byte logits out.

Pre-norm transformer blocks (LayerNorm, causal self-attention, LayerNorm, GELU
MLP), learned positions, and an output layer tied to the token embedding (one
parameter used twice in forward: DDP must reduce it once).

Presets (``PRESETS``), parameter counts with the 256-byte vocabulary:

* ``tiny``  d=64,  2 layers, 32 tokens:  ~0.1M  (tests, the demo)
* ``small`` d=256, 4 layers, 64 tokens:  ~3.2M  (the training job's default)
* ``comm``  d=512, 4 layers, 64 tokens: ~12.8M  (communication-heavy: 51 MB of
  float32 gradients a step)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    dropout: float = 0.0

    def with_(self, **changes) -> GPTConfig:
        """A copy with some fields changed (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS = {
    "tiny": GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=2),
    "small": GPTConfig(seq_len=64, d_model=256, n_layers=4, n_heads=4),
    "comm": GPTConfig(seq_len=64, d_model=512, n_layers=4, n_heads=8),
}


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        heads = [z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v)]
        att = F.scaled_dot_product_attention(*heads, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer over bytes.

    ``forward(idx)`` takes ``(batch, time)`` int64 tokens and returns
    ``(batch, time, vocab)`` logits; ``loss(idx, targets)`` the mean
    cross-entropy.
    """

    def __init__(self, cfg: GPTConfig = PRESETS["small"]):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_heads={cfg.n_heads}: "
                             "choose n_heads dividing d_model")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: used at the input and at the output
        self.apply(self._init)
        # GPT-2's scaling of the residual projections keeps the residual stream's
        # variance from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len="
                             f"{self.cfg.seq_len}: build the model with a larger seq_len")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self) -> int:
        """Trainable parameters, the tied weight counted once."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
