"""sched.clip_grad_norm_: one norm over the whole pipelined model, as torch's on the unsplit one.

Each layout steps once, clips with max_norm at half the model's norm (so the
gradients are scaled) and compares the returned norm and every clipped
gradient with ``torch.nn.utils.clip_grad_norm_`` in one process: K = 1..4
stages, norm types 1, 2 and inf, the GPT's tied embedding, pp x dp with DDP
and with FSDP, and tensor-parallel stages on a tp x pp grid.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from test_pipeline_dp import grid_of, mse, net, shards, stage_bounds
from test_pipeline_dp import reference as dp_reference
from test_pipeline_runtime import bounds, data, mlp, reference
from torch import nn

import mpiring
from mpiring.parallel.fsdp import FullyShardedDataParallel
from mpiring.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleZeroBubble
from mpiring.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import build_pipeline, units


def clipped_reference(params, norm_type: float):
    """(the norm, and max_norm = half of it) after clipping ``params`` in place, torch's way."""
    total = float(torch.nn.utils.get_total_norm([q.grad for q in params], norm_type))
    torch.nn.utils.clip_grad_norm_(params, total / 2, norm_type)
    return total, total / 2


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_clip_matches_the_unsplit_model(comm, name, norm_type):
    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = (Schedule1F1B if name == "1f1b" else ScheduleZeroBubble)(stage, 4, mse)
    x, y = data()
    reference(full, x, y, 4, mse)
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    total, max_norm = clipped_reference(list(full.parameters()), norm_type)
    got = sched.clip_grad_norm_(max_norm, norm_type)
    assert float(got) == pytest.approx(total, rel=1e-12)
    for mine, ref in zip(part.parameters(), full[lo:hi].parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-14)
    # Under the limit: the norm comes back and the gradients stay as they are.
    before = [q.grad.clone() for q in part.parameters()]
    # (torch divides by the norm + 1e-6: the clipped norm is a little under max_norm)
    assert float(sched.clip_grad_norm_(total * 10, norm_type)) == pytest.approx(max_norm, rel=1e-4)
    for b, q in zip(before, part.parameters()):
        assert torch.equal(b, q.grad)


def _stepped(comm):
    """This rank's stage of the MLP after one 1F1B step of two micro-batches."""
    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, mse)
    x, y = data()
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    return part, sched


def test_a_nonfinite_norm_is_refused_on_every_rank(comm):
    part, sched = _stepped(comm)
    if comm.rank == comm.size - 1:
        next(part.parameters()).grad[0] = math.inf  # one element on one stage
    before = [q.grad.clone() for q in part.parameters()]
    with pytest.raises(RuntimeError, match="total norm of order 2.0 is inf"):
        sched.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert math.isinf(float(sched.clip_grad_norm_(1.0)))  # left as it was
    for b, q in zip(before, part.parameters()):
        assert torch.equal(b, q.grad)


def test_the_tied_embedding_counts_once(comm):
    if comm.size < 2:
        pytest.skip("a tied pair needs two stages")
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)
    torch.manual_seed(0)
    full = GPT(cfg).double()
    stage, sched, _ = build_pipeline(comm, cfg, "1f1b", 2, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g))
    full.zero_grad()
    torch.stack([lm_loss(full(a), b) for a, b in zip(torch.tensor_split(x, 2),
                                                    torch.tensor_split(y, 2))]).mean().backward()
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    total, max_norm = clipped_reference(list(full.parameters()), 2.0)
    assert float(sched.clip_grad_norm_(max_norm)) == pytest.approx(total, rel=1e-12)
    lo, hi = stage_bounds(len(units(full)), comm.size, comm.rank)
    ref_part = nn.Sequential(*units(full)[lo:hi])
    for (n, mine), ref in zip(stage.module.named_parameters(), ref_part.parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-14, msg=n)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_pp_x_dp(world, wrap):
    # DDP replicas hold the same gradients (one pipeline's norm is the model's);
    # FSDP's ranks hold shards, whose shares are summed over its group as well.
    grid = grid_of(world, 2, 2)
    full = net()
    lo, hi = stage_bounds(len(full), 2, grid.pp_rank)
    part = copy.deepcopy(full[lo:hi])
    wrapped = (mpiring.DistributedDataParallel(part, comm=grid.dp) if wrap == "ddp" else
               FullyShardedDataParallel(part, grid.dp, auto_wrap=None))
    stage = PipelineStage(wrapped, grid.pp_rank, 2, grid.pp)
    sched = Schedule1F1B(stage, 3, mse)
    try:
        batches = shards(2, 0)
        dp_reference(full, batches, 3, mse)
        x, y = batches[grid.dp_rank]
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        total, max_norm = clipped_reference(list(full.parameters()), 2.0)
        assert float(sched.clip_grad_norm_(max_norm)) == pytest.approx(total, rel=1e-12)
        if wrap == "ddp":
            for mine, ref in zip(part.parameters(), full[lo:hi].parameters()):
                torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-14)
        else:  # this rank's shard of the clipped flat gradient
            flat = torch.cat([q.grad.reshape(-1) for q in full[lo:hi].parameters()])
            f = wrapped.units[0].flat
            torch.testing.assert_close(f.shard.grad, flat[f.lo:f.hi], rtol=1e-10, atol=1e-14)
    finally:
        wrapped.close()


