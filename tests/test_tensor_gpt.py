"""The tensor-parallel GPT against the project's GPT, float64, on K = 1..4 ranks (and 5).

Three AdamW steps of both models on the same batches: the loss of every step
and, after the last, this rank's slice of every gradient and parameter equal
the full model's. Sequence parallelism must give the same numbers; dropout
must keep the replicated residual stream identical on every rank of the group.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_tensor_parallel import TIGHT, tp  # noqa: F401  (the tp fixture: K1..K4, world)
from torch.nn import functional as F

from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.models.gpt_tp import TensorParallelGPT
from mpiring.tools.train.loop import TrainConfig, TrainJob, train

# 37 tokens, 3 heads of 8, 96 MLP columns, 7-token windows: little divides by 2, 3 or 4,
# and 4 ranks leave one without a head.
CFG = GPTConfig(vocab_size=37, seq_len=8, d_model=24, n_layers=2, n_heads=3, dropout=0.0)
T, B = 7, 3


def batch(step: int, t: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    seq = torch.randint(0, CFG.vocab_size, (B, t + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def pair(comm, **options):
    torch.manual_seed(7)
    full = GPT(CFG).double()
    return full, TensorParallelGPT.from_full(full, comm, **options)


# 7 and 8 tokens split unevenly over 3 (and 7 over 2 and 4); 2 tokens over 3 or 4 ranks
# leave a rank of the sequence-parallel split with none.
@pytest.mark.parametrize("t", [T, 8, 2], ids=["t7", "t8", "t2"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_three_steps_equal_the_full_gpt(tp, sp, t):  # noqa: F811
    full, model = pair(tp, sequence_parallel=sp)
    assert model.num_params() <= full.num_params()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (full, model)]
    for step in range(3):
        x, y = batch(step, t)
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


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_an_empty_batch_gives_what_the_full_gpt_gives(tp, sp):  # noqa: F811
    full, model = pair(tp, sequence_parallel=sp)
    x = torch.zeros(0, T, dtype=torch.long)
    assert full(x).shape == (0, T, CFG.vocab_size)
    # This rank's vocabulary columns, as for any batch.
    assert model(x).shape == (0, *model(batch(0)[0]).shape[1:])


def test_frozen_parameters_stay_frozen_in_the_split_model(tp):  # noqa: F811
    torch.manual_seed(7)
    full = GPT(CFG).double()
    for part in (full.tok, full.pos, full.blocks[0].ln1, full.blocks[1].fc):
        part.requires_grad_(False)
    model = TensorParallelGPT.from_full(full, tp)
    frozen = {n for n, p in full.named_parameters() if not p.requires_grad}
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen


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


@pytest.mark.deadline(120)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_train_tp2_dp2_equals_ddp_on_2_ranks(world, subcomms, sp):
    """``train --tp 2`` on 4 ranks: the same losses as plain DDP on 2 (float32, close)."""
    if world.size != 4:
        pytest.skip("needs a 4-rank job: tp=2 x dp=2 against dp=2")
    data = (np.arange(40_000) * 7919 % 241).astype(np.uint8)
    common = dict(steps=3, batch_size=2, preset="tiny", seq_len=16, log_every=1, val_batches=1,
                  lr=3e-3)
    job = TrainJob(world, TrainConfig(tp=2, sequence_parallel=sp, **common),
                   train_data=data, val_data=data[:4000])
    assert (job.tp_comm.size, job.data_comm.size) == (2, 2)
    assert job.tp_comm.rank == world.rank % 2 and job.data_comm.rank == world.rank // 2
    got = train(job)
    # One rank's state_dict would hold its own shards only: refused, naming make_job.
    with pytest.raises(ValueError, match="make_job"):
        job.state_dict()
    job.close()
    if subcomms[2] is not None:
        ref_job = TrainJob(subcomms[2], TrainConfig(**common), train_data=data,
                           val_data=data[:4000])
        want = train(ref_job)
        ref_job.close()
        np.testing.assert_allclose(got.losses, want.losses, rtol=2e-5)
        np.testing.assert_allclose(got.val_loss, want.val_loss, rtol=2e-5)
    world.barrier()


def test_train_refuses_a_tp_that_does_not_divide(world):
    if world.size % 3 == 0:
        pytest.skip("3 divides this job")
    data = np.zeros(4000, dtype=np.uint8)
    with pytest.raises(ValueError, match="does not divide"):
        TrainJob(world, TrainConfig(tp=3, preset="tiny", seq_len=16), train_data=data,
                 val_data=data)
    with pytest.raises(ValueError, match="mode ddp or naive"):
        TrainConfig(tp=2, mode="ps").validate()


def test_each_block_draws_its_own_masks_whatever_the_pipeline_split(tp):  # noqa: F811
    # One stream for the whole model gave every pipeline stage's first block stage 0's
    # first masks (each rank builds the model from one seed). Per-block streams: the
    # blocks' masks differ, and a block draws the same masks alone as after the others.
    cfg = CFG.with_(dropout=0.5, n_layers=3)

    def masks(model, blocks):
        out = []
        for i in blocks:
            with model.blocks[i].streams.fork("tensor"):
                out.append(F.dropout(torch.ones(32, dtype=torch.float64), 0.5))
        return out

    torch.manual_seed(7)
    full = GPT(cfg)
    every = masks(TensorParallelGPT.from_full(full, tp, seed=11), range(3))
    assert not any(torch.equal(every[i], every[j]) for i in range(3) for j in range(i))
    alone = masks(TensorParallelGPT.from_full(full, tp, seed=11), [2])  # a stage of block 2
    assert torch.equal(alone[0], every[2])



def _streams_now(model) -> list[torch.Tensor]:
    """A draw from each block's two streams: where the streams stand."""
    out = []
    for block in model.blocks:
        for name in ("tensor", "shared"):
            with block.streams.fork(name):
                out.append(torch.rand(4, dtype=torch.float64))
    return out


