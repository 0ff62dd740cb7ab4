"""ZeroRedundancyOptimizer: equal to unsharded data parallel, 1/K of the state, portable state dicts.

The reference is computed without any collective: every rank trains the same
model on the whole global batch with the plain torch optimizer. Data parallel
over K ranks with equal shards and mean losses must give the same parameters up
to floating-point order.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_gloo import gloo_world  # noqa: E402

from mpiring.parallel.zero import ZeroRedundancyOptimizer  # noqa: E402

GLOBAL_BATCH = 12  # divisible by K = 1, 2, 3, 4
STEPS = 3


class Net(torch.nn.Module):
    """Two dtypes (two flat segments), a LayerNorm, sizes that do not divide by K."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.fc1 = torch.nn.Linear(7, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.fc2 = torch.nn.Linear(13, 5)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=dtype))

    def forward(self, x):
        return (self.fc2(torch.tanh(self.norm(self.fc1(x)))).double() * self.scale)


def make_model(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return Net(dtype)


def groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def batch(step, n=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 7, generator=g), torch.randn(n, 5, generator=g, dtype=torch.float64)


def shard(x, rank, size):
    per = x.shape[0] // size
    return x[rank * per:(rank + 1) * per]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def train_reference(steps, start=0, model=None, opt=None):
    model = model or make_model()
    opt = opt or torch.optim.AdamW(groups(model), lr=0.05)
    for s in range(start, start + steps):
        x, y = batch(s)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return model, opt


def train_zero(model, opt, comm, steps, start=0):
    for s in range(start, start + steps):
        x, y = batch(s)
        opt.zero_grad()
        loss_fn(model, shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)).backward()
        opt.step()


def assert_same_params(a, b, rtol=1e-5, atol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol, msg=name)


def assert_replicas_identical(model, comm):
    mine = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).numpy()
    everyone = comm.mpi_comm.allgather(mine)
    for r, theirs in enumerate(everyone):
        np.testing.assert_array_equal(theirs, mine, err_msg=f"replica of r{r} differs")


@pytest.mark.parametrize("stage", (1, 2))
def test_zero_equals_unsharded_data_parallel(comm, stage):
    model = make_model()
    opt = ZeroRedundancyOptimizer(groups(model), comm, torch.optim.AdamW, stage=stage, lr=0.05)
    train_zero(model, opt, comm, STEPS - 1)
    # Lay the shards out anew mid-run (what a DDP bucket rebuild triggers): the
    # state follows its elements to their new owners.
    opt._relayout([(seg.indices[::-1], False) for seg in opt._segments[::-1]])
    train_zero(model, opt, comm, 1, start=STEPS - 1)
    reference, _ = train_reference(STEPS)
    assert_same_params(model, reference)
    assert_replicas_identical(model, comm)

    # State is sharded: each rank keeps AdamW's two moments for its shard only,
    # and the shards are the ring's chunks (sizes differ by at most one per segment).
    total = sum(p.numel() for p in model.parameters())
    moments = sum(v.numel() for st in opt.optim.state.values() for k, v in st.items() if k != "step")
    assert moments == 2 * opt.shard_numel
    shards = comm.mpi_comm.allgather(opt.shard_numel)
    assert sum(shards) == total
    assert max(shards) - min(shards) <= 2  # two segments (float32, float64)

    if stage == 1:  # the DDP contract: p.grad is the mean over ranks
        x, y = batch(STEPS - 1)
        check = make_model()
        check.load_state_dict(model.state_dict())
        opt.zero_grad()
        loss_fn(model, shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)).backward()
        opt.step()
        loss_fn(check, x, y).backward()
        for p, q in zip(model.parameters(), check.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("stage", (1, 2))
def test_max_grad_norm_clips_the_mean_gradient(comm, stage):
    # What clip_grad_norm_ does on one process between backward and step: the norm of
    # the mean gradient, which no rank holds before step().
    model, ref = make_model(), make_model()
    opt = ZeroRedundancyOptimizer(groups(model), comm, torch.optim.AdamW, stage=stage, lr=0.05,
                                  max_grad_norm=0.3)
    ref_opt = torch.optim.AdamW(groups(ref), lr=0.05)
    for s in range(3):
        x, y = batch(s)
        opt.zero_grad()
        loss_fn(model, shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        ref_opt.step()
        assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert float(norm) > 0.3  # the clipping did something
    assert_same_params(model, ref)
    with pytest.raises(ValueError, match="max_grad_norm=0: give a positive norm"):
        ZeroRedundancyOptimizer(model.parameters(), comm, max_grad_norm=0, lr=0.1)


def test_zero_sgd_tiny_model_and_empty_shards(comm):
    # 3 elements over up to 4 ranks: some ranks own nothing and must still take part.
    torch.manual_seed(3)
    w = torch.nn.Parameter(torch.randn(3))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = ZeroRedundancyOptimizer([w], comm, torch.optim.SGD, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for s in range(3):
        target = torch.arange(3.0) * (s + 1)
        opt.zero_grad()
        ((w - target) ** 2 * (comm.rank + 1)).sum().backward()
        opt.step()
        plain.zero_grad()
        mean = sum((r + 1) for r in range(comm.size)) / comm.size
        ((ref - target) ** 2 * mean).sum().backward()
        plain.step()
    torch.testing.assert_close(w.detach(), ref.detach())


def test_zero_skips_parameters_without_gradients_like_torch(comm):
    # A parameter with no gradient on any rank is not updated (no weight decay, no
    # momentum), exactly as the plain optimizer skips it.
    model = make_model()
    reference = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), comm, torch.optim.AdamW, lr=0.05,
                                  weight_decay=0.1)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    x, y = batch(0)
    for m, o, xs, ys in ((model, opt, shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)),
                         (reference, plain, x, y)):
        o.zero_grad()
        loss_fn(m, xs, ys).backward()
        m.scale.grad = None
        o.step()
    assert_same_params(model, reference)
    assert torch.equal(model.scale.detach(), make_model().scale.detach())


