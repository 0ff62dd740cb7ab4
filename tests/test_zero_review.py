"""Where a user of torch's ZeroRedundancyOptimizer, DDP comm hooks or a parameter
server would notice a difference: each against torch's own (gloo, same processes)
or against one process training on the same data."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

from mpiring import ZeroRedundancyOptimizer  # noqa: E402
from mpiring.parallel.data import ParameterServer  # noqa: E402
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


# --- ZeRO against torch's ZeroRedundancyOptimizer --------------------------------------

@pytest.mark.deadline(120)
@pytest.mark.parametrize("stage", (1, 2))
def test_optimizers_groups_and_frozen_params_equal_torch_zero(world, stage):
    """Adam with weight decay, AdamW with two groups of other lrs, SGD momentum with a
    frozen bias: parameters and the consolidated state equal torch's ZeRO's."""
    dist = gloo_world(world)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    def groups(m):
        return [{"params": [p for p in m[0].parameters() if p.requires_grad], "lr": 0.02},
                {"params": list(m[2].parameters()), "lr": 0.1, "weight_decay": 0.3}]

    cases = [(torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}, False, False),
             (torch.optim.AdamW, {"lr": 0.05}, True, False),
             (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, True, True)]
    for cls, kwargs, split, frozen in cases:
        ours, theirs = net(), net()
        for m in (ours, theirs):
            m[0].bias.requires_grad_(not frozen)
        tddp = nn.parallel.DistributedDataParallel(theirs)
        topt = TorchZero(groups(theirs) if split else theirs.parameters(), optimizer_class=cls,
                         **kwargs)
        opt = ZeroRedundancyOptimizer(groups(ours) if split else ours.parameters(), world, cls,
                                      stage=stage, **kwargs)
        train(tddp, topt, world.rank, range(3))
        train(ours, opt, world.rank, range(3))
        assert worst_diff(world, ours, theirs) < 1e-6, cls.__name__
        topt.consolidate_state_dict(to=0)
        opt.consolidate_state_dict(to=0)
        if world.rank == 0:
            a, b = opt.state_dict(), topt.state_dict()
            assert a["param_groups"] == b["param_groups"]
            assert sorted(a["state"]) == sorted(b["state"])
            for i, st in b["state"].items():
                for k, v in st.items():
                    torch.testing.assert_close(a["state"][i][k], v, rtol=1e-5, atol=1e-7)
        del tddp
    dist.barrier()


@pytest.mark.deadline(120)
@pytest.mark.parametrize("stage", (1, 2))
def test_add_param_group_equals_torch_zero(world, stage):
    """torch's ZeRO takes a group after construction (a collective): so does ours, the
    existing Adam state moving with its parameters to their new shards."""
    dist = gloo_world(world)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    ours, theirs = net(), net()
    tddp = nn.parallel.DistributedDataParallel(theirs)
    topt = TorchZero(theirs[0].parameters(), optimizer_class=torch.optim.Adam, lr=0.05,
                     weight_decay=0.1)
    opt = ZeroRedundancyOptimizer(ours[0].parameters(), world, torch.optim.Adam, stage=stage,
                                  lr=0.05, weight_decay=0.1)
    train(tddp, topt, world.rank, range(2))
    train(ours, opt, world.rank, range(2))
    topt.add_param_group({"params": list(theirs[2].parameters()), "lr": 0.02})
    opt.add_param_group({"params": list(ours[2].parameters()), "lr": 0.02})
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.02]
    assert opt.param_groups[1]["betas"] == (0.9, 0.999)  # the inner optimizer's defaults
    train(tddp, topt, world.rank, range(2, 5))
    train(ours, opt, world.rank, range(2, 5))
    assert worst_diff(world, ours, theirs) < 1e-6
    topt.consolidate_state_dict(to=0)
    opt.consolidate_state_dict(to=0)
    if world.rank == 0:
        a, b = opt.state_dict(), topt.state_dict()
        assert sorted(a["state"]) == sorted(b["state"]) == [0, 1, 2, 3]
        for i, st in b["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(a["state"][i][k], v, rtol=1e-5, atol=1e-7)
    del tddp
    dist.barrier()


def test_bad_add_param_group_is_refused_on_every_rank_and_training_goes_on(comm):
    model = net()
    opt = ZeroRedundancyOptimizer(model[0].parameters(), comm, torch.optim.SGD, lr=0.1)
    bad = comm.size - 1
    extra = torch.arange(3) if comm.rank == bad else torch.zeros(3, requires_grad=True)
    with pytest.raises((TypeError, ValueError), match=r"floating-point|rejected"):
        opt.add_param_group({"params": [extra]})
    with pytest.raises(ValueError, match="more than one parameter group|rejected"):
        opt.add_param_group({"params": [model[0].weight]})  # already in a group
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.01})
    ref = net()
    ref_opt = torch.optim.SGD([{"params": list(ref[0].parameters())},
                               {"params": list(ref[2].parameters()), "lr": 0.01}], lr=0.1)
    for s in range(2):
        opt.zero_grad()
        x, y = data(comm.rank, s)
        (model(x) - y).pow(2).mean().mul(comm.size).backward()
        opt.step()
        # One process on the same data: the sum of the ranks' losses.
        ref_opt.zero_grad()
        sum((ref(data(r, s)[0]) - data(r, s)[1]).pow(2).mean() for r in range(comm.size)).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_torch_signature_is_taken_or_refused_naming_the_fix(comm):
    model = net()
    with pytest.raises(TypeError, match=r"optimizer_class=Adam by keyword"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.1)
    with pytest.raises(ValueError, match=r"ddp=model with stage=2"):
        ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                process_group=comm, overlap_with_ddp=True, lr=0.1)
    # torch's process_group= and parameters_as_bucket_view= (ours always are views).
    other = net()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                  process_group=comm, parameters_as_bucket_view=True, lr=0.1)
    ref = ZeroRedundancyOptimizer(other.parameters(), comm, torch.optim.Adam, lr=0.1)
    assert "process_group" not in opt.param_groups[0]
    train(model, opt, comm.rank, range(2))
    train(other, ref, comm.rank, range(2))
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# --- the parameter server --------------------------------------------------------------

@pytest.mark.parametrize("server_first", (True, False), ids=("server-shortest", "server-longest"))
def test_parameter_server_join_trains_ranks_with_fewer_batches(comm, server_first):
    """Rank r has 2 + r batches. Inside join() a rank out of batches answers the others'
    steps with zeros: one process summing the ranks still training, divided by K."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    ref = nn.Linear(4, 2).double()
    ref.load_state_dict(model.state_dict())
    ps = ParameterServer(model, comm, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                         server=0 if server_first else comm.size - 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def batches(r):
        return [data(r, i, torch.float64) for i in range(2 + r)]

    with ps.join():
        for x, y in batches(comm.rank):
            ps.zero_grad()
            (model(x[:, :4]) - y[:, :2]).pow(2).mean().backward()
            ps.step()
    for i in range(2 + comm.size - 1):
        ref_opt.zero_grad()
        live = [b[i] for r in range(comm.size) if i < len(b := batches(r))]
        (sum((ref(x[:, :4]) - y[:, :2]).pow(2).mean() for x, y in live) / comm.size).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_parameter_server_refuses_on_every_rank_what_the_server_refuses(comm):
    """The optimizer factory runs on the server only: its error (an empty parameter
    list, a bad lr) used to leave the workers waiting in step() until the deadline."""
    server = comm.size - 1
    with pytest.raises(ValueError, match=r"Invalid learning rate|r\d failed to build"):
        ParameterServer(nn.Linear(3, 2), comm, lambda p: torch.optim.SGD(p, lr=-1.0),
                        server=server)
    frozen = nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ParameterServer(frozen, comm, lambda p: torch.optim.SGD(p, lr=0.1), server=server)
    # The communicator is still usable: a good one trains.
    ps = ParameterServer(nn.Linear(3, 2), comm, lambda p: torch.optim.SGD(p, lr=0.1),
                         server=server)
    ps.step()
