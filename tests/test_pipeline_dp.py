"""Pipeline x data parallelism against one process on the global batch, float64.

pp stages times dp replicas (``stage_grid``: stage = rank // dp). Replica d
gets its own rows of the global batch; after a step every rank's ``.grad``
must be the mean over the replicas of the gradient of the mean micro-batch
loss, as one process computes it on the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_ddp import Recorder  # a tracer that keeps its records in memory
from torch import nn

import mpiring
from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.pipeline import Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble
from mpiring.parallel.pipeline.data_parallel import stage_grid
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import build_pipeline, units

SCHEDULES = {
    "gpipe": lambda st, m, lf: ScheduleGPipe(st, m, lf),
    "gpipe-recompute": lambda st, m, lf: ScheduleGPipe(st, m, lf, recompute=True),
    "1f1b": lambda st, m, lf: Schedule1F1B(st, m, lf),
    "zb": lambda st, m, lf: ScheduleZeroBubble(st, m, lf),
}
LAYOUTS = [(2, 2), (2, 1), (1, 2)]  # (pp, dp)


def net() -> nn.Sequential:
    # A LayerNorm among the Linears: under zero bubble its gradient comes in B
    # (through autograd), the Linears' in W (outside it).
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(3, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 5), nn.Tanh(),
                         nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def shards(dp: int, salt: int):
    """Replica d's rows (9 + d of them: the replicas need not hold the same count)."""
    g = torch.Generator().manual_seed(40 + salt)
    return [(torch.randn(9 + d, 3, generator=g, dtype=torch.float64),
             torch.randn(9 + d, 2, generator=g, dtype=torch.float64)) for d in range(dp)]


def mse(out, t):
    return ((out - t) ** 2).mean()


def reference(full: nn.Module, data, m: int, loss_fn) -> None:
    """One process: the mean over replicas of the mean over micro-batches of the loss."""
    full.zero_grad()
    total = 0
    for x, y in data:
        losses = [loss_fn(full(a), b) for a, b in zip(torch.tensor_split(x, m),
                                                      torch.tensor_split(y, m))]
        total = total + torch.stack(losses).mean()
    (total / len(data)).backward()


def grid_of(world, pp: int, dp: int):
    if pp * dp > world.size:
        pytest.skip(f"needs {pp * dp} ranks, the job has {world.size}")
    n = pp * dp
    sub = world.split(world.rank // n if world.rank < world.size // n * n else None,
                      key=world.rank)
    if sub is None:
        pytest.skip(f"rank {world.rank} is outside the {pp}x{dp} grids")
    return stage_grid(sub, pp)


def stage_bounds(n: int, k: int, i: int) -> tuple[int, int]:
    return chunk_bounds(n, k)[i]


def train_and_compare(world, pp: int, dp: int, name: str, m: int, set_to_none: bool = True,
                      **ddp_options):
    """Three steps of schedule ``name`` on a pp x dp grid against one process, float64.

    The second step runs on DDP's rebuilt buckets; the third reuses the transport's
    slots (shared memory on one host) for a second time.
    """
    grid = grid_of(world, pp, dp)
    full = net()
    lo, hi = stage_bounds(len(full), pp, grid.pp_rank)
    part = copy.deepcopy(full[lo:hi])
    ddp = mpiring.DistributedDataParallel(part, comm=grid.dp, **ddp_options)
    stage = mpiring.PipelineStage(ddp, grid.pp_rank, pp, grid.pp)
    sched = SCHEDULES[name](stage, m, mse)
    try:
        for salt in (0, 1, 2):
            data = shards(dp, salt)
            reference(full, data, m, mse)
            x, y = data[grid.dp_rank]
            part.zero_grad(set_to_none=set_to_none)
            sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
            for mine, ref in zip(part.parameters(), full[lo:hi].parameters()):
                assert mine.grad.grad_fn is None  # no graph hangs on .grad (W's GEMM)
                torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-12)
        assert ddp.reducer.iteration == 3  # one reduction per step, not one per micro-batch
    finally:
        ddp.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"pp{t[0]}xdp{t[1]}")
