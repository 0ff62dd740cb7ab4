"""DDP communication hooks: against torch's own hooks (gloo), against plain DDP, and their invariants."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch_gloo import gloo_world  # noqa: E402

from mpiring.parallel.data import DistributedDataParallel  # noqa: E402
from mpiring.parallel.data import comm_hooks as ch  # noqa: E402

SHAPES = [(24, 10), (10,), (16, 3, 2), (7,), (12, 12)]


def bucket_of(comm, step, shapes=SHAPES, dtype=torch.float32, scale=1.0, params=None):
    """A GradBucket over fake parameters with rank- and index-dependent gradients
    (pass the same ``params`` every step: a hook keeps its state per parameter)."""
    params = params or [torch.zeros(s, dtype=dtype) for s in shapes]
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    g = torch.Generator().manual_seed(97 * step + comm.rank)
    buf = (torch.randn(total, generator=g, dtype=torch.float64) * scale).to(dtype)
    return ch.GradBucket(0, buf, params, offsets, True, comm)


def exact_mean(comm, buf):
    return torch.from_numpy(np.mean(comm.mpi_comm.allgather(buf.double().numpy()), axis=0))


@pytest.mark.deadline(90)
def test_hooks_equal_torch_hooks_on_the_same_bucket(world, subcomms):
    """fp16, bf16 and PowerSGD (6 iterations: warm start, error feedback) vs torch's, via gloo."""
    dist = gloo_world(world)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps

    comm = subcomms[world.size]
    for ours, theirs, rtol in ((ch.fp16_compress_hook, default_hooks.fp16_compress_hook, 3e-3),
                               (ch.bf16_compress_hook, default_hooks.bf16_compress_hook, 2e-2)):
        a, b = bucket_of(comm, 0, scale=100.0), bucket_of(comm, 0, scale=100.0)
        mean = exact_mean(comm, a.buffer())
        out_a = ours(ch.HookState(), a)
        out_b = theirs(None, b).wait()
        scale = float(mean.abs().max())
        torch.testing.assert_close(out_a.double(), out_b.double(), rtol=0, atol=rtol * scale)
        torch.testing.assert_close(out_a.double(), mean, rtol=0, atol=rtol * scale)

    # PowerSGD: torch's hook takes our bucket as it is (it only calls the same methods).
    mine = ch.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    torchs = tps.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    for step in range(6):
        a, b = bucket_of(comm, step), bucket_of(comm, step)
        out_a = ch.powerSGD_hook(mine, a)
        out_b = tps.powerSGD_hook(torchs, b).wait()
        torch.testing.assert_close(out_a, out_b, rtol=1e-4, atol=1e-5, msg=f"step {step}")
    assert mine.iter == torchs.iter == 6
    assert mine.bytes_sent < mine.dense_bytes or comm.size == 1  # one rank sends nothing
    dist.barrier()


def test_topk_error_feedback_conserves_the_gradient(comm):
    """Sent so far + what every rank still holds back = the sum of all mean gradients."""
    state = ch.TopKState(ratio=0.05)
    total_sent = torch.zeros(0, dtype=torch.float64)
    total_mean = None
    params = [torch.zeros(s) for s in SHAPES]
    for step in range(4):
        b = bucket_of(comm, step, params=params)
        mean = exact_mean(comm, b.buffer())
        # The first step by hand: each rank's top-k of g / K, summed over ranks.
        if step == 0:
            parts = comm.mpi_comm.allgather(b.buffer().double().numpy() / comm.size)
            k = int(np.ceil(0.05 * b.buffer().numel()))
            ref = np.zeros_like(parts[0])
            for part in parts:
                top = np.argsort(-np.abs(part))[:k]
                ref[top] += part[top]
        out = ch.topk_hook(state, b).double()
        if step == 0:
            np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-7)
            assert int((out != 0).sum()) <= comm.size * k
        total_sent = out if total_sent.numel() == 0 else total_sent + out
        total_mean = mean if total_mean is None else total_mean + mean
    held_back = exact_mean(comm, state.errors[0]) * comm.size
    torch.testing.assert_close(total_sent + held_back, total_mean, rtol=1e-5, atol=1e-5)
    if comm.size > 1:
        # the AllGather grows with K: dense / sparse = 1 / (K ratio) = 5 at K = 4
        assert state.bytes_sent < state.dense_bytes / 4


