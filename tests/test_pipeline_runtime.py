"""The pipeline runtime against the unsplit model, float64, on K = 1..4 stages.

Every rank builds the whole model from one seed and keeps its stage's layers;
the reference is the unsplit model run by one process on the same
micro-batches, with the gradient of the mean of the micro-batch losses.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    SchedulePipeDream,
    ScheduleZeroBubble,
)
from mpiring.parallel.pipeline.actions import parse_schedule
from mpiring.parallel.pipeline.runtime import PipelineSchedule, _eager_sends
from mpiring.parallel.pipeline.schedules import build, compute_only
from mpiring.parallel.pipeline.transport import TAG_META, TAGS
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import split_gpt, units

ROWS = 10  # does not divide by 4 or 8: uneven micro-batches
SCHEDULES = {
    "gpipe": lambda st, m, lf: ScheduleGPipe(st, m, lf),
    "gpipe-recompute": lambda st, m, lf: ScheduleGPipe(st, m, lf, recompute=True),
    "1f1b": lambda st, m, lf: Schedule1F1B(st, m, lf),
    "zb": lambda st, m, lf: ScheduleZeroBubble(st, m, lf),
}


def mlp(widths=(3, 7, 5, 6, 4, 2), seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers).double()


def bounds(n: int, k: int) -> list[tuple[int, int]]:
    edges = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(n), k)])
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


def data(salt: int = 0):
    g = torch.Generator().manual_seed(123 + salt)
    return (torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
            torch.randn(ROWS, 2, generator=g, dtype=torch.float64))


def mse(out, t):
    return ((out - t) ** 2).mean()


def reference(full: nn.Module, x, y, m: int, loss_fn, accumulate: bool = False):
    """Losses, output and grads of the mean of the micro-batch losses, one process
    (added to the gradients already there with ``accumulate``)."""
    if not accumulate:
        full.zero_grad()
    losses = [loss_fn(full(a), b) for a, b in zip(torch.tensor_split(x, m), torch.tensor_split(y, m))]
    torch.stack(losses).mean().backward()
    with torch.no_grad():
        out = full(x)
    return [v.item() for v in losses], out


def same_grads(part: nn.Module, twin: nn.Module) -> None:
    """Each of the stage's gradients equals its slice of the unsplit model's."""
    for p_stage, p_full in zip(part.parameters(), twin.parameters()):
        torch.testing.assert_close(p_stage.grad, p_full.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("m", (1, 2, 4, 8))
def test_schedule_matches_unsplit_model(comm, name, m):
    full = mlp()
    # Uneven stages: 10 modules (5 Linear + 5 Tanh) over K stages, array_split bounds.
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm, count_activations=True)
    sched = SCHEDULES[name](stage, m, mse)
    for salt in (0, 1):  # the second step reuses the agreed shapes and the stage state
        x, y = data(salt)
        ref_losses, ref_out = reference(full, x, y, m, mse)
        part.zero_grad()
        losses: list = []
        out = sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
                         losses=losses if stage.is_last else None)
        if stage.is_last:
            assert [float(v) for v in losses] == pytest.approx(ref_losses, rel=1e-12)
            torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        else:
            assert out is None
        same_grads(part, full[lo:hi])
    assert stage.live_bytes == 0  # every micro-batch's activations released
    assert stage.peak_activation_bytes > 0  # ... after they were counted


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_a_step_without_autograd_is_refused_and_eval_runs_under_inference_mode(comm, name):
    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = SCHEDULES[name](stage, 2, mse)
    x, y = data()
    ins, tgt = (x if stage.is_first else None), (y if stage.is_last else None)
    # A step that could compute no gradient would train nothing, silently: refused on
    # every rank before anything moves, naming eval().
    for off in (torch.no_grad, torch.inference_mode):
        with off(), pytest.raises(ValueError, match=r"step\(\) under torch.no_grad\(\) or "
                                                    r"torch.inference_mode\(\) computes no "
                                                    r"gradient: .*call eval\(\)"):
            sched.step(ins, target=tgt)
    with torch.no_grad():
        want = full(x)
    # eval() under inference_mode, twice (the second reuses what the first laid out),
    # then plain: the buffers made under inference_mode must take a later write.
    for mode in (torch.inference_mode, torch.inference_mode, torch.enable_grad):
        with mode():
            out = sched.eval(ins)
        if stage.is_last:
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    ref_losses, _ = reference(full, x, y, 2, mse)
    losses: list = []
    sched.step(ins, target=tgt, losses=losses if stage.is_last else None)
    if stage.is_last:
        assert [float(v) for v in losses] == pytest.approx(ref_losses, rel=1e-12)
    same_grads(part, full[lo:hi])


@pytest.mark.parametrize("name", ["gpipe", "gpipe-recompute", "1f1b"])
def test_batch_norm_statistics_are_updated_once_per_micro_batch(comm, name):
    # The recomputing forward runs in training mode too: its update of the running
    # statistics must not count, or every micro-batch would be counted twice.
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 4),
                         nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    sched = SCHEDULES[name](PipelineStage(part, comm.rank, comm.size, comm), 3, mse)
    for salt in (0, 1):
        x, y = data(salt)
        full.zero_grad()
        part.zero_grad()
        # The twin: the micro-batches one after the other, as the stages see them.
        losses = [mse(full(a), b) for a, b in zip(torch.tensor_split(x, 3),
                                                 torch.tensor_split(y, 3))]
        torch.stack(losses).mean().backward()
        sched.step(x if comm.rank == 0 else None, target=y if comm.rank == comm.size - 1
                   else None)
        for (n, got), want in zip(part.named_buffers(), full[lo:hi].buffers()):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=n)
        same_grads(part, full[lo:hi])


def test_sizes_of_any_integer_type_count_and_others_are_refused(comm):
    # Counts often come from NumPy (a config, an arange): torch takes them; True, 2.0
    # and 0 are mistakes.
    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, np.int64(comm.rank), np.int32(comm.size), comm)
    assert type(stage.stage_index) is int and type(stage.num_stages) is int
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=rf"n_microbatches={bad!r}: give a positive integer"):
            Schedule1F1B(stage, bad, mse)
    sched = Schedule1F1B(stage, np.int64(2), mse)
    assert type(sched.n_microbatches) is int
    assert build("1f1b", np.int64(2), np.uint8(3)) == build("1f1b", 2, 3)
    x, y = data()
    reference(full, x, y, 2, mse)
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    same_grads(part, full[lo:hi])


def test_an_in_place_op_on_a_received_input_names_the_cut():
    # A received input is a leaf that requires grad: torch's own message names the
    # symptom; the stage's failure adds the fix.
    from mpiring.parallel.pipeline.runtime import _hint
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        nn.ReLU(inplace=True)(x)
    assert "make that op out of place, or cut the model elsewhere" in _hint(info.value)
    assert _hint(RuntimeError("boom")) == ""


class _Binarize(nn.Module):
    """A stage boundary without a gradient: its output is integers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        return (self.lin(x) > 0).long()


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x.to(self.lin.weight.dtype))


