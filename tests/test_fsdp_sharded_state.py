"""Sharded checkpoints of FSDP: each rank saves its own slices and loads at any world size.

A model trained some steps at K ranks is saved sharded (``sharded_state_dict`` and
``sharded_optim_state_dict``, or ``save_sharded``: a file per rank and an index), then
loaded at K' ranks (sub-communicators of the job, every K' = 1..N) with the saving
wrap or another one, and trained on: equal to the uninterrupted run, bit for bit where the
layout is the same, to 1e-12 (float64) where the gradient's sums run in another order;
the loaded state equals ``full_state_dict`` / ``full_optim_state_dict`` at the save,
bit for bit. The save never allocates a whole parameter (a parameter larger than any
shard, every tensor the save and the load make is counted); bad sets of files are
refused on every rank before anything changes.

Run at 1, 2, 3 and 4 ranks.
"""

from __future__ import annotations

import os
import shutil
import struct
import zipfile

import pytest

torch = pytest.importorskip("torch")
from test_fsdp import Block, Scale  # noqa: E402  (the same blocks as the full-state tests)
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from mpiring.parallel.checkpoint import CheckpointCorruptError  # noqa: E402
from mpiring.parallel.fsdp import (  # noqa: E402
    FullyShardedDataParallel,
    full_optim_state_dict,
    load_sharded,
    load_sharded_optim_state_dict,
    save_sharded,
    sharded_optim_state_dict,
)
from mpiring.parallel.fsdp.sharded import shard_file_name  # noqa: E402

GLOBAL = 420  # rows per step, divisible by 1..7


class Net(nn.Module):
    """Root: inp, a tied pair (one tensor, two names), a frozen shift, out and a buffer
    counting forwards; units of odd sizes and one of 2 elements (empty shards)."""

    def __init__(self, hidden=(11, 5)):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.mix = nn.Linear(13, 13, bias=False)
        self.mix_again = nn.Linear(13, 13, bias=False)
        self.mix_again.weight = self.mix.weight
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, 13), requires_grad=False)
        self.blocks = nn.ModuleList([Block(13, hidden[0]), Scale(), Block(13, hidden[1])])
        self.out = nn.Linear(13, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += 1
        x = self.mix_again(torch.tanh(self.mix(self.inp(x)))) + self.shift
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return Net(**kw).double()


def batch(comm, step):
    """This rank's rows of a global batch that depends on the step and the row."""
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL, 7, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL, 3, generator=g, dtype=torch.float64)
    per = GLOBAL // comm.size
    rows = slice(comm.rank * per, (comm.rank + 1) * per)
    return x[rows], y[rows]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def train(model, opt, comm, steps):
    for s in steps:
        opt.zero_grad()
        x, y = batch(comm, s)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def shared_dir(comm, factory, name):
    """A folder every rank of ``comm`` names the same (rank 0's)."""
    return comm.control.bcast_json(str(factory.mktemp(name)) if comm.rank == 0 else None)


