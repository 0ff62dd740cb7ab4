"""Comm hooks as a script ported from torch uses them: hook states saved with torch.save
and resumed, odd parameters, torch's wrappers and debugging hook, hooks returning
futures of another dtype; each against torch DDP (gloo) or an uninterrupted run."""

from __future__ import annotations

import importlib
import io

import pytest

torch = pytest.importorskip("torch")

# DDP's first call imports torch._dynamo (many seconds on a busy machine): at collection,
# outside any test's deadline.
importlib.import_module("torch._dynamo")
from torch import nn  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

from mpiring.parallel.data import DistributedDataParallel as DDP  # noqa: E402
from mpiring.parallel.data import comm_hooks as ch  # noqa: E402
from mpiring.parallel.data.bucketing import DEFAULT_BUCKET_ALGO  # noqa: E402


class Net(nn.Module):
    """Odd sizes, two layers of one shape (PowerSGD batches them), optionally a parameter
    of zero elements (it still gets a gradient: it is used in forward)."""

    def __init__(self, empty: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 9)
        self.c = nn.Linear(9, 13)
        self.d = nn.Linear(13, 3)
        self.e = nn.Parameter(torch.zeros(0, 4)) if empty else None

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        out = self.d(torch.tanh(self.c(h)))
        return out if self.e is None else out + self.e.sum()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 17 * rank)
    n = 2 + rank  # batches of different sizes per rank
    return torch.randn(n, 7, generator=g) * (1 + rank), torch.randn(n, 3, generator=g)


def train(model, net, rank, steps, opt=None, grads=None):
    opt = opt or torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    for s in steps:
        opt.zero_grad()
        x, y = batch(s, rank)
        ((model(x) - y) ** 2).mean().backward()
        if grads is not None:
            grads.append([p.grad.clone() for p in net.parameters() if p.numel()])
        opt.step()
    return opt


