"""Where a user of torch's ZeroRedundancyOptimizer, DDP comm hooks or a parameter
server would notice a difference: each against torch's own (gloo, same processes)
or against one process training on the same data."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

from mpiring.parallel.data import comm_hooks as ch  # noqa: E402


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def data(rank: int, step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(31 * step + rank)
    n = 3 + rank  # uneven per rank: the mean of the ranks' means, as DDP
    return (torch.randn(n, 5, generator=g, dtype=dtype),
            torch.randn(n, 3, generator=g, dtype=dtype))


def train(model, opt, rank: int, steps: range) -> None:
    for s in steps:
        x, y = data(rank, s)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()


def worst_diff(world, a: nn.Module, b: nn.Module) -> float:
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    return max(world.mpi_comm.allgather(diff))


# --- PowerSGD ------------------------------------------------------------------------

# Shapes interleave (w1, w2, w1, bias, w2): torch draws the first random Qs, and lays
# out P and Q, grouped by shape; in bucket order the Qs go to other matrices.
INTERLEAVED = [(8, 6), (6, 4), (8, 6), (5,), (6, 4)]


@pytest.mark.deadline(90)
@pytest.mark.parametrize("options", [{}, {"warm_start": False}, {"use_error_feedback": False},
                                     {"batch_tensors_with_same_shape": True},
                                     {"matrix_approximation_rank": 3}],
                         ids=lambda o: ",".join(o) or "defaults")
def test_powersgd_equals_torch_when_bucket_shapes_interleave(world, options):
    dist = gloo_world(world)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps

    params = [torch.zeros(s) for s in INTERLEAVED]
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    total = sum(p.numel() for p in params)

    def bucket(step):
        g = torch.Generator().manual_seed(97 * step + world.rank)
        return ch.GradBucket(0, torch.randn(total, generator=g), params, offsets, True, world)

    kwargs = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, **options}
    mine, theirs = ch.PowerSGDState(**kwargs), tps.PowerSGDState(None, **kwargs)
    for step in range(4):
        ours = ch.powerSGD_hook(mine, bucket(step))
        torchs = tps.powerSGD_hook(theirs, bucket(step)).wait()
        torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    dist.barrier()