@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("m", (1, 4))
def test_pp_x_dp_matches_one_process(world, layout, name, m):
    train_and_compare(world, *layout, name, m)


@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_gradients_as_bucket_views(world, name):
    # .grad is a view into DDP's bucket: W adds into it in place, step after step.
    train_and_compare(world, 2, 2, name, 4, set_to_none=False, gradient_as_bucket_view=True)


@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_where_the_buckets_go(world, name):
    # The buckets go out inside the step's last backward (overlap): 1F1B's last B;
    # ZB's last W, which writes the Linears' gradients outside autograd and so runs
    # them through it for the parameters' hooks to fire.
    grid = grid_of(world, 2, 2)
    full = net()
    lo, hi = stage_bounds(len(full), 2, grid.pp_rank)
    part = copy.deepcopy(full[lo:hi])
    # A bucket per parameter: each goes out as that parameter's gradient is done.
    ddp = mpiring.DistributedDataParallel(part, comm=grid.dp, bucket_cap_mb=1e-6,
                                          first_bucket_mb=1e-6)
    stage = mpiring.PipelineStage(ddp, grid.pp_rank, 2, grid.pp)
    rec = Recorder(world.rank)
    stage.comm.tracer = ddp.comm.tracer = rec
    sched = SCHEDULES[name](stage, 3, mse)
    x, y = shards(2, 0)[grid.dp_rank]
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    ddp.close()
    events = [r for r in rec.records if r.get("type") == "event"]
    acts = [e for e in events if e["cat"] == "pipeline"]
    buckets = [e for e in events if e["name"] == "ddp.all_reduce"]
    assert buckets
    assert len(buckets) == sum(1 for _ in part.parameters()) > 1
    last = acts[-1]
    assert last["action"] == ("B" if name == "1f1b" else "W") and last["mb"] == 2
    assert all(last["t_start"] <= b["t_start"] <= b["t_end"] <= last["t_end"] for b in buckets)


