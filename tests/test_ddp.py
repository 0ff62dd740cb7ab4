"""mpiring.DistributedDataParallel and the parameter server, on K = 1..4 ranks.

References are computed on every rank without communication: the same model
run by one process on the concatenated global batch (float64, so that the
only difference is summation order).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mpiring.parallel.data import DistributedDataParallel as DDP
from mpiring.parallel.data import ParameterServer
from mpiring.parallel.data.bucketing import MIB
from mpiring.runtime.trace import Tracer

PER_RANK = 3
SMALL = 1100 / MIB    # bucket caps in MiB: a few parameters of the MLP per bucket
TINY = 300 / MIB


@pytest.fixture(scope="module", autouse=True)
def _warm_torch_optim():
    # torch.optim imports torch._dynamo on first use (seconds of CPU): every rank
    # pays for it here, side by side, not one after another inside tests where
    # the other ranks of a communicator wait.
    import torch._dynamo  # noqa: F401


class Recorder(Tracer):
    """A tracer that keeps its records in memory."""

    def __init__(self, rank: int):
        super().__init__(rank)
        self.records: list[dict] = []

    @property
    def enabled(self) -> bool:
        return True

    def write(self, rec) -> None:
        self.records.append(rec)

    def events(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("type") == "event" and r["name"] == name]


def mlp(seed: int, widths=(6, 16, 16, 16, 3)) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def global_batch(k: int, salt: int, features: int = 6, outputs: int = 3):
    g = torch.Generator().manual_seed(1000 + 17 * k + salt)
    return (torch.randn(k * PER_RANK, features, generator=g, dtype=torch.float64),
            torch.randn(k * PER_RANK, outputs, generator=g, dtype=torch.float64))


def shard(t: torch.Tensor, comm) -> torch.Tensor:
    return t[comm.rank * PER_RANK:(comm.rank + 1) * PER_RANK]


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def assert_grads(model: nn.Module, ref: nn.Module, note: str = "") -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=f"{name} {note}")


def sgd(model: nn.Module, lr: float = 0.1) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad


def gather(comm, values) -> np.ndarray:
    """Every rank's 1-d float64/int64 array (same length), as rows."""
    arr = np.ascontiguousarray(values)
    out = np.empty((comm.size, arr.size), dtype=arr.dtype)
    comm.mpi_comm.Allgather(arr, out)
    return out


def flat_params(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


@pytest.mark.parametrize("overlap,view", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "naive", "bucket-view"])
def test_gradients_equal_single_process_of_global_batch(comm, overlap, view):
    model, ref = mlp(1), mlp(1)
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY, overlap=overlap,
              gradient_as_bucket_view=view)
    assert len(ddp.bucket_params) >= 3
    for it in range(3):  # the second iteration runs on the rebuilt buckets
        X, Y = global_batch(comm.size, it)
        model.zero_grad(set_to_none=it != 2)  # also accumulate into zeroed view grads
        ref.zero_grad()
        loss_fn(ddp(shard(X, comm)), shard(Y, comm)).backward()
        loss_fn(ref(X), Y).backward()
        assert_grads(model, ref, f"iteration {it}")
        if view:
            storages = {b.flat.untyped_storage().data_ptr() for b in ddp.reducer.buckets}
            assert all(p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())
        sgd(model)
        sgd(ref)
    ddp.close()


def test_comm_thread_sleeps_while_overlapping_and_drops_done_buckets(comm):
    """The comm thread waits without taking the core from backward, and keeps no old bucket."""
    import gc
    import weakref

    model = mlp(3)
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    naive = DDP(mlp(3), comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY, overlap=False)
    try:
        assert ddp.reducer._bucket_comm.idle == "sleep"
        assert naive.reducer._bucket_comm.idle != "sleep"
        assert comm.idle != "sleep"  # the user's communicator keeps its mode
        X, Y = global_batch(comm.size, 0)
        loss_fn(ddp(shard(X, comm)), shard(Y, comm)).backward()
        old = [weakref.ref(b.flat) for b in ddp.reducer.buckets]
        model.zero_grad(set_to_none=True)
        out = ddp(shard(X, comm))  # the buckets are rebuilt before this forward
        assert ddp.reducer.rebuilt
        gc.collect()
        alive = [r for r in old if r() is not None]
        assert not alive, f"{len(alive)} bucket(s) of the first layout still alive"
        loss_fn(out, shard(Y, comm)).backward()
    finally:
        ddp.close()
        naive.close()


