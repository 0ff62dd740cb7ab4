"""An unsplit backward adds each Linear's weight gradient into .grad with one GEMM.

1F1B's and GPipe's B go through ``split_backward``'s layer with ``fuse`` set:
dW = dY^T X lands in ``.grad`` by ``addmm_`` instead of being handed to
autograd's AccumulateGrad. These tests hold it to autograd's result on K = 1..4
stages, check that it is the path taken, and that a parameter with a hook, or
a layer under autocast, keeps autograd's own accumulation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_pipeline_runtime import bounds, data, mlp, mse, reference
from torch import nn

from mpiring.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from mpiring.parallel.pipeline import split_backward as sb


def _run(comm, make, m: int, *, fuse: bool, hooks=None):
    """One step of ``make``'s schedule on this rank's stage; (stage params, full model)."""
    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    counts = hooks(part) if hooks is not None else None
    if hooks is not None:
        hooks(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    stage.fuse_weight_grads = fuse
    sched = make(stage, m, mse)
    x, y = data()
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    reference(full, x, y, m, mse)  # the unsplit model's gradients
    sched.free()
    stage.free()
    return list(part.parameters()), list(full[lo:hi].parameters()), counts


@pytest.mark.parametrize("make", [Schedule1F1B, ScheduleGPipe], ids=["1f1b", "gpipe"])
@pytest.mark.parametrize("m", (1, 3))  # 3: uneven micro-batches (4, 3, 3)
def test_the_fused_gemm_is_the_path_and_equals_autograd(comm, monkeypatch, make, m):
    monkeypatch.setattr(sb, "FUSE_MIN_WEIGHTS", 0)  # these layers are small: route them all
    runs = []
    real_run = sb.Deferred.run
    monkeypatch.setattr(sb.Deferred, "run", lambda self: (runs.append(1), real_run(self)))
    for fuse in (True, False):
        runs.clear()
        got, want, _ = _run(comm, make, m, fuse=fuse)
        for p, q in zip(got, want):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        linears = len(got) // 2  # weight and bias each
        # One GEMM per Linear and micro-batch when fused; none when autograd accumulates.
        assert len(runs) == (linears * m if fuse else 0), (fuse, len(runs))


def test_only_layers_with_enough_weights_are_fused(comm, monkeypatch):
    # Weights per Linear: 21, 35, 30, 24, 8. At 30, the second and third are fused.
    monkeypatch.setattr(sb, "FUSE_MIN_WEIGHTS", 30)
    m, runs = 3, []
    real_run = sb.Deferred.run
    monkeypatch.setattr(sb.Deferred, "run",
                        lambda self: (runs.append(self.params[0].numel()), real_run(self)))
    got, want, _ = _run(comm, Schedule1F1B, m, fuse=True)
    for p, q in zip(got, want):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    mine = [p.numel() for p in got[::2]]  # this stage's weights
    assert sorted(runs) == sorted(n for n in mine for _ in range(m) if n >= 30), (runs, mine)


def _hooked(part: nn.Module) -> dict[str, int]:
    """Every weight's gradient doubled on its way in, each bias's accumulations counted."""
    counts: dict[str, int] = {}
    for name, p in part.named_parameters():
        if name.endswith("weight"):
            p.register_hook(lambda g: 2 * g)
        else:
            counts[name] = 0

            def seen(_p, name=name):
                counts[name] += 1
            p.register_post_accumulate_grad_hook(seen)
    return counts


def test_parameters_with_hooks_keep_autograds_accumulation(comm, monkeypatch):
    monkeypatch.setattr(sb, "FUSE_MIN_WEIGHTS", 0)
    m = 4
    runs = []
    real_run = sb.Deferred.run
    monkeypatch.setattr(sb.Deferred, "run", lambda self: (runs.append(1), real_run(self)))
    got, want, counts = _run(comm, Schedule1F1B, m, fuse=True, hooks=_hooked)
    for p, q in zip(got, want):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert not runs  # every Linear has a hooked parameter: none is fused
    # AccumulateGrad ran once per micro-batch, each time firing the hook.
    assert counts and set(counts.values()) == {m}, counts


@pytest.mark.one_rank
def test_fusable_needs_no_hook_and_one_dtype():
    lin = nn.Linear(3, 2)
    x, gy = torch.randn(4, 3), torch.randn(4, 2)
    item = sb.Deferred(lin.weight, lin.bias, x, gy)
    assert item.fusable(0)
    assert not sb.Deferred(lin.weight, lin.bias, x.bfloat16(), gy.bfloat16()).fusable(0)
    h = lin.bias.register_post_accumulate_grad_hook(lambda p: None)
    assert not item.fusable(0) and item.fusable(1)  # one hook the sink knows to be inert
    h.remove()
    h = lin.weight.register_hook(lambda g: g)
    assert not item.fusable(1)  # a hook that may change the gradient: autograd's path
    h.remove()
    assert item.fusable(0)


@pytest.mark.one_rank
def test_autocast_keeps_autograds_linear():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    routed = copy.deepcopy(plain)
    sink = sb.install(routed)
    sink.route = 0  # as a stage's forward sets it: autocast alone turns it away
    x = torch.randn(6, 4)
    for fuse in (False, True):
        grads = []
        for mod in (plain, routed):
            mod.zero_grad()
            sink.fuse = fuse
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = mod(x)
            assert out.dtype == torch.bfloat16
            out.float().square().sum().backward()
            grads.append([p.grad for p in mod.parameters()])
        for a, b in zip(*grads):
            assert b.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=0, atol=0)