class Shuffled(torch.nn.Module):
    """Layers registered in an order other than the forward's (heads declared first),
    so DDP's rebuild after the first backward reorders the parameters in the bucket."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 3)
        self.mid = torch.nn.Linear(8, 8)
        self.inp = torch.nn.Linear(6, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def test_topk_error_feedback_follows_the_bucket_rebuild(comm):
    """Per parameter: applied so far + what every rank holds back = the sum of the true
    means (one-process torch), across DDP's rebuild with the default start_iter=0."""
    torch.manual_seed(0)
    model = Shuffled()
    torch.manual_seed(0)
    reference = Shuffled()
    ddp = DistributedDataParallel(model, comm)
    state = ch.TopKState(ratio=0.05)
    ddp.register_comm_hook(state, ch.topk_hook)
    before = [list(b) for b in ddp.bucket_params]
    applied = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    true = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    k = comm.size
    for s in range(3):
        x = torch.randn(2 * k, 6, generator=torch.Generator().manual_seed(s))
        model.zero_grad()
        ddp(x[2 * comm.rank:2 * comm.rank + 2]).pow(2).sum().backward()
        reference.zero_grad()
        (reference(x).pow(2).sum() / k).backward()
        for a, t, p, q in zip(applied, true, model.parameters(), reference.parameters()):
            a += p.grad
            t += q.grad
    if k > 1:
        assert ddp.bucket_params != before  # the rebuild did reorder the bucket
    red = ddp.reducer
    held = {b: exact_mean(comm, err) * k for b, err in state.errors.items()}
    where = {id(p): red._where[i] for i, p in enumerate(red.params)}
    for (name, p), a, t in zip(model.named_parameters(), applied, true):
        b, off = where[id(p)]
        mine = held[b][off:off + p.numel()].view_as(p) if b in held else 0
        torch.testing.assert_close(a + mine, t, rtol=1e-5, atol=1e-6, msg=name)
    ddp.close()


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 32)
        self.b = torch.nn.Linear(32, 32)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def make_tiny():
    torch.manual_seed(0)
    return Tiny()