def test_replicas_bit_identical_after_steps(comm):
    model = mlp(seed=comm.rank).float()  # different on every rank until wrapped
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    rows = gather(comm, flat_params(model))
    assert (rows == rows[0]).all(), "construction must take rank 0's parameters"
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for it in range(4):
        X, Y = global_batch(comm.size, it)
        opt.zero_grad()
        loss_fn(ddp(shard(X, comm).float()), shard(Y, comm).float()).backward()
        opt.step()
    rows = gather(comm, flat_params(model))
    assert (rows == rows[0]).all(), "replicas drifted apart"
    ddp.close()


@pytest.mark.deadline(30)  # the old behaviour: a backward that never returned
def test_training_through_a_closed_wrapper_raises_instead_of_hanging(comm):
    torch.manual_seed(0)
    model = mlp(0)
    ddp = DDP(model, comm)
    x, y = global_batch(comm.size, 1)
    loss_fn(ddp(shard(x, comm)), shard(y, comm)).backward()
    ddp.close()
    with pytest.raises(RuntimeError, match="closed.*wrap the module again"):
        loss_fn(ddp(shard(x, comm)), shard(y, comm)).backward()
    with torch.no_grad():  # evaluation still runs, through the wrapper or the module
        torch.testing.assert_close(ddp(shard(x, comm)), model(shard(x, comm)))
    with pytest.raises(RuntimeError, match="closed"):
        ddp.reducer._thread.submit(lambda: None)


def test_no_sync_accumulates_locally_then_reduces_the_sum(comm):
    model, ref, local = mlp(2), mlp(2), mlp(2)
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    (X1, Y1), (X2, Y2) = global_batch(comm.size, 10), global_batch(comm.size, 11)
    with ddp.no_sync():
        loss_fn(ddp(shard(X1, comm)), shard(Y1, comm)).backward()
    loss_fn(local(shard(X1, comm)), shard(Y1, comm)).backward()
    assert_grads(model, local, "inside no_sync: local gradients only")
    loss_fn(ddp(shard(X2, comm)), shard(Y2, comm)).backward()
    loss_fn(ref(X1), Y1).backward()
    loss_fn(ref(X2), Y2).backward()
    assert_grads(model, ref, "after the synced backward: mean of the accumulated sums")
    ddp.close()


class Branchy(nn.Module):
    """``c`` takes part only when asked; ``never`` never does."""

    def __init__(self, with_never: bool = True):
        super().__init__()
        torch.manual_seed(5)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.c = nn.Linear(8, 3)
        self.never = nn.Linear(8, 3) if with_never else None
        self.double()

    def forward(self, x, use_c: bool):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


@pytest.mark.parametrize("option", ["bucket_cap_mb", "find_unused_parameters", "algo"])
def test_options_that_differ_across_ranks_are_refused_on_every_rank(comm, option):
    # A bucket cap of its own on one rank met the others' messages truncated; another
    # algorithm or unused-parameter rule stalled at the first step.
    if comm.size == 1:
        pytest.skip("needs another rank to differ from")
    last = comm.rank == comm.size - 1
    value = {"bucket_cap_mb": 1.0 if last else 25.0, "find_unused_parameters": last,
             "algo": "native" if last else "ring"}[option]
    with pytest.raises(ValueError, match=rf"r{comm.size - 1} have option {option}=.* Pass the "
                                         "same arguments on every rank"):
        DDP(Branchy(with_never=False), comm, **{option: value})


@pytest.mark.deadline(30)  # the old behaviour: the good ranks waited for the stall deadline
@pytest.mark.parametrize("option", ["bucket_cap_mb", "first_bucket_mb", "algo"])
def test_a_bad_option_on_one_rank_raises_on_every_rank(comm, option):
    last = comm.rank == comm.size - 1
    good = {"bucket_cap_mb": 25.0, "first_bucket_mb": 1.0, "algo": "ring"}[option]
    bad = {"bucket_cap_mb": -1, "first_bucket_mb": float("inf"), "algo": "rign"}[option]
    with pytest.raises(ValueError, match=rf"r{comm.size - 1}: .*{option}="):
        DDP(Branchy(with_never=False), comm, **{option: bad if last else good})