@pytest.mark.parametrize("case", ["frozen-first", "integer-boundary", "input-grad"])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_stages_that_pass_no_gradient_back(comm, case, name):
    # A frozen first stage (its output needs no gradient), an integer boundary (the
    # stage after cannot give one: it sends zeros), and a first-stage input that
    # requires grad (x.grad must come back, with recomputation too).
    if case == "integer-boundary":
        if comm.size != 2:
            pytest.skip("a two-stage model")
        torch.manual_seed(4)
        full = nn.Sequential(_Binarize(), _Embed()).double()
    else:
        full = mlp()
        if case == "frozen-first":
            if comm.size == 1:
                pytest.skip("the whole model would be frozen")
            lo0, hi0 = bounds(len(full), comm.size)[0]
            full[lo0:hi0].requires_grad_(False)  # the first stage's output needs no gradient
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = SCHEDULES[name](stage, 4, mse)
    for salt in (0, 1):
        x, y = data(salt)
        xr, xm = x.clone().requires_grad_(case == "input-grad"), x.clone()
        reference(full, xr, y, 4, mse)
        xm.requires_grad_(case == "input-grad")
        part.zero_grad(set_to_none=True)
        sched.step(xm if stage.is_first else None, target=y if stage.is_last else None)
        for (n, p_stage), p_full in zip(part.named_parameters(), full[lo:hi].parameters()):
            if p_full.grad is None:
                assert p_stage.grad is None, n
            else:
                torch.testing.assert_close(p_stage.grad, p_full.grad, rtol=1e-10, atol=1e-12,
                                           msg=n)
        if case == "input-grad" and stage.is_first:
            torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-10, atol=1e-12)


