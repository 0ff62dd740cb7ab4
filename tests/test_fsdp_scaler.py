"""FSDP with float16 compute and a loss scaler: every rank skips an overflowed step, or none.

An overflow lands in one rank's shard only (the first element of a unit's flat),
so a per-rank ``torch.amp.GradScaler`` would skip there alone. The twin is one
process on the whole batch: float32 master weights, a float16 compute copy and
torch's own GradScaler, as FSDP's ``MixedPrecision(float16, reduce_dtype=float32)``.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import mpiring  # noqa: E402
from mpiring.parallel.fsdp import FullyShardedDataParallel, MixedPrecision  # noqa: E402

GLOBAL = 60
INIT_SCALE = 2.0 ** 10


class Gain(nn.Module):
    """``w(x) + (g - 1) * k``: g's gradient is k times the others'; g (registered on this
    module itself, before w's) is first in the flat: rank 0's shard."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(5, 5)
        self.g = nn.Parameter(torch.ones(1))
        self.k = 1.0  # set to 1e4 for the step that must overflow

    def forward(self, x):
        return self.w(x) + (self.g - 1) * self.k


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 5)
        self.blocks = nn.ModuleList([Gain()])

    def forward(self, x):
        return self.blocks[0](torch.tanh(self.inp(x)))


def make():
    torch.manual_seed(7)
    return Net()


def batch(step):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(GLOBAL, 5, generator=g)
    y = torch.randn(GLOBAL, 5, generator=g) * (1 + torch.arange(GLOBAL).reshape(-1, 1) / GLOBAL)
    return x, y


def mine(t, comm):
    per = t.shape[0] // comm.size
    return t[comm.rank * per:(comm.rank + 1) * per]


def loss_of(out, y):
    return ((out.float() - y) ** 2).mean()


def twin(steps, ks):
    """One process: float16 compute copy of float32 weights, torch's GradScaler."""
    ref = make()
    half = copy.deepcopy(ref).half()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    scales = []
    for s in range(steps):
        half.blocks[0].k = ks[s]
        with torch.no_grad():
            for h, p in zip(half.parameters(), ref.parameters()):
                h.copy_(p)
        half.zero_grad(set_to_none=True)
        opt.zero_grad()
        x, y = batch(s)
        scaler.scale(loss_of(half(x.half()), y)).backward()
        for h, p in zip(half.parameters(), ref.parameters()):
            p.grad = h.grad.float()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return ref, scales


def test_one_ranks_overflow_makes_every_rank_skip(comm):
    ks = [1e4, 1.0, 1.0]  # step 0 overflows (g's gradient only), the others do not
    ref, ref_scales = twin(len(ks), ks)
    model = FullyShardedDataParallel(
        make(), comm, mixed_precision=MixedPrecision(torch.float16, reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = mpiring.ShardedGradScaler(model, init_scale=INIT_SCALE)
    for s, k in enumerate(ks):
        model.module.blocks[0].k = k
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        x, y = batch(s)
        scaler.scale(loss_of(model(mine(x, comm)), mine(y, comm))).backward()
        local_inf = int(any(not torch.isfinite(p.grad).all() for p in model.parameters()
                            if p.grad is not None))
        scaler.step(opt)
        scaler.update()
        infs = comm.control.allgather_array([local_inf])[:, 0].tolist()
        moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
        scales = comm.control.allgather_array([scaler.get_scale()])[:, 0].tolist()
        assert scales == [ref_scales[s]] * comm.size, (s, scales, ref_scales)
        if s == 0:
            # The overflow is in rank 0's shard only: the others saw none, and still
            # skipped (the point of the agreement).
            assert infs == [1] + [0] * (comm.size - 1), infs
            assert not moved
        else:
            assert infs == [0] * comm.size and moved
    assert ref_scales == [INIT_SCALE / 2] * 3
    full = model.full_state_dict()
    for key, v in ref.state_dict().items():
        # float16 compute on 1/K of the batch vs on all of it: sums rounded differently.
        torch.testing.assert_close(full[key], v, rtol=2e-3, atol=2e-3, msg=lambda m, k=key: f"{k}: {m}")
    assert not torch.equal(full["blocks.0.g"], torch.ones(1))  # g trained after the skip
    model.close()


@pytest.mark.parametrize("held", [False, True], ids=["at-once", "past-a-held-micro-batch"])
def test_a_plain_grad_scaler_that_lets_ranks_disagree_is_caught(comm, held):
    # held: the overflowed backward synced, then the step's next micro-batch holds every
    # unit back (no_sync), so its forward finds no rank stepped yet and its backward
    # compares no inf checks: the forward after the step must still check.
    if comm.size == 1:
        pytest.skip("one rank always agrees with itself")
    model = FullyShardedDataParallel(make(), comm, mixed_precision=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)  # checks this rank's shards only
    model.module.blocks[0].k = 1e4
    x, y = batch(0)
    scaler.scale(loss_of(model(mine(x, comm)), mine(y, comm))).backward()
    if held:
        model.module.blocks[0].k = 1.0
        with model.no_sync():
            scaler.scale(loss_of(model(mine(x, comm)), mine(y, comm))).backward()
    scaler.step(opt)  # rank 0 skips, the others step
    scaler.update()
    with pytest.raises(RuntimeError, match=r"skipped the step while .* Use mpiring.ShardedGradScaler"):
        model(mine(x, comm))
    model.close()
    comm.barrier()