def assert_equal(got, want, tol=None):
    assert sorted(got) == sorted(want)  # the optimizer's names come in unit order
    for k, v in want.items():
        if isinstance(v, dict):
            assert_equal(got[k], v, tol)
        elif torch.is_tensor(v) and tol is None:
            assert torch.equal(got[k], v), f"{k}: differs"
        elif torch.is_tensor(v):
            torch.testing.assert_close(got[k], v, rtol=tol, atol=tol, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module", autouse=True)
def warm_up():
    """A process's first optimizer (torch imports its compiler then) and first backward
    cost seconds: pay them on every rank at once, not rank after rank as each
    sub-communicator first reaches them while the others wait."""
    model = make()
    opt = adamw(model)
    model(torch.zeros(1, 7, dtype=torch.float64)).sum().backward()
    opt.step()


class NoComm:
    """Stands in for a Communicator: its rank and size, and an error on any exchange."""

    def __init__(self, real):
        self.rank, self.size = real.rank, real.size

    def __getattr__(self, name):
        raise AssertionError(f"communication during a sharded state dict call: comm.{name}")


class no_communication:
    """Within it the model cannot communicate: both its communicators are ``NoComm``."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.saved = self.model.comm, self.model.thread_comm
        self.model.comm, self.model.thread_comm = NoComm(self.saved[0]), NoComm(self.saved[1])

    def __exit__(self, *exc):
        self.model.comm, self.model.thread_comm = self.saved
        return False


class LargestStorage(TorchDispatchMode):
    """The largest storage behind any tensor an operation returns while it is active."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


# --- other world sizes and wraps, through files -------------------------------------------

WRAPS = {"blocks": "blocks", "one unit": None, "blocks and fc1": lambda m: isinstance(
    m, (Block, Scale)) or (isinstance(m, nn.Linear) and m.out_features == 11)}


def test_save_at_k_load_at_every_k_and_wrap(world, subcomms, tmp_path_factory):
    n = world.size
    # 1..4 (the shared sub-communicators) and the whole job where it is larger (5, 7).
    sizes = [k for k in (1, 2, 3, 4) if k <= n] + ([n] if n > 4 else [])
    subs = {k: world if k == n else subcomms[k] for k in sizes}
    saved = {}
    for k in sizes:
        sub = subs[k]
        path = shared_dir(world, tmp_path_factory, f"k{k}")
        if sub is None:
            continue
        model = FullyShardedDataParallel(make(), sub)
        opt = adamw(model)
        train(model, opt, sub, range(2))
        assert save_sharded(path, model, opt, step=2) == path
        full, optim = model.full_state_dict(), full_optim_state_dict(model, opt)
        train(model, opt, sub, [2])  # the uninterrupted run's third step
        saved[k] = path, full, optim, model.full_state_dict()
        model.close()
    paths = {k: world.control.bcast_json(saved[k][0] if world.rank == 0 else None)
             for k in sizes}
    assert sorted(os.listdir(paths[n])) == sorted(
        ["index.pt"] + [shard_file_name(r, n) for r in range(n)])
    for k in sizes:
        for k2 in sizes:
            sub = subs[k2]
            if sub is None:
                continue
            # The saving wrap at the saving size (bit-identical); another one elsewhere.
            names = ["blocks", "one unit"] if k2 == k else [list(WRAPS)[(k + k2) % 3]]
            for wrap in names:
                model = FullyShardedDataParallel(make(seed=3), sub, auto_wrap=WRAPS[wrap])
                opt = adamw(model)
                if (k + k2) % 2:  # in memory: every saved rank's dicts (files mapped)
                    files = [torch.load(os.path.join(paths[k], shard_file_name(r, k)),
                                        weights_only=True, mmap=True) for r in range(k)]
                    with no_communication(model):
                        model.load_sharded_state_dict([f["model"] for f in files])
                        load_sharded_optim_state_dict(model, opt, [f["optim"] for f in files])
                else:
                    assert load_sharded(paths[k], model, opt) == 2
                full, optim = model.full_state_dict(), full_optim_state_dict(model, opt)
                train(model, opt, sub, [2])
                after = model.full_state_dict()
                model.close()
                if world.rank >= k:
                    continue  # this rank has not the saving run's states to compare with
                _, want_full, want_optim, want_after = saved[k]
                assert_equal(full, want_full)  # the loaded state: exactly what was saved
                assert_equal(optim, want_optim)
                same = k2 == k and wrap == "blocks"
                assert_equal(after, want_after, tol=None if same else 1e-12)


# --- memory: no whole parameter, anywhere ------------------------------------------------

class Big(nn.Module):
    """One parameter (960 elements) larger than any rank's shard of the unit at K >= 2."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(24, 40)
        self.extra = nn.Parameter(torch.linspace(0.0, 1.0, 37))

    def forward(self, x):
        return self.lin(x).sum(-1, keepdim=True) * self.extra.sum()


def big(comm, wrap=None):
    torch.manual_seed(1)
    model = FullyShardedDataParallel(Big().double(), comm, auto_wrap=wrap)
    opt = adamw(model)
    g = torch.Generator().manual_seed(comm.rank)
    model(torch.randn(3, 24, generator=g, dtype=torch.float64)).sum().backward()
    opt.step()
    return model, opt


def test_a_save_holds_no_whole_parameter(world, tmp_path_factory):
    if world.size < 2:
        pytest.skip("at one rank the shard is the whole model")
    path = shared_dir(world, tmp_path_factory, "big")
    model, opt = big(world)
    shard = model.units[0].flat.shard
    weight = 24 * 40
    assert shard.numel() < weight  # the point: a shard holds only part of lin.weight
    with LargestStorage() as seen:
        sd = model.sharded_state_dict()
        osd = sharded_optim_state_dict(model, opt)
        save_sharded(path, model, opt, step=1)
    # No tensor larger than the shard came to be, and the entries are views of the shard.
    assert seen.nbytes <= shard.numel() * 8 < weight * 8
    for e in sd["params"].values():
        assert e["values"].numel() == e["stop"] - e["start"] <= shard.numel()
        assert e["values"].untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
    for e in osd["state"].values():
        for v in e["values"].values():
            assert v.numel() == e["stop"] - e["start"]
    # The file holds this rank's shard, its two moments and small scalars: nothing more.
    mine = torch.load(os.path.join(path, shard_file_name(world.rank, world.size)),
                      weights_only=True, mmap=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tree_leaves(mine) if torch.is_tensor(t)}
    assert max(storages.values()) == shard.numel() * 8
    assert sum(storages.values()) <= 3 * shard.numel() * 8 + 64
    saved_most = max(hi - lo for lo, hi in model.units[0].flat.bounds)
    model.close()
    # Loading at another size, or another wrap: nothing larger than an old or a new shard.
    k2 = world.size - 1 if world.size > 2 else world.size
    sub = world.split(0 if world.rank < k2 else None, key=world.rank)
    if sub is not None:
        torch.manual_seed(2)
        inner = Big().double()
        # At the same size, lin a unit of its own: another layout all the same.
        other = FullyShardedDataParallel(inner, sub,
                                         auto_wrap=None if k2 != world.size else [inner.lin])
        other_opt = adamw(other)
        largest = max(u.flat.shard.numel() for u in other.units)
        with LargestStorage() as seen:
            load_sharded(path, other, other_opt)
        assert seen.nbytes <= max(largest, saved_most) * 8 < weight * 8
        other.close()
        sub.free()


# --- refusals, on every rank, before anything changes ---------------------------------------

def test_bad_sets_are_refused_on_every_rank(world, tmp_path_factory):
    first = shared_dir(world, tmp_path_factory, "first")
    second = shared_dir(world, tmp_path_factory, "second")
    model = FullyShardedDataParallel(make(), world)
    opt = adamw(model)
    train(model, opt, world, range(1))
    save_sharded(first, model, opt, step=1)
    train(model, opt, world, [1])
    save_sharded(second, model, opt, step=2)
    before, before_optim = model.full_state_dict(), full_optim_state_dict(model, opt)
    last = world.size - 1

    def refused(error, match, path, target=model, target_opt=opt):
        with pytest.raises(error, match=match):
            load_sharded(path, target, target_opt)
        # Nothing changed, on any rank.
        assert_equal(model.full_state_dict(), before)
        assert_equal(full_optim_state_dict(model, opt), before_optim)

    def copy(src, name):
        dst = shared_dir(world, tmp_path_factory, name)
        if world.rank == 0:
            shutil.rmtree(dst)
            shutil.copytree(src, dst)
        world.barrier()
        return dst

    def edit(fn):
        if world.rank == 0:
            fn()
        world.barrier()

    # A file of another save in the folder: only its reader sees it, every rank refuses.
    mixed = copy(first, "mixed")
    edit(lambda: shutil.copy(os.path.join(second, shard_file_name(last, world.size)),
                             os.path.join(mixed, shard_file_name(last, world.size))))
    refused(ValueError, f"load_sharded: r{last}: .*two different saves mixed", mixed)
    # A missing file: not every element is covered.
    gone = copy(first, "gone")
    edit(lambda: os.unlink(os.path.join(gone, shard_file_name(last, world.size))))
    refused(FileNotFoundError, f"load_sharded: r{last}", gone)
    # A damaged file (one byte flipped in its tensors).
    bad = copy(first, "bad")

    def flip():
        # A byte of the first tensor's data (a random byte may fall in the archive's
        # alignment padding, which holds nothing and which no checksum covers).
        path = os.path.join(bad, shard_file_name(last, world.size))
        with zipfile.ZipFile(path) as archive:
            info = next(i for i in archive.infolist() if "/data/" in i.filename)
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        data[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
        with open(path, "wb") as fh:
            fh.write(bytes(data))
    edit(flip)
    refused(CheckpointCorruptError, f"load_sharded: r{last}: .*damaged", bad)
    # A save that did not finish: no index.
    unfinished = copy(first, "unfinished")
    edit(lambda: os.unlink(os.path.join(unfinished, "index.pt")))
    refused(FileNotFoundError, "no index.pt", unfinished)
    # Another model: names it lacks, names it has not, shapes that differ.
    for other, match in ((Net(hidden=(11, 6)).double(), r"blocks\.2\.fc1\.weight was saved "
                          r"with shape \(5, 13\), the model's is \(6, 13\)"),
                         (nn.ModuleDict({"inp": nn.Linear(7, 13)}).double(),
                          r"the save names \[.*'blocks\.0\.fc1\.bias'.*which the model lacks")):
        wrapped = FullyShardedDataParallel(other, world)
        refused(ValueError, match, first, wrapped, adamw(wrapped))
        wrapped.close()
    # The same refusals from in-memory sets, without communication: every rank reads the
    # same list (each file mapped, its pages read only where copied), so all refuse alike.
    dicts = [torch.load(os.path.join(first, shard_file_name(r, world.size)), weights_only=True,
                        mmap=True)["model"] for r in range(world.size)]
    late = torch.load(os.path.join(second, shard_file_name(last, world.size)), weights_only=True,
                      mmap=True)["model"]
    cases = [(dicts[:-1] or [{**dicts[0], "rank": 1}], r"does not cover every element"),
             (dicts[:-1] + [late] if world.size > 1 else [dicts[0], late], "2 different saves")]
    if world.size > 1:  # a lone dict of another rank
        cases.append((dicts[(world.rank + 1) % world.size], "one dict loads only on the rank"))
    for bad_set, match in cases:
        with no_communication(model), pytest.raises(ValueError, match=match):
            model.load_sharded_state_dict(bad_set)
    assert_equal(model.full_state_dict(), before)
    # ... and torch's own optimizer.state_dict() (keyed by number) is no sharded state.
    with pytest.raises(ValueError, match="not a sharded state dict"):
        load_sharded_optim_state_dict(model, opt, opt.state_dict())
    # The good set loads, and equals the first save's state.
    model.load_sharded_state_dict(dicts)
    assert load_sharded(first, model, opt) == 1
    model.close()


# --- the same world size and wrap: no communication, bit-identical -----------------------

def test_same_layout_continues_bit_identically_without_communication(comm):
    model = FullyShardedDataParallel(make(), comm)
    opt = adamw(model)
    train(model, opt, comm, range(2))
    with no_communication(model):
        sd = model.sharded_state_dict()
        osd = sharded_optim_state_dict(model, opt)
    # Each rank's slices only, views of its shards: the sum over ranks is the model once.
    mine = sum(e["stop"] - e["start"] for e in sd["params"].values())
    assert mine == sum(p.numel() for p in model.parameters())
    assert comm.control.allreduce_scalar(mine) == sum(
        p.numel() for p in {id(p): p for p in make().parameters()}.values())
    assert "mix_again.weight" not in sd["params"] and sd["aliases"] == {
        "mix_again.weight": "mix.weight"}
    other = FullyShardedDataParallel(make(seed=9), comm)
    other_opt = adamw(other)
    with no_communication(other):
        other.load_sharded_state_dict(sd)
        load_sharded_optim_state_dict(other, other_opt, osd)
    train(model, opt, comm, [2])
    train(other, other_opt, comm, [2])
    assert_equal(other.full_state_dict(), model.full_state_dict())
    assert_equal(full_optim_state_dict(other, other_opt), full_optim_state_dict(model, opt))
    model.close()
    other.close()
