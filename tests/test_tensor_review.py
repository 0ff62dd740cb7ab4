"""Review of the tensor-parallel layer as a Megatron / torch TP user would use it.

Each case is a place where a script moved from the full model (or from torch's
own tools) would notice a difference: an uneven sequence split, a copy of the
model, a view of the logits. The references are the unsplit GPT and torch's
layers, float64 unless the case is about another dtype.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_tensor_parallel import TIGHT, tp  # noqa: F401  (the tp fixture: K1..K4, world)
from torch import nn
from torch.nn import functional as F

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rng_states,
    vocab_parallel_cross_entropy,
)
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.models.gpt_tp import TensorParallelGPT

# 29 tokens, 3 heads of 4, 31-token windows: nothing divides by 2, 3 or 4.
CFG = GPTConfig(vocab_size=29, seq_len=31, d_model=12, n_layers=2, n_heads=3, dropout=0.0)


def tokens(seed: int, b: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, CFG.vocab_size, (b, t + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def pair(comm, **options):
    torch.manual_seed(11)
    full = GPT(CFG).double()
    return full, TensorParallelGPT.from_full(full, comm, **options)


# --- the uneven split through the command line's job -----------------------------------
@pytest.mark.deadline(120)
def test_train_tp3_sequence_parallel_seq31_equals_one_rank(world):
    """The job of the brief, `train --tp 3 --sequence-parallel --seq-len 31`, through the
    command line's own job (make_job): the losses of a one-rank run (float32, close)."""
    if world.size != 3:
        pytest.skip("needs a 3-rank job: tp=3 against one rank")
    from mpiring.tools.train.job3d import make_job
    from mpiring.tools.train.loop import TrainConfig, TrainJob, train

    data = (np.arange(40_000) * 7919 % 241).astype(np.uint8)
    common = dict(steps=3, batch_size=2, preset="tiny", seq_len=31, log_every=1,
                  val_batches=1, lr=3e-3)
    job = make_job(world, TrainConfig(tp=3, sequence_parallel=True, **common),
                   train_data=data, val_data=data[:4000])
    assert job.tp_comm.size == 3
    got = train(job)
    job.close()
    one = world.split(0 if world.rank == 0 else None, key=world.rank)
    if one is not None:
        ref = TrainJob(one, TrainConfig(**common), train_data=data, val_data=data[:4000])
        want = train(ref)
        ref.close()
        one.free()
        np.testing.assert_allclose(got.losses, want.losses, rtol=2e-5)
        np.testing.assert_allclose(got.val_loss, want.val_loss, rtol=2e-5)
    world.barrier()


# --- the logits as the full GPT returns them ---------------------------------------------
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_logits_are_contiguous_as_the_full_gpts_are(tp, sp):  # noqa: F811
    """nanoGPT's loss, `cross_entropy(logits.view(-1, V), y.view(-1))`, works on GPT's
    logits; the split model's came back a transposed view, and .view() raised."""
    full, model = pair(tp, sequence_parallel=sp)
    x, y = tokens(5, 3, 7)
    want = full(x)
    assert want.is_contiguous()
    logits = model(x)
    assert logits.is_contiguous(), logits.stride()
    flat = logits.view(-1, logits.shape[-1])
    lo, hi = chunk_bounds(CFG.vocab_size, tp.size)[tp.rank]
    torch.testing.assert_close(flat.detach(), want.detach().view(-1, CFG.vocab_size)[:, lo:hi],
                               **TIGHT)
    got = vocab_parallel_cross_entropy(flat, y.reshape(-1), tp)
    torch.testing.assert_close(got.detach(), lm_loss(want, y).detach(), **TIGHT)


