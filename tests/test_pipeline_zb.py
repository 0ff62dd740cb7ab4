"""Zero bubble's B/W split on the GPT: the Linear weight gradients wait for W, and stay exact.

The reference is the unsplit model in one process, float64; the split Linear
layers run torch's own kernels, so the gradients agree to rounding.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.pipeline import PipelineStage, ScheduleZeroBubble, split_backward
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import split_gpt, units

CFG = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g),
            torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g))


def _reference(full, x, y, m):
    full.zero_grad()
    losses = [lm_loss(full(a), b) for a, b in zip(torch.tensor_split(x, m), torch.tensor_split(y, m))]
    torch.stack(losses).mean().backward()
    return [v.item() for v in losses]


def _gpt_stage(comm):
    """The unsplit GPT, this rank's part of a copy, and its counting stage."""
    torch.manual_seed(5)
    full = GPT(CFG).double()
    module, tied = split_gpt(full, comm.size, comm.rank)
    return full, module, PipelineStage(module, comm.rank, comm.size, comm,
                                       tied_parameters=tied, count_activations=True)


def _step_and_compare(full, module, stage, sched, x, y, m: int) -> None:
    """One step of ``sched``: the unsplit model's losses and gradients."""
    ref = _reference(full, x, y, m)
    module.zero_grad(set_to_none=True)
    losses: list = []
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
               losses=losses if stage.is_last else None)
    if stage.is_last:
        assert [float(v) for v in losses] == pytest.approx(ref, rel=1e-12)
    _same_grads(full, module, stage.comm)


def _same_grads(full, module, comm) -> None:
    parts = units(full)  # the unsplit model's own modules for this stage, in order
    lo, hi = chunk_bounds(len(parts), comm.size)[comm.rank]
    for (name, mine), theirs in zip(module.named_parameters(),
                                    nn.Sequential(*parts[lo:hi]).parameters(), strict=True):
        assert mine.grad is not None, name
        # W's GEMM on an X that requires grad must not leave a graph (holding every
        # micro-batch's dY) on .grad.
        assert mine.grad.grad_fn is None, f"{name}.grad has a graph: {mine.grad.grad_fn}"
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("m", (1, 3, 8))
def test_zero_bubble_gpt_matches_unsplit_model(comm, m):
    full, module, stage = _gpt_stage(comm)
    sched = ScheduleZeroBubble(stage, m, lm_loss)
    for salt in (0, 1):  # the second step: agreed shapes, kept buffers, posted receives
        x, y = _batch(9, 20 + salt + comm.size)
        _step_and_compare(full, module, stage, sched, x, y, m)
    assert stage.live_bytes == 0