def _dropout_model(tp, sp):  # noqa: F811
    torch.manual_seed(7)
    model = TensorParallelGPT.from_full(GPT(CFG.with_(dropout=0.2)).double(), tp,
                                        sequence_parallel=sp, hidden_dropout=0.3, seed=11)
    return model.train()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_pipeline_recomputation_replays_the_tensor_parallel_dropout_masks(tp, sp):  # noqa: F811
    # A recomputed forward must draw the first forward's masks from the TP streams too
    # (restoring torch's generator is not enough: every TP dropout draws from the
    # streams), or the gradients belong to other masks than the loss reported. After
    # the step the streams stand where a run without recomputation leaves them.
    from mpiring.parallel.pipeline import PipelineStage, ScheduleGPipe

    pp = tp.split(tp.rank, key=0)  # each rank its own one-stage pipeline
    x, y = batch(0)

    def run(recompute: bool):
        model = _dropout_model(tp, sp)
        stage = PipelineStage(model, 0, 1, pp)
        sched = ScheduleGPipe(stage, 3, model.loss, recompute=recompute)
        losses: list = []
        sched.step(x, target=y, losses=losses)
        sched.free()
        stage.free()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return [float(v) for v in losses], grads, _streams_now(model)

    (l0, g0, s0), (l1, g1, s1) = run(False), run(True)
    pp.free()
    assert l0 == l1
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")
    assert all(torch.equal(a, b) for a, b in zip(s0, s1)), "the recompute moved the streams on"


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant"])
def test_torch_checkpoint_without_the_contexts_is_refused_not_wrong(tp, reentrant):  # noqa: F811
    # Before: the recompute drew the streams' next masks, and the gradients differed
    # from the uncheckpointed model's, silently. Without dropout nothing is drawn: fine.
    from torch.utils.checkpoint import checkpoint

    h0 = torch.randn(T, B, CFG.d_model, generator=torch.Generator().manual_seed(tp.rank),
                     dtype=torch.float64)
    model = _dropout_model(tp, False)
    out = h0.clone().requires_grad_()
    for block in model.blocks:
        out = checkpoint(block, out, T, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="context_fn=mpiring.parallel.tensor.checkpoint_"):
        (out * out).sum().backward()
    model.eval()  # no dropout drawn: checkpointing needs no replay
    out = h0.clone().requires_grad_()
    for block in model.blocks:
        out = checkpoint(block, out, T, use_reentrant=reentrant)
    (out * out).sum().backward()


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_torch_checkpoint_replays_the_masks_with_checkpoint_contexts(tp, sp):  # noqa: F811
    from torch.utils.checkpoint import checkpoint

    from mpiring.parallel.tensor import checkpoint_contexts, split_sizes

    n = split_sizes(T, tp.size)[tp.rank] if sp else T  # this rank's tokens under SP
    h0 = torch.randn(n, B, CFG.d_model, generator=torch.Generator().manual_seed(tp.rank),
                     dtype=torch.float64)

    def run(ckpt: bool):
        model = _dropout_model(tp, sp)
        h = h0.clone().requires_grad_()
        out = h
        for block in model.blocks:
            out = (checkpoint(block, out, T, use_reentrant=False, context_fn=checkpoint_contexts)
                   if ckpt else block(out, T))
        (out * out).sum().backward()
        grads = [p.grad.clone() for p in model.blocks.parameters()] + [h.grad]
        return grads, _streams_now(model)

    (g0, s0), (g1, s1) = run(False), run(True)
    for i, (a, b) in enumerate(zip(g0, g1)):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, i=i: f"gradient {i}: {m}")
    assert all(torch.equal(a, b) for a, b in zip(s0, s1)), "the recompute moved the streams on"