# --- copies of the model ----------------------------------------------------------------
def test_deepcopy_shares_the_communicator_and_copies_the_weights(tp):  # noqa: F811
    """copy.deepcopy (an EMA or reference model) raised "cannot serialize
    'mpi4py.MPI.Intracomm' instance": the copy must keep the group and own its weights."""
    torch.manual_seed(4)
    ref_c, ref_r, ref_e = nn.Linear(5, 7).double(), nn.Linear(7, 3).double(), nn.Embedding(9, 5)
    col = ColumnParallelLinear.from_full(ref_c, tp)
    row = RowParallelLinear.from_full(ref_r, tp, sequence_parallel=True)
    emb = VocabParallelEmbedding.from_full(ref_e.double(), tp)
    net = nn.ModuleDict({"emb": emb, "col": col, "row": row})
    twin = copy.deepcopy(net)
    for name, layer in twin.items():
        assert layer.comm is tp, f"{name}: the copy has another communicator"
    for (name, a), b in zip(net.named_parameters(), twin.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
    ids = (torch.arange(14).view(7, 2) * 3 + 1) % 9
    want = row(F.gelu(col(emb(ids))))
    got = twin["row"](F.gelu(twin["col"](twin["emb"](ids))))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        twin["col"].weight.add_(1.0)
    assert not torch.equal(twin["col"].weight, col.weight), "the copy shares the weight"


def test_averaged_model_of_the_split_gpt(tp):  # noqa: F811
    """torch.optim.swa_utils.AveragedModel deep-copies the model: it must run, and average
    to this rank's shards of the full GPT's average; its dropout streams are live copies
    (a recomputation replays them), not the original's."""
    full, model = pair(tp, sequence_parallel=tp.size > 1)
    avgs = [torch.optim.swa_utils.AveragedModel(m) for m in (full, model)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (full, model)]
    x, y = tokens(9, 2, 7)
    lm_loss(full(x), y).backward()
    model.loss(model(x), y).backward()
    for o, a, m in zip(opts, avgs, (full, model)):
        o.step()
        a.update_parameters(m)
    weights = dict(avgs[0].module.named_parameters())
    for name, p in avgs[1].module.named_parameters():
        torch.testing.assert_close(p.detach(), model.shard(name, weights[name]), **TIGHT,
                                   msg=lambda m, n=name: f"average of {n}: {m}")
    live = get_rng_states()
    for block, twin in zip(model.blocks, avgs[1].module.blocks):
        assert twin.streams is not block.streams and twin.streams in live
    lo, hi = chunk_bounds(CFG.vocab_size, tp.size)[tp.rank]
    with torch.no_grad():
        torch.testing.assert_close(avgs[1](x), avgs[0](x)[..., lo:hi], **TIGHT)


# --- a full GPT's checkpoint into the split model ---------------------------------------
def test_load_full_state_dict_of_the_gpt(tp):  # noqa: F811
    """GPT's state_dict holds the tied weight twice (tok.weight, head.weight): shard()
    raised AttributeError on head.weight, so a full checkpoint could not be cut."""
    full, _ = pair(tp)
    torch.manual_seed(99)  # another model, to load over
    model = TensorParallelGPT(CFG, tp).double()
    state = full.state_dict()
    assert "head.weight" in state
    assert torch.equal(model.shard("head.weight", state["head.weight"]),
                       model.shard("tok.weight", state["tok.weight"]))
    model.load_full_state_dict(state)
    weights = dict(full.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), model.shard(name, weights[name])), name
    x, _ = tokens(3, 2, 7)
    lo, hi = chunk_bounds(CFG.vocab_size, tp.size)[tp.rank]
    torch.testing.assert_close(model(x), full(x)[..., lo:hi], **TIGHT)
    # What load_state_dict says of other keys, it still says; an untied head is refused.
    with pytest.raises(RuntimeError, match="Unexpected key.*extra.weight"):
        model.load_full_state_dict({**state, "extra.weight": torch.zeros(2)})
    untied = {**state, "head.weight": state["tok.weight"] + 1}
    with pytest.raises(ValueError, match="head.weight differs from tok.weight"):
        model.load_full_state_dict(untied)