def test_a_parameter_used_only_under_no_sync_is_averaged(comm):
    # c takes part in the no_sync micro-batch only: the synced backward does not reach
    # it, yet its accumulated gradient must be averaged over the ranks, not left local.
    model = Branchy(with_never=False)
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY, find_unused_parameters=True)
    X0, Y0 = global_batch(comm.size, 40)
    X1, Y1 = global_batch(comm.size, 41)
    with ddp.no_sync():
        loss_fn(ddp(shard(X0, comm), True), shard(Y0, comm)).backward()
    loss_fn(ddp(shard(X1, comm), False), shard(Y1, comm)).backward()
    ref = Branchy(with_never=False)
    ref.load_state_dict(model.state_dict())
    (loss_fn(ref(X0, True), Y0) + loss_fn(ref(X1, False), Y1)).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    ddp.close()


def test_a_gradient_after_its_bucket_went_out_raises(comm):
    # b is not reached from the output, so it is marked unused and its bucket goes out;
    # then the loss's other term gives it a gradient. torch raises; so must this, not
    # step with each rank's own gradient of b.
    class Aux(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.a, self.b = nn.Linear(6, 3), nn.Linear(6, 3)
            self.double()

        def forward(self, x):
            self.extra = self.b(x)  # an auxiliary term the loss picks up
            return self.a(x)

    model = Aux()
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY, find_unused_parameters=True)
    X, Y = global_batch(comm.size, 50)
    out = ddp(shard(X, comm))
    with pytest.raises(RuntimeError, match="reported a gradient after it had already been "
                                           f"reduced or marked unused \\(rank\\(s\\) r{comm.rank}"):
        loss_fn(out + model.extra, shard(Y, comm)).backward()
    ddp.close()


def test_a_comm_hook_on_some_ranks_only_is_refused_on_every_rank(comm):
    from mpiring.parallel.data import comm_hooks

    if comm.size == 1:
        pytest.skip("needs a rank without the hook")
    model = Branchy(with_never=False)
    ddp = DDP(model, comm)
    if comm.rank == comm.size - 1:
        ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    X, _ = global_batch(comm.size, 60)
    with pytest.raises(ValueError, match=rf"different comm hooks \(r0: none, .*r{comm.size - 1}: "
                                         r"fp16_compress_hook\)"):
        ddp(shard(X, comm), False)
    ddp.close()


def test_a_sparse_embedding_is_refused_when_wrapped(comm):
    # Refused on every rank at construction, not at the first backward.
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)).double()
    with pytest.raises(TypeError, match="0 is built with sparse=True: use sparse=False"):
        DDP(model, comm)