def test_state_dict_round_trip_across_world_sizes(subcomms, world, tmp_path_factory):
    """Save at K=4 (or the job's size), load at K=2 and K=1, continue: equal to never stopping."""
    big = subcomms[world.size]
    path = os.path.join(str(world.mpi_comm.bcast(str(tmp_path_factory.mktemp("zero")) if world.rank == 0
                                                  else None)), "ckpt.pt")
    model = make_model()
    opt = ZeroRedundancyOptimizer(groups(model), big, torch.optim.AdamW, lr=0.05)
    train_zero(model, opt, big, 2)
    opt.consolidate_state_dict(to=0)
    if world.rank == 0:
        sd = opt.state_dict()
        torch.save({"model": model.state_dict(), "optim": sd}, path)
        # The consolidated dict is an unsharded optimizer's dict.
        _, plain = train_reference(2)
        expected = plain.state_dict()
        assert sd["param_groups"] == expected["param_groups"]
        for i, st in expected["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(sd["state"][i][k], v, rtol=1e-5, atol=1e-7,
                                           msg=f"param {i} {k}")
    else:
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()
    world.barrier()

    reference, _ = train_reference(4)
    for k in (2, 1):
        sub = subcomms[k]
        if sub is not None:
            ckpt = torch.load(path, weights_only=False)
            resumed = make_model(seed=123)
            resumed.load_state_dict(ckpt["model"])
            ropt = ZeroRedundancyOptimizer(groups(resumed), sub, torch.optim.AdamW, lr=0.05)
            ropt.load_state_dict(ckpt["optim"])
            train_zero(resumed, ropt, sub, 2, start=2)
            assert_same_params(resumed, reference)
        world.barrier()


def test_rejects_bad_arguments_on_every_rank(comm):
    model = make_model()
    with pytest.raises(ValueError, match="stage"):
        ZeroRedundancyOptimizer(model.parameters(), comm, stage=3, lr=0.1)
    with pytest.raises(TypeError, match="optimizer_class"):
        ZeroRedundancyOptimizer(model.parameters(), comm, optimizer_class=object, lr=0.1)
    # Hyperparameters are checked by the inner class, as torch itself would (a TypeError).
    for cls, kwargs in ((torch.optim.AdamW, {"weight_decy": 0.1}),
                        (torch.optim.SGD, {"lr": 0.1, "betas": (0.9, 0.99)})):
        with pytest.raises(TypeError) as theirs:
            cls(make_model().parameters(), **kwargs)
        with pytest.raises(TypeError, match=re.escape(str(theirs.value))):
            ZeroRedundancyOptimizer(model.parameters(), comm, optimizer_class=cls, **kwargs)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ZeroRedundancyOptimizer(model.parameters(), comm, torch.optim.SGD, lr=-1.0)
    if comm.size > 1:
        # Rank 1 builds a different model: every rank raises, naming the parameter.
        other = torch.nn.Linear(7, 14) if comm.rank == 1 else torch.nn.Linear(7, 13)
        with pytest.raises(ValueError, match="parameter 0 differs"):
            ZeroRedundancyOptimizer(other.parameters(), comm, lr=0.1)
        # torch's own check (an empty list) on one rank only: every rank raises, at once.
        mine = [] if comm.rank == 1 else list(model.parameters())
        with pytest.raises(ValueError, match="empty parameter list|r1 rejected"):
            ZeroRedundancyOptimizer(mine, comm, lr=0.1)