def test_gpt_with_tied_embedding(comm):
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)
    torch.manual_seed(3)
    full = GPT(cfg).double()
    module, tied = split_gpt(full, comm.size, comm.rank)
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = Schedule1F1B(stage, 3, lm_loss)
    g = torch.Generator().manual_seed(9)
    # Two steps without zero_grad: the second adds to the first, on both models (the
    # tied sum must add the second step's part, not the first's again).
    for step in range(2):
        x, y = (torch.randint(0, 11, (7, 5), generator=g),
                torch.randint(0, 11, (7, 5), generator=g))
        ref_losses, _ = reference(full, x, y, 3, lm_loss, accumulate=step > 0)
        losses: list = []
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
                   losses=losses if stage.is_last else None)
        if stage.is_last:
            assert [float(v) for v in losses] == pytest.approx(ref_losses, rel=1e-12)
        if stage.is_first or stage.is_last:
            # Both copies of the tied weight carry the whole gradient (input + output use).
            w = module[0].tok.weight if stage.is_first else module[-1].head.weight
            torch.testing.assert_close(w.grad, full.tok.weight.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, s=step: f"after step {s + 1}: {m}")
    assert all(p.grad is not None for p in module.parameters())


@pytest.mark.parametrize("name", ("1f1b", "zb"))
def test_stages_built_on_the_meta_device_then_materialized(comm, name):
    # torchtitan's order: build the model on "meta", split it, make the stages, then
    # to_empty() and initialize. to_empty() puts new Parameter objects in the modules,
    # so the tied weight given to PipelineStage at build time is stale by the first step.
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)
    torch.manual_seed(3)
    full = GPT(cfg).double()
    twin, _ = split_gpt(full, comm.size, comm.rank)  # the values to initialize with
    with torch.device("meta"):
        meta = GPT(cfg).double()
    module, tied = split_gpt(meta, comm.size, comm.rank)
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = SCHEDULES[name](stage, 3, lm_loss)
    g = torch.Generator().manual_seed(9)
    x, y = torch.randint(0, 11, (7, 5), generator=g), torch.randint(0, 11, (7, 5), generator=g)
    if comm.rank != comm.size - 1:
        module.to_empty(device="cpu")
    # A step while one stage is still on "meta": refused on every rank before any message
    # (its forward would have failed on that rank alone, mid-schedule).
    with pytest.raises(ValueError, match=rf"r{comm.size - 1}: stage {comm.size - 1}: "
                                         "parameters or buffers on the meta device"):
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    if comm.rank == comm.size - 1:
        module.to_empty(device="cpu")
    if comm.size == 1:  # torch's to_empty unties a tie inside one module: tie it again
        module[-1].head.weight = module[0].tok.weight
    with torch.no_grad():
        module.load_state_dict(twin.state_dict())
    ref_losses, _ = reference(full, x, y, 3, lm_loss)
    losses: list = []
    sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
               losses=losses if stage.is_last else None)
    if stage.is_last:
        assert [float(v) for v in losses] == pytest.approx(ref_losses, rel=1e-12)
    # Every gradient, the tied weight's whole one (input and output use) on both ends
    # included, against the unsplit model's units that this stage holds copies of.
    parts = units(full)
    lo, hi = chunk_bounds(len(parts), comm.size)[comm.rank]
    same_grads(module, nn.Sequential(*parts[lo:hi]))
    sched.free()
    stage.free()