@pytest.mark.parametrize("cap", ["none", "half", "zero"])
def test_a_limit_on_the_held_weight_gradients(comm, cap):
    # max_held_bytes: before each forward the queued W's beyond the limit run (the
    # least worth first); the gradients stay exact, the held bytes stay under the limit,
    # and a limit of 0 runs every W before the next forward.
    full, module, stage = _gpt_stage(comm)
    x, y = _batch(9, 7)
    held: list[int] = []  # what the queues keep at the end of each forward
    original = stage.forward

    def forward(mb, *args, **kwargs):
        out = original(mb, *args, **kwargs)
        held.append(sum(split_backward.held_bytes(q) for q in stage._wq.values()))
        return out
    stage.forward = forward
    ScheduleZeroBubble(stage, 4, lm_loss).step(x if stage.is_first else None,
                                               target=y if stage.is_last else None)
    unlimited = max(held)
    held.clear()
    limit = {"none": None, "half": unlimited // 2, "zero": 0}[cap]
    sched = ScheduleZeroBubble(stage, 4, lm_loss, max_held_bytes=limit)
    ScheduleZeroBubble(stage, 4, lm_loss)  # another schedule on the stage: its own limit
    _step_and_compare(full, module, stage, sched, x, y, 4)
    if limit is not None:
        assert max(held) <= limit and (limit or not any(held))
    assert stage.live_bytes == 0
    with pytest.raises(ValueError, match="max_held_bytes=-1: give a number of bytes"):
        ScheduleZeroBubble(stage, 4, lm_loss, max_held_bytes=-1)


def _whole_gpt_after_b(comm):
    """One stage holding the whole GPT (embeddings, attention, LayerNorms, MLP, head),
    after one micro-batch's F and split B; with the unsplit twin, the batch and the
    bytes the forward saved."""
    if comm.size > 1:
        pytest.skip("one stage: the program is F B W per micro-batch")
    torch.manual_seed(1)
    full = GPT(CFG).double()
    mine = copy.deepcopy(full)
    stage = PipelineStage(mine, 0, 1, comm, count_activations=True)
    stage.split_backward()
    x, y = _batch(4, 3)
    with pytest.raises(ValueError, match="pass split=True to forward"):
        stage.forward(0, x, target=y, loss_fn=lm_loss)
        stage.backward(0, None, split=True)
    stage.reset()
    stage.forward(0, x, target=y, loss_fn=lm_loss, split=True)
    saved = stage.live_bytes
    stage.backward(0, None, split=True)
    return full, mine, stage, (x, y), saved


def _w_and_compare(full, mine, stage, batch) -> None:
    """Micro-batch 0's W: nothing held after it, and the unsplit model's gradients."""
    stage.weight(0)
    assert stage.live_bytes == 0
    lm_loss(full(batch[0]), batch[1]).backward()
    for (name, p), q in zip(mine.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_the_linear_weight_gradients_wait_for_w(comm):
    full, mine, stage, batch, saved = _whole_gpt_after_b(comm)
    linear = {f"{n}.{k}" for n, m in mine.named_modules() if isinstance(m, nn.Linear)
              for k, _ in m.named_parameters(recurse=False)}
    after_b = {n for n, p in mine.named_parameters() if p.grad is not None}
    assert linear and not after_b & linear, "a Linear weight gradient was computed in B"
    # LayerNorms and the embeddings are done in B (the tied embedding is also the head's
    # weight: its embedding part is in, the head's part waits).
    assert {n for n, _ in mine.named_parameters()} - linear <= after_b
    # What W keeps (each Linear's input and output gradient) is no more than the forward saved.
    assert 0 < stage.live_bytes <= saved
    _w_and_compare(full, mine, stage, batch)


def test_a_limit_keeps_the_weight_gradients_worth_most(comm):
    # Under max_held_bytes, the W items that run early (on the critical path) are those
    # with the least work per byte they keep: here the projection, the head and the
    # qkv layer go, and the MLP's two layers (in * out / (in + out) = 6.4 for d = 8)
    # stay deferred; the largest-first order this replaced ran exactly those first.
    full, mine, stage, batch, _ = _whole_gpt_after_b(comm)
    queue = stage._wq[0]
    mlp = [d for d in queue if d.tensors[0].shape[-1] * d.tensors[1].shape[-1] == 4 * 8 * 8]
    assert len(mlp) == 2 * CFG.n_layers and len(queue) > len(mlp)
    stage._hold_at_most(split_backward.held_bytes(mlp))
    assert stage._wq[0] == mlp
    assert stage.live_bytes == split_backward.held_bytes(mlp)
    _w_and_compare(full, mine, stage, batch)


@pytest.mark.parametrize("layer", ["linear", "linear-no-bias", "layer-norm", "embedding"])
def test_split_layer_variants(comm, layer):
    # Each layer against itself unsplit; a Linear defers its weight gradient (a queue
    # item), the others keep theirs in B.
    torch.manual_seed(7)
    make = {"linear": lambda: nn.Linear(6, 6),
            "linear-no-bias": lambda: nn.Linear(6, 6, bias=False),
            "layer-norm": lambda: nn.LayerNorm(6),
            "embedding": lambda: nn.Embedding(9, 6, padding_idx=2)}[layer]
    ref = make().double()
    mod = copy.deepcopy(ref)
    sink = split_backward.install(mod)
    sink.route = 0  # as a stage's forward sets it
    is_emb = layer == "embedding"
    x = torch.tensor([[1, 2, 3], [2, 8, 0]]) if is_emb else torch.randn(2, 3, 6, dtype=torch.float64)
    xr = x if is_emb else x.clone().requires_grad_()
    xm = x if is_emb else x.clone().requires_grad_()
    (ref(xr) ** 3).sum().backward()
    sink.queue = queue = []
    (mod(xm) ** 3).sum().backward()
    sink.queue = None
    assert bool(queue) == layer.startswith("linear")
    assert all(p.grad is None for p in mod.parameters()) == bool(queue)
    for item in queue:
        item.run()
    for p, q in zip(mod.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    if not is_emb:
        torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-12, atol=1e-14)


def _split_and_compare(ref: nn.Module, x: torch.Tensor) -> tuple[list, nn.Module]:
    """Backward of sum(ref(x)^2) on ref and on a split copy (B, then its queue's W); the
    copy's output and every .grad must equal ref's (None where ref's is). Returns the
    weights W deferred, and the copy."""
    mod = copy.deepcopy(ref)
    sink = split_backward.install(mod)
    sink.route = 0  # as a stage's forward sets it
    (ref(x) ** 2).sum().backward()
    sink.queue = queue = []
    out = mod(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-12, atol=1e-14)
    (out ** 2).sum().backward()
    sink.queue = None
    held = list(queue)
    for item in queue:
        item.run()
    for (name, p), q in zip(mod.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: frozen, yet W gave it a gradient"
        else:
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)
    return [item.params[0] for item in held], mod


def test_frozen_parameters_get_no_gradient_from_w(comm):
    # A frozen layer (LoRA's base weights, a frozen embedding) must end B and W
    # without a .grad, as it would under plain autograd; the trainable one gets its.
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 2)).double()
    # Frozen after a trainable layer, so their backward runs (for the input's gradient).
    for p in list(ref[1].parameters()) + list(ref[2].parameters()):
        p.requires_grad_(False)
    deferred, _ = _split_and_compare(ref, torch.randn(4, 6, dtype=torch.float64))
    assert len(deferred) == 1, "only the trainable layer has weight-gradient work to defer"