def data_for(step, rank, size, n=8):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(n * size, 12, generator=g), torch.randn(n * size, 4, generator=g)
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def train(model, comm, steps, micro=1, fixed=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = data_for(m if fixed else 10 * s + m, comm.rank, comm.size)
            if m < micro - 1:  # accumulate locally, reduce with the last micro-batch
                with model.no_sync():
                    ((model(x) - y) ** 2).mean().backward()
                continue
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def params_of(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("numel", [1001, 8, 0])
def test_allreduce_hook_sums_the_status_tail_with_the_gradients(comm, numel):
    """As the reducer without a hook: one AllReduce over gradients and tail, so the ring
    cuts the same chunks and sums every element in the same order."""
    from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO
    if comm.size == 1:
        pytest.skip("nothing to reduce")
    g = torch.Generator().manual_seed(comm.rank)
    # Magnitudes apart by rank: the order of the sum shows in the last bits.
    grads = torch.randn(numel, generator=g) * 10.0 ** comm.rank
    status = torch.arange(comm.size + 3, dtype=torch.float32) + comm.rank
    want = torch.cat([grads / comm.size, status])
    comm.all_reduce(want, op="sum", algo=DEFAULT_BUCKET_ALGO, check=False)
    flat = torch.cat([grads, status])
    state = ch.HookState()
    ch.run_comm_hook(state, ch.allreduce_hook, comm, 0, flat, numel, [torch.zeros(numel)], [0],
                     True, numel, 0)
    assert torch.equal(flat, want)  # the tail summed once, undivided
    assert state.calls == 1


@pytest.mark.parametrize("algo", ["ring-seg", "recursive-doubling", "native"])
def test_allreduce_hook_is_bitwise_plain_ddp_and_no_sync_works(comm, algo):
    # Each with the model's algorithm: another one sums in another order.
    plain = DistributedDataParallel(make_tiny(), comm, algo=algo)
    hooked = DistributedDataParallel(make_tiny(), comm, algo=algo)
    state = ch.HookState()
    hooked.register_comm_hook(state, ch.allreduce_hook)
    train(plain, comm, 3, micro=2)
    train(hooked, comm, 3, micro=2)
    assert torch.equal(params_of(plain), params_of(hooked))
    assert state.calls == 3 * len(hooked.bucket_params)
    with pytest.raises(RuntimeError, match="already registered|before the first backward"):
        hooked.register_comm_hook(state, ch.allreduce_hook)
    plain.close()
    hooked.close()


@pytest.mark.parametrize("name", ("fp16", "bf16", "topk", "powersgd"))
def test_compressed_training_keeps_replicas_identical_and_learns(comm, name):
    if comm.size in (1, 3):
        pytest.skip("runs on K=2 and K=4 only, to save time")
    model = DistributedDataParallel(make_tiny(), comm)
    state, hook = ch.make_hook(name, ratio=0.1, start_iter=2)
    model.register_comm_hook(state, hook)
    losses = train(model, comm, 8, fixed=True)
    mine = params_of(model).numpy()
    for r, theirs in enumerate(comm.mpi_comm.allgather(mine)):
        np.testing.assert_array_equal(theirs, mine, err_msg=f"replica r{r} differs")
    assert losses[-1] < losses[0]
    if comm.size > 1:
        assert 0 < state.bytes_sent < state.dense_bytes
    model.close()


@pytest.mark.deadline(90)
def test_ddp_with_hooks_equals_torch_ddp_with_torch_hooks(world, subcomms):
    """Whole training runs: our DDP + our hook vs torch DDP + torch's hook, same data."""
    dist = gloo_world(world)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    comm = subcomms[world.size]
    cases = [
        (ch.HookState(), ch.fp16_compress_hook, None, default_hooks.fp16_compress_hook, 1e-3),
        (ch.PowerSGDState(start_powerSGD_iter=2), ch.powerSGD_hook,
         tps.PowerSGDState(None, start_powerSGD_iter=2), tps.powerSGD_hook, 1e-4),
    ]
    for our_state, our_hook, their_state, their_hook, tol in cases:
        ours = DistributedDataParallel(make_tiny(), comm)
        ours.register_comm_hook(our_state, our_hook)
        theirs = TorchDDP(make_tiny())
        theirs.register_comm_hook(their_state, their_hook)
        train(ours, comm, 5)
        train(theirs, comm, 5)
        torch.testing.assert_close(params_of(ours), params_of(theirs), rtol=tol, atol=tol,
                                   msg=our_hook.__name__)
        ours.close()
    dist.barrier()


def test_ring_bytes_and_make_hook_without_mpi():
    # 10 float32 elements on 4 ranks: chunks 3, 3, 2, 2. ReduceScatter: all but
    # your own chunk; AllGather: all but your right neighbour's.
    assert [ch.ring_bytes_sent(10, 4, 4, r, ("rs",)) for r in range(4)] == [28, 28, 32, 32]
    assert [ch.ring_bytes_sent(10, 4, 4, r, ("ag",)) for r in range(4)] == [28, 32, 32, 28]
    assert ch.ring_bytes_sent(10, 4, 1, 0, ("rs", "ag")) == 0
    state, hook = ch.make_hook("powersgd", rank=2, start_iter=5)
    assert hook is ch.powerSGD_hook and state.matrix_approximation_rank == 2
    assert ch.make_hook("none") == (None, None)
    with pytest.raises(ValueError, match="unknown comm hook"):
        ch.make_hook("int8")
    with pytest.raises(ValueError, match="start_powerSGD_iter"):
        ch.PowerSGDState(start_powerSGD_iter=1)