def test_a_tied_parameter_taken_out_after_a_step_is_refused(comm):
    # The parameters are checked in full until a step goes through; after that a tied
    # name that no longer names a Parameter (module surgery, a later fully_shard) has
    # them checked again, rather than the tied sum adding zeros for it.
    if comm.size == 1:
        pytest.skip("one stage holds both ends of the tie: no tied_parameters")
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)
    torch.manual_seed(3)
    module, tied = split_gpt(GPT(cfg).double(), comm.size, comm.rank)
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = Schedule1F1B(stage, 2, lm_loss)
    x = y = torch.zeros(4, 5, dtype=torch.long)
    args = (x if stage.is_first else None,)
    sched.step(*args, target=y if stage.is_last else None)
    if stage.is_last:
        head = module[-1].head
        w = head.weight
        del head.weight
        head.weight = w.detach().clone()  # a plain tensor: no gradient, no Parameter
    with pytest.raises(ValueError, match=rf"r{comm.size - 1}: stage {comm.size - 1}: "
                                         r"tied_parameters \[0\] are no longer parameters"):
        sched.step(*args, target=y if stage.is_last else None)
    sched.free()
    stage.free()


def test_zero_bubble_defers_the_weight_gradients(comm):
    # After B alone, the Linear weights have no gradient yet; W gives them.
    if comm.size > 1:
        pytest.skip("checked on one stage, where the program is F B W per micro-batch")
    part = mlp()[:2]
    stage = PipelineStage(part, 0, 1, comm)
    stage.split_backward()
    x = data()[0]
    out, loss = stage.forward(0, x, target=torch.zeros(ROWS, 7, dtype=torch.float64),
                              loss_fn=mse, split=True)
    stage.backward(0, None, split=True)
    assert part[0].weight.grad is None
    stage.weight(0)
    assert part[0].weight.grad is not None and part[0].weight.grad.abs().sum() > 0


def _pipedream_reference(parts, x, y, m, lr):
    """One process plays every stage in the 1F1B order, updating after each backward
    with the weights its forward used (stashed): the update rule, written out."""
    p = len(parts)
    progs = [compute_only(build("pipedream", p, m)[i]) for i in range(p)]
    xs, ys = torch.tensor_split(x, m), torch.tensor_split(y, m)
    acts, grads, stash, saved = {}, {}, {}, {}
    pc = [0] * p
    while any(pc[i] < len(progs[i]) for i in range(p)):
        for i in range(p):
            while pc[i] < len(progs[i]):
                a = progs[i][pc[i]]
                if a.kind == "F":
                    if i > 0 and (i - 1, a.mb) not in acts:
                        break
                    inp = xs[a.mb] if i == 0 else acts[(i - 1, a.mb)].detach().requires_grad_()
                    w = {n: t.detach().clone().requires_grad_() for n, t in parts[i].named_parameters()}
                    out = functional_call(parts[i], w, (inp,))
                    stash[(i, a.mb)], saved[(i, a.mb)] = w, (inp, out)
                    acts[(i, a.mb)] = out
                else:
                    if i < p - 1 and (i + 1, a.mb) not in grads:
                        break
                    inp, out = saved.pop((i, a.mb))
                    if i == p - 1:
                        (mse(out, ys[a.mb]) / m).backward()
                    else:
                        out.backward(grads[(i + 1, a.mb)])
                    grads[(i, a.mb)] = inp.grad
                    with torch.no_grad():
                        for n, t in parts[i].named_parameters():
                            t -= lr * stash[(i, a.mb)][n].grad
                pc[i] += 1


def test_pipedream_weight_stashing(comm):
    m, lr = 4, 0.1
    full = mlp()
    b = bounds(len(full), comm.size)
    parts = [copy.deepcopy(full[lo:hi]) for lo, hi in b]
    part = copy.deepcopy(parts[comm.rank])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = SchedulePipeDream(stage, m, mse, optimizer=torch.optim.SGD(part.parameters(), lr=lr))
    for salt in (0, 1):
        x, y = data(salt)
        _pipedream_reference(parts, x, y, m, lr)
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        for mine, ref in zip(part.parameters(), parts[comm.rank].parameters()):
            torch.testing.assert_close(mine, ref, rtol=1e-12, atol=1e-12)
    # Two steps of m updates each moved every stage's weights.
    start = full[b[comm.rank][0]:b[comm.rank][1]].parameters()
    assert any((a - c).abs().max() > 0 for a, c in zip(part.parameters(), start))