def test_dualpipev_head_reduces_in_its_last_whole_backward(world):
    # DualPipeV on pp = 2 x dp = 2, the V's 4 stages (rank r: r and 3 - r), each its own
    # DDP with .grad as bucket views. Rank 0's head stage (3) splits its backwards in the
    # warm-up (their W's run at once) and ends on a whole one: its replicas reduce inside
    # that B, with a Linear wide enough for the fused weight-gradient GEMM elsewhere.
    from mpiring.parallel.pipeline import ScheduleDualPipeV
    from mpiring.parallel.pipeline import split_backward as sb

    grid = grid_of(world, 2, 2)
    torch.manual_seed(6)
    full = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 6), nn.LayerNorm(6),
                         nn.Linear(6, 512), nn.Tanh(), nn.Tanh(), nn.Linear(512, 256)).double()
    assert full[-1].weight.numel() >= sb.FUSE_MIN_WEIGHTS
    cuts = chunk_bounds(len(full), 4)
    mine = [grid.pp_rank, 3 - grid.pp_rank]
    parts = [copy.deepcopy(full[slice(*cuts[s])]) for s in mine]
    ddps = [mpiring.DistributedDataParallel(part, comm=grid.dp, gradient_as_bucket_view=True,
                                            bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
            for part in parts]  # a bucket per parameter
    rec = Recorder(world.rank)
    head = ddps[1] if grid.pp_rank == 0 else None
    stages = [mpiring.PipelineStage(d, s, 4, grid.pp) for d, s in zip(ddps, mine)]
    sched = ScheduleDualPipeV(stages, 4, mse)
    try:
        for salt in (0, 1, 2):
            g = torch.Generator().manual_seed(70 + salt)
            data = [(torch.randn(9 + d, 3, generator=g, dtype=torch.float64),
                     torch.randn(9 + d, 256, generator=g, dtype=torch.float64))
                    for d in range(2)]
            reference(full, data, 4, mse)
            x, y = data[grid.dp_rank]
            for part in parts:
                part.zero_grad(set_to_none=False)
            if head is not None and salt == 2:  # the last step: where the buckets go
                stages[1].comm.tracer = head.comm.tracer = rec
            sched.step(x if stages[0].is_first else None,
                       target=y if stages[-1].is_last else None)
            for part, s in zip(parts, mine):
                for a, b in zip(part.parameters(), full[slice(*cuts[s])].parameters()):
                    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
        assert all(d.reducer.iteration == 3 for d in ddps)
    finally:
        sched.free()
        for d in ddps:
            d.close()
    if head is not None:
        events = [r for r in rec.records if r.get("type") == "event"]
        acts = [e for e in events if e["cat"] == "pipeline" and e["stage"] == 3]
        buckets = [e for e in events if e["name"] == "ddp.all_reduce"]
        last = acts[-1]
        assert (last["action"], last["mb"]) == ("B", 3)
        # The head's buckets (one per parameter: the wide weight, its bias);
        # stage 0's, on the same data-parallel group, go out in its own last W.
        sizes = sorted(8 * q.numel() for q in parts[1].parameters())
        mine = [b for b in buckets if b.get("bytes") in sizes]
        assert sorted(b["bytes"] for b in mine) == sizes
        assert all(last["t_start"] <= b["t_start"] <= last["t_end"] for b in mine)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: f"pp{t[0]}xdp{t[1]}")
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("meta", [False, True], ids=["values", "meta"])
def test_fully_shard_stages_reduce_once_a_step(world, layout, name, meta):
    # torchtitan's wiring: fully_shard each stage's layers, then the stage, over grid.dp
    # (meta: on the meta device, materialized after the schedule is made), then
    # PipelineStage. Each unit's gradient is reduce-scattered once a step, in the last
    # micro-batch's backward, as the FullyShardedDataParallel wrapper's is.
    from mpiring.parallel.fsdp import fully_shard

    pp, dp = layout
    grid = grid_of(world, pp, dp)
    full = net()
    lo, hi = stage_bounds(len(full), pp, grid.pp_rank)
    part = copy.deepcopy(full[lo:hi])
    if meta:
        part = part.to_empty(device="meta")
    for layer in part:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=grid.dp)
    fully_shard(part, mesh=grid.dp)
    stage = mpiring.PipelineStage(part, grid.pp_rank, pp, grid.pp)
    sched = SCHEDULES[name](stage, 4, mse)
    if meta:
        part.to_empty(device="cpu")
        part.load_full_state_dict(full[lo:hi].state_dict())
    engine = part.fsdp_engine
    calls = []
    scatter = engine.thread_comm.reduce_scatter
    engine.thread_comm.reduce_scatter = lambda *a, **k: calls.append(1) or scatter(*a, **k)
    opts = [torch.optim.SGD(part.parameters(), lr=0.5), torch.optim.SGD(full.parameters(), lr=0.5)]
    try:
        for salt in (0, 1):
            data = shards(dp, salt)
            reference(full, data, 4, mse)
            x, y = data[grid.dp_rank]
            sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        got, want = part.full_state_dict(), full[lo:hi].state_dict()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
        if dp > 1:
            assert len(calls) == 2 * sum(u.flat.requires_grad and u.flat.numel > 0
                                         for u in engine.units)
    finally:
        sched.free()
        stage.free()
        part.close()


