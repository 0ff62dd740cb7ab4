"""Where a script ported from torch DDP would notice a difference: buffers, the
replica check, gradient clipping and the sampler, each against torch's behaviour."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from mpiring.parallel.checkpoint import ReplicaDivergenceError, check_replicas
from mpiring.parallel.clip import clip_grad_norm_
from mpiring.parallel.data import DistributedDataParallel as DDP
from mpiring.parallel.data.sampler import DistributedSampler


def bn_net() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5)).double()


def batch(rank: int, it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * it + 7 * rank)
    return torch.randn(3 + rank, 4, generator=g, dtype=torch.float64) * (1 + it)


def test_buffers_broadcast_when_torch_ddp_does(world):
    """torch broadcasts rank 0's buffers at the start of the first forward and of each
    one after a synced forward: so at an eval forward after training, and not at the
    synced forward after no_sync() ones. The BatchNorm statistics must match torch's."""
    from mpiring.tools.train.torch_pg import destroy_torch_process_group, init_torch_process_group

    pg = init_torch_process_group(world, torch.device("cpu"))
    ours, theirs = bn_net(), bn_net()
    ddp = DDP(ours, world)
    tddp = nn.parallel.DistributedDataParallel(theirs, process_group=pg)
    try:
        for it in range(2):
            for model in (ddp, tddp):
                with model.no_sync():
                    model(batch(world.rank, 2 * it)).pow(2).mean().backward()
                model(batch(world.rank, 2 * it + 1)).pow(2).mean().backward()
                with torch.no_grad():
                    model.eval()
                    model(batch(world.rank, 9))
                    model.train()
            diff = max(float((a - b).abs().max()) for a, b in zip(ours.buffers(), theirs.buffers()))
            # Every rank asserts on every rank's difference: r0's always match (it is the root).
            worst = world.mpi_comm.allgather(diff)
            assert max(worst) < 1e-12, f"iteration {it}: buffers differ from torch's by {worst}"
    finally:
        ddp.close()
        del tddp
        destroy_torch_process_group(world)


def test_broadcast_buffers_false_keeps_each_ranks_buffers_at_construction(comm):
    for kwargs, from_root in (({"broadcast_buffers": False}, False),
                              ({"broadcast_buffers": True}, True),
                              ({"forward_sync_buffers": False}, True)):
        model = bn_net()
        with torch.no_grad():
            model[1].running_mean.copy_(torch.arange(5.0) + 10 * comm.rank)
        ddp = DDP(model, comm, **kwargs)
        want = torch.arange(5.0, dtype=torch.float64) + (0 if from_root else 10 * comm.rank)
        torch.testing.assert_close(model[1].running_mean, want, msg=str(kwargs))
        ddp.close()


def test_check_replicas_passes_healthy_ddp_with_batchnorm(comm):
    """After a step each rank's BatchNorm statistics are its own (torch's too): not a
    divergence. The parameters are compared; buffers only when asked."""
    model = bn_net()
    ddp = DDP(model, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp(batch(comm.rank, 0)).pow(2).mean().backward()
    opt.step()
    check_replicas(ddp, comm, step=1)
    if comm.size > 1:
        with pytest.raises(ReplicaDivergenceError, match="running_mean"):
            check_replicas(ddp, comm, step=1, buffers=True)
    ddp.close()


def test_clip_grad_norm_takes_torchs_arguments_and_refuses_bare_parameters():
    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        for i, p in enumerate(m.parameters()):
            p.grad = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) * (i + 1)
        return m

    for norm_type in (2.0, 1.0, math.inf):
        ours, theirs = make(), make()
        got = clip_grad_norm_(ours, 0.5, norm_type, False, foreach=None)  # torch's positions
        want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type, False)
        assert float(got) == pytest.approx(float(want), rel=1e-6)
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    model = make()
    for bare in (model.parameters(), list(model.parameters()), model[0].weight):
        with pytest.raises(TypeError, match=r"pass the model itself.*torch\.nn\.utils"):
            clip_grad_norm_(bare, 1.0)