class Complexish(nn.Module):
    """A complex weight between real ones (torch DDP reduces complex gradients too)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.w = nn.Parameter(torch.randn(3, 6, dtype=torch.complex128))
        self.b = nn.Parameter(torch.randn(3, dtype=torch.float64))

    def forward(self, x):
        return (x.to(self.w.dtype) @ self.w.T).abs() * self.a + self.b


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket-view"])
def test_complex_parameters_are_averaged_like_real_pairs(comm, view):
    model, ref = Complexish(), Complexish()
    with torch.no_grad():
        model.w.add_(comm.rank)  # construction takes rank 0's values
    # Tiny buckets: the complex weight gets a bucket of its own, the status tail another.
    ddp = DDP(model, comm, bucket_cap_mb=TINY / 8, first_bucket_mb=TINY / 8,
              gradient_as_bucket_view=view)
    # Before the first forward (a hook may be registered only then).
    with pytest.raises(TypeError, match="w is complex, and comm hooks reduce real"):
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    for it in range(2):
        X, Y = global_batch(comm.size, 40 + it)
        for m in (model, ref):
            m.zero_grad()
        loss_fn(ddp(shard(X, comm)), shard(Y, comm)).backward()
        loss_fn(ref(X), Y).backward()
        assert_grads(model, ref, f"iteration {it}")
        sgd(model)
        sgd(ref)
    ddp.close()


def test_a_dataclass_output_is_searched_for_tensors(comm):
    # find_unused_parameters walks the output for the graph: a dataclass's fields too
    # (torch's _find_tensors), else every parameter looks unused and no rank's gradient
    # is averaged.
    import dataclasses

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        tag: str = "logits"

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Branchy(with_never=False)

        def forward(self, x):
            return Out(self.inner(x, True))

    model = Wrapped()
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY, find_unused_parameters=True)
    X, Y = global_batch(comm.size, 31)
    loss_fn(ddp(shard(X, comm)).y, shard(Y, comm)).backward()
    ref = Wrapped()
    ref.load_state_dict(model.state_dict())
    loss_fn(ref(X).y, Y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    ddp.close()


def test_unused_parameters_with_flag(comm):
    model = Branchy()
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY, find_unused_parameters=True)
    for it in range(2):
        X, Y = global_batch(comm.size, 20 + it)
        uses = [(r + it) % 2 == 0 for r in range(comm.size)]
        model.zero_grad()
        loss_fn(ddp(shard(X, comm), uses[comm.rank]), shard(Y, comm)).backward()
        # Expected: each rank's local gradient (zero where a layer was unused), averaged.
        expected: dict[str, torch.Tensor] = {}
        for r in range(comm.size):
            ref = Branchy()
            ref.load_state_dict(model.state_dict())
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            loss_fn(ref(X[sl], uses[r]), Y[sl]).backward()
            for name, p in ref.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                expected[name] = expected.get(name, 0) + g / comm.size
        for name, p in model.named_parameters():
            if name.startswith("never"):
                assert p.grad is None, "a parameter unused on every rank keeps .grad untouched"
            elif name.startswith("c") and not any(uses):
                assert p.grad is None
            else:
                torch.testing.assert_close(p.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
        sgd(model)
    ddp.close()


def test_unused_parameters_without_flag_raise_on_every_rank(comm):
    model = Branchy(with_never=False)
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    X, Y = global_batch(comm.size, 30)
    last = comm.size - 1
    out = ddp(shard(X, comm), use_c=comm.rank != last)
    with pytest.raises(RuntimeError, match=r"c\.weight.*c\.bias|c\.bias.*c\.weight") as info:
        loss_fn(out, shard(Y, comm)).backward()
    message = str(info.value)
    assert f"rank(s) r{last}" in message and "find_unused_parameters=True" in message
    # The reduction finished everywhere, so the model can go on when all is used again.
    ref = Branchy(with_never=False)
    ref.load_state_dict(model.state_dict())
    model.zero_grad()
    loss_fn(ddp(shard(X, comm), use_c=True), shard(Y, comm)).backward()
    loss_fn(ref(X, True), Y).backward()
    assert_grads(model, ref)
    ddp.close()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # used at the input and at the output
        self.double()

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def test_tied_weights_reduced_once(comm):
    model, ref = Tied(), Tied()
    ddp = DDP(model, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    assert sorted(i for b in ddp.bucket_params for i in b) == [0, 1, 2]
    g = torch.Generator().manual_seed(40 + comm.size)
    idx = torch.randint(0, 10, (comm.size * PER_RANK, 5), generator=g)
    target = torch.randint(0, 10, (comm.size * PER_RANK * 5,), generator=g)
    ce = nn.functional.cross_entropy
    mine = slice(comm.rank * PER_RANK * 5, (comm.rank + 1) * PER_RANK * 5)
    ce(ddp(shard(idx, comm)).reshape(-1, 10), target[mine]).backward()
    ce(ref(idx).reshape(-1, 10), target).backward()
    assert_grads(model, ref)
    ddp.close()


def test_batchnorm_buffers_follow_rank0(comm):
    def make():
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()

    for broadcast in (True, False):
        model = make()
        with torch.no_grad():
            model[1].running_mean.fill_(float(comm.rank))  # rank-dependent before wrapping
        ddp = DDP(model, comm, broadcast_buffers=broadcast)
        # As torch: broadcast_buffers=False keeps each rank's own buffers at construction.
        want = 0.0 if broadcast else 8.0 * comm.rank
        assert float(model[1].running_mean.sum()) == want, "construction takes rank 0's buffers"
        seen: list[torch.Tensor] = []
        model[1].register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(m.running_mean.clone()))
        for it in range(2):
            X, Y = global_batch(comm.size, 50 + it)
            loss_fn(ddp(shard(X, comm)), shard(Y, comm)).backward()
        after_first = gather(comm, seen[1].numpy())  # buffers as the 2nd forward saw them
        same = bool((after_first == after_first[0]).all())
        assert same == (broadcast or comm.size == 1)
        assert int(gather(comm, model[1].num_batches_tracked.reshape(1).numpy())[:, 0].min()) == 2
        ddp.close()


class Shuffled(nn.Module):
    """Registered l0..l3, used in the order l2, l0, l3, l1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(8, 8) for _ in range(4))
        self.double()

    def forward(self, x):
        for layer in (self.l2, self.l0, self.l3, self.l1):
            x = torch.tanh(layer(x))
        return x


LAYER_BYTES = (64 + 8) * 8 / MIB  # one Linear(8, 8) of float64 per bucket