@pytest.mark.parametrize("name", ("Adafactor", "LBFGS"))
def test_optimizers_that_need_whole_tensors_are_refused_on_every_rank(comm, name):
    # Adafactor factors a matrix's second moment by rows and columns and LBFGS takes
    # dot products over all parameters: on flat shards both run and differ silently.
    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"this torch has no torch.optim.{name}")
    model = make_model()
    with pytest.raises(TypeError, match=rf"{name} does not work on flat shards.*per element"):
        ZeroRedundancyOptimizer(model.parameters(), comm, optimizer_class=cls, lr=0.1)
    if comm.size > 1:
        # Only rank 1 asks for it: every rank raises, before any byte moves.
        chosen = cls if comm.rank == 1 else torch.optim.AdamW
        with pytest.raises(TypeError if comm.rank == 1 else ValueError,
                           match=rf"{name} does not work on flat shards|r1 rejected"):
            ZeroRedundancyOptimizer(model.parameters(), comm, optimizer_class=chosen, lr=0.1)


@pytest.mark.deadline(90)
def test_equals_torch_zero_redundancy_optimizer_over_gloo(world, subcomms):
    """torch DDP + torch's ZeroRedundancyOptimizer (gloo) vs ours, same data and init."""
    dist = gloo_world(world)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    comm = subcomms[world.size]
    # torch's optimizer takes one dtype only: an all-float32 model here.
    ours = make_model(dtype=torch.float32)
    theirs = make_model(dtype=torch.float32)
    ddp = TorchDDP(theirs)
    topt = TorchZero(theirs.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05)
    opt = ZeroRedundancyOptimizer(ours.parameters(), comm, torch.optim.AdamW, lr=0.05)
    for s in range(STEPS):
        x, y = batch(s)
        xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
        topt.zero_grad()
        loss_fn(ddp, xs, ys).backward()
        topt.step()
        opt.zero_grad()
        loss_fn(ours, xs, ys).backward()
        opt.step()
    assert_same_params(ours, theirs)
    topt.consolidate_state_dict(to=0)
    opt.consolidate_state_dict(to=0)
    if world.rank == 0:
        a, b = opt.state_dict(), topt.state_dict()
        assert a["param_groups"] == b["param_groups"]
        for i, st in b["state"].items():
            for k, v in st.items():
                torch.testing.assert_close(a["state"][i][k], v, rtol=1e-5, atol=1e-7)
    dist.barrier()


@pytest.mark.parametrize("stage", (1, 2))
def test_zero_with_ddp_buckets_no_sync_and_rebuild(comm, stage):
    """ZeRO on a DDP model: buckets reduce-scattered during backward (stage 2), no_sync,
    the bucket rebuild after the first iteration; equal to the unsharded reference."""
    from mpiring.parallel.data import DistributedDataParallel

    model = make_model()
    # Tiny buckets: several per dtype, and the rebuild reorders them.
    ddp = DistributedDataParallel(model, comm, bucket_cap_mb=200 / 2**20, first_bucket_mb=100 / 2**20)
    initial_buckets = [list(b) for b in ddp.bucket_params]
    opt = ZeroRedundancyOptimizer(groups(model), comm, torch.optim.AdamW, stage=stage, ddp=ddp,
                                  lr=0.05)
    reference = make_model()
    ref_opt = torch.optim.AdamW(groups(reference), lr=0.05)
    for s in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):  # two micro-batches, the first under no_sync
            x, y = batch(10 * s + micro)
            xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
            if micro == 0:
                with ddp.no_sync():
                    loss_fn(ddp, xs, ys).backward()
            else:
                loss_fn(ddp, xs, ys).backward()
            loss_fn(reference, x, y).backward()
        if s == 0 and stage == 2:
            assert len(opt._reduced) == len(ddp.bucket_params) > 2  # the hook ran per bucket
        opt.step()
        ref_opt.step()
    assert_same_params(model, reference)
    assert_replicas_identical(model, comm)
    if stage == 2:  # the shards follow the rebuilt buckets
        ours = [[id(opt._all_params[i]) for i in seg.indices] for seg in opt._segments
                if seg.external]
        assert ours == [[id(ddp.reducer.params[j]) for j in b] for b in ddp.bucket_params]
        assert ddp.reducer.rebuilt
        # The rebuild moved parameters between buckets; the first step followed it
        # before any optimizer state existed.
        assert ddp.bucket_params != initial_buckets and opt.relayouts == 1
    # A step without a synced backward would skip the reduction: refused on every rank.
    x, y = batch(99)
    with ddp.no_sync():
        loss_fn(ddp, shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)).backward()
    with pytest.raises(RuntimeError, match="no synced backward"):
        opt.step()
    ddp.close()