def test_bad_arguments_raise_on_every_rank(comm):
    stage = PipelineStage(nn.Identity(), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 4, mse)
    x, y = data()
    with pytest.raises(ValueError, match="fewer than n_microbatches=4"):
        sched.step(x[:3] if stage.is_first else None, target=y[:3] if stage.is_last else None)
    with pytest.raises(ValueError, match=r"0 rows \(an empty batch\): give at least "
                                         r"n_microbatches=4 rows"):
        sched.step(x[:0] if stage.is_first else None, target=y[:0] if stage.is_last else None)
    if comm.size > 1:
        with pytest.raises(ValueError, match="only the first stage takes the input"):
            sched.step(x, target=y if stage.is_last else None)
        with pytest.raises(ValueError, match="same batch"):
            sched.step(x if stage.is_first else None, target=y[:7] if stage.is_last else None)
    with pytest.raises(ValueError, match="stage_index=comm.rank"):
        PipelineStage(nn.Identity(), (comm.rank + 1) % comm.size if comm.size > 1 else 1,
                      comm.size, comm)
    deep = torch.zeros((ROWS,) + (1,) * 8, dtype=torch.float64)  # 9 dimensions
    with pytest.raises(ValueError, match="x has 9 dimensions; the first stage's inputs may have "
                                         "up to 8"):
        sched.step(deep if stage.is_first else None, target=y if stage.is_last else None)


@pytest.mark.parametrize("bad", ["shape", "dtype", "frozen", "foreign"])
def test_tied_parameters_that_do_not_match_are_refused_on_every_rank(comm, bad):
    if comm.size < 2:
        pytest.skip("the tie joins the first and the last stage")
    ends = comm.rank in (0, comm.size - 1)
    part = nn.Linear(4, 4).double()
    tied = [part.weight] if ends else []
    if comm.rank == comm.size - 1:
        if bad in ("shape", "dtype"):
            part = nn.Linear(4, 3).double() if bad == "shape" else nn.Linear(4, 4).float()
            tied = [part.weight]
        elif bad == "frozen":
            part.weight.requires_grad_(False)  # one end would sum, the other not
        else:
            tied = [nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))]  # not part's
    want = {"shape": r"tied_parameters differ: first stage \[\[4, 4, 'torch.float64', "
                     r"True\]\], last stage \[\[3, 4, 'torch.float64', True\]\]",
            "dtype": r"last stage \[\[4, 4, 'torch.float32', True\]\]",
            "frozen": r"last stage \[\[4, 4, 'torch.float64', False\]\] \(shapes, then "
                      r"dtype and requires_grad\)",
            "foreign": f"r{comm.size - 1} gave 1 tied parameter\\(s\\) that are not "
                       "parameters of its submodule"}[bad]
    with pytest.raises(ValueError, match=want):
        PipelineStage(part, comm.rank, comm.size, comm, tied_parameters=tied)


def test_a_frozen_tied_pair_gets_no_gradient(comm):
    # Frozen on both ends: nothing to sum, no zero gradient (AdamW's weight decay would
    # move a zero gradient's parameter on both stages).
    if comm.size < 2:
        pytest.skip("the tie joins the first and the last stage")
    torch.manual_seed(0)
    part = nn.Linear(3, 3).double()
    part.weight.requires_grad_(False)
    ends = comm.rank in (0, comm.size - 1)
    stage = PipelineStage(part, comm.rank, comm.size, comm,
                          tied_parameters=[part.weight] if ends else None)
    sched = Schedule1F1B(stage, 2, mse)
    x = torch.randn(4, 3, dtype=torch.float64)
    sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
    assert part.weight.grad is None and part.bias.grad is not None


def test_a_stage_that_computes_its_own_loss_returns_the_losses(comm):
    # The last stage's output is its micro-batch's loss (0-dim): the merged output is
    # the m losses stacked (torch.cat cannot join 0-dim tensors).
    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    body = (lambda o: o.pow(2).mean()) if comm.rank == comm.size - 1 else (lambda o: o)

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.part = part

        def forward(self, x):
            return body(self.part(x))

    stage = PipelineStage(Stage(), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 4, lambda out, target: out)
    x, y = data()
    out = sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    if stage.is_last:
        want = torch.stack([full(a).pow(2).mean() for a in torch.tensor_split(x, 4)])
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)


