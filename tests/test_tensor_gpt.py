"""The tensor-parallel GPT against the project's GPT, float64, on K = 1..4 ranks (and 5).

Three AdamW steps of both models on the same batches: the loss of every step
and, after the last, this rank's slice of every gradient and parameter equal
the full model's. Sequence parallelism must give the same numbers; dropout
must keep the replicated residual stream identical on every rank of the group.
"""

from __future__ import annotations

import pytest
import torch
from test_tensor_parallel import TIGHT, tp  # noqa: F401  (the tp fixture: K1..K4, world)

from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.models.gpt_tp import TensorParallelGPT

# 37 tokens, 3 heads of 8, 96 MLP columns, 7-token windows: little divides by 2, 3 or 4,
# and 4 ranks leave one without a head.
CFG = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_layers=2, n_heads=3, dropout=0.0)
T, B = 7, 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    seq = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def pair(comm, **options):
    torch.manual_seed(7)
    full = GPT(CFG).double()
    return full, TensorParallelGPT.from_full(full, comm, **options)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_three_steps_equal_the_full_gpt(tp, sp):  # noqa: F811
    full, model = pair(tp, sequence_parallel=sp)
    assert model.num_params() <= full.num_params()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (full, model)]
    for step in range(3):
        x, y = batch(step)
        for o in opts:
            o.zero_grad()
        want = lm_loss(full(x), y)
        want.backward()
        got = model.loss(model(x), y)
        got.backward()
        torch.testing.assert_close(got.detach(), want.detach(), **TIGHT,
                                   msg=lambda m, s=step: f"loss of step {s}: {m}")
        if step == 2:
            grads = {n: p.grad for n, p in full.named_parameters()}
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad, model.shard(name, grads[name]), **TIGHT,
                                           msg=lambda m, n=name: f"gradient of {n}: {m}")
        for o in opts:
            o.step()
    weights = dict(full.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), model.shard(name, weights[name]), **TIGHT,
                                   msg=lambda m, n=name: f"{n} after three steps: {m}")


def test_default_init_is_the_full_gpt(tp):  # noqa: F811
    torch.manual_seed(3)
    full = GPT(CFG)
    torch.manual_seed(3)
    model = TensorParallelGPT(CFG, tp)
    weights = dict(full.named_parameters())
    assert {n for n, _ in model.named_parameters()} == set(weights)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), model.shard(name, weights[name])), name


def test_dropout_keeps_the_replicated_stream_identical(tp):  # noqa: F811
    cfg = CFG.with_(dropout=0.2)
    torch.manual_seed(7)
    model = TensorParallelGPT(cfg, tp, hidden_dropout=0.3, seed=11).double()
    seen: list[torch.Tensor] = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, out: seen.append(out.detach().clone()))
    torch.manual_seed(100 + tp.rank)  # torch's own generator differs per rank on purpose
    x, _ = batch(0)
    model.train()
    model(x)
    dropped, seen[:] = list(seen), []
    model.eval()
    model(x)
    for i, (mine, plain) in enumerate(zip(dropped, seen)):
        assert not torch.equal(mine, plain), f"block {i}: dropout changed nothing"
        everyone = torch.zeros(tp.size, *mine.shape, dtype=mine.dtype)
        everyone[tp.rank] = mine
        tp.all_gather(everyone)
        for r in range(tp.size):
            assert torch.equal(everyone[r], everyone[0]), f"block {i}: r{r}'s residual stream differs"
