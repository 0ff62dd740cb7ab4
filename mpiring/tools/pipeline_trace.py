"""A real run's pipeline from its trace: the lecture's diagram, to scale, with the bubble per rank.

The pipeline runtime records each compute action as an event of category
"pipeline" (``name`` "1F3", ``action``, ``stage``, ``mb``, ``schedule``,
``microbatches``, ``replica``: the data-parallel replica, 0 without DDP). Here
the events are cut into steps (a step ends where an action would repeat) and
grouped into pipelines (one per replica), and one step is drawn::

    pipeline step 5 of 5: 1f1b, 2 stages, 8 micro-batches (replica 0)
    设备 1: [F1][F2]      [B1    ][F3][B2    ] ...   bubble 22%
    设备 2:     [F1][B1    ][F2][B2    ]       ...   bubble 17%

The bubble of a rank is its idle share of the step (first start to last end
over the pipeline's ranks); beside it, the schedule's prediction from the
step's own mean F, B and W times (``validate.predicted_bubble``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from mpiring.parallel.pipeline.actions import Action, B, F
from mpiring.parallel.pipeline.diagram import draw
from mpiring.parallel.pipeline.schedules import GENERATORS, MULTI, build
from mpiring.parallel.pipeline.validate import Span, bubble, predicted_bubble

CATEGORY = "pipeline"
KIND_COLORS = {"F": "skyblue", "B": "yellowgreen", "W": "sandybrown"}  # not the ring phases


@dataclass
class Step:
    """One step of one pipeline: per stage, its rank and measured spans (seconds, aligned)."""

    index: int
    replica: int
    schedule: str
    microbatches: int
    ranks: list[int]
    spans: list[list[Span]]
    missing: str = ""  # what a rank did not run of this step ("": complete)

    @property
    def bubble(self) -> list[float]:
        return bubble(self.spans)

    @property
    def stages(self) -> int:
        """The pipeline's stages (more than its ranks when a rank holds several)."""
        return 1 + max((x.action.stage for row in self.spans for x in row), default=0)

    @property
    def predicted(self) -> list[float] | None:
        """The schedule's bubble per rank with this step's mean action times (None: custom)."""
        if self.schedule not in GENERATORS and self.schedule not in MULTI:
            return None
        p = len(self.spans)
        return predicted_bubble(build(self.schedule, p, self.microbatches, self.stages // p),
                                self.spans)


def events(files) -> list[tuple[int, float, dict[str, Any]]]:
    """Every pipeline event as ``(rank, clock offset, record)``."""
    return [(f.rank, f.offset, r) for f in files for r in f.records
            if r.get("type") == "event" and r.get("cat") == CATEGORY]


def _split_steps(recs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    seen: set[tuple[int, str, int]] = set()
    for r in sorted(recs, key=lambda r: r["t_start"]):
        key = (int(r["stage"]), r["action"], r["mb"])  # a rank may hold several stages
        if not out or key in seen:  # an action repeats: the next step has begun
            out.append([])
            seen = set()
        seen.add(key)
        out[-1].append(r)
    return out


def steps(files) -> list[Step]:
    """Every pipeline step in the trace, by replica, then in time order."""
    by_rank: dict[int, tuple[float, list[dict[str, Any]]]] = {}
    for rank, offset, rec in events(files):
        by_rank.setdefault(rank, (offset, []))[1].append(rec)
    pipelines: dict[int, dict[int, int]] = defaultdict(dict)  # replica -> stage -> rank
    for rank, (_, recs) in by_rank.items():  # a rank by its first stage (r of r, r + p, ...)
        first = min(int(r["stage"]) for r in recs)
        pipelines[int(recs[0].get("replica", 0))][first] = rank
    _check_complete(pipelines, by_rank)
    out: list[Step] = []
    for replica in sorted(pipelines):
        stages = pipelines[replica]
        ranks = [stages[s] for s in sorted(stages)]
        per_rank = [_split_steps(by_rank[r][1]) for r in ranks]
        for k in range(min(len(s) for s in per_rank)):
            rows = []
            for r, cut in zip(ranks, per_rank):
                offset = by_rank[r][0]
                rows.append([Span(Action(int(e["stage"]), e["action"], int(e["mb"])),
                                  e["t_start"] + offset, e["t_end"] + offset) for e in cut[k]])
            first = per_rank[0][k][0]
            m = int(first.get("microbatches", 0))
            held = [{int(e["stage"]) for e in by_rank[r][1]} for r in ranks]
            out.append(Step(k + 1, replica, str(first.get("schedule", "custom")), m, ranks,
                            rows, _missing(rows, ranks, held, m)))
    return out


def _check_complete(pipelines: dict[int, dict[int, int]],
                    by_rank: dict[int, tuple[float, list[dict[str, Any]]]]) -> None:
    """Refuse a pipeline whose stages are not all there: a missing rank file would
    otherwise be drawn as a shorter pipeline, with made-up bubbles and predictions."""
    held = {replica: sorted({int(r["stage"]) for rank in stages.values()
                             for r in by_rank[rank][1]})
            for replica, stages in pipelines.items()}
    if not held:  # no pipeline at all: explain says so
        return
    top = max(h[-1] for h in held.values())
    for replica, stages in sorted(held.items()):
        lost = sorted(set(range(top + 1)) - set(stages))
        if lost:
            where = f" of replica {replica}" if len(held) > 1 else ""
            raise ValueError(
                f"no trace file holds pipeline stage(s) {', '.join(map(str, lost))}{where} "
                f"(the files hold stages {', '.join(map(str, stages))}): a rank's file is "
                "missing; copy every rank's file of the run into the directory")


def _missing(rows: list[list[Span]], ranks: list[int], held: list[set[int]], m: int) -> str:
    """What a step lacks: every stage a rank holds runs F (and, training, B) for each of the
    m micro-batches. A rank whose file ends mid-step (killed, or still running) lacks some,
    and its "bubble" would be the time it never ran."""
    if m < 1:  # a custom schedule: no count to check against
        return ""
    kinds = [F] + ([B] if any(x.action.kind == B for row in rows for x in row) else [])
    for rank, row, stages in zip(ranks, rows, held):
        have = {(x.action.stage, x.action.kind, x.action.mb) for x in row}
        need = len(stages) * len(kinds) * m
        got = sum((st, k, mb) in have for st in stages for k in kinds for mb in range(m))
        if got < need:
            return f"r{rank} ran {got} of its {need} {'/'.join(kinds)} actions"
    return ""


def has_pipeline(files) -> bool:
    """True when the trace holds pipeline actions."""
    return any(True for _ in events(files))


def _last_training_step(found: list[Step]) -> int:
    """The last step that trained (a train run ends on its eval() steps, forwards only);
    the last step when none did."""
    # A step a rank did not finish (its trace cut off) is only drawn when asked for.
    whole = [s for s in found if not s.missing] or found
    trained = [s.index for s in whole if not s.schedule.endswith(".eval")]
    return max(trained) if trained else max(s.index for s in whole)


def explain(files, step: int | None = None, width: int = 150) -> str:
    """The lecture's diagram of one pipeline step (default: the last that trained, not an
    ``eval()``), every replica.

    Raises:
        ValueError: no pipeline events, or no such step.
    """
    found = steps(files)
    if not found:
        raise ValueError("the trace has no pipeline actions: record a run of a pipeline "
                         "schedule with --trace DIR")
    count = max(s.index for s in found)
    pick = _last_training_step(found) if step is None else step
    chosen = [s for s in found if s.index == pick]
    if not chosen:
        raise ValueError(f"no pipeline step {step}: the trace has steps 1..{count}")
    out = []
    for s in chosen:
        t0 = min(row[0].start for row in s.spans if row)
        t1 = max(row[-1].end for row in s.spans if row)
        p = len(s.spans)
        where = f"{s.stages} stages" + (f" on {p} ranks" if s.stages > p else "")
        out.append(f"pipeline step {s.index} of {count}: {s.schedule}, {where}, "
                   f"{s.microbatches} micro-batches (replica {s.replica}), "
                   f"{(t1 - t0) * 1e3:.1f} ms")
        if s.missing:
            out.append(f"incomplete: {s.missing} (its trace ends inside this step), so the "
                       "bubbles below are not the schedule's")
        out.append(draw(s.spans, width=width))
        predicted = s.predicted
        for i, (rank, frac) in enumerate(zip(s.ranks, s.bubble)):
            busy = sum(x.end - x.start for x in s.spans[i])
            pred = f", predicted {predicted[i]:.1%}" if predicted else ""
            held = "stage" if s.stages == p else "stages"
            # The stages the rank ran (r, r + p, ...; ZB-V's r and 2p-1-r).
            mine = ", ".join(str(k) for k in sorted({x.action.stage for x in s.spans[i]}))
            out.append(f"  {held} {mine} (r{rank}): bubble {frac:.1%} "
                       f"({(t1 - t0 - busy) * 1e3:.1f} ms idle){pred}")
        out.append("")
    cut = sorted({s.index for s in found if s.missing} - {pick})
    if step is None and cut:
        out.append(f"step {', '.join(map(str, cut))} incomplete (a rank's trace ends inside "
                   "it): not drawn.")
    out.append("predicted: the schedule simulated with this step's mean F, B and W times per "
               "stage. Another step: --collective pipeline --call N")
    return "\n".join(out)


def list_steps(files) -> list[tuple[str, int, str, int, int]]:
    """``trace explain --list`` rows: ("pipeline", step, schedule, 0, ranks in all replicas)."""
    ranks: dict[int, int] = defaultdict(int)
    names: dict[int, str] = {}
    for s in steps(files):
        ranks[s.index] += len(s.spans)
        names[s.index] = s.schedule
    return [("pipeline", k, names[k], 0, ranks[k]) for k in sorted(ranks)]


def label(span: dict[str, Any]) -> tuple[str, str] | None:
    """(colour, text) for a pipeline event span of ``timeline.tracks``; None for others."""
    if span.get("cat") != CATEGORY:
        return None
    kind, mb = span["args"].get("action", "F"), span["args"].get("mb", 0)
    return KIND_COLORS.get(kind, "tab:gray"), f"{kind}{int(mb) + 1}"


def title(files) -> str:
    """A plot title: the last training step's schedule and measured bubble per rank."""
    found = steps(files)
    if not found:
        return ""
    pick = _last_training_step(found)
    last = [s for s in found if s.index == pick]
    parts = [f"r{r} {b:.0%}" for s in last for r, b in zip(s.ranks, s.bubble)]
    return (f"pipeline {last[0].schedule}, m={last[0].microbatches}; bubble in the last step: "
            + ", ".join(parts))