def _failing_pipeline(rank0_subprocess, ranks: int, timeout: int, layer: str, steps: int):
    """Run a 1F1B pipeline of Linear stages whose stage 1 is ``layer`` (its class source,
    named Bad) in a job of its own, which must fail within 30 s; its output, or None on
    the ranks that do not run it."""
    code = (
        "import os, time, torch, mpiring\n"
        "os.environ['MPIRING_PP_SHARED'] = '1'\n"
        "from torch import nn\n"
        "from mpiring.parallel.pipeline import PipelineStage, Schedule1F1B\n"
        f"comm = mpiring.init(timeout={timeout})\n" + layer +
        "mod = Bad(3, 3).double() if comm.rank == 1 else nn.Linear(3, 3).double()\n"
        "st = PipelineStage(mod, comm.rank, comm.size, comm)\n"
        "s = Schedule1F1B(st, 2, lambda o, t: ((o - t) ** 2).mean())\n"
        "x = torch.zeros(4, 3, dtype=torch.float64)\n"
        f"for _ in range({steps}):\n"
        "    s.step(x if st.is_first else None, target=x if st.is_last else None)\n"
    )
    result = rank0_subprocess(ranks, ["-c", code], timeout=60)
    if result is None:
        return None
    rc, out, seconds = result
    assert rc != 0 and seconds < 30, out
    return out


@pytest.mark.parametrize("body, said", [
    ("raise RuntimeError('boom in the middle stage')", "boom in the middle stage"),
    # Not a tensor or a tuple of tensors: the fix is named.
    ("return {'h': super().forward(x)}",
     "returned a dict; a stage hands the next one a tensor or a tuple of tensors"),
])
def test_a_stage_that_raises(rank0_subprocess, body, said):
    layer = ("class Bad(nn.Linear):\n"
             "    def forward(self, x):\n"
             f"        {body}\n")
    out = _failing_pipeline(rank0_subprocess, 3, 4, layer, steps=1)
    if out is not None:
        assert "pipeline stage 1 failed in 1F0" in out and said in out, out


def test_a_stage_that_hangs_ends_at_the_deadline_naming_the_shared_slot(rank0_subprocess,
                                                                       world):
    # Past the first step the stages talk through shared memory: a wait there keeps the
    # communicator's deadline, and its report names the slot and the peer.
    probe = world.shared_window(64) if world.size > 1 else None
    if probe is None:
        pytest.skip("no shared-memory window for this job's ranks")
    probe.free()
    layer = ("class Bad(nn.Linear):\n"
             "    calls = 0\n"
             "    def forward(self, x):\n"
             "        Bad.calls += 1\n"
             "        if Bad.calls == 3:  # the second step's first forward\n"
             "            time.sleep(120)\n"
             "        return super().forward(x)\n")
    out = _failing_pipeline(rank0_subprocess, 2, 3, layer, steps=2)
    if out is not None:
        # Step 2: the user's second step() (the slots are laid out at the first one's end).
        assert re.search(r"\[r0\] mpiring stall: .*Wait\(shared slot 0RECV_B0 from r1, step 2\), "
                         r"waiting for r1 to write this slot", out), out
        assert "has not written this shared-memory slot" in out, out


@pytest.mark.parametrize("name", ["1f1b", "zb"])
def test_every_rank_of_the_job(world, name):
    # The whole test job as one pipeline (an odd 5 in its own launch); m < p included.
    full = mlp((3, 4, 5, 4, 3, 5, 2))
    lo, hi = bounds(len(full), world.size)[world.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, world.rank, world.size, world)
    for m in (2, 7):
        sched = SCHEDULES[name](stage, m, mse)
        x, y = data(m)
        reference(full, x, y, m, mse)
        part.zero_grad()
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        same_grads(part, full[lo:hi])


def test_shapes_agreed_once_then_again_for_a_new_shape(comm):
    # Step 1 sends a header per activation (on the checked communicator); step 2
    # only the tensors, unchecked, into last step's buffers; a new batch size
    # agrees again. Every step's gradients against the unsplit model.
    from test_ddp import Recorder

    full = mlp()
    lo, hi = bounds(len(full), comm.size)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 3, mse)
    rec = Recorder(comm.rank)
    stage.comm.tracer = sched.transport.fast.tracer = rec
    headers = []
    for rows in (10, 10, 7, 10):
        x, y = data(rows)
        x, y = x[:rows], y[:rows]
        reference(full, x, y, 3, mse)
        part.zero_grad()
        n = len(rec.records)
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        # A header's tag: TAG_META on the tags of its pair of stages (TAGS apart).
        headers.append(sum(1 for r in rec.records[n:] if r.get("type") == "p2p" and
                           r["tag"] % TAGS == TAG_META % TAGS))
        assert not sched.transport.fresh
        same_grads(part, full[lo:hi])
    # 3 headers (one per micro-batch) on each link: sent by one end, received by the other.
    per = 3 * ((comm.rank > 0) + (comm.rank < comm.size - 1))
    assert headers == [per, 0, per, per]