def test_tensor_parallel_stages(world):
    # tp=2 x pp=2: each stage a column layer, tanh and a row layer over its tp group;
    # the split weights' shares are summed over the group, the row layer's bias (whole
    # on every tp rank) counted once.
    grid = grid_of(world, 2, 2)  # its data-parallel groups (one stage each) serve as tp
    tp, pp = grid.dp, grid.pp
    torch.manual_seed(9)
    full = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(),
                         nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    s = pp.rank
    lins = [full[4 * s], full[4 * s + 2]]
    col = ColumnParallelLinear.from_full(lins[0], tp)
    row = RowParallelLinear.from_full(lins[1], tp)
    part = nn.Sequential(col, nn.Tanh(), row, nn.Tanh()) if s == 0 else nn.Sequential(col, nn.Tanh(), row)
    stage = PipelineStage(part, s, 2, pp)
    sched = Schedule1F1B(stage, 2, mse)
    x, y = data()
    reference(full, x, y, 2, mse)
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    total, max_norm = clipped_reference(list(full.parameters()), 2.0)
    assert float(sched.clip_grad_norm_(max_norm)) == pytest.approx(total, rel=1e-12)
    for layer, ref in ((col, lins[0]), (row, lins[1])):
        for name in ("weight", "bias"):
            want = layer.shard(name, getattr(ref, name).grad)
            torch.testing.assert_close(getattr(layer, name).grad, want, rtol=1e-10, atol=1e-14)


def test_a_nan_gradient_under_the_inf_norm(comm):
    # max() would drop a NaN, and MPI's MAX of one is undefined: it is counted apart.
    part, sched = _stepped(comm)
    if comm.rank == 0:
        next(part.parameters()).grad[0, 0] = math.nan
    assert math.isnan(float(sched.clip_grad_norm_(1.0, math.inf)))
    with pytest.raises(RuntimeError, match="total norm of order inf is nan"):
        sched.clip_grad_norm_(1.0, math.inf, error_if_nonfinite=True)


def test_a_split_weight_tied_to_a_plain_module_counts_as_split(comm):
    # The vocabulary-split table is also a plain Linear's weight, registered first: it
    # is still each rank's own rows, summed over the group.
    from mpiring.parallel.clip import clip_grad_norm_
    from mpiring.parallel.tensor.embedding import VocabParallelEmbedding

    torch.manual_seed(2)
    table = nn.Embedding(11, 3).double()
    emb = VocabParallelEmbedding.from_full(table, comm)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, emb.weight.shape[0], bias=False).double()
            self.head.weight = emb.weight  # registered here first
            self.emb = emb

    model = Tied()
    grad = torch.arange(33, dtype=torch.float64).view(11, 3) / 10
    emb.weight.grad = emb.shard("weight", grad)
    want = float(grad.norm())
    assert float(clip_grad_norm_(model, 1e9)) == pytest.approx(want, rel=1e-12)


def test_pipedream_refuses_to_clip(comm):
    from mpiring.parallel.pipeline import SchedulePipeDream

    stage = PipelineStage(nn.Linear(3, 3).double(), comm.rank, comm.size, comm)
    opt = torch.optim.SGD(stage.module.parameters(), lr=0.1)
    sched = SchedulePipeDream(stage, 2, mse, optimizer=opt)
    with pytest.raises(ValueError, match="leaves no gradient to clip"):
        sched.clip_grad_norm_(1.0)