def flat(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize("kind", ["powersgd", "topk"])
def test_hook_state_saved_mid_run_resumes_bit_for_bit(comm, kind):
    """torch.save(state) as with torch's PowerSGDState (its __getstate__ drops the process
    group): with process_group=comm the save raised, and a loaded TopKState silently lost
    its error feedback (its layouts named parameters by id(), which a new process lacks)."""
    def new_state():
        if kind == "powersgd":
            return ch.PowerSGDState(process_group=comm, start_powerSGD_iter=2)
        return ch.TopKState(ratio=0.1)
    hook = ch.powerSGD_hook if kind == "powersgd" else ch.topk_hook

    net = Net()
    model = DDP(net, comm)
    model.register_comm_hook(new_state(), hook)
    train(model, net, comm.rank, range(6))
    model.close()
    want = flat(net)

    net = Net()
    model = DDP(net, comm)
    state = new_state()
    model.register_comm_hook(state, hook)
    opt = train(model, net, comm.rank, range(3))
    model.close()
    saved = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "hook": state}, saved)
    saved.seek(0)
    ckpt = torch.load(saved, weights_only=False)
    loaded = ckpt["hook"]
    assert getattr(loaded, "process_group", None) is None  # torch's: the default group
    assert loaded.errors and loaded.iter == state.iter

    net = Net()
    net.load_state_dict(ckpt["model"])
    model = DDP(net, comm)
    model.register_comm_hook(loaded, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    opt.load_state_dict(ckpt["opt"])
    train(model, net, comm.rank, range(3, 6), opt)
    model.close()
    assert torch.equal(flat(net), want), float((flat(net) - want).abs().max())


def test_topk_state_loaded_into_other_buckets_warns_and_restarts(comm):
    """A saved error whose positions fit no bucket of the new model cannot be placed:
    said once, then dropped, instead of being added to other parameters' coordinates."""
    state = ch.TopKState(ratio=0.05)  # k = 1: sparse (with an error to keep) on 1-4 ranks
    params = [torch.zeros(5, 3), torch.zeros(4)]
    g = torch.Generator().manual_seed(comm.rank)
    bucket = ch.GradBucket(0, torch.randn(19, generator=g), params, [0, 15], True, comm)
    ch.topk_hook(state, bucket)
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    other = [torch.zeros(4), torch.zeros(5, 3)]  # the same bucket, the other order
    bucket = ch.GradBucket(0, torch.randn(19, generator=g), other, [0, 4], True, comm)
    with pytest.warns(UserWarning, match="bucket 0's saved error feedback does not fit"):
        ch.topk_hook(loaded, bucket)


def test_powersgd_takes_a_parameter_of_zero_elements(comm):
    """torch's powerSGD_hook fails on it (view(0, -1)); here it goes uncompressed and the
    other parameters' gradients are bit for bit those of the model without it."""
    runs = []
    for empty in (False, True):
        net = Net(empty=empty)
        model = DDP(net, comm)
        model.register_comm_hook(ch.PowerSGDState(start_powerSGD_iter=2), ch.powerSGD_hook)
        grads = []
        train(model, net, comm.rank, range(4), grads=grads)
        model.close()
        runs.append(grads)
    for step, (a, b) in enumerate(zip(*runs)):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {step}"


def test_noop_and_compress_wrappers_equal_torchs(world):
    """torch DDP with torch's noop_hook / fp16_compress_wrapper(hook) against this DDP with
    comm_hooks' namesakes, same processes and data: noop bit for bit (no communication),
    the wrappers to float16's rounding."""
    dist = gloo_world(world)
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    cases = [
        ("noop", (None, ch.noop_hook), (None, debugging_hooks.noop_hook), 0.0),
        ("fp16(allreduce)", (None, ch.fp16_compress_wrapper(ch.allreduce_hook)),
         (None, dh.fp16_compress_wrapper(dh.allreduce_hook)), 2e-3),
        ("fp16(powerSGD)",
         (ch.PowerSGDState(start_powerSGD_iter=2), ch.fp16_compress_wrapper(ch.powerSGD_hook)),
         (tps.PowerSGDState(None, start_powerSGD_iter=2),
          dh.fp16_compress_wrapper(tps.powerSGD_hook)), 5e-3),
    ]
    for name, ours, theirs, tol in cases:
        mine, torchs = [], []
        net = Net()
        model = DDP(net, world)
        model.register_comm_hook(*ours)
        train(model, net, world.rank, range(4), grads=mine)
        model.close()
        net = Net()
        model = TorchDDP(net)
        model.register_comm_hook(*theirs)
        train(model, net, world.rank, range(4), grads=torchs)
        for step, (a, b) in enumerate(zip(mine, torchs)):
            for x, y in zip(a, b):
                if tol == 0:
                    assert torch.equal(x, y), f"{name} step {step}"
                else:
                    torch.testing.assert_close(x, y, rtol=0, atol=tol * float(y.abs().max()),
                                               msg=f"{name} step {step}")
    dist.barrier()


def test_wrapper_sends_the_narrow_dtype_and_counts_the_dense_baseline(comm):
    """The wrapped hook sees a float16 buffer (torch's set_buffer swaps the buffer; a
    copy into the float32 one would send float32), and dense_bytes stays the float32
    AllReduce's so that bytes_sent / dense_bytes is the saving."""
    seen = []

    def spy(state, bucket):
        seen.append(bucket.buffer().dtype)
        return ch.allreduce_hook(state, bucket)

    state = ch.HookState()
    n = 37
    g = torch.Generator().manual_seed(comm.rank)
    grads = torch.randn(n, generator=g) * (comm.rank + 1)
    bucket = ch.GradBucket(0, grads.clone(), [torch.zeros(n)], [0], True, comm)
    out = ch.fp16_compress_wrapper(spy)(state, bucket)
    assert seen == [torch.float16] and out.dtype == torch.float32
    assert out.data_ptr() == bucket.buffer().data_ptr()
    dense = ch.ring_bytes_sent(n, 4, comm.size, comm.rank, ("rs", "ag"))
    assert state.dense_bytes == dense and state.bytes_sent * 2 == dense
    want = grads.half().div_(comm.size)  # cast, then divide in float16, then sum
    comm.all_reduce(want, op="sum", algo=DEFAULT_BUCKET_ALGO, check=False)
    assert torch.equal(out, want.float())


def test_user_hook_returning_a_future_of_another_dtype(comm):
    """A hook written as torch's are: a Future whose value is a float16 list; its result is
    cast into the float32 bucket, bit for bit fp16_compress_hook's."""
    def my_hook(state, bucket):
        wire = bucket.buffer().div_(bucket.comm.size).to(torch.float16)
        bucket.comm.all_reduce(wire, op="sum", algo=DEFAULT_BUCKET_ALGO, check=False)
        fut = torch.futures.Future()
        fut.set_result([wire])
        return fut.then(lambda f: f.value()[0])

    runs = []
    for hook in (my_hook, ch.fp16_compress_hook):
        net = Net()
        model = DDP(net, comm)
        model.register_comm_hook(None, hook)
        grads = []
        train(model, net, comm.rank, range(3), grads=grads)
        model.close()
        runs.append(grads)
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("options", [{"gradient_as_bucket_view": True}, {"static_graph": True}],
                         ids=["bucket_view", "static_graph"])
def test_powersgd_with_accumulation_and_ddp_options_equals_torchs(world, options):
    """no_sync accumulation plus torch's DDP options: the same PowerSGD numbers as torch
    DDP with torch's hook (the sum order of the AllReduce differs: a tolerance)."""
    dist = gloo_world(world)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    runs = []
    for ours in (True, False):
        net = Net()
        if ours:
            model = DDP(net, world, **options)
            model.register_comm_hook(ch.PowerSGDState(matrix_approximation_rank=2,
                                                      start_powerSGD_iter=2), ch.powerSGD_hook)
        else:
            model = TorchDDP(net, **options)
            model.register_comm_hook(tps.PowerSGDState(None, matrix_approximation_rank=2,
                                                       start_powerSGD_iter=2), tps.powerSGD_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        grads = []
        for s in range(4):
            opt.zero_grad()
            if s > 0:  # torch's static_graph needs a synced first iteration (it asserts)
                x, y = batch(2 * s, world.rank)
                with model.no_sync():  # accumulated locally, reduced with the next
                    ((model(x) - y) ** 2).mean().backward()
            x, y = batch(2 * s + 1, world.rank)
            ((model(x) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            opt.step()
        if ours:
            model.close()
        runs.append(grads)
    for step, (a, b) in enumerate(zip(*runs)):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    dist.barrier()


def test_torchs_own_hooks_and_states_map_to_mpirings(world):
    """register_comm_hook(torch_state, torch_hook) as a torch script writes it, through
    torch_equivalent: the same numbers as torch DDP with them, and torch's own
    PowerSGDState object advances (so saving it checkpoints the run, as with torch)."""
    dist = gloo_world(world)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    def psgd():
        return tps.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                 batch_tensors_with_same_shape=True)

    for make, tol in (((lambda: (psgd(), tps.powerSGD_hook)), 1e-5),
                      ((lambda: (None, dh.fp16_compress_wrapper(dh.allreduce_hook))), 2e-3)):
        runs, states = [], []
        for ours in (True, False):
            net = Net()
            state, hook = make()
            states.append(state)
            if ours:
                model = DDP(net, world)
                model.register_comm_hook(state, hook)  # torch's, mapped by DDP
            else:
                model = TorchDDP(net)
                model.register_comm_hook(state, hook)
            grads = []
            train(model, net, world.rank, range(4), grads=grads)
            if ours:
                model.close()
            runs.append(grads)
        for step, (a, b) in enumerate(zip(*runs)):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=tol, atol=tol * float(y.abs().max()),
                                           msg=f"step {step}")
        if states[0] is not None:
            assert states[0].iter == states[1].iter == 4
            assert states[0].error_dict.keys() == states[1].error_dict.keys()
    assert ch.torch_equivalent(psgd(), tps.batched_powerSGD_hook) is None
    assert ch.torch_equivalent(None, dh.fp16_compress_wrapper(tps.batched_powerSGD_hook)) is None
    dist.barrier()


def test_a_raising_hook_is_named_with_its_bucket_on_every_rank(comm):
    """A hook that raises (here on every rank, before any collective, so nobody waits):
    the error at the end of backward names the hook, the bucket and the rank."""
    def bad_hook(state, bucket):
        if bucket.index() == 0:
            raise ValueError("no such compression")
        return ch.allreduce_hook(state, bucket)

    net = Net()
    model = DDP(net, comm)
    model.register_comm_hook(None, bad_hook)
    x, y = batch(0, comm.rank)
    with pytest.raises(RuntimeError, match=rf"comm hook '.*bad_hook' raised ValueError on "
                                           rf"bucket 0 \(rank {comm.rank}\): no such compression"):
        ((model(x) - y) ** 2).mean().backward()
    model.close()