def test_a_linear_with_its_own_forward_is_not_split(comm):
    # A subclass that changes forward (LoRA adds a low-rank path) must keep it: the
    # deferring forward is F.linear alone. A subclass that keeps nn.Linear's is split.
    class Lora(nn.Linear):
        def __init__(self, n):
            super().__init__(n, n)
            self.a = nn.Parameter(torch.randn(2, n, dtype=torch.float64))
            self.b = nn.Parameter(torch.randn(n, 2, dtype=torch.float64))

        def forward(self, x):
            return super().forward(x) + x @ self.a.t() @ self.b.t()

    class Plain(nn.Linear):
        pass

    torch.manual_seed(11)
    ref = nn.Sequential(Lora(4), nn.Tanh(), Plain(4, 3), nn.Tanh(), nn.Linear(3, 3)).double()
    own = ref[4]  # a forward set on the instance (a hook library's way) is kept too
    own.forward = types.MethodType(lambda self, x: F.linear(x, self.weight, self.bias) * 2, own)
    deferred, mod = _split_and_compare(ref, torch.randn(5, 4, dtype=torch.float64))
    assert len(deferred) == 1 and deferred[0] is mod[2].weight


def test_a_parametrized_linear_is_not_split(comm):
    # weight_norm computes the weight from two parameters: W writing .grad onto the
    # computed weight would leave the parameters without a gradient.
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(13)
    ref = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.Linear(4, 3)).double()
    deferred, mod = _split_and_compare(ref, torch.randn(5, 4, dtype=torch.float64))
    assert len(deferred) == 1 and deferred[0] is mod[2].weight


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_linear_parametrized_after_install_computes_its_tensor(comm, name):
    # The routed forward reads the layer's own parameters; a parametrization added later
    # takes the tensor out of them, and the layer computes it as torch would.
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, t):
            return 2 * t

    torch.manual_seed(14)
    ref = nn.Linear(4, 3).double()
    mod = copy.deepcopy(ref)
    sink = split_backward.install(mod)
    for m in (ref, mod):
        parametrize.register_parametrization(m, name, Double())
    x = torch.randn(5, 4, dtype=torch.float64)
    for route in (None, 0):
        sink.route = route
        torch.testing.assert_close(mod(x), ref(x), rtol=0, atol=0)
    sink.route = None