def test_forward_order_differs_from_registration_order(comm):
    model, ref = Shuffled(), Shuffled()
    rec = Recorder(comm.rank)
    sub = comm.dup()
    sub.tracer = rec
    ddp = DDP(model, sub, bucket_cap_mb=LAYER_BYTES, first_bucket_mb=LAYER_BYTES)
    layer = lambda b: {i // 2 for i in b}  # noqa: E731  (params 2j, 2j+1 belong to layer j)
    assert [layer(b) for b in ddp.bucket_params] == [{3}, {2}, {1}, {0}]
    for it in range(3):
        X, _ = global_batch(comm.size, 60 + it, features=8, outputs=8)
        model.zero_grad()
        ref.zero_grad()
        ddp(shard(X, comm)).pow(2).mean().backward()
        ref(X).pow(2).mean().backward()
        assert_grads(model, ref, f"iteration {it}")
    # Rebuilt after the first iteration from the observed order: l1, l3, l0, l2.
    assert [layer(b) for b in ddp.bucket_params] == [{1}, {3}, {0}, {2}]
    layout = np.array([i for b in ddp.bucket_params for i in b] + [len(b) for b in ddp.bucket_params])
    rows = gather(comm, layout.astype(np.int64))
    assert (rows == rows[0]).all(), "bucket layout must be the same on every rank"

    # Launch order from the trace: 0, 1, 2, 3 in every iteration, on every rank,
    # although in iteration 0 bucket 2 (l1) was complete first.
    events = sorted(rec.events("ddp.all_reduce"), key=lambda e: e["t_start"])
    order = [(e["iteration"], e["bucket"]) for e in events]
    assert order == [(it, b) for it in range(3) for b in range(4)]
    rows = gather(comm, np.array([b for _, b in order], dtype=np.int64))
    assert (rows == rows[0]).all()
    ddp.close()


def _overlapped(comm, overlap: bool, iterations: int = 3) -> list[bool]:
    """Per iteration: did some bucket's AllReduce start before backward ended?"""
    torch.manual_seed(9)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(192, 192), nn.Tanh()) for _ in range(6)])
    rec = Recorder(comm.rank)
    sub = comm.dup()
    sub.tracer = rec
    ddp = DDP(model, sub, bucket_cap_mb=0.14, first_bucket_mb=0.14, overlap=overlap)
    x = torch.randn(256, 192, generator=torch.Generator().manual_seed(comm.rank))
    for _ in range(iterations):
        ddp(x).pow(2).mean().backward()
    ddp.close()
    result = []
    for it in range(iterations):
        end = [e["t_end"] for e in rec.events("ddp.backward") if e["iteration"] == it][0]
        starts = [e["t_start"] for e in rec.events("ddp.all_reduce") if e["iteration"] == it]
        assert len(starts) == len(ddp.bucket_params) >= 4
        result.append(min(starts) < end)
    return result


def test_overlap_visible_in_trace(comm):
    if comm.size not in (2, 4):
        pytest.skip("trace overlap checked on 2 and 4 ranks")
    naive = _overlapped(comm, overlap=False)
    assert not any(naive), "overlap=False must not start any AllReduce before backward ends"
    overlapped = _overlapped(comm, overlap=True)
    # Thread scheduling on a loaded machine can delay one iteration; not all of them.
    assert any(overlapped), f"no bucket started before backward ended: {overlapped}"


def test_matches_torch_ddp_over_gloo(world):
    from mpiring.tools.train.torch_pg import destroy_torch_process_group, init_torch_process_group

    pg = init_torch_process_group(world, torch.device("cpu"))
    try:
        _compare_with_torch_ddp(world, pg)
    finally:
        # torch's DDP is gone with the helper's frame: nothing uses the group any more.
        destroy_torch_process_group(world)


def _compare_with_torch_ddp(world, pg) -> None:
    ours, theirs = mlp(11), mlp(11)
    ddp = DDP(ours, world, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    tddp = nn.parallel.DistributedDataParallel(theirs, process_group=pg, bucket_cap_mb=SMALL)
    try:
        for it in range(2):
            X, Y = global_batch(world.size, 70 + it)
            loss_fn(ddp(shard(X, world)), shard(Y, world)).backward()
            loss_fn(tddp(shard(X, world)), shard(Y, world)).backward()
            assert_grads(ours, theirs, f"iteration {it}")
            for m in (ours, theirs):
                sgd(m)
                m.zero_grad()
    finally:
        ddp.close()


def test_model_difference_raises_on_every_rank_naming_it(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    torch.manual_seed(0)
    width = 5 if comm.rank == 1 else 4
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, width))
    with pytest.raises(ValueError, match=r"rank\(s\) r1 differ") as info:
        DDP(model, comm)
    message = str(info.value)
    assert "parameter 1.weight shape (5, 4)" in message and "shape (4, 4)" in message


