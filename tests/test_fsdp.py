"""FullyShardedDataParallel (ZeRO-3): equal to one process on the global batch, and to DDP.

The reference trains the same model on the whole global batch in one process
(AdamW, float64), without any collective. FSDP on K ranks, each on its 1/K of
the batch with mean losses, must give the same parameters up to floating-point
order. Units have sizes that do not divide K (and one of 2 elements, so that
some ranks hold empty shards).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import mpiring  # noqa: E402
from mpiring.parallel.fsdp import (  # noqa: E402
    FullyShardedDataParallel,
    MixedPrecision,
    full_optim_state_dict,
    load_full_optim_state_dict,
)

GLOBAL = 60  # divisible by 1..5
STEPS = 3


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([0.9, 0.1]))

    def forward(self, x):
        return x * self.p[0] + self.p[1]


class Net(nn.Module):
    """Root unit (inp, out: 146 elements), then units of 336, 2 and 174 elements."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([Block(13, 11), Scale(), Block(13, 5)])
        self.out = nn.Linear(13, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(step, n=GLOBAL):
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(n, 7, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def mine(t, comm):
    per = t.shape[0] // comm.size
    return t[comm.rank * per:(comm.rank + 1) * per]


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


def reference(steps, clip=None, micro=1):
    """One process on the whole global batch, plain torch: the twin FSDP must equal."""
    model = make_model()
    opt, losses, norms = train(model, None, steps, clip=clip, micro=micro)
    return model, losses, norms


def train(model, comm, steps, clip=None, micro=1, opt=None):
    """``steps`` AdamW steps of ``micro`` micro-batches; ``comm=None``: the global batch."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    losses, norms = [], []
    for s in range(steps):
        opt.zero_grad()
        total = 0.0
        for m in range(micro):
            x, y = batch(s * micro + m)
            if comm is None:
                loss = loss_fn(model, x, y)
                loss.backward()
                total += loss.item()
                continue
            ctx = model.no_sync() if m < micro - 1 and hasattr(model, "no_sync") else _null()
            with ctx:
                loss = loss_fn(model, mine(x, comm), mine(y, comm))
                loss.backward()
            total += comm.control.allreduce_scalar(loss.item()) / comm.size
        losses.append(total)
        if clip is not None:
            norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if comm is None
                    else model.clip_grad_norm_(clip))
            norms.append(float(norm))
        opt.step()
    return opt, losses, norms


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def assert_state_close(full, ref_model, rtol=1e-7, atol=1e-8):
    ref = ref_model.state_dict()
    assert list(full) == list(ref)
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def check_equals_one_process(comm, reshard, prefetch=True):
    model = FullyShardedDataParallel(make_model(), comm, reshard_after_forward=reshard,
                                     prefetch=prefetch)
    opt, losses, _ = train(model, comm, STEPS)
    ref, ref_losses, _ = reference(STEPS)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
    assert_state_close(model.full_state_dict(), ref)
    # Sharded: the root and three blocks, each split with array_split bounds.
    sizes = [u.flat.numel for u in model.units]
    assert sizes == [146, 336, 2, 174]
    for u, n in zip(model.units, sizes):
        assert u.flat.shard.numel() == len(np.array_split(np.arange(n), comm.size)[comm.rank])
        assert not u.flat.allocated  # freed after backward
    shard = sum(p.numel() for p in model.parameters())
    moments = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    assert moments == 2 * shard
    assert comm.control.allreduce_scalar(shard) == sum(sizes)
    model.close()


@pytest.mark.parametrize("reshard", (True, False), ids=("reshard", "keep"))
def test_fsdp_equals_one_process(comm, reshard):
    check_equals_one_process(comm, reshard)


def test_fsdp_without_prefetch_equals_one_process(comm):
    check_equals_one_process(comm, True, prefetch=False)


def test_without_prefetch_one_unit_is_gathered_at_a_time(comm):
    """prefetch=False: each unit is gathered only when it runs; the count returns to zero."""
    model = FullyShardedDataParallel(make_model(), comm, prefetch=False)
    seen = []
    for u in model.units[1:]:
        u.module.register_forward_pre_hook(
            lambda m, a: seen.append(sum(v.flat.allocated for v in model.units[1:])))
    train(model, comm, 2)
    assert seen and max(seen) == 1  # never the next unit beside the one that runs
    assert model.unsharded_bytes == 0 and model.peak_unsharded_bytes > 0
    model.close()


def test_fsdp_equals_one_process_whole_world(world):
    check_equals_one_process(world, True)  # run with -n 5 for an odd world


def test_forward_keeps_only_the_root_and_the_last_unit_gathered(comm):
    # The last unit's backward comes first: freeing it after its forward would
    # only gather it again. Its place is known once the first forward ran.
    model = FullyShardedDataParallel(make_model(), comm)
    for step, held in enumerate(([True, False, False, False], [True, False, False, True])):
        x, y = batch(step)
        loss = loss_fn(model, mine(x, comm), mine(y, comm))
        assert [u.flat.allocated for u in model.units] == held
        loss.backward()
        assert not any(u.flat.allocated for u in model.units)
    with torch.no_grad():  # no backward to wait for: everything is freed
        model(mine(batch(2)[0], comm))
    assert not any(u.flat.allocated for u in model.units)
    model.close()


def test_fsdp_matches_ddp(comm):
    fsdp = FullyShardedDataParallel(make_model(), comm)
    ddp_model = make_model()
    ddp = mpiring.DistributedDataParallel(ddp_model, comm)
    _, f_losses, _ = train(fsdp, comm, STEPS)
    _, d_losses, _ = train(ddp, comm, STEPS)
    np.testing.assert_allclose(f_losses, d_losses, rtol=1e-9)
    assert_state_close(fsdp.full_state_dict(), ddp_model)
    ddp.close()
    fsdp.close()


def test_no_sync_accumulates_unsharded_gradients(comm):
    model = FullyShardedDataParallel(make_model(), comm)
    x, y = batch(0)
    with model.no_sync():
        loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    assert all(p.grad is None for p in model.parameters())  # nothing reduced yet
    assert model.units[1].acc is not None and model.units[1].acc.numel() == 336
    # The unsharded sums count as unsharded bytes: the whole model's gradient.
    held = sum(u.acc.numel() * u.acc.element_size() for u in model.units if u.acc is not None)
    assert held == sum(u.flat.numel for u in model.units) * 8
    assert model.unsharded_bytes == held and model.peak_unsharded_bytes >= held
    model.zero_grad()
    assert model.unsharded_bytes == 0
    _, losses, _ = train(model, comm, 2, micro=3)
    ref, ref_losses, _ = reference(2, micro=3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-9)
    assert_state_close(model.full_state_dict(), ref)
    model.close()


class SkipNet(Net):
    """Net whose forward leaves out the Scale unit while ``skip`` is set (on every rank)."""

    skip = False

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x if (SkipNet.skip and isinstance(b, Scale)) else b(x)
        return self.out(x)


@pytest.mark.parametrize("micro", (1, 2))
def test_a_unit_no_backward_reached_keeps_no_gradient(comm, monkeypatch, micro):
    # As torch: the skipped unit's parameters get no gradient, so AdamW (with weight
    # decay) leaves them alone; a zero gradient would decay them and move their moments.
    # With two micro-batches the first (no_sync) reaches it: that sum is reduced.
    def run(model, c):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        for s in range(3):
            opt.zero_grad()
            for m in range(micro):
                monkeypatch.setattr(SkipNet, "skip", s == 1 and m == micro - 1)
                x, y = batch(s * micro + m)
                if c is not None:
                    x, y = mine(x, c), mine(y, c)
                ctx = model.no_sync() if c is not None and m < micro - 1 else _null()
                with ctx:
                    loss_fn(model, x, y).backward()
            if c is not None and s == 1 and micro == 1:
                assert model.units[2].flat.shard.grad is None  # Scale: no ReduceScatter
            opt.step()
        return model

    torch.manual_seed(0)
    ref = run(SkipNet().double(), None)
    torch.manual_seed(0)
    model = run(FullyShardedDataParallel(SkipNet().double(), comm), comm)
    assert_state_close(model.full_state_dict(), ref)
    model.close()


def test_the_optimizer_state_of_a_unit_never_reached(comm, monkeypatch):
    # No step gave it a gradient: AdamW holds no state for it, so the full state has
    # no entry for it (torch's has none) and loading that state steps on.
    monkeypatch.setattr(SkipNet, "skip", True)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(SkipNet().double(), comm)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = batch(0)
    loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    opt.step()
    state = full_optim_state_dict(model, opt)
    assert "blocks.1.p" not in state["state"] and "inp.weight" in state["state"]
    fresh = torch.optim.AdamW(model.parameters(), lr=0.05)
    load_full_optim_state_dict(model, fresh, state)
    loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    fresh.step()  # a state without its step count would fail here
    model.close()


@pytest.mark.parametrize("norm_type", (2.0, float("inf")))
def test_clip_grad_norm_uses_the_global_norm(comm, norm_type):
    model = FullyShardedDataParallel(make_model(), comm)
    clip = 0.5
    if norm_type == 2.0:
        _, _, norms = train(model, comm, STEPS, clip=clip)
        ref, _, ref_norms = reference(STEPS, clip=clip)
        assert min(ref_norms) > clip  # the clipping really acted
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-9)
        assert_state_close(model.full_state_dict(), ref)
    else:
        x, y = batch(0)
        loss_fn(model, mine(x, comm), mine(y, comm)).backward()
        ref = make_model()
        loss_fn(ref, x, y).backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=norm_type))
        got = float(model.clip_grad_norm_(1e-3, norm_type=norm_type))
        assert got == pytest.approx(want, rel=1e-12)
    model.close()


@pytest.mark.parametrize("reduce_dtype", (torch.float32, torch.bfloat16))
def test_mixed_precision_computes_in_bfloat16(comm, reduce_dtype):
    torch.manual_seed(0)
    base = Net()  # float32 master weights
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    model = FullyShardedDataParallel(base, comm, mixed_precision=mp)
    seen = []
    base.blocks[0].fc1.register_forward_hook(lambda m, a, o: seen.append((m.weight.dtype, o.dtype)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        out = model(mine(x, comm).float())
        ((out.float() - mine(y, comm).float()) ** 2).mean().backward()
        opt.step()
    assert seen[0] == (torch.bfloat16, torch.bfloat16)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters() if p.grad is not None)
    # Against the float64 reference with the same steps: bfloat16's 8 bits.
    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for s in range(STEPS):
        x, y = batch(s)
        ref_opt.zero_grad()
        loss_fn(ref, x, y).backward()
        ref_opt.step()
    full = model.full_state_dict()
    for k, v in ref.state_dict().items():
        assert full[k].dtype == torch.float32
        torch.testing.assert_close(full[k].double(), v, rtol=0.05, atol=0.02, msg=k)
    model.close()


def test_a_forward_without_backward_does_not_keep_old_parameters(comm):
    # The root and the last unit stay gathered after a forward with grad on (no
    # backward came to free them); new shard values (a step, a load) must be gathered.
    model, ref = FullyShardedDataParallel(make_model(), comm), make_model()
    x, y = batch(0)
    loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    loss_fn(ref, x, y).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model(mine(x, comm))  # a metric without no_grad: no backward follows
    opt.step()
    ref_opt.step()
    with torch.no_grad():
        torch.testing.assert_close(model(mine(x, comm)), ref(mine(x, comm)), rtol=1e-12, atol=1e-12)
    model(mine(x, comm))
    other = make_model(seed=1)
    model.load_full_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(mine(x, comm)), other(mine(x, comm)), rtol=1e-12,
                                   atol=1e-12)
    model.close()


def test_a_refused_state_dict_loads_nothing(comm):
    model = FullyShardedDataParallel(make_model(), comm)
    before = model.full_state_dict()
    bad = make_model(seed=2).state_dict()
    last = [k for k in bad if k.startswith("blocks.")][-1]  # the last unit: the others load first
    bad[last] = torch.zeros(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"{last}: the state dict has shape"):
        model.load_full_state_dict(bad)
    for k, v in model.full_state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed although the state dict was refused"
    model.close()


def test_the_plain_state_dict_is_refused_with_the_fix(comm):
    # nn.Module's state_dict would hold this rank's flat shards: a checkpoint of it,
    # loaded on every rank, gives each rank rank 0's slices without an error.
    from mpiring.parallel import checkpoint as ck

    model = FullyShardedDataParallel(make_model(), comm)
    fix = r"full_state_dict\(\) on every rank .* load_full_state_dict\(\)"
    with pytest.raises(RuntimeError, match="FullyShardedDataParallel.state_dict\\(\\): .*" + fix):
        model.state_dict()
    with pytest.raises(RuntimeError, match="load_state_dict\\(\\): .*" + fix):
        model.load_state_dict({})
    with pytest.raises(RuntimeError, match=fix):
        ck.training_state(1, model, None)
    model.close()


def test_full_state_dict_keys_and_tied_weights(comm):
    from mpiring.tools.models.gpt import GPT, PRESETS

    torch.manual_seed(0)
    cfg = PRESETS["tiny"].with_(n_layers=2, d_model=16, n_heads=2, seq_len=8)
    ref = GPT(cfg).double()
    model = FullyShardedDataParallel(GPT(cfg).double(), comm)  # same seed? reload below
    model.load_full_state_dict(ref.state_dict())
    assert [u.module for u in model.units[1:]] == list(model.module.blocks)
    idx = torch.arange(4 * comm.size * 8).remainder(cfg.vocab_size).view(4 * comm.size, 8)
    out = model(mine(idx, comm))
    torch.testing.assert_close(out, ref(mine(idx, comm)), rtol=1e-10, atol=1e-12)
    out.sum().backward()
    full = model.full_state_dict()
    assert list(full) == list(ref.state_dict())  # both names of the tied weight
    assert full["tok.weight"].data_ptr() != full["head.weight"].data_ptr()
    torch.testing.assert_close(full["head.weight"], full["tok.weight"])
    model.close()


def test_checkpoint_moves_between_world_sizes(comm, tmp_path_factory):
    # Train 2 steps on K ranks, save the full model and optimizer state, load
    # them on one rank (a split of this communicator), train one more step:
    # equal to three uninterrupted steps in one process.
    model = FullyShardedDataParallel(make_model(), comm)
    opt, _, _ = train(model, comm, 2)
    sd, osd = model.full_state_dict(), full_optim_state_dict(model, opt)
    model.close()
    # Through a file, written atomically by rank 0 and read by every rank.
    from mpiring.parallel.checkpoint import load_checkpoint, save_checkpoint, training_state

    directory = comm.control.bcast_json(str(tmp_path_factory.mktemp("fsdp")) if comm.rank == 0
                                        else None)
    if comm.rank == 0:
        save_checkpoint(directory, training_state(2, extra={"model": sd, "optim": osd}))
    comm.barrier()
    saved = load_checkpoint(os.path.join(directory, "ckpt-000000002.pt"))["extra"]
    sd, osd = saved["model"], saved["optim"]
    alone = comm.split(comm.rank, key=0)
    one = FullyShardedDataParallel(make_model(seed=5), alone)
    one_opt = torch.optim.AdamW(one.parameters(), lr=0.05, weight_decay=0.1)
    one.load_full_state_dict(sd)
    # A saved moment of another size is refused, not cut to the parameter's length.
    name = next(iter(osd["state"]))
    bigger = {**osd, "state": {**osd["state"], name: {
        **osd["state"][name], "exp_avg": torch.zeros(osd["state"][name]["exp_avg"].numel() + 3,
                                                     dtype=torch.float64)}}}
    with pytest.raises(ValueError, match=f"{name}: the optimizer state's 'exp_avg' has"):
        load_full_optim_state_dict(one, one_opt, bigger)
    load_full_optim_state_dict(one, one_opt, osd)
    x, y = batch(2)
    one_opt.zero_grad()
    loss_fn(one, x, y).backward()
    one_opt.step()
    ref, _, _ = reference(3)
    assert_state_close(one.full_state_dict(), ref)
    one.close()


class LoRA(nn.Module):
    """A frozen base Linear plus a trainable low-rank update, in one module (one unit)."""

    def __init__(self, d, r=2):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Linear(d, r, bias=False)
        self.b = nn.Linear(r, d, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x):
        return x + self.base(torch.tanh(x)) + self.b(self.a(x))


class Tuned(nn.Module):
    """A frozen input layer (root), LoRA blocks (mixed units), a wholly frozen block and
    a trainable head (root): what fine-tuning with FSDP looks like."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([LoRA(13), Block(13, 5), LoRA(13)])
        self.out = nn.Linear(13, 3)
        self.inp.requires_grad_(False)
        self.blocks[1].requires_grad_(False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@pytest.mark.parametrize("prefetch", (False, True))
def test_frozen_parameters_stay_and_the_rest_trains(comm, prefetch):
    # As torch on one process: the frozen ones never move (AdamW with weight decay
    # would move a zero gradient's), the trainable ones match. A unit's frozen
    # parameters are a unit of their own, gathered for forward and backward and freed
    # with the trainable part after its backward (the ZeRO-3 bound holds).
    def make():
        torch.manual_seed(1)
        return Tuned().double()

    ref = make()
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    train(ref, None, STEPS)
    model = FullyShardedDataParallel(make(), comm, prefetch=prefetch)
    assert sum(not u.flat.requires_grad for u in model.units) == 4  # root, 3 blocks
    train(model, comm, STEPS)
    full = model.full_state_dict()
    assert_state_close(full, ref)
    for k in ("inp.weight", "blocks.0.base.weight", "blocks.1.fc1.weight", "blocks.2.base.bias"):
        assert torch.equal(full[k], before[k]), k
    assert all(not u.flat.shard.requires_grad or u.flat.shard.grad is not None
               for u in model.units)
    assert all(u.flat.shard.grad is None for u in model.units if not u.flat.requires_grad)
    # When the gradient reaches blocks.0, blocks.2 (a LoRA unit) is freed, frozen part
    # too, and so is the wholly frozen blocks.1 (its inputs' gradients are in).
    gathered = []

    def probe(m, args):  # on blocks.1's input, after FSDP's own hooks there
        args[0].register_hook(lambda g: gathered.append(
            sorted({u.index for u in model.units if u.flat.allocated and u.index != 0})))
    handle = model.units[4].module.register_forward_pre_hook(probe)
    x, y = batch(9)
    loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    handle.remove()
    # (blocks.0 itself may be gathered already: FSDP's hook on that output ran first.)
    assert len(gathered) == 1 and not {2, 3} & set(gathered[0]), gathered
    state = full_optim_state_dict(model, torch.optim.AdamW(model.parameters()))
    assert "blocks.0.base.weight" not in state["state"]
    model.close()


class LowBase(LoRA):
    """A frozen base in float32 beside float64 adapters (a quantised base, in spirit)."""

    def __init__(self, d):
        super().__init__(d)
        self.base.float()

    def forward(self, x):
        return x + self.base(torch.tanh(x).float()).double() + self.b(self.a(x))


def test_a_frozen_part_may_have_its_own_dtype(comm):
    # The frozen and the trainable parameters of a unit are two flats, each of one dtype.
    def make():
        torch.manual_seed(4)
        net = Tuned().double()
        net.blocks[0] = LowBase(13).double()
        net.blocks[0].base.float()
        return net

    ref = make()
    train(ref, None, 2)
    model = FullyShardedDataParallel(make(), comm)
    train(model, comm, 2)
    assert_state_close(model.full_state_dict(), ref, rtol=1e-6, atol=1e-7)
    model.close()


class InPlace(Block):
    """A block that changes its input in place first (an in-place activation)."""

    def forward(self, x):
        return super().forward(torch.nn.functional.leaky_relu_(x, 0.5))


class Prompted(nn.Module):
    """A trainable input layer under frozen blocks (prompt or prefix tuning)."""

    def __init__(self, depth=6):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([(InPlace if i % 2 else Block)(13, 11)
                                     for i in range(depth)])
        self.blocks.requires_grad_(False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x.sum(1, keepdim=True).expand(-1, 3)


class KeywordPrompted(Prompted):
    """The same, each block called with its input as a keyword (``block(x=h)``)."""

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x=x)
        return x.sum(1, keepdim=True).expand(-1, 3)


@pytest.mark.parametrize("net,prefetch", [(Prompted, False), (Prompted, True),
                                          (KeywordPrompted, False)],
                         ids=("positional", "positional-prefetch", "keyword"))
def test_frozen_units_are_freed_after_their_backward(comm, prefetch, net):
    # Every block frozen, the gradient flowing through them to the input layer: each is
    # freed once its inputs' gradients are in, so the unsharded peak does not grow with
    # depth (it did: every frozen block stayed gathered to the end of backward).
    torch.manual_seed(3)
    model = FullyShardedDataParallel(net().double(), comm, prefetch=prefetch)
    train(model, comm, 2)  # the second step: prefetch follows the recorded order
    x, y = batch(5)
    loss_fn(model, mine(x, comm), mine(y, comm))  # a forward whose backward never runs
    model.reset_peak()
    loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    root, block = (model.units[i].flat.numel * 8 for i in (0, 1))
    # The root and its gradient, the block computing, one more in flight with prefetch.
    assert model.peak_unsharded_bytes <= 3 * root + (3 if prefetch else 2) * block
    torch.manual_seed(3)
    ref = net().double()
    train(ref, None, 2)
    assert_state_close(model.full_state_dict(), ref)
    model.close()


def test_the_state_dicts_still_work_after_close(comm):
    # close() frees the communication thread's communicator; saving afterwards gathers
    # on the model's own.
    model = FullyShardedDataParallel(make_model(), comm)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    train(model, comm, 1, opt=opt)
    before, optim = model.full_state_dict(), full_optim_state_dict(model, opt)
    model.close()
    after = model.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = full_optim_state_dict(model, opt)
    assert all(torch.equal(optim["state"][k]["exp_avg"], again["state"][k]["exp_avg"])
               for k in optim["state"])


def test_bad_model_raises_on_every_rank(comm):
    net = make_model()
    net.blocks[0].fc1.float()  # one unit with two dtypes
    with pytest.raises(TypeError, match="mixes parameter dtypes"):
        FullyShardedDataParallel(net, comm)
    if comm.size > 1:
        net = make_model()
        if comm.rank == 1:
            net.blocks[2] = Block(13, 6)  # rank 1's model differs
        with pytest.raises(ValueError, match="differ|rejected"):
            FullyShardedDataParallel(net, comm)
        # The same sizes frozen, but not the same parameters (fc1's and fc2's weights
        # have 143 elements each): the flats' layouts differ, and are refused.
        net = make_model()
        (net.blocks[0].fc1 if comm.rank == 0 else net.blocks[0].fc2).weight.requires_grad_(False)
        with pytest.raises(ValueError, match="the units differ between ranks .* layout checksum"):
            FullyShardedDataParallel(net, comm)
    with pytest.raises(TypeError, match="auto_wrap"):
        FullyShardedDataParallel(make_model(), comm, auto_wrap=3)
    comm.barrier()


@pytest.mark.parametrize("backwards", (1, 2), ids=("one-backward", "two-backwards"))
@pytest.mark.parametrize("prefetch", (True, False))
def test_two_forwards_before_backward_through_a_frozen_unit(comm, prefetch, backwards):
    # blocks.0 wholly frozen between trainable units: each forward's graph needs it
    # gathered in backward, so the second forward must not erase the first one's count.
    def make():
        net = make_model()
        net.blocks[0].requires_grad_(False)
        return net

    def run(model, c):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
        for s in range(STEPS):
            x, y = batch(s)
            if c is not None:
                x, y = mine(x, c), mine(y, c)
            opt.zero_grad()
            losses = [loss_fn(model, x, y), loss_fn(model, (0.5 + s) * x, y)]
            if backwards == 1:
                sum(losses).backward()
            else:
                for loss in losses:
                    loss.backward()
            opt.step()

    ref = make()
    run(ref, None)
    model = FullyShardedDataParallel(make(), comm, prefetch=prefetch)
    frozen = next(u for u in model.units if u.module is model.module.blocks[0])
    gathers, unshard = [], frozen.unshard

    def counted():
        gathers.append(frozen.status == "sharded" and model._in_backward)
        unshard()
    frozen.unshard = counted
    run(model, comm)
    assert_state_close(model.full_state_dict(), ref)
    assert not any(u.flat.allocated for u in model.units)  # freed after the backward(s)
    # Gathered once per backward, for both forwards' graphs: not freed after the first.
    assert sum(gathers) == STEPS * backwards, gathers
    model.close()


def test_a_unit_freed_early_in_backward_is_gathered_again(comm):
    # Should a frozen unit be freed while a graph still needs it (here its first
    # forward's count is dropped by hand), that graph's backward gathers it again
    # rather than read freed storage.
    def make():
        net = make_model()
        net.blocks[0].requires_grad_(False)
        return net

    def step(model, c, between=lambda: None):
        x, y = batch(0)
        if c is not None:
            x, y = mine(x, c), mine(y, c)
        first = loss_fn(model, x, y)
        between()
        (first + loss_fn(model, 0.5 * x, y)).backward()

    ref = make()
    step(ref, None)
    model = FullyShardedDataParallel(make(), comm)
    frozen = next(u for u in model.units if u.module is model.module.blocks[0])
    step(model, comm, between=frozen._pending.clear)
    # An SGD step of lr 1 puts the gradients into the parameters: compare those.
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=1.0).step()
    assert_state_close(model.full_state_dict(), ref)
    assert not any(u.flat.allocated for u in model.units)
    model.close()


class Albert(nn.Module):
    """One block registered four times, in two containers (ALBERT's shared layers),
    and one block of its own."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        shared = Block(13, 11)
        self.blocks = nn.ModuleList([shared, Block(13, 5), shared])
        self.tail = nn.Sequential(shared)
        self.out = nn.Linear(13, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.tail(x))


@pytest.mark.parametrize("policy", ("blocks", "list"))
def test_a_block_registered_at_several_places_is_one_unit(comm, policy):
    def make():
        torch.manual_seed(5)
        return Albert().double()

    ref = make()
    train(ref, None, STEPS)
    net = make()
    wrap = "blocks" if policy == "blocks" else [net.blocks[0], net.blocks[1]]
    model = FullyShardedDataParallel(net, comm, auto_wrap=wrap)
    assert [u.flat.numel for u in model.units] == [146, 336, 174]  # the shared block once
    train(model, comm, STEPS)
    full = model.full_state_dict()
    assert_state_close(full, ref)  # every name of the shared block: blocks.0/2, tail.0
    assert torch.equal(full["blocks.0.fc1.weight"], full["tail.0.fc1.weight"])
    model.close()


class Masked(Net):
    """Net with a bool mask and an int16 counter buffer (no dtype a ring can reduce)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.ones(13, dtype=torch.bool))
        self.register_buffer("shift", torch.zeros(3, dtype=torch.int16))

    def forward(self, x):
        h = self.inp(x).masked_fill(~self.mask, 0.0)
        for b in self.blocks:
            h = b(h)
        return self.out(h) + self.shift


def test_bool_and_int_buffers_start_from_rank_0(comm):
    def make(rank):
        torch.manual_seed(6)
        net = Masked().double()
        # Rank-dependent buffers before wrapping: rank 0's must win everywhere.
        net.mask.copy_(torch.arange(13) % (rank + 2) != 0)
        net.shift.copy_(torch.arange(3, dtype=torch.int16) * (rank + 1) - 1)
        return net

    ref = make(0)
    train(ref, None, STEPS)
    model = FullyShardedDataParallel(make(comm.rank), comm)
    assert torch.equal(model.module.mask, make(0).mask)
    assert torch.equal(model.module.shift, make(0).shift)
    train(model, comm, STEPS)
    assert_state_close(model.full_state_dict(), ref)
    model.close()


@pytest.mark.parametrize("name", ("Adafactor", "LBFGS"))
def test_optimizers_that_need_whole_tensors_are_refused(comm, name):
    # Adafactor factors a matrix's second moment (a 1-D shard would get a per-element
    # one) and LBFGS takes global dot products: on shards both silently differ.
    cls = getattr(torch.optim, name, None)
    if cls is None:
        pytest.skip(f"this torch has no torch.optim.{name}")
    model = FullyShardedDataParallel(make_model(), comm)
    opt = cls(model.parameters(), lr=0.05)
    x, y = batch(0)
    loss_fn(model, mine(x, comm), mine(y, comm)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=rf"{name} does not work on flat shards.*per element"):
        opt.step(lambda: loss_fn(model, mine(x, comm), mine(y, comm)))
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # A plain model is not touched by the check.
    plain = make_model()
    loss_fn(plain, x, y).backward()
    cls(plain.parameters(), lr=0.05).step(lambda: loss_fn(plain, x, y))
    model.close()
    comm.barrier()
