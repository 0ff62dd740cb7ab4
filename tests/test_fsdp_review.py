"""FSDP as a user porting from torch's FSDP meets it: against torch's own ``fully_shard``
over gloo in the same processes (float64, and bfloat16 mixed precision), and the
refusals a port runs into, each naming the fix.

Run at 1, 2, 3 and 4 ranks (the torch comparisons span the whole job: ``world``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

from mpiring.parallel.fsdp import (  # noqa: E402
    FullyShardedDataParallel,
    MixedPrecision,
    full_optim_state_dict,
    load_full_optim_state_dict,
)


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, d))

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class Net(nn.Module):
    """A float32 buffer added in the root (a positional table), blocks of sizes no K divides."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.register_buffer("pos", torch.linspace(-1.0, 1.0, 7))
        self.blocks = nn.ModuleList([Block(7, 3), Block(7, 5)])
        self.out = nn.Linear(7, 2)

    def forward(self, x):
        x = self.inp(x) + self.pos  # float32 + bfloat16 -> float32 again under mixed precision
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def batch(world, step, dtype=torch.float64):
    """This rank's rows of a global batch whose values depend on the step and the row."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(3 * world.size, 5, generator=g, dtype=dtype)
    y = torch.randn(3 * world.size, 2, generator=g, dtype=dtype)
    rows = slice(3 * world.rank, 3 * world.rank + 3)
    return x[rows], y[rows]


def make(dtype=torch.float64):
    torch.manual_seed(0)
    return Net().to(dtype)


def torch_full_state(model):
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()}


def step_both(world, models, opts, step, micro=1, clip=None, dtype=torch.float64):
    """One optimizer step of each model over ``micro`` micro-batches (synced on the last)."""
    from torch.distributed.tensor import DTensor

    norms = []
    for model, opt in zip(models, opts):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)  # the same name in both
            x, y = batch(world, step * micro + m, dtype)
            ((model(x).to(y.dtype) - y) ** 2).mean().backward()
        if clip is not None:
            if isinstance(model, FullyShardedDataParallel):
                norms.append(float(model.clip_grad_norm_(clip)))
            else:
                n = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                norms.append(float(n.full_tensor() if isinstance(n, DTensor) else n))
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("policy", ("list", "classes", "callable"))
@pytest.mark.parametrize("reshard", (True, False), ids=("reshard", "keep"))
def test_nested_units_match_torch_fully_shard(world, reshard, policy):
    # torch: fully_shard(block.mlp), then fully_shard(block), then the root. The same
    # nesting here as a list of modules, or as torch's ModuleWrapPolicy({Block, MLP})
    # (a tuple, or a callable, which did not look inside a chosen block before):
    # each keeps its own parameters, as torch's do.
    from torch.distributed.fsdp import fully_shard

    gloo_world(world)
    ref = make()
    for b in ref.blocks:
        fully_shard(b.mlp, reshard_after_forward=reshard)
        fully_shard(b, reshard_after_forward=reshard)
    fully_shard(ref, reshard_after_forward=reshard)
    net = make()
    nested = {"list": [m for b in net.blocks for m in (b, b.mlp)],
              "classes": (Block, nn.Sequential),
              "callable": lambda m: isinstance(m, (Block, nn.Sequential))}[policy]
    model = FullyShardedDataParallel(net, world, auto_wrap=nested, reshard_after_forward=reshard)
    # The root (inp, out), then each block's LayerNorm apart from its MLP.
    assert [u.flat.numel for u in model.units] == [7 * 5 + 7 + 7 * 2 + 2, 14, 3 * 7 + 3 + 7 * 3 + 7,
                                                   14, 5 * 7 + 5 + 7 * 5 + 7]
    opts = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in (ref, model)]
    for s in range(3):
        norms = step_both(world, (ref, model), opts, s, micro=2, clip=0.5)
        assert norms[1] == pytest.approx(norms[0], rel=1e-12)
    assert norms[0] > 0.5  # the clipping acted
    got, want = model.full_state_dict(), torch_full_state(ref)
    assert list(got) == list(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-13, msg=k)
    assert not any(u.flat.allocated for u in model.units)  # freed after the backward
    model.close()


def test_mixed_precision_casts_every_units_inputs(world):
    # The root adds a float32 buffer to a bfloat16 activation: float32 reaches the first
    # block. torch FSDP2 casts each unit's inputs to param_dtype; casting the root's only
    # made the block's bfloat16 LayerNorm refuse its float32 input.
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gloo_world(world)
    ref = make(torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in ref.blocks:
        fully_shard(b, mp_policy=policy)
    fully_shard(ref, mp_policy=policy)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FullyShardedDataParallel(make(torch.float32), world, mixed_precision=mp)
    seen = []
    model.module.blocks[0].ln.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for s in range(2):
        step_both(world, (ref, model), opts, s, dtype=torch.float32)
    assert seen == [torch.bfloat16, torch.bfloat16]
    got, want = model.full_state_dict(), torch_full_state(ref)
    for k, v in want.items():
        assert got[k].dtype == v.dtype == torch.float32
        # The same bfloat16 compute; the float32 sums differ in order only.
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    model.close()


def test_reduce_dtype_alone_keeps_the_compute_dtype(world):
    # torch's MixedPrecisionPolicy(reduce_dtype=...) leaves param_dtype None: compute in
    # the parameters' own dtype. A bfloat16 default computed in bfloat16 without a word.
    seen = []
    net = make(torch.float32)
    net.blocks[1].mlp[0].register_forward_hook(lambda m, a, o: seen.append((m.weight.dtype,
                                                                             o.dtype)))
    model = FullyShardedDataParallel(net, world,
                                     mixed_precision=MixedPrecision(reduce_dtype=torch.float64))
    x, y = batch(world, 0, torch.float32)
    ((model(x) - y) ** 2).mean().backward()
    assert seen == [(torch.float32, torch.float32)]
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    model.close()


def test_a_parameter_read_outside_its_units_forward_raises_naming_the_fix(world):
    # Once its unit is freed, a module's attribute was a view of zero bytes: reading it
    # (logging a weight) read freed memory and killed the process (SIGSEGV).
    model = FullyShardedDataParallel(make(), world)
    x, y = batch(world, 0)
    ((model(x) - y) ** 2).mean().backward()
    w = model.module.blocks[0].mlp[0].weight
    assert tuple(w.shape) == (3, 7) and w.dtype == torch.float64  # metadata still reads
    with pytest.raises(RuntimeError, match=r"blocks\.0\.mlp\.0\.weight is sharded now .*"
                                           r"full_state_dict\(\)\['blocks\.0\.mlp\.0\.weight'\]"):
        float(w.sum())
    with pytest.raises(RuntimeError, match="is sharded now"):
        torch.nn.functional.linear(x[:, :7], w)
    ln = model.module.blocks[0].ln.weight  # passed by keyword: still named
    with pytest.raises(RuntimeError, match=r"blocks\.0\.ln\.weight is sharded now"):
        torch.nn.functional.layer_norm(x[:, :7], (7,), weight=ln)
    # Inside the forward the module sees the gathered values again.
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()
    full = model.full_state_dict()["blocks.0.mlp.0.weight"]
    assert full.shape == (3, 7) and full.abs().sum() > 0
    model.close()


def test_a_torch_auto_wrap_policy_is_refused_naming_the_fix(world):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with pytest.raises(TypeError, match=r"ModuleWrapPolicy.*auto_wrap=\(Block,\)"):
        FullyShardedDataParallel(make(), world, auto_wrap=ModuleWrapPolicy({Block}))
    model = FullyShardedDataParallel(make(), world, auto_wrap=(Block,))  # no rank was left behind
    assert [u.module for u in model.units[1:]] == list(model.module.blocks)
    model.close()


def test_an_optimizer_state_that_would_load_nothing_is_refused(world):
    model = FullyShardedDataParallel(make(), world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = batch(world, 0)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    state = full_optim_state_dict(model, opt)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    # torch's own optimizer.state_dict() (keyed by number): nothing matched, nothing loaded.
    plain = make()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    ((plain(x) - y) ** 2).mean().backward()
    plain_opt.step()
    with pytest.raises(ValueError, match=r"torch's optimizer.state_dict\(\).*"
                                         r"full_optim_state_dict\(model, opt\)"):
        load_full_optim_state_dict(model, fresh, plain_opt.state_dict())
    renamed = {**state, "state": {"module." + k: v for k, v in state["state"].items()}}
    with pytest.raises(ValueError, match=r"'module.inp.weight'.* not parameters of this model"):
        load_full_optim_state_dict(model, fresh, renamed)
    part = {**state, "state": {k: v for k, v in state["state"].items() if k != "inp.bias"}}
    with pytest.raises(ValueError, match="but not .*inp.bias.* loads whole or not at all"):
        load_full_optim_state_dict(model, fresh, part)
    assert not fresh.state and fresh.param_groups[0]["lr"] == 0.5  # refused: nothing changed
    load_full_optim_state_dict(model, fresh, state)
    for sh in model.parameters():
        torch.testing.assert_close(fresh.state[sh]["exp_avg"], opt.state[sh]["exp_avg"])
    model.close()