def test_tied_parameters_a_fully_shard_stage_took_are_refused_at_the_step(world):
    # On "meta", fully_shard only records; its to_empty() takes the parameters into the
    # engine, so the tied weight PipelineStage was given is no Parameter of the stage
    # any more: the tied sum would add zeros, silently. Refused on every rank instead.
    from mpiring.parallel.fsdp import fully_shard
    from mpiring.tools.train.pipeline import split_gpt

    grid = grid_of(world, 2, 1)
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)
    with torch.device("meta"):
        part, tied = split_gpt(GPT(cfg).double(), 2, grid.pp_rank)
    fully_shard(part, mesh=grid.dp)
    stage = mpiring.PipelineStage(part, grid.pp_rank, 2, grid.pp, tied_parameters=tied)
    sched = Schedule1F1B(stage, 2, lm_loss)
    part.to_empty(device="cpu")
    x = y = torch.zeros(4, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"r1: stage 1: tied_parameters \[0\] are no longer "
                                         "parameters of the stage's module"):
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    sched.free()
    stage.free()
    part.close()


def test_gpt_pp_x_dp_with_tied_embedding(world):
    # The trainer's wiring: ProcessGrid, DDP over grid.dp, the tied embedding summed
    # between the first and last stage of each pipeline.
    if world.size < 4:
        pytest.skip("needs 4 ranks (pp=2 x dp=2)")
    sub = world.split(0 if world.rank < 4 else None, key=world.rank)
    if sub is None:
        pytest.skip("rank outside the 4-rank grid")
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)
    torch.manual_seed(0)
    full = GPT(cfg).double()
    stage, sched, opt = build_pipeline(sub, cfg, "1f1b", 3, pp=2, dtype=torch.float64)
    grid = sched.grid
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 11, (4 + d, 5), generator=g),
             torch.randint(0, 11, (4 + d, 5), generator=g)) for d in range(2)]
    reference(full, data, 3, lm_loss)
    x, y = data[grid.dp_rank]
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    lo, hi = chunk_bounds(len(units(full)), 2)[grid.pp_rank]
    ref_part = nn.Sequential(*units(full)[lo:hi])  # the same parameters, grads included
    for (n, mine), ref in zip(stage.module.named_parameters(), ref_part.parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-12, msg=n)
    w = stage.tied_parameters[0]
    torch.testing.assert_close(w.grad, full.tok.weight.grad, rtol=1e-10, atol=1e-12)
    stage.ddp.close()


def test_pipedream_refuses_data_parallel_stages(world):
    grid = grid_of(world, 1, min(world.size, 2))
    from mpiring.parallel.pipeline import SchedulePipeDream

    part = net()
    ddp = mpiring.DistributedDataParallel(part, comm=grid.dp)
    stage = mpiring.PipelineStage(ddp, 0, 1, grid.pp)
    with pytest.raises(ValueError, match="reduction per micro-batch"):
        SchedulePipeDream(stage, 2, mse, optimizer=torch.optim.SGD(part.parameters(), lr=0.1))
    ddp.close()


@pytest.mark.parametrize("how", ["wrapper", "fully_shard"])
def test_zero_bubble_refuses_fsdp_stages_before_a_step(world, how):
    # W writes the Linears' gradients outside autograd, where FSDP's flat gradient
    # never sees them: refused when the schedule is built, on every rank alike, not
    # at the end of a step whose compute has run.
    from mpiring.parallel.fsdp import FullyShardedDataParallel, fully_shard

    grid = grid_of(world, 2, 1)
    full = net()
    lo, hi = stage_bounds(len(full), 2, grid.pp_rank)
    part = copy.deepcopy(full[lo:hi])
    # Only the last stage is sharded: the first must learn of it from the gathered table.
    shard = ((lambda m: FullyShardedDataParallel(m, grid.dp)) if how == "wrapper" else
             (lambda m: fully_shard(m, mesh=grid.dp)))
    wrapped = shard(part) if grid.pp_rank == 1 else part
    stage = mpiring.PipelineStage(wrapped, grid.pp_rank, 2, grid.pp)
    with pytest.raises(ValueError, match="FullyShardedDataParallel with a split backward"):
        ScheduleZeroBubble(stage, 2, mse)
    Schedule1F1B(stage, 2, mse).free()  # the same stages under 1F1B are fine
    stage.free()
    if grid.pp_rank == 1:
        wrapped.close()
