"""Pipeline schedules on the project's GPT: measured bubble vs the schedule's prediction.

For each number of micro-batches m, every schedule (and torch.distributed.
pipelining's Schedule1F1B over gloo, on the same stages, micro-batches and
ranks) is built once; then the steps go round-robin, one step of each mode
in turn, so that a slow moment of the shared machine falls on every mode
alike. Every rank times each ``step()`` and records its compute spans
(``sched.timeline``); a mode's row is its fastest step (that step's slowest
rank), the same step on every rank.

* bubble: the worst rank's share of that step (first start to last end over
  every rank) spent outside F, B and W: waiting, and its own sends and
  receives, are all counted as bubble. busiest (JSON bubble_busiest,
  predicted_busiest): the same share for the stage with the most compute,
  whose idle time is what the schedule adds to the step (a lighter stage
  also idles for the uneven split, in every schedule alike).
* idle (JSON idle_ms, idle_busiest_ms and their predicted_ twins): the same
  in milliseconds. ZB-H1 against 1F1B is a ratio of these: at the same m
  both do the same work, and the bubble the zero-bubble paper cuts to a
  third, (p-1)(F+B-W) against (p-1)(F+B+W), is a time; a share of the step
  divides ZB-H1's by its own shorter step, which counts its gain against it.
* predicted: the validator's simulation of the same schedule with each
  stage's measured mean F, B and W times, and each message taking the
  measured per-transfer time (the fastest of 40 ping-pongs of the activation
  between neighbours, through the pipeline's own path, before the timed steps).
* replay: the same simulation with each action's own measured time instead
  of the stage's mean (what a runtime with no overhead would have done with
  exactly these compute times).
* zbv: ZB-V, the same 2 stages per rank placed in a V (rank r holding r and
  2p-1-r), the backward split: its idle time and peak against 1F1B's.
* dualpipev: DeepSeek's DualPipeV on ZB-V's V and stages (full backwards in
  the steady state): its idle time and peak against ZB-V's (m >= 2p only).
* 1f1b-autograd: 1F1B with autograd's accumulation of the Linear weights'
  gradients (``stage.fuse_weight_grads = False``), against 1F1B's one GEMM
  into ``.grad`` per large layer and micro-batch.
* interleaved: Megatron's interleaved 1F1B with 2 stages per rank (the same
  units cut into twice as many stages, rank r holding r and r + p): its bubble
  against 1F1B's on the same ranks (the stages differ, the work does not).
* interleaved-zb: the same stages and order with the backward split (torch's
  ScheduleInterleavedZeroBubble): its idle time and peak against interleaved's.
* ideal ms (JSON): the simulated step of the same program with those times,
  from the first compute start to the last compute end: the compute bound
  that the torch row is compared with.
* msg us: the median time from a producer's compute end to the consumer's
  compute start, over the messages the consumer was waiting for (posting,
  transfer, noticing it, the runtime's steps in between).
* peak act: the bytes autograd saved for backward (and, between B and W, the
  bytes W keeps), per stage, counted in one untimed step before the others
  (the counting hooks cost a few percent of a forward, which torch's
  schedule, timed beside it, does not pay).
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from mpiring.parallel.pipeline.actions import Action
from mpiring.parallel.pipeline.diagram import draw
from mpiring.parallel.pipeline.schedules import MULTI
from mpiring.parallel.pipeline.transport import wait_all
from mpiring.parallel.pipeline.validate import (
    Span,
    bubble,
    idle_time,
    measured_costs,
    predicted_bubble,
    simulate,
)
from mpiring.tools.models.gpt import GPT, PRESETS, lm_loss
from mpiring.tools.train.pipeline import build_pipeline, split_gpt

MODES = ("gpipe", "gpipe-recompute", "1f1b", "1f1b-autograd", "zb", "zb-cap", "interleaved",
         "interleaved-zb", "zbv", "dualpipev", "torch-1f1b")
#: The modes of several stages per rank (INTERLEAVED_V each; the V holds 2).
MULTI_MODES = tuple(x for x in MODES if x in MULTI)
#: Stages per rank of the "interleaved" mode (Megatron's virtual pipeline size).
INTERLEAVED_V = 2


def _batch(cfg, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g),
            torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g))


def _gather_spans(comm, spans: list[Span]) -> list[list[Span]]:
    mine = [[s.action.stage, s.action.kind, s.action.mb, s.start, s.end] for s in spans]
    rows = comm.control.allgather_json(mine) if comm.size > 1 else [mine]
    return [[Span(Action(st, k, mb), t0, t1) for st, k, mb, t0, t1 in row] for row in rows]


def _fastest(comm, times: list[float]) -> tuple[int, float]:
    """(index, seconds) of the fastest step, timed by its slowest rank: the same step on
    every rank (on shared cores the other steps hold other jobs' time slices)."""
    table = comm.control.allgather_array(times) if comm.size > 1 else [times]
    per_step = [max(col) for col in zip(*table)]
    best = per_step.index(min(per_step))
    return best, per_step[best]


def message_delay(spans: list[list[Span]]) -> float | None:
    """Median seconds from a producer's compute end to the consumer's compute start, over
    the messages the consumer sat waiting for (the runtime's whole per-message path)."""
    n = 1 + max((s.action.stage for row in spans for s in row), default=0)  # stages
    ends = {s.action: s.end for row in spans for s in row}
    delays = []
    for row in spans:
        for prev, s in zip(row, row[1:]):
            a = s.action
            dep = (Action(a.stage - 1, "F", a.mb) if a.kind == "F" and a.stage > 0 else
                   Action(a.stage + 1, "B", a.mb) if a.kind == "B" and a.stage < n - 1 else None)
            if dep in ends and ends[dep] > prev.end:
                delays.append(s.start - ends[dep])
    return statistics.median(delays) if delays else None


def transfer_time(comm, shape, dtype=torch.float32, rounds: int = 40) -> float:
    """Seconds one activation of ``shape`` takes between neighbouring ranks: the fastest
    half round trip, on an unchecked duplicate, waited for as the transport waits.

    The fastest, not a typical one: a round trip that another job's time slice
    stretched is not the path's cost, and a longer transfer step would only
    raise the prediction (and flatter the measured/predicted ratio)."""
    fast = comm.dup()
    fast.check = False
    buf = torch.zeros(shape, dtype=dtype)
    worst = 0.0
    for left in range(comm.size - 1):
        times = []
        for _ in range(rounds if comm.rank in (left, left + 1) else 0):
            t0 = time.perf_counter()
            if comm.rank == left:
                fast.isend(buf, left + 1, 7).wait()
                wait_all([fast.irecv(buf, left + 1, 7)])
            else:
                wait_all([fast.irecv(buf, left, 7)])
                fast.isend(buf, left, 7).wait()
            times.append(time.perf_counter() - t0)
        if comm.rank == left:
            worst = max(worst, min(times) / 2)
        comm.barrier()
    fast.free()
    return comm.control.allreduce_scalar(worst, "max") if comm.size > 1 else worst


class _Mpiring:
    def __init__(self, comm, cfg, mode: str, m: int):
        name = ("gpipe" if mode.startswith("gpipe") else "zb" if mode == "zb-cap" else
                "1f1b" if mode == "1f1b-autograd" else mode)
        v = INTERLEAVED_V if mode in MULTI_MODES else 1
        _, self.sched, _ = build_pipeline(comm, cfg, name, m, stages_per_rank=v,
                                          recompute=mode == "gpipe-recompute")
        self.stages = self.sched.stages
        for st in self.stages:  # 1f1b-autograd: B hands the weight gradients to autograd
            st.fuse_weight_grads = mode != "1f1b-autograd"
        self.mode, self.times, self.timelines, self.peak = mode, [], [], 0

    def step(self, x, y, timed: bool, count: bool = False) -> None:
        for st in self.stages:
            st.module.zero_grad(set_to_none=True)
            st.count_activations = count
        first, last = self.stages[0].is_first, self.stages[-1].is_last
        self.stages[0].comm.barrier()
        t0 = time.perf_counter()
        self.sched.step(x if first else None, target=y if last else None)
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.timelines.append(self.sched.timeline)
        if count:  # several stages: what the rank's stages hold together, at its peak
            self.peak = max(self.peak, self.stages[0].peak_activation_bytes
                            if len(self.stages) == 1 else self.sched.peak_activation_bytes)

    def row(self, comm, m: int, transfer: float):
        best, seconds = _fastest(comm, self.times)
        spans = _gather_spans(comm, self.timelines[best])
        acts = self.sched.actions
        peaks = comm.control.allgather_json(int(self.peak)) if comm.size > 1 else [self.peak]
        ideal = simulate(acts, measured_costs(acts, spans), transfer=transfer)
        # The stage with the most compute: the step cannot be shorter than its work, so its
        # idle share is what the schedule costs; a lighter stage's extra idle is the split's.
        busiest = max(range(len(spans)), key=lambda r: sum(x.end - x.start for x in spans[r]))
        idle, idle_ideal = idle_time(spans), idle_time(ideal)
        return {"mode": self.mode, "m": m, "step_ms": 1e3 * seconds,
                "ideal_ms": 1e3 * (max(r[-1].end for r in ideal if r) -
                                   min(r[0].start for r in ideal if r)),
                "bubble": max(bubble(spans)),
                "predicted": max(predicted_bubble(acts, spans, transfer=transfer)),
                "bubble_busiest": bubble(spans)[busiest],
                "predicted_busiest": bubble(ideal)[busiest],
                "idle_ms": 1e3 * max(idle), "predicted_idle_ms": 1e3 * max(idle_ideal),
                "idle_busiest_ms": 1e3 * idle[busiest],
                "predicted_idle_busiest_ms": 1e3 * idle_ideal[busiest],
                "replay": max(predicted_bubble(acts, spans, transfer=transfer, replay=True)),
                "transfer_us": 1e6 * transfer,
                "msg_us": None if (d := message_delay(spans)) is None else 1e6 * d,
                "peak_act_mib": max(peaks) / 2**20,
                "peak_act_mib_per_stage": [v / 2**20 for v in peaks]}, spans


class _Torch:
    mode = "torch-1f1b"
    def __init__(self, comm, cfg, m: int, group):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        torch.manual_seed(0)
        module, _ = split_gpt(GPT(cfg), comm.size, comm.rank)
        self.module = copy.deepcopy(module)
        stage = PipelineStage(self.module, comm.rank, comm.size, torch.device("cpu"), group=group)
        self.sched = Schedule1F1B(stage, m, loss_fn=lm_loss)
        self.comm, self.times = comm, []

    def step(self, x, y, timed: bool, count: bool = False) -> None:
        comm = self.comm
        self.module.zero_grad(set_to_none=True)
        comm.barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            self.sched.step(x)
        elif comm.rank == comm.size - 1:
            self.sched.step(target=y, losses=[])
        else:
            self.sched.step()
        if timed:
            self.times.append(time.perf_counter() - t0)

    def row(self, comm, m: int, transfer: float):
        return {"mode": "torch-1f1b", "m": m, "step_ms": 1e3 * _fastest(comm, self.times)[1],
                "bubble": None, "predicted": None, "replay": None, "peak_act_mib": None}, None


def interleaved_fits(preset: str, ranks: int) -> bool:
    """Whether the preset's GPT has a unit for each of the interleaved mode's stages."""
    return PRESETS[preset].n_layers + 2 >= INTERLEAVED_V * ranks


def run_pp_bench(comm, *, preset: str = "small", ms=(4, 8, 16), modes=MODES, mb_rows: int = 2,
                 steps: int = 5, warmup: int = 2) -> tuple[list[dict], dict]:
    """Every (m, mode) row, and the measured spans of each mpiring run (for drawing)."""
    bad = [x for x in modes if x not in MODES]
    if bad:
        raise ValueError(f"unknown modes {bad}: use some of {', '.join(MODES)}")
    if "zb-cap" in modes and ("1f1b" not in modes or modes.index("1f1b") > modes.index("zb-cap")):
        raise ValueError("zb-cap holds ZB-H1 to 1F1B's measured peak: list 1f1b before it")
    if set(MULTI_MODES) & set(modes) and not interleaved_fits(preset, comm.size):
        raise ValueError(f"the {', '.join(MULTI_MODES)} modes cut the GPT into {INTERLEAVED_V} "
                         f"stages per rank, {INTERLEAVED_V * comm.size} here, more than the "
                         f"{preset} preset's {PRESETS[preset].n_layers + 2} units: leave them "
                         "out of --modes, or run on fewer ranks")
    cfg = PRESETS[preset]
    transfer = transfer_time(comm, (mb_rows, cfg.seq_len, cfg.d_model))
    group = None
    if "torch-1f1b" in modes:
        from mpiring.tools.train.torch_pg import init_torch_process_group
        group = init_torch_process_group(comm, torch.device("cpu"))
    rows, drawn = [], {}
    try:
        for m in ms:
            # DualPipeV runs from one micro-batch per stage up (2p).
            here = [x for x in modes if x != "dualpipev" or m >= 2 * comm.size]
            runs = [_Torch(comm, cfg, m, group) if mode == "torch-1f1b"
                    else _Mpiring(comm, cfg, mode, m) for mode in here]
            x, y = _batch(cfg, m * mb_rows, seed=m)
            for run in runs:  # the memory step: counting hooks on, not timed
                if run.mode == "zb-cap":
                    # ZB-H1 within 1F1B's peak: each stage's W may hold what its own 1F1B
                    # peak leaves below the pipeline's (1F1B's peaks, counted just before).
                    base = next(r for r in runs if r.mode == "1f1b")
                    peaks = comm.control.allgather_json(int(base.peak)) if comm.size > 1 \
                        else [base.peak]
                    run.sched.max_held_bytes = int(max(peaks) - base.peak)
                run.step(x, y, timed=False, count=True)
            for i in range(warmup + steps):  # round-robin: one step of each mode in turn
                for run in runs:
                    run.step(x, y, timed=i >= warmup)
            for run in runs:  # each mode's window (and communicators) freed before the next
                if isinstance(run, _Mpiring):
                    run.sched.free()
                    for st in run.stages:
                        st.free()
                    run.sched.grid.free()
            for mode, run in zip(here, runs):
                row, spans = run.row(comm, m, transfer)
                # What a reader of the JSON alone needs to price the row again.
                row.update(preset=preset, mb_rows=mb_rows, ranks=comm.size)
                rows.append(row)
                if spans is not None:
                    drawn[(mode, m)] = spans
            _ratios([r for r in rows if r["m"] == m])
    finally:
        if group is not None:
            import torch.distributed as dist

            from mpiring.tools.train.torch_pg import destroy_torch_process_group
            dist.barrier()
            destroy_torch_process_group(comm)
    return rows, drawn


def _ratios(rows: list[dict]) -> None:
    by = {r["mode"]: r for r in rows}
    base = by.get("1f1b")
    for r in rows:
        if base is not None:
            r["x_1f1b"] = r["step_ms"] / base["step_ms"]
    def idle_against_1f1b(r: dict, prefix: str) -> None:
        """The worst rank's and the busiest stage's idle time over 1F1B's."""
        r[f"{prefix}_over_1f1b_idle"] = r["idle_ms"] / base["idle_ms"]
        if base["idle_busiest_ms"]:
            r[f"{prefix}_over_1f1b_idle_busiest"] = r["idle_busiest_ms"] / base["idle_busiest_ms"]
    for zb in ("zb", "zb-cap"):
        if base is not None and zb in by and base["bubble"]:
            by[zb]["zb_over_1f1b_bubble"] = by[zb]["bubble"] / base["bubble"]
            if base["bubble_busiest"]:
                by[zb]["zb_over_1f1b_busiest"] = (by[zb]["bubble_busiest"] /
                                                  base["bubble_busiest"])
            idle_against_1f1b(by[zb], "zb")
    if base is not None and "zbv" in by and base["idle_busiest_ms"]:
        idle_against_1f1b(by["zbv"], "zbv")
    vee, dual = by.get("zbv"), by.get("dualpipev")
    if vee is not None and dual is not None and vee["idle_busiest_ms"]:
        dual["dualpipev_over_zbv_idle"] = dual["idle_ms"] / vee["idle_ms"]
        dual["dualpipev_over_zbv_idle_busiest"] = dual["idle_busiest_ms"] / vee["idle_busiest_ms"]
    il = by.get("interleaved")
    if il is not None and "interleaved-zb" in by and il["idle_busiest_ms"]:
        izb = by["interleaved-zb"]
        izb["izb_over_il_idle"] = izb["idle_ms"] / il["idle_ms"]
        izb["izb_over_il_idle_busiest"] = izb["idle_busiest_ms"] / il["idle_busiest_ms"]
    if base is not None and base["bubble"] and il is not None:
        il["il_over_1f1b_bubble"] = il["bubble"] / base["bubble"]
        il["il_over_1f1b_predicted"] = (il["predicted"] / base["predicted"]
                                        if base["predicted"] else None)
    if base is not None and "torch-1f1b" in by:
        base["over_torch"] = base["step_ms"] / by["torch-1f1b"]["step_ms"]
        # How far torch's step is from the schedule's simulated bound on these stages (from
        # mpiring's own mean F, B, W and the fastest ping-pong): a runtime running the same
        # kernels can beat torch by about as much as torch lies above it.
        base["torch_over_ideal"] = by["torch-1f1b"]["step_ms"] / base["ideal_ms"]


def format_pp_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table, then the goals' ratios per m."""
    head = (f"{'schedule':<16} {'m':>3} {'step ms':>9} {'x 1f1b':>7} {'bubble':>7} "
            f"{'busiest':>7} {'predicted':>9} {'meas/pred':>9} {'replay':>7} {'meas/rep':>8} "
            f"{'msg us':>6} {'peak act MiB':>12}")
    lines = [head, "-" * len(head)]

    def pct(v):
        return f"{v:.1%}" if v is not None else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"
    for r in rows:
        act = f"{r['peak_act_mib']:.2f}" if r["peak_act_mib"] is not None else "-"
        msg = f"{r['msg_us']:.0f}" if r.get("msg_us") is not None else "-"
        lines.append(f"{r['mode']:<16} {r['m']:>3} {r['step_ms']:>9.1f} "
                     f"{r.get('x_1f1b', float('nan')):>7.2f} {pct(r['bubble']):>7} "
                     f"{pct(r.get('bubble_busiest')):>7} {pct(r['predicted']):>9} "
                     f"{ratio(r['bubble'], r['predicted']):>9} "
                     f"{pct(r['replay']):>7} {ratio(r['bubble'], r['replay']):>8} {msg:>6} {act:>12}")
    if rows and rows[0].get("transfer_us") is not None:
        lines.append(f"per-transfer time (measured, in the prediction): "
                     f"{rows[0]['transfer_us']:.0f} us")
    for m in sorted({r["m"] for r in rows}):
        by = {r["mode"]: r for r in rows if r["m"] == m}
        parts = []
        for mode in ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev"):
            if mode in by:
                parts.append(f"{mode} meas/pred {ratio(by[mode]['bubble'], by[mode]['predicted'])}")
        for zb in ("zb", "zb-cap"):
            if "zb_over_1f1b_bubble" not in by.get(zb, {}):
                continue
            peaks = "/".join(f"{v:.2f}" for v in by[zb]["peak_act_mib_per_stage"])
            base = "/".join(f"{v:.2f}" for v in by["1f1b"]["peak_act_mib_per_stage"])
            z = by[zb]
            busy = ("" if z.get("zb_over_1f1b_busiest") is None else
                    f", busiest stage {z['zb_over_1f1b_idle_busiest']:.2f} "
                    f"(share {z['zb_over_1f1b_busiest']:.2f})")
            parts.append(f"{zb}/1f1b idle time {z['zb_over_1f1b_idle']:.2f} (share of the "
                         f"step {z['zb_over_1f1b_bubble']:.2f}){busy}"
                         f" (peak act per stage {zb} {peaks}, 1f1b {base} MiB)")
        if "il_over_1f1b_bubble" in by.get("interleaved", {}):
            il = by["interleaved"]
            parts.append(f"interleaved/1f1b bubble {il['il_over_1f1b_bubble']:.2f} (predicted "
                         f"{ratio(il['predicted'], by['1f1b']['predicted'])})")
        if "izb_over_il_idle" in by.get("interleaved-zb", {}):
            z = by["interleaved-zb"]
            parts.append(f"interleaved-zb/interleaved idle time {z['izb_over_il_idle']:.2f}, "
                         f"busiest rank {z['izb_over_il_idle_busiest']:.2f} (peak act per "
                         f"rank {z['peak_act_mib']:.2f}/{by['interleaved']['peak_act_mib']:.2f} "
                         "MiB)")
        if "zbv_over_1f1b_idle" in by.get("zbv", {}):
            v = by["zbv"]
            peaks = "/".join(f"{x:.2f}" for x in v["peak_act_mib_per_stage"])
            parts.append(f"zbv/1f1b idle time {v['zbv_over_1f1b_idle']:.2f}, busiest stage "
                         f"{v['zbv_over_1f1b_idle_busiest']:.2f} (peak act per rank {peaks} MiB)")
        if "dualpipev_over_zbv_idle" in by.get("dualpipev", {}):
            d = by["dualpipev"]
            parts.append(f"dualpipev/zbv idle time {d['dualpipev_over_zbv_idle']:.2f}, busiest "
                         f"stage {d['dualpipev_over_zbv_idle_busiest']:.2f} (peak act per rank "
                         f"{d['peak_act_mib']:.2f}/{by['zbv']['peak_act_mib']:.2f} MiB)")
        if "over_torch" in by.get("1f1b", {}):
            parts.append(f"1f1b/torch step {by['1f1b']['over_torch']:.2f} (torch step / 1f1b's "
                         f"simulated compute bound {by['1f1b']['torch_over_ideal']:.2f})")
        lines.append(f"m={m}: " + "; ".join(parts))
    return "\n".join(lines)


def draw_run(spans: list[list[Span]], width: int = 120) -> str:
    """A measured run's per-device timeline, to scale."""
    return draw(spans, width=width)
