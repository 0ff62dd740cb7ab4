"""Pipeline schedules on the project's GPT: measured bubble vs the schedule's prediction.

For each number of micro-batches m and each schedule, every rank times
``step()`` and records its compute spans (``sched.timeline``); the row is the
fastest step (its slowest rank's time), the same step on every rank. The
measured bubble of a rank is the part of that step (first start to last end,
over every rank) it spent idle; the prediction is the validator's simulation of the same
schedule with each stage's measured mean F, B and W times. Peak activation
memory is the stage's count of the bytes autograd saved for backward.
torch.distributed.pipelining's Schedule1F1B over gloo runs the same stages,
micro-batches and ranks for comparison.
"""

from __future__ import annotations

import copy
import time

import torch

from mpiring.parallel.pipeline.actions import Action
from mpiring.parallel.pipeline.diagram import draw
from mpiring.parallel.pipeline.validate import Span, bubble, predicted_bubble
from mpiring.tools.models.gpt import GPT, PRESETS, lm_loss
from mpiring.tools.train.pipeline import build_pipeline, split_gpt

MODES = ("gpipe", "gpipe-recompute", "1f1b", "zb", "torch-1f1b")


def _batch(cfg, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g))


def _gather_spans(comm, spans: list[Span]) -> list[list[Span]]:
    mine = [[s.action.stage, s.action.kind, s.action.mb, s.start, s.end] for s in spans]
    rows = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
    return [[Span(Action(st, k, mb), t0, t1) for st, k, mb, t0, t1 in row] for row in rows]


def _predict(sched, spans: list[list[Span]]) -> float:
    """The schedule's bubble simulated with each stage's measured mean F, B and W times."""
    return max(predicted_bubble(sched.actions, spans))


def _fastest(comm, times: list[float]) -> tuple[int, float]:
    """(index, seconds) of the fastest step, timed by its slowest rank: the same step on
    every rank (on shared cores the other steps hold other jobs' time slices)."""
    table = comm.control.allgather_array(times) if comm.size > 1 else [times]
    per_step = [max(col) for col in zip(*table)]
    best = per_step.index(min(per_step))
    return best, per_step[best]


def _run_mpiring(comm, cfg, mode: str, m: int, mb_rows: int, steps: int, warmup: int):
    name = "gpipe" if mode.startswith("gpipe") else mode
    stage, sched, _ = build_pipeline(comm, cfg, name, m, recompute=mode == "gpipe-recompute")
    x, y = _batch(cfg, m * mb_rows, seed=m)
    times, timelines = [], []
    for i in range(warmup + steps):
        stage.module.zero_grad(set_to_none=True)
        comm.barrier()
        t0 = time.perf_counter()
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            timelines.append(sched.timeline)
    best, seconds = _fastest(comm, times)
    spans = _gather_spans(comm, timelines[best])
    peak = comm.control.allreduce_scalar(int(stage.peak_activation_bytes), "max") \
        if comm.size > 1 else stage.peak_activation_bytes
    return {"mode": mode, "m": m, "step_ms": 1e3 * seconds,
            "bubble": max(bubble(spans)), "predicted": _predict(sched, spans),
            "peak_act_mib": peak / 2**20}, spans


def _run_torch(comm, cfg, m: int, mb_rows: int, steps: int, warmup: int):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from mpiring.tools.train.torch_pg import destroy_torch_process_group, init_torch_process_group

    group = init_torch_process_group(comm, torch.device("cpu"))
    try:
        torch.manual_seed(0)
        module, _ = split_gpt(GPT(cfg), comm.size, comm.rank)
        module = copy.deepcopy(module)
        stage = PipelineStage(module, comm.rank, comm.size, torch.device("cpu"), group=group)
        sched = Schedule1F1B(stage, m, loss_fn=lm_loss)
        x, y = _batch(cfg, m * mb_rows, seed=m)
        times = []
        for i in range(warmup + steps):
            module.zero_grad(set_to_none=True)
            comm.barrier()
            t0 = time.perf_counter()
            if comm.rank == 0:
                sched.step(x)
            elif comm.rank == comm.size - 1:
                sched.step(target=y, losses=[])
            else:
                sched.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        dist.barrier()
    finally:
        destroy_torch_process_group(comm)
    return {"mode": "torch-1f1b", "m": m, "step_ms": 1e3 * _fastest(comm, times)[1], "bubble": None,
            "predicted": None, "peak_act_mib": None}


def run_pp_bench(comm, *, preset: str = "small", ms=(4, 8, 16), modes=MODES, mb_rows: int = 2,
                 steps: int = 5, warmup: int = 2) -> tuple[list[dict], dict]:
    """Every (m, mode) row, and the measured spans of each mpiring run (for drawing)."""
    bad = [x for x in modes if x not in MODES]
    if bad:
        raise ValueError(f"unknown modes {bad}: use some of {', '.join(MODES)}")
    cfg = PRESETS[preset]
    rows, drawn = [], {}
    for m in ms:
        for mode in modes:
            if mode == "torch-1f1b":
                rows.append(_run_torch(comm, cfg, m, mb_rows, steps, warmup))
            else:
                row, spans = _run_mpiring(comm, cfg, mode, m, mb_rows, steps, warmup)
                rows.append(row)
                drawn[(mode, m)] = spans
        base = next((r for r in rows if r["m"] == m and r["mode"] == "1f1b"), None)
        for r in rows:
            if r["m"] == m and base is not None:
                r["x_1f1b"] = r["step_ms"] / base["step_ms"]
    return rows, drawn


def format_pp_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table."""
    head = (f"{'schedule':<16} {'m':>3} {'step ms':>9} {'x 1f1b':>7} {'bubble':>7} "
            f"{'predicted':>9} {'meas/pred':>9} {'peak act MiB':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        def pct(v):
            return f"{v:.1%}" if v is not None else "-"
        ratio = f"{r['bubble'] / r['predicted']:.2f}" if r["bubble"] and r["predicted"] else "-"
        act = f"{r['peak_act_mib']:.2f}" if r["peak_act_mib"] is not None else "-"
        lines.append(f"{r['mode']:<16} {r['m']:>3} {r['step_ms']:>9.1f} "
                     f"{r.get('x_1f1b', float('nan')):>7.2f} {pct(r['bubble']):>7} "
                     f"{pct(r['predicted']):>9} {ratio:>9} {act:>12}")
    return "\n".join(lines)


def draw_run(spans: list[list[Span]], width: int = 120) -> str:
    """A measured run's per-device timeline, to scale."""
    return draw(spans, width=width)