# Stage 0 sends both activations after both forwards (not right after each), and
# stage 1 receives both first: both sends wait for their group (posting F1's from
# F1 itself would overtake F0's, and stage 1 would take F1's activation for F0's).
LATE_SENDS = ["0F0 0F1 0SEND_F0 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
              "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1"]


def test_sends_posted_by_the_action_that_makes_them(comm):
    plan = _eager_sends(build("1f1b", 3, 4)[1])
    assert sorted(plan) == sorted([("F", 1, k) for k in range(4)] +
                                  [("B", 1, k) for k in range(4)])
    assert all(plan[(k, s, mb)].kind == "SEND_" + k and plan[(k, s, mb)].mb == mb
               for k, s, mb in plan)
    late = parse_schedule(LATE_SENDS)
    assert _eager_sends(late[0]) == {}
    assert sorted(_eager_sends(late[1])) == [("B", 1, 0), ("B", 1, 1)]
    if comm.size != 2:
        return
    full = mlp()
    lo, hi = bounds(len(full), 2)[comm.rank]
    part = copy.deepcopy(full[lo:hi])
    stage = PipelineStage(part, comm.rank, 2, comm)
    sched = PipelineSchedule(stage, 2, mse, actions=late)
    for salt in (0, 1, 2):  # steps 2 and 3 run on receives posted at the step's start
        x, y = data(salt)
        reference(full, x, y, 2, mse)
        part.zero_grad()
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        assert sched.transport.posted == {}  # every posted receive was used
        same_grads(part, full[lo:hi])


def test_a_program_count_that_does_not_fit_the_stages_is_refused(comm):
    if comm.size < 2:
        pytest.skip("needs 2 stages or more")
    stage = PipelineStage(mlp(), comm.rank, comm.size, comm)
    with pytest.raises(ValueError, match=f"actions holds {comm.size - 1} programs for "
                                         f"{comm.size} ranks: give one per rank"):
        PipelineSchedule(stage, 2, mse, actions=build("1f1b", comm.size - 1, 2))


def test_activation_memory_of_each_schedule(comm):
    """The counted peaks follow the schedules' memory models, per stage (A: one
    micro-batch's activations): GPipe m A, 1F1B min(p - i, m) A, GPipe with
    recomputation A plus the m stage inputs, ZB-H1 at most p A (its W keeps each
    Linear's input and output gradient, no more than the forward saved)."""
    cfg = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=4, n_heads=2)
    m, rows = 4, 8
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 11, (rows, 5), generator=g), torch.randint(0, 11, (rows, 5), generator=g)
    peaks = {}
    for name, make in [("gpipe", lambda s: ScheduleGPipe(s, m, lm_loss)),
                       ("recompute", lambda s: ScheduleGPipe(s, m, lm_loss, recompute=True)),
                       ("1f1b", lambda s: Schedule1F1B(s, m, lm_loss)),
                       ("zb", lambda s: ScheduleZeroBubble(s, m, lm_loss))]:
        torch.manual_seed(0)
        module, tied = split_gpt(GPT(cfg).double(), comm.size, comm.rank)
        stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied,
                              count_activations=True)
        make(stage).step(x if stage.is_first else None, target=y if stage.is_last else None)
        peaks[name] = stage.peak_activation_bytes
    p, i = comm.size, comm.rank
    one = peaks["gpipe"] / m
    inp = rows // m * 5 * (8 if i == 0 else 8 * cfg.d_model)  # int64 ids, or float64 rows
    assert one > 0 and peaks["gpipe"] == m * one
    assert peaks["1f1b"] == min(p - i, m) * one, peaks
    assert peaks["recompute"] == one + m * inp, peaks
    assert one <= peaks["zb"] <= min(p, m) * one, peaks
