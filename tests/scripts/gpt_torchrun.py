"""A small GPT trained the torchrun way: torch.distributed over gloo, rank from the environment.

Written as a torchrun user writes it (the single-file-trainer idiom): it is
distributed if ``RANK`` is set, rank 0 logs, gradient accumulation skips the
sync on all but the last micro-step. tests/test_dropin.py runs it under
``mpiexec -n 2 python -m mpiring.run`` as it is, and again with only the three
import lines marked ``# port`` switched to mpiring; both must print the same.
"""

import math
import os

import torch
import torch.distributed as dist  # port
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP  # port
from torch.utils.data.distributed import DistributedSampler  # port

VOCAB, SEQ, WIDTH, HEADS, SAMPLES, STEPS, MICRO, BATCH = 29, 12, 24, 3, 40, 6, 2, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def main():
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        dist.init_process_group(backend="gloo")
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        assert dist.get_rank() == rank and dist.get_world_size() == world
    else:
        rank, world = 0, 1
    master = rank == 0
    torch.manual_seed(1234)  # the same initial model everywhere
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=gen)
    model = GPT()
    if ddp:
        model = DDP(model, device_ids=None)
    raw = model.module if ddp else model
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-3, weight_decay=0.1)
    sampler = DistributedSampler(range(SAMPLES), num_replicas=world, rank=rank, shuffle=True,
                                 seed=3) if ddp else None
    order = list(sampler) if ddp else list(range(SAMPLES))
    if master:
        print(f"world {world} params {sum(p.numel() for p in raw.parameters())}", flush=True)
    pos = 0
    for step in range(STEPS):
        total = 0.0
        for micro in range(MICRO):
            rows = [order[(pos + i) % len(order)] for i in range(BATCH)]
            pos += BATCH
            x, y = data[rows, :-1], data[rows, 1:]
            if ddp:
                model.require_backward_grad_sync = micro == MICRO - 1
            loss = model(x, y) / MICRO
            total += loss.item()
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if master:
            print(f"step {step} loss {total:.6f} norm {norm.item():.6f}", flush=True)
    digest = sum(math.fsum(p.detach().double().flatten().tolist()) for p in raw.parameters())
    print(f"final r{rank} {digest:.12f} keys {len(model.state_dict())}", flush=True)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