def test_parameter_server_matches_ddp(comm):
    a, b = mlp(12), mlp(12)
    ddp = DDP(a, comm, bucket_cap_mb=SMALL, first_bucket_mb=TINY)
    opt = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    ps = ParameterServer(b, comm, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                         server=comm.size - 1, bucket_cap_mb=SMALL)
    assert (ps.optimizer is not None) == (comm.rank == comm.size - 1)
    for it in range(3):
        X, Y = global_batch(comm.size, 80 + it)
        opt.zero_grad()
        ps.zero_grad()
        loss_fn(ddp(shard(X, comm)), shard(Y, comm)).backward()
        loss_fn(b(shard(X, comm)), shard(Y, comm)).backward()
        opt.step()
        ps.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    rows = gather(comm, flat_params(b))
    assert (rows == rows[0]).all(), "workers must hold the server's parameters"
    ddp.close()


def test_parameter_server_leaves_parameters_without_any_gradient_alone(comm):
    """A layer no rank uses keeps grad None on the server, so AdamW's weight decay skips
    it, as one process with torch's AdamW does; the used layer matches torch too."""
    def make():
        torch.manual_seed(0)
        return nn.ModuleDict({"used": nn.Linear(6, 3), "unused": nn.Linear(6, 3)}).double()

    model, reference = make(), make()
    ps = ParameterServer(model, comm, lambda ps_: torch.optim.AdamW(ps_, lr=0.1, weight_decay=0.5))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    for it in range(3):
        X, Y = global_batch(comm.size, 90 + it)
        ps.zero_grad()
        loss_fn(model["used"](shard(X, comm)), shard(Y, comm)).backward()
        ps.step()
        ref_opt.zero_grad()
        loss_fn(reference["used"](X), Y).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12, msg=name)
    if ps.is_server:
        assert model["unused"].weight.grad is None


def test_static_graph_with_a_never_used_parameter_matches_torch_ddp(world):
    """torch's static_graph needs no find_unused_parameters for a parameter that is never
    used: it finds the unused set in the first iteration. So does ours, gradients equal."""
    from mpiring.tools.train.torch_pg import destroy_torch_process_group, init_torch_process_group

    pg = init_torch_process_group(world, torch.device("cpu"))
    ours, theirs = Branchy(), Branchy()
    ddp = DDP(ours, world, bucket_cap_mb=SMALL, first_bucket_mb=TINY, static_graph=True)
    tddp = nn.parallel.DistributedDataParallel(theirs, process_group=pg, bucket_cap_mb=SMALL,
                                               static_graph=True)
    try:
        for it in range(3):
            X, Y = global_batch(world.size, 60 + it)
            for m in (ours, theirs):
                m.zero_grad()
            loss_fn(ddp(shard(X, world), True), shard(Y, world)).backward()
            loss_fn(tddp(shard(X, world), True), shard(Y, world)).backward()
            for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
                if q.grad is None:
                    assert p.grad is None, f"{name} iteration {it}"
                else:
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12,
                                               msg=f"{name} iteration {it}")
            assert ours.never.weight.grad is None
    finally:
        ddp.close()
        del tddp
        destroy_torch_process_group(world)


def test_a_dropped_wrapper_stops_its_thread_and_leaves_the_module_alone(comm):
    """torch's DDP has no close(): a wrapper that is simply dropped must not keep its
    communication thread, nor hooks that tie it to the module it wrapped."""
    import gc

    model, twin = mlp(3), mlp(3)
    ddp = DDP(model, comm)
    X, Y = global_batch(comm.size, 5)
    loss_fn(ddp(shard(X, comm)), shard(Y, comm)).backward()
    thread = ddp.reducer._thread
    del ddp
    gc.collect()
    thread._thread.join(timeout=10)
    assert not thread._thread.is_alive(), "the dropped wrapper's thread still runs"
    for m in (model, twin):  # the bare module trains on its own again: local gradients
        m.zero_grad()
        loss_fn(m(shard(X, comm)), shard(Y, comm)).backward()
    assert_grads(model, twin, "after the wrapper was dropped")