def test_stage2_with_ddp_over_some_parameters_is_refused_stage1_matches(comm):
    """Stage 2 reduce-scatters whole DDP buckets: an optimizer over only some of the
    DDP model's parameters would update with partial sums, so every rank refuses it.
    Stage 1 takes DDP's mean as it is: the split (ZeRO + a plain SGD) matches torch."""
    from mpiring.parallel.data import DistributedDataParallel

    model = make_model()
    ddp = DistributedDataParallel(model, comm)
    mine = [p for n, p in model.named_parameters() if n != "fc2.weight"]
    with pytest.raises(ValueError, match="fc2.weight.*every trainable parameter"):
        ZeroRedundancyOptimizer(mine, comm, torch.optim.SGD, stage=2, ddp=ddp, lr=0.1)
    opt = ZeroRedundancyOptimizer(mine, comm, torch.optim.SGD, stage=1, ddp=ddp, lr=0.1)
    other = torch.optim.SGD([model.fc2.weight], lr=0.1)
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        other.zero_grad()
        loss_fn(ddp, shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)).backward()
        opt.step()
        other.step()
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
    assert_same_params(model, reference)
    assert_replicas_identical(model, comm)
    ddp.close()


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")
@pytest.mark.parametrize("stage,with_ddp", ((1, False), (2, False), (2, True)))
def test_grad_scaler_skips_an_overflowed_step_on_every_rank(comm, stage, with_ddp):
    """torch.amp.GradScaler: an inf in one rank's batch makes every rank skip the step and
    back off the scale together, as one process with torch's SGD does on the whole batch."""
    from mpiring.parallel.data import DistributedDataParallel

    model, reference = make_model(dtype=torch.float32), make_model(dtype=torch.float32)
    model, reference = model.float(), reference.float()
    ddp = DistributedDataParallel(model, comm) if with_ddp else None
    opt = ZeroRedundancyOptimizer(model.parameters(), comm, torch.optim.SGD, stage=stage,
                                  ddp=ddp, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    last = comm.size - 1
    for s in range(5):
        x, y = batch(s)
        x, y = x.float(), y.float()
        if s == 1:
            x[last * (GLOBAL_BATCH // comm.size), 0] = float("inf")  # only the last rank's shard
        opt.zero_grad()
        xs, ys = shard(x, comm.rank, comm.size), shard(y, comm.rank, comm.size)
        scaler.scale(((ddp or model)(xs).float() - ys).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        ref_opt.zero_grad()
        ref_scaler.scale((reference(x).float() - y).pow(2).mean()).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale(), f"step {s}"
    assert scaler.get_scale() < 2.0 ** 10 * 2  # backed off once, grew at most once
    assert_same_params(model, reference)
    assert_replicas_identical(model, comm)
    if ddp is not None:
        ddp.close()


def test_training_job_zero2_and_zero1_with_fp16_hook_follow_adamw(world, subcomms):
    """The train command's configurations: zero2 and zero1+fp16 give AdamW's loss curve."""
    from mpiring.tools.train.data import read_corpus
    from mpiring.tools.train.loop import TrainConfig, TrainJob, train

    comm = subcomms[world.size]
    train_bytes, val_bytes, _ = read_corpus(150_000)
    common = dict(preset="tiny", steps=3, lr=3e-3, seed=3, val_batches=1, log_every=3,
                  batch_size=3, bucket_mb=0.05, first_bucket_mb=0.01)
    curves = {}
    for name, extra in (("adamw", {}), ("zero2", dict(optimizer="zero2")),
                        ("zero1-fp16", dict(optimizer="zero1", comm_hook="fp16"))):
        job = TrainJob(comm, TrainConfig(**common, **extra), train_data=train_bytes,
                       val_data=val_bytes)
        curves[name] = train(job).losses
        if name == "zero1-fp16":
            assert job.comm_hook_state.bytes_sent * 2 == job.comm_hook_state.dense_bytes
            state = job.state_dict()  # a collective with a sharded optimizer: full state everywhere
            assert len(state["optimizer"]["state"]) == len(list(job.model.parameters()))
        job.close()
    np.testing.assert_allclose(curves["zero2"], curves["adamw"], rtol=1e-5)
    np.testing.assert_allclose(curves["zero1-fp16"], curves["adamw"], rtol=2e-3)


def test_comm_defaults_to_the_process_group(world):
    import mpiring.comm.default as default

    model = torch.nn.Linear(3, 2)
    before = default._default
    default._default = None
    try:
        with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: no communicator: call "
                                             r"mpiring.init_process_group\(\)"):
            ZeroRedundancyOptimizer(model.parameters())
        default._default = world
        opt = ZeroRedundancyOptimizer(model.parameters(), lr=0.1)
        assert opt.comm is world
    finally:
        default._default = before
