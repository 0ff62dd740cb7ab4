"""DDP under torch.compile (both orders) and DDP.join() for uneven inputs, on K = 1..4 ranks.

The reference is one process on the global batch (float64): each step's
gradient is the mean of the ranks' gradients, as DDP promises, and for join()
the ranks still training contribute (the others count as zeros, or are left
out of the divisor with divide_by_initial_world_size=False).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from mpiring.parallel.data import DistributedDataParallel as DDP
from mpiring.parallel.data.bucketing import MIB

SMALL = 400 / MIB  # a few parameters a bucket: several buckets, and a rebuild that moves them


@pytest.fixture(scope="module", autouse=True)
def _warm_dynamo():
    # Every rank imports dynamo here, side by side, not inside a test's collectives.
    import torch._dynamo  # noqa: F401


def net(seed: int = 5, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(5, 7), nn.Tanh()] + ([nn.BatchNorm1d(7)] if batchnorm else []) + [
        nn.Linear(7, 4), nn.Tanh(), nn.Linear(4, 3)]
    return nn.Sequential(*layers).double()


def batch(rank: int, step: int, n: int = 3):
    g = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def mean_grads(ref: nn.Module, parts: list[tuple[torch.Tensor, torch.Tensor]], divisor: int):
    """The reference step: sum of the per-rank gradients over ``divisor``, then SGD."""
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for x, y in parts:
        ref.zero_grad()
        loss_fn(ref(x), y).backward()
        for t, p in zip(total, ref.parameters()):
            t += p.grad
    with torch.no_grad():
        for t, p in zip(total, ref.parameters()):
            p -= 0.1 * t / divisor


def sgd(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.zero_grad(set_to_none=True)


def assert_params(model: nn.Module, ref: nn.Module, note: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-11, atol=1e-12,
                                   msg=f"{name} {note}")


@pytest.mark.deadline(240)
@pytest.mark.parametrize("order", ["compile(DDP(m))", "DDP(compile(m))"])
def test_compiled_training_equals_the_eager_twin(comm, order):
    if comm.size not in (2, 3):
        pytest.skip("compiling takes seconds: 2 ranks and an odd 3 cover the communication")
    torch._dynamo.reset()
    model, ref = net(), net()
    if order == "compile(DDP(m))":
        ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=SMALL)
        run = torch.compile(ddp, backend="aot_eager")
    else:
        ddp = DDP(torch.compile(model, backend="aot_eager"), comm, bucket_cap_mb=SMALL,
                  first_bucket_mb=SMALL)
        run = ddp
    for step in range(4):  # step 1's forward rebuilds the buckets: the issue's failure
        if step == 2:
            with ddp.no_sync():  # accumulate locally, reduce the sum at step 3
                loss_fn(run(batch(comm.rank, 50)[0]), batch(comm.rank, 50)[1]).backward()
        x, y = batch(comm.rank, step)
        loss_fn(run(x), y).backward()
        if step == 2:
            # The reference: one step of (g(50) + g(step)) averaged over the ranks.
            parts = [batch(r, s) for r in range(comm.size) for s in (50, step)]
            mean_grads(ref, parts, comm.size)
        else:
            mean_grads(ref, [batch(r, step) for r in range(comm.size)], comm.size)
        sgd(model)
        assert_params(model, ref, f"{order} K={comm.size} step {step}")
    assert ddp.reducer.rebuilt or comm.size == 1
    ddp.close()


def _uneven_run(comm, divide_initial: bool, steps_of):
    model = net(batchnorm=True)
    ref = copy.deepcopy(model)
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=SMALL)
    mine = steps_of(comm.rank)
    with ddp.join(divide_by_initial_world_size=divide_initial):
        for step in range(mine):
            x, y = batch(comm.rank, step)
            loss_fn(ddp(x), y).backward()
            sgd(model)
    for step in range(max(steps_of(r) for r in range(comm.size))):
        active = [r for r in range(comm.size) if steps_of(r) > step]
        mean_grads(ref, [batch(r, step) for r in active],
                   comm.size if divide_initial else len(active))
    return ddp, model, ref


@pytest.mark.deadline(120)
@pytest.mark.parametrize("divide_initial", [True, False], ids=["initial-K", "active"])
def test_join_uneven_inputs_equal_the_twin(comm, divide_initial):
    # Rank r has 2 + r batches (and on 3+ ranks rank 1 has none): the lowest rank
    # leaves first, so the buffers' root moves off rank 0 and the last one decides.
    def steps_of(r):
        return 0 if (r == 1 and comm.size >= 3) else 2 + r

    ddp, model, ref = _uneven_run(comm, divide_initial, steps_of)
    assert_params(model, ref, f"join K={comm.size}")
    stats = torch.cat([b.detach().reshape(-1).double() for b in model.buffers()
                       if b.dtype == torch.float64]).numpy()
    rows = comm.control.allgather_array(stats)
    assert np.array_equal(rows, np.repeat(rows[:1], comm.size, axis=0)), \
        "buffers differ across ranks after join()"
    assert ddp.reducer.divisor == comm.size
    # Training goes on normally after the context.
    x, y = batch(comm.rank, 99)
    loss_fn(ddp(x), y).backward()
    ddp.close()


@pytest.mark.deadline(120)
def test_join_takes_the_buffers_of_the_highest_rank_still_training(comm):
    # torch's _find_common_rank is a MAX: with ranks 0 and K-1 training to the end,
    # rank K-1 is the buffers' root throughout and the final model is its own: its
    # BatchNorm statistics are those of its own batches alone.
    if comm.size < 2:
        pytest.skip("needs two ranks training to the end")

    steps = 3 if comm.rank in (0, comm.size - 1) else 1
    torch.manual_seed(6)
    model = nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 3)).double()  # stats of the data
    ddp = DDP(model, comm)
    with ddp.join():
        for step in range(steps):
            x, y = batch(comm.rank, step)
            loss_fn(ddp(x), y).backward()
            sgd(model)
    alone = nn.BatchNorm1d(5).double()  # rank K-1's batches alone
    for step in range(3):
        alone(batch(comm.size - 1, step)[0])
    for got, want in zip(model[0].buffers(), alone.buffers()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ddp.close()


@pytest.mark.deadline(60)
def test_join_throw_on_early_termination_raises_everywhere(comm):
    if comm.size == 1:
        pytest.skip("one rank cannot run out before another")
    ddp = DDP(net(), comm, bucket_cap_mb=SMALL)
    steps = 1 if comm.rank == comm.size - 1 else 3
    with pytest.raises(RuntimeError, match=rf"r{comm.size - 1} ran out of inputs"):
        with ddp.join(throw_on_early_termination=True):
            for step in range(steps):
                x, y = batch(comm.rank, step)
                loss_fn(ddp(x), y).backward()
    assert ddp._join is None
    ddp.close()


def test_join_refuses_nesting(comm):
    ddp = DDP(net(), comm)
    if comm.size > 1:
        with ddp.join():
            with pytest.raises(RuntimeError, match="already inside join"):
                with ddp.join():
                    pass
    ddp.close()


@pytest.mark.deadline(30)  # the old behaviour: an MPI "message truncated" abort or a stall
def test_zero_step_inside_join_raises_everywhere(comm):
    """join() shadows DDP's reductions, not ZeRO's collectives: a clear error on every rank
    at the first step, before any rank runs out of inputs."""
    from mpiring.parallel.zero import ZeroRedundancyOptimizer

    if comm.size == 1:
        pytest.skip("join() does nothing on one rank")
    ddp = DDP(net(), comm)
    opt = ZeroRedundancyOptimizer(ddp.module.parameters(), comm, torch.optim.SGD, stage=1,
                                  ddp=ddp, lr=0.1)
    with pytest.raises(RuntimeError, match="inside ddp.join"):
        with ddp.join():
            for step in range(1 + comm.rank):
                x, y = batch(comm.rank, step)
                loss_fn(ddp(x), y).backward()
                opt.step()
    ddp.close()