def test_sampler_has_torchs_dataset_attribute():
    data = list(range(11))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = torch.utils.data.DistributedSampler(data, num_replicas=3, rank=2, seed=4)
    ours = DistributedSampler(data, num_replicas=3, rank=2, seed=4)
    assert ours.dataset is data
    for epoch in (0, 5):
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs)


def test_unfreezing_a_parameter_frozen_at_wrap_time_raises_instead_of_diverging(comm):
    """torch keeps such a parameter's gradient local, so the replicas drift apart silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    model[0].weight.requires_grad_(False)
    ddp = DDP(model, comm)
    ddp(batch(comm.rank, 0)).sum().backward()  # frozen: fine
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"0\.weight had requires_grad=False.*wrap"):
        ddp(batch(comm.rank, 1))
    with torch.no_grad(), ddp.no_sync():  # local forwards reduce nothing: allowed
        ddp(batch(comm.rank, 2))
    ddp.close()
    model.zero_grad()
    rewrapped = DDP(model, comm)
    rewrapped(batch(comm.rank, 3)).pow(2).sum().backward()
    grads = comm.mpi_comm.allgather(model[0].weight.grad.reshape(-1).tolist())
    assert all(g == grads[0] for g in grads), "the unfrozen weight is reduced after rewrapping"
    rewrapped.close()


def test_forward_after_join_broadcasts_alike_on_every_rank(comm):
    """Whether a forward broadcasts the buffers depends on the rank's last forward; under
    join() the ranks' last forwards differ, so a forward after it must not deadlock."""
    if comm.size == 1:
        pytest.skip("needs ranks that run out of inputs")
    model = bn_net()
    ddp = DDP(model, comm)
    with torch.no_grad():  # a local forward, the last one on r0 (no inputs in join)
        ddp(batch(comm.rank, 0))
    with ddp.join():
        for it in range(2 if comm.rank else 0):  # r0 has no inputs at all
            ddp(batch(comm.rank, it + 1)).pow(2).mean().backward()
    with torch.no_grad():
        ddp.eval()
        out = ddp(batch(0, 5))
    rows = comm.mpi_comm.allgather(out.reshape(-1).tolist())
    assert all(r == rows[0] for r in rows), "after join every rank holds the same model"
    ddp.close()


def test_torchs_default_comm_hooks_run_as_mpirings(comm):
    """A ported script registers torch's own hooks; they would call torch.distributed on
    the comm thread. The default ones map to mpiring's; the others are refused at once."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def grads(hook):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        ddp = DDP(model, comm)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        for it in range(2):
            ddp(batch(comm.rank, it)).pow(2).mean().backward()
        ddp.close()
        return [p.grad for p in model.parameters()]

    for got, want in zip(grads(default_hooks.allreduce_hook), grads(None)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    ddp = DDP(nn.Linear(3, 2), comm)
    state = powerSGD_hook.PowerSGDState(process_group=None)
    with pytest.raises(TypeError, match="batched_powerSGD_hook runs torch.distributed's.*"
                                        "PowerSGDState"):
        ddp.register_comm_hook(state, powerSGD_hook.batched_powerSGD_hook)
    ddp.close()


def test_a_hook_registered_after_the_first_forward_is_refused(comm):
    # The ranks compare their hooks at the first forward; one registered later (on some
    # ranks) met the others' plain AllReduce: "Message truncated", then an abort.
    from mpiring.parallel.data import comm_hooks

    ddp = DDP(nn.Linear(3, 2).double(), comm)
    loss = ddp(batch(comm.rank, 0)[:, :3]).sum()  # a forward: the hooks were compared
    with pytest.raises(RuntimeError, match="register the hook before the first forward"):
        ddp.register_comm_hook(None, comm_hooks.allreduce_hook)
    loss.backward()  # and the step goes on as agreed
    ddp.close()
