r"""Turn a recorded trace into pictures and explanations (pure: files in, text or JSON out).

A trace directory holds one JSON-lines file per rank (``mpiring.runtime.trace``): a
``header`` (with ``wall_minus_clock``, the offset from the rank's
``perf_counter`` to wall-clock time), ``step`` records of the ring collectives
and ``event`` records of other spans (DDP buckets, backward...). From it:

* ``chrome_trace``: one Chrome trace (Perfetto, chrome://tracing) with a row per
  rank, every ring step nested in its collective call, and the events on the
  same timeline, each kind on its own track;
* ``plot``: the same timeline as a PNG (matplotlib);
* ``explain`` of a pipeline run (``mpiring.tools.pipeline_trace``): the lecture's
  per-device diagram of one step, to scale, with the measured bubble per rank;
  ``plot`` colours its F, B and W boxes and numbers the micro-batches;
* ``explain``: the lecture's step diagram as text. Replaying the step records
  (who sent which chunk to whom, in order) shows after every step which chunks
  each rank holds and whose contributions each contains::

      reduce-scatter step 1/3: r0 c3->r1  r1 c0->r2  r2 c1->r3  r3 c2->r0
              c0     c1     c2     c3
        r0     0      0    0+3      0
        r1   0+1      1      1      1
        ...

Ranks are aligned by wall-clock time (``t + wall_minus_clock``), so files from
several hosts line up as well as the hosts' clocks agree.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from mpiring.runtime.trace import FORMAT_VERSION

# Phases whose receive reduces into what the rank holds; the others copy.
REDUCING_PHASES = ("reduce-scatter", "reduce", "push")
# Recursive doubling's and halving-doubling's phases that reduce what they receive
# (the fold hands an even rank's data to the odd one above it, which adds it).
EXCHANGE_REDUCING = ("doubling", "fold")
# Algorithms whose every message is the whole buffer: their steps carry no chunk
# numbers, and replaying them as one chunk is exact.
WHOLE_BUFFER_ALGOS = ("recursive-doubling",)
# Algorithms whose steps record the elements they moved (``send_range``/``recv_range``):
# replayed with the distinct ranges as chunks.
RANGE_ALGOS = ("halving-doubling",)
MAX_LABELS = 2000  # plot's F1/B1 labels: more are unreadable at the PNG's width
PHASE_COLORS = {
    "reduce-scatter": "tab:blue", "all-gather": "tab:green", "broadcast": "tab:orange",
    "reduce": "tab:red", "push": "tab:purple", "pull": "tab:brown",
}


@dataclass
class TraceFile:
    """One rank's file: its rank, its clock offset and its records (header excluded)."""

    name: str
    rank: int
    offset: float
    records: list[dict[str, Any]]
    job: str | None = None  # the run's id and rank count (headers written by mpiring.init)
    world: int | None = None
    # The file's communicators: id -> their job ranks in rank order ("comm" records).
    groups: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Call:
    """The steps one rank recorded for one collective call."""

    rank: int
    collective: str
    call: int
    algo: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    offset: float = 0.0
    nth: int = 0  # earlier calls with the same key in this rank's file
    # The job ranks of the communicator it ran on, in rank order (its steps' dst and
    # src are already job ranks); None: the steps do not say (a version-1 file).
    group: tuple[int, ...] | None = None

    @property
    def ident(self) -> tuple[str, int, str, int]:
        """Identifies the call across ranks: two communicators of one rank (a DDP
        bucket communicator and its parent, say) both count ``all_reduce#1``, but
        every rank makes its calls in the same order, so the n-th one matches."""
        return self.collective, self.call, self.algo, self.nth

    @property
    def t_start(self) -> float:
        return min(s["t_start"] for s in self.steps) + self.offset

    @property
    def t_end(self) -> float:
        return max(s["t_end"] for s in self.steps) + self.offset

    @property
    def key(self) -> tuple[str, int, str]:
        return self.collective, self.call, self.algo


# The trace formats this reader understands: the writer's (mpiring.runtime.trace), and
# version 1, which is version 2 without the "comm" records and the steps' ranges (its
# calls are replayed as before: a call of several groups is refused). A header without
# "version" is version 1 (every file written before it was recorded).
READABLE_VERSIONS = (1, FORMAT_VERSION)
# The fields each record type must have for the tools to read it: a file of another
# mpiring version that lacks one is refused naming it, not a KeyError traceback.
REQUIRED = {
    "step": ("collective", "call", "algo", "phase", "step", "steps", "t_start", "t_end"),
    "event": ("t_start", "t_end"),
    "p2p": ("op", "peer", "t_start", "t_end"),
    "comm": ("id", "ranks"),
}
NUMERIC = ("call", "step", "steps", "t_start", "t_end")
# Two files whose records are this far apart are taken for two runs: a new mpiexec
# job takes longer than this to start, while one run's ranks overlap in time.
RUN_GAP_S = 1.0


def load(directory: str) -> list[TraceFile]:
    """Read every ``*.jsonl`` file of a trace directory.

    Warns (``UserWarning``) when the files' spans fall into runs that never overlap
    in time: an earlier run's files left in the directory (a later run with fewer
    ranks overwrites only its own ranks' files).

    Raises:
        ValueError: the directory has no trace files, a file has no header, two
            files claim the same rank, or a file is of another trace format version.
    """
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory: pass the directory given to "
                         "--trace (or MPIRING_TRACE)")
    files = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".jsonl"):
            continue
        recs = _read_records(os.path.join(directory, name), name)
        headers = [r for r in recs if r.get("type") == "header"]
        if not headers:
            raise ValueError(f"{name}: no header line; is it an mpiring trace file?")
        h = headers[0]
        try:
            rank, offset = int(h["rank"]), float(h.get("wall_minus_clock", 0.0))
            version = int(h.get("version", 1))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: its header has no valid rank; is it an mpiring trace "
                             "file?") from None
        if version not in READABLE_VERSIONS:
            raise ValueError(f"{name}: trace format version {version}, but this mpiring reads "
                             f"version {' and '.join(map(str, READABLE_VERSIONS))}: read it with "
                             "the mpiring version that "
                             "wrote it, or record the run again with this one")
        body = [r for r in recs if r.get("type") != "header"]
        _check_fields(name, body)
        job, world = h.get("job"), h.get("world")
        files.append(TraceFile(name, rank, offset, body, str(job) if job else None,
                               world if isinstance(world, int) else None,
                               _groups_of(name, body)))
    if not files:
        raise ValueError(f"no trace files (*.jsonl) in {directory!r}: record one with "
                         "--trace DIR or MPIRING_TRACE=DIR")
    _check_runs(files)
    by_rank: dict[int, list[str]] = defaultdict(list)
    for f in files:
        by_rank[f.rank].append(f.name)
    twice = {r: names for r, names in by_rank.items() if len(names) > 1}
    if twice:  # merged, their calls would pair up with themselves and nothing would match
        r, names = min(twice.items())
        raise ValueError(f"{' and '.join(names)} are both rank {r}'s trace: they come from "
                         "different runs; keep one run's files per directory (trace each run "
                         "into its own --trace DIR)")
    if not any(f.job for f in files):  # older files: no id to compare, only their times
        _warn_separate_runs(files)
    return files


def _check_runs(files: list[TraceFile]) -> None:
    """Refuse files of two runs (their headers' job ids differ); warn about ranks of the
    run that have no file here (a copy that left one out: a pipeline's last stage)."""
    runs: dict[str | None, list[TraceFile]] = defaultdict(list)
    for f in files:
        runs[f.job].append(f)
    if len(runs) > 1:
        parts = "; ".join(", ".join(f.name for f in fs) + (
            f" (run {job}, {fs[0].world} ranks)" if job else " (no run id)")
            for job, fs in runs.items())
        raise ValueError(f"the directory holds the files of {len(runs)} runs: {parts}. Keep "
                         "one run's files per directory (trace each run into its own --trace "
                         "DIR; a later run with fewer ranks leaves the earlier one's other "
                         "files)")
    world = files[0].world
    if world:
        absent = sorted(set(range(world)) - {f.rank for f in files})
        if absent:
            warnings.warn(f"rank(s) {', '.join(map(str, absent))} of the run's {world} have no "
                          "file here: what they did is missing from the picture; copy every "
                          "rank's file of the run into the directory", stacklevel=3)


def _check_fields(name: str, recs: list[dict[str, Any]]) -> None:
    for rec in recs:
        need = REQUIRED.get(rec.get("type"), ())
        if rec.get("type") == "event" and rec.get("cat") == "pipeline":  # pipeline_trace's
            need = need + ("action", "stage", "mb")
        missing = [k for k in need if k not in rec]
        bad = [k for k in NUMERIC if k in need and k not in missing
               and (isinstance(rec[k], bool) or not isinstance(rec[k], (int, float)))]
        if missing or bad:
            what = (f"no {', '.join(missing)}" if missing else f"a non-numeric {', '.join(bad)}")
            article = "an" if rec["type"][0] in "aeiou" else "a"
            raise ValueError(f"{name}: {article} {rec['type']} record has {what}: the file was "
                             "written by another mpiring version (or edited); record the run "
                             "again with this one")


def _groups_of(name: str, recs: list[dict[str, Any]]) -> dict[int, tuple[int, ...]]:
    """The file's communicators (its "comm" records), checked: every step's ``comm``
    is defined and its peers are ranks of that communicator."""
    groups: dict[int, tuple[int, ...]] = {}
    for rec in recs:
        if rec.get("type") == "comm":
            ranks = rec["ranks"]
            if not isinstance(ranks, list) or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in ranks):
                raise ValueError(f"{name}: a comm record's ranks are not a list of ranks: the "
                                 "file was written by another mpiring version (or edited)")
            groups[rec["id"]] = tuple(ranks)
        elif rec.get("type") == "step" and "comm" in rec:
            g = groups.get(rec["comm"])
            if g is None or any(p is not None and not 0 <= p < len(g)
                                for p in (rec.get("dst"), rec.get("src"))):
                raise ValueError(f"{name}: a step names communicator {rec['comm']!r}, which "
                                 "no comm record before it defines (or a peer outside it): the "
                                 "file is cut or edited; record the run again")
    return groups


def _warn_separate_runs(files: list[TraceFile]) -> None:
    """Warn when the files form groups whose time spans never overlap: every rank of one
    run takes part in its collectives, so one run's files overlap in time (but for an
    eager send that completes before its receiver starts waiting: hence the slack).
    The header carries no job id to tell for sure."""
    spans = []
    for f in files:
        ts = [(r["t_start"], r["t_end"]) for r in f.records if "t_start" in r and "t_end" in r]
        if ts:
            spans.append((min(a for a, _ in ts) + f.offset, max(b for _, b in ts) + f.offset,
                          f.name))
    runs: list[list[tuple[float, float, str]]] = []
    for span in sorted(spans):
        if runs and span[0] <= max(e for _, e, _ in runs[-1]) + RUN_GAP_S:
            runs[-1].append(span)
        else:
            runs.append([span])
    if len(runs) > 1:
        parts = "; ".join(", ".join(sorted(n for _, _, n in run))
                          + f" (from {time.strftime('%H:%M:%S', time.localtime(run[0][0]))})"
                          for run in runs)
        warnings.warn(f"the files look like {len(runs)} separate runs (their records are "
                      f"more than {RUN_GAP_S:g} s apart): {parts}. An earlier run's files are "
                      "left when a later one has fewer ranks: trace each run into its own "
                      "directory", stacklevel=2)


def _read_records(path: str, name: str) -> list[dict[str, Any]]:
    """The JSON objects of one file, a line each. A last line cut short (the rank was
    killed mid-write) is dropped with a warning: the rest of the run is still worth
    reading. Any other bad line is an error naming the file and line."""
    with open(path) as fh:
        lines = fh.read().split("\n")
    recs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines):  # no newline after it: a partial write
                warnings.warn(f"{name}: line {i} is cut short (the run ended mid-write); "
                              "reading the lines before it", stacklevel=3)
                break
            raise ValueError(f"{name}, line {i}: not JSON; is it an mpiring trace file?") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{name}, line {i}: not a trace record (a JSON object); is it an "
                             "mpiring trace file?")
        recs.append(rec)
    return recs


def calls(files: list[TraceFile]) -> list[Call]:
    """Group each file's step records into calls (consecutive steps with one key and
    communicator). A step's peers become job ranks where the file says which group
    the call ran on."""
    out: list[Call] = []
    for f in files:
        current: Call | None = None
        current_comm = None
        remap = False
        seen: dict[tuple[str, int, str], int] = {}
        for rec in f.records:
            if rec.get("type") != "step":
                continue
            key = (rec["collective"], rec["call"], rec["algo"])
            comm = rec.get("comm")
            # A new call starts when the key or communicator changes or its step
            # numbering restarts.
            restart = (current is not None and current.key == key and rec["step"] == 0
                       and rec["phase"] == current.steps[0]["phase"])
            if current is None or current.key != key or comm != current_comm or restart:
                nth = seen.get(key, -1) + 1
                seen[key] = nth
                g = None if comm is None else f.groups[comm]
                current = Call(f.rank, *key, offset=f.offset, nth=nth, group=g)
                current_comm = comm
                remap = g is not None and g != tuple(range(len(g)))
                out.append(current)
            if remap:
                # Peers are communicator ranks: name them by job rank (a copy: the
                # file's records keep what was written).
                g = current.group
                rec = dict(rec, dst=None if rec.get("dst") is None else g[rec["dst"]],
                           src=None if rec.get("src") is None else g[rec["src"]])
            current.steps.append(rec)
    return out


def _t0(files: list[TraceFile]) -> float:
    starts = [r["t_start"] + f.offset for f in files for r in f.records if "t_start" in r]
    return min(starts) if starts else 0.0


def _lanes(spans: list[tuple[float, float]]) -> list[int]:
    """Greedy interval packing: the lane of each span so that a lane's spans never overlap."""
    ends: list[float] = []
    lanes = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda j: spans[j][0]):
        start, end = spans[i]
        for lane, last in enumerate(ends):
            if last <= start:
                ends[lane] = end
                lanes[i] = lane
                break
        else:
            ends.append(end)
            lanes[i] = len(ends) - 1
    return lanes


def _step_name(s: dict[str, Any]) -> str:
    parts = [f"{s['phase']} {s['step'] + 1}/{s['steps']}"]
    if s.get("send_chunk") is not None:
        parts.append(f"c{s['send_chunk']}->r{s['dst']}")
    if s.get("recv_chunk") is not None:
        parts.append(f"c{s['recv_chunk']}<-r{s['src']}")
    return " ".join(parts)


def tracks(files: list[TraceFile]) -> list[dict[str, Any]]:
    """Every span to draw, with its rank, track name and lane: the common input of
    ``chrome_trace`` and ``plot``.

    Kinds: "call" (a collective call), "step" (one ring step, inside its call),
    "reduce" (the reduction at the end of a step) and "event" (other spans).
    Times are seconds since the earliest record of any rank.
    """
    t0 = _t0(files)
    spans: list[dict[str, Any]] = []
    by_rank_calls: dict[int, list[Call]] = defaultdict(list)
    for c in calls(files):
        by_rank_calls[c.rank].append(c)
    for rank, cs in by_rank_calls.items():
        lanes = _lanes([(c.t_start, c.t_end) for c in cs])
        for c, lane in zip(cs, lanes):
            track = "collectives" if lane == 0 else f"collectives ({lane + 1})"
            spans.append({"kind": "call", "rank": rank, "track": track,
                          "name": f"{c.collective}#{c.call} {c.algo}", "cat": c.collective,
                          "start": c.t_start - t0, "end": c.t_end - t0,
                          "args": {"steps": len(c.steps),
                                   "bytes_sent": sum(s.get("bytes_sent", 0) for s in c.steps),
                                   "bytes_recv": sum(s.get("bytes_recv", 0) for s in c.steps)}})
            for s in c.steps:
                start, end = s["t_start"] + c.offset - t0, s["t_end"] + c.offset - t0
                args = {k: s.get(k) for k in ("send_chunk", "dst", "recv_chunk", "src",
                                              "bytes_sent", "bytes_recv")}
                args["wait_us"] = round(s.get("wait_s", 0.0) * 1e6, 3)
                args["reduce_us"] = round(s.get("reduce_s", 0.0) * 1e6, 3)
                spans.append({"kind": "step", "rank": rank, "track": track,
                              "name": _step_name(s), "cat": s["phase"], "start": start,
                              "end": end, "args": args})
                # Only a step that received into a reducing phase reduced anything: a
                # broadcast root's or a reduce leaf's send-only step also has reduce_s
                # (its send time, as t_recv = t_start), and an all-gather only copies.
                if (s.get("reduce_s", 0.0) > 0 and s.get("src") is not None
                        and s["phase"] in REDUCING_PHASES + EXCHANGE_REDUCING):
                    spans.append({"kind": "reduce", "rank": rank, "track": track,
                                  "name": "reduce", "cat": s["phase"],
                                  "start": end - s["reduce_s"], "end": end, "args": {}})
    for f in files:  # point-to-point messages (a pipeline's activations): one track
        msgs = [r for r in f.records if r.get("type") == "p2p"]
        lanes = _lanes([(m["t_start"], m["t_end"]) for m in msgs])
        for m, lane in zip(msgs, lanes):
            arrow = "->" if m["op"] == "send" else "<-"
            # The peer is a rank of the message's communicator (a pipeline group's): named
            # by its job rank where the file records that communicator.
            group = f.groups.get(m.get("comm"))
            peer = group[m["peer"]] if group is not None and 0 <= m["peer"] < len(group) \
                else m["peer"]
            spans.append({"kind": "event", "rank": f.rank, "group": "p2p",
                          "track": "p2p" if lane == 0 else f"p2p ({lane + 1})",
                          "name": f"{m['op']} {arrow}r{peer} tag {m.get('tag')}",
                          "cat": "p2p", "start": m["t_start"] + f.offset - t0,
                          "end": m["t_end"] + f.offset - t0,
                          "args": {"call": m.get("call"), "peer": peer,
                                   **{k: m.get(k) for k in ("tag", "bytes", "dtype", "via")
                                      if k in m}}})
    for f in files:
        events = [r for r in f.records if r.get("type") == "event"]
        # A track per event name (ddp.backward, ddp.all_reduce...), unless a
        # category has many names (one per bucket, say): then one per category.
        names_in: dict[str, set[str]] = defaultdict(set)
        for e in events:
            names_in[str(e.get("cat", "event"))].add(str(e.get("name", "")))
        by_track: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in events:
            cat = str(e.get("cat", "event"))
            track = str(e.get("name") or cat) if len(names_in[cat]) <= 6 else cat
            by_track[track].append(e)
        for track, es in by_track.items():
            lanes = _lanes([(e["t_start"], e["t_end"]) for e in es])
            for e, lane in zip(es, lanes):
                extra = {k: v for k, v in e.items()
                         if k not in ("type", "rank", "name", "cat", "t_start", "t_end")}
                spans.append({"kind": "event", "rank": f.rank, "group": track,
                              "track": track if lane == 0 else f"{track} ({lane + 1})",
                              "name": str(e.get("name", track)), "cat": str(e.get("cat", "event")),
                              "start": e["t_start"] + f.offset - t0,
                              "end": e["t_end"] + f.offset - t0, "args": extra})
    return spans


def _track_order(spans: list[dict[str, Any]]) -> list[tuple[int, str]]:
    seen: dict[tuple[int, str], None] = {}
    for s in sorted(spans, key=lambda s: (s["rank"], s["kind"] == "event", s["track"])):
        seen.setdefault((s["rank"], s["track"]), None)
    return list(seen)


def chrome_trace(files: list[TraceFile]) -> dict[str, Any]:
    """The trace as a Chrome trace-event JSON object (``{"traceEvents": [...]}``).

    pid = rank (a row per rank, named "rank r"), tid = a track within the rank:
    "collectives" (calls with their steps nested inside, and the reduction at the
    end of each step nested in the step) and one track per event category.
    """
    spans = tracks(files)
    order = _track_order(spans)
    tids: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for rank in sorted({r for r, _ in order}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
    for rank, track in order:
        tid = sum(1 for (r, _) in tids if r == rank)
        tids[(rank, track)] = tid
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                       "args": {"name": track}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                       "args": {"sort_index": tid}})
    # Parents before children at equal start times, so viewers nest them.
    depth = {"call": 0, "event": 0, "step": 1, "reduce": 2}
    for s in sorted(spans, key=lambda s: (s["start"], depth[s["kind"]])):
        events.append({"ph": "X", "name": s["name"], "cat": s["cat"], "pid": s["rank"],
                       "tid": tids[(s["rank"], s["track"])], "ts": s["start"] * 1e6,
                       "dur": max(0.0, (s["end"] - s["start"]) * 1e6),
                       "args": _json_safe(s["args"])})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": "mpiring trace merge", "ranks": len({f.rank for f in files})}}


def _json_safe(value: Any) -> Any:
    """``value`` with NaN and infinities as strings: JSON has no such numbers, so a
    diverged run's ``loss: NaN`` would make the whole file unreadable to the browser's
    JSON.parse (Perfetto, chrome://tracing), though Python's json reads it."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def plot(files: list[TraceFile], path: str, title: str = "",
         window: tuple[float, float] | None = None) -> None:
    """Draw the timeline as a PNG: a row per rank and track, ring steps coloured by phase.

    The darker end of a step is its reduction; events (DDP buckets, backward...)
    get their own rows under their rank. ``window`` = (from, to) in ms since the
    trace's start draws only that stretch (a training run's last steps, say).

    Raises:
        ValueError: nothing recorded at all, or nothing inside ``window``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = tracks(files)
    if not spans:  # an empty picture would look like a run that did nothing
        raise ValueError("nothing to draw: the trace has headers but no recorded spans "
                         "(the run ended before its first traced call)")
    label = None
    if has_pipeline(files):  # F, B, W in their colours, numbered, as the lecture draws them
        from mpiring.tools import pipeline_trace

        label = pipeline_trace.label
        title = title or pipeline_trace.title(files)
    if window is not None:
        lo, hi = window[0] / 1e3, window[1] / 1e3
        spans = [s for s in spans if s["end"] >= lo and s["start"] <= hi]
        if not spans:
            raise ValueError(f"nothing recorded between {window[0]:g} and {window[1]:g} ms")
    order = _track_order(spans)
    row = {t: i for i, t in enumerate(order)}
    fig, ax = plt.subplots(figsize=(11, 0.9 + 0.45 * max(1, len(order))))
    cat_colors: dict[str, str] = {}
    palette = ["tab:cyan", "tab:olive", "tab:pink", "tab:gray", "gold", "teal"]
    used: dict[str, str] = {}
    # One broken_barh per (row, look), not one per span: every call adds a collection
    # and re-runs autoscale over all the earlier ones, so per-span calls cost O(n^2)
    # (10k spans took 4 minutes; 250k, from 100k step records, did not end in 10).
    bars: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    texts = []
    for s in spans:
        y = row[(s["rank"], s["track"])]
        x, w = s["start"] * 1e3, max((s["end"] - s["start"]) * 1e3, 1e-6)
        if s["kind"] == "call":
            look = (y, 0.42, (("facecolors", "none"), ("edgecolors", "black"),
                              ("linewidth", 0.6)))
        elif s["kind"] == "step":
            color = PHASE_COLORS.get(s["cat"], "tab:gray")
            used[s["cat"]] = color
            look = (y, 0.32, (("facecolors", color), ("edgecolors", "white"),
                              ("linewidth", 0.3)))
        elif s["kind"] == "reduce":
            look = (y, 0.32, (("facecolors", "black"), ("alpha", 0.35)))
        elif label is not None and (kind := label(s)) is not None:
            color, text = kind
            used[text[0]] = color
            look = (y, 0.32, (("facecolors", color), ("edgecolors", "black"),
                              ("linewidth", 0.3)))
            texts.append((x + w / 2, y, text))
        else:
            color = cat_colors.setdefault(s["group"], palette[len(cat_colors) % len(palette)])
            used[s["group"]] = color
            look = (y, 0.32, (("facecolors", color), ("edgecolors", "black"),
                              ("linewidth", 0.3), ("alpha", 0.8)))
        bars[look].append((x, w))
    for (y, half, style), xs in bars.items():
        ax.broken_barh(xs, (y - half, 2 * half), **dict(style))
    # Labels only while they can be read: thousands of them are a grey smear that
    # costs minutes to render (--window picks a stretch to label).
    if len(texts) <= MAX_LABELS:
        for x, y, text in texts:
            ax.text(x, y, text, ha="center", va="center", fontsize=6, clip_on=True)
    if window is not None:
        ax.set_xlim(window[0], window[1])
    ax.set_yticks(range(len(order)), [f"r{r} {t}" for r, t in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    handles = [Patch(color=c, label=n) for n, c in used.items()]
    handles.append(Patch(color="black", alpha=0.35, label="reduction"))
    # Above the axes, so that it never hides a bar.
    ax.legend(handles=handles, fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0),
              ncol=min(6, len(handles)), frameon=False)
    ax.set_title(title or "mpiring trace", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- explain: replay the step records ------------------------------------------------
def list_calls(files: list[TraceFile]) -> list[tuple[str, int, str, int, int]]:
    """(collective, call, algo, nth, ranks) of every call in the trace, in time order.

    ``nth`` > 0 marks a later call with the same name (another communicator's).
    """
    seen: dict[tuple[str, int, str, int], set[int]] = {}
    first: dict[tuple[str, int, str, int], float] = {}
    for c in calls(files):
        seen.setdefault(c.ident, set()).add(c.rank)
        first[c.ident] = min(first.get(c.ident, c.t_start), c.t_start)
    rows = [(*k, len(seen[k])) for k in sorted(seen, key=lambda k: first[k])]
    if has_pipeline(files):  # then the pipeline's steps: ("pipeline", step, schedule, 0, ranks)
        from mpiring.tools import pipeline_trace

        rows += pipeline_trace.list_steps(files)
    return rows


def group_sizes(files: list[TraceFile]) -> dict[tuple[str, int, str, int], int]:
    """The calls that ran on several smaller communicators: ident -> the size of each
    group (the largest, when they differ). Taken from the recorded groups, or, for a
    version-1 file, guessed from the peers the steps name (see ``group_size``)."""
    per_call: dict[tuple[str, int, str, int], dict[int, list[dict[str, Any]]]] = defaultdict(dict)
    recorded: dict[tuple[str, int, str, int], set[tuple[int, ...]]] = defaultdict(set)
    for c in calls(files):
        per_call[c.ident][c.rank] = c.steps
        if c.group is not None:
            recorded[c.ident].add(c.group)
    sizes = {}
    for ident, per_rank in per_call.items():
        if ident in recorded:
            groups = recorded[ident]
            if len(groups) > 1:
                sizes[ident] = max(len(g) for g in groups)
            continue
        k = group_size(per_rank)
        if k is not None and k < len(per_rank):
            sizes[ident] = k
    return sizes


def call_groups(files: list[TraceFile]) -> dict[tuple[str, int, str, int], list[tuple[int, ...]]]:
    """The groups each call ran on, as the steps record them (job ranks in the
    communicator's rank order), the group of the lowest rank first. Calls whose steps
    name no group (a version-1 file) are left out."""
    found: dict[tuple[str, int, str, int], set[tuple[int, ...]]] = defaultdict(set)
    for c in calls(files):
        if c.group is not None:
            found[c.ident].add(c.group)
    return {ident: sorted(gs, key=lambda g: (min(g, default=0), g)) for ident, gs in found.items()}


def job_ranks(files: list[TraceFile]) -> list[int]:
    """The ranks of the job: the header's rank count, else the ranks that have a file."""
    world = files[0].world if files else None
    return list(range(world)) if world else sorted(f.rank for f in files)


def has_pipeline(files: list[TraceFile]) -> bool:
    """True when the trace holds pipeline actions (events of category "pipeline")."""
    return any(r.get("type") == "event" and r.get("cat") == "pipeline"
               for f in files for r in f.records)


def call_name(collective: str, call: int, nth: int = 0) -> str:
    """``all_reduce#3``, or ``all_reduce#3 (2nd)`` for a later call with the same name."""
    suffix = {1: "2nd", 2: "3rd"}.get(nth, f"{nth + 1}th")
    return f"{collective}#{call}" + (f" ({suffix})" if nth else "")


def _cell(holding: frozenset[int] | None, everyone: frozenset[int]) -> str:
    if holding is None:
        return "."
    if holding == everyone and len(everyone) > 1:
        return "ALL"
    return "+".join(str(r) for r in sorted(holding))


def _table(state: dict[int, list[frozenset[int] | None]], everyone: frozenset[int]) -> list[str]:
    nchunks = len(next(iter(state.values())))
    if nchunks > 12:  # too wide for columns: runs of equal cells per rank
        lines = []
        for r in sorted(state):
            runs, start = [], 0
            cells = [_cell(h, everyone) for h in state[r]]
            for i in range(1, nchunks + 1):
                if i == nchunks or cells[i] != cells[start]:
                    span = f"c{start}" if i - 1 == start else f"c{start}-c{i - 1}"
                    runs.append(f"{span}: {cells[start]}")
                    start = i
            lines.append(f"  r{r:<4} " + "   ".join(runs))
        return lines
    cells = {r: [_cell(h, everyone) for h in state[r]] for r in state}
    width = max(3, *(len(c) for row in cells.values() for c in row))
    lines = ["      " + "".join(f"{'c' + str(c):>{width + 2}}" for c in range(nchunks))]
    for r in sorted(state):
        lines.append(f"  r{r:<3}" + "".join(f"{c:>{width + 2}}" for c in cells[r]))
    return lines


def _pick(files, collective, call, nth=None):
    found = list_calls(files)
    if collective is not None:
        found = [c for c in found if c[0] == collective]
    if call is not None:
        found = [c for c in found if c[1] == call]
    if nth is not None:  # "all_reduce#1 (2nd)" is nth=2: the second call with that name
        found = [c for c in found if c[3] == nth - 1]
    if not found and not list_calls(files):
        raise ValueError("the trace has no collective calls (a rank alone, or a run that "
                         "ended before its first one): trace a run of 2 or more ranks")
    if not found:
        have = ", ".join(call_name(c, n, i) for c, n, _, i, _ in list_calls(files)[:20]) or "none"
        raise ValueError(f"no traced call matches collective={collective} call={call}"
                         + (f" nth={nth}" if nth is not None else "") + "; "
                         f"the trace has: {have}")
    return found[0]


@dataclass
class Replay:
    """One group's call, replayed (see ``replay``)."""

    ident: tuple[str, int, str, int]
    ranks: list[int]  # the group's job ranks, sorted: the table's rows
    group: tuple[int, ...]  # the same in the communicator's rank order (rank i = group[i])
    groups: list[tuple[int, ...]]  # every group that made the call (recorded ones only)
    snapshots: list
    chunks: list[tuple[int, int]] | None = None  # the elements of each chunk, when recorded
    per_rank: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def replay(files: list[TraceFile], collective: str | None = None, call: int | None = None,
           nth: int | None = None, rank: int | None = None):
    """Replay one call's steps; return (key, ranks, snapshots).

    ``snapshots`` is a list of (label, transfers, state): the state after each
    round of steps (round i = every rank's i-th step), where
    ``state[rank][chunk]`` is the set of ranks whose data the chunk holds, or
    None when the rank does not hold that chunk yet. Ranks are job ranks.

    A call made by several groups (each tensor-parallel group's ``all_reduce#1``)
    is replayed for one of them: the group holding job rank ``rank``, by default
    the group of the lowest rank.

    Messages are matched in order per (sender, receiver), as MPI matches them;
    a receive in a reducing phase (reduce-scatter, reduce, push) adds the
    sender's contributions to the receiver's, any other receive replaces them.

    Raises:
        ValueError: no such call, no group holding ``rank``, or steps that do not
            match up (a rank's file missing, or a version-1 file's call made on a
            sub-communicator: its steps do not say which ranks it ran on).
    """
    r = replay_group(files, collective, call, nth, rank)
    return r.ident, r.ranks, r.snapshots


def _select(files: list[TraceFile], ident: tuple[str, int, str, int], rank: int | None):
    """(group, per_rank, groups) of one group's call. ``group`` is None for steps that
    name no group (a version-1 file): then ``per_rank`` is every rank that recorded it."""
    name = call_name(ident[0], ident[1], ident[3])
    cs = [c for c in calls(files) if c.ident == ident]
    recorded = [c for c in cs if c.group is not None]
    if not recorded:
        return None, {c.rank: c.steps for c in cs}, []
    groups = sorted({c.group for c in recorded}, key=lambda g: (min(g, default=0), g))
    if rank is None:
        group = groups[0]
    else:
        holding = [g for g in groups if rank in g]
        if not holding and rank not in {f.rank for f in files}:
            # Its group's records would be in its file and its group mates': with none
            # of those here, "took no part" would be a guess.
            raise ValueError(f"{name}: rank {rank} has no file here, so which group it made "
                             f"the call in is unknown (the files here show "
                             f"{_groups_text(groups)}): copy every rank's file of the run "
                             "into the directory, or pick a rank of those groups")
        if not holding:
            raise ValueError(f"{name}: rank {rank} took no part in it; it ran on "
                             f"{_groups_text(groups)}: pick a rank of one of those (or its "
                             "file was cut short before the call)")
        group = holding[0]
    per_rank = {c.rank: c.steps for c in recorded if c.group == group}
    missing = sorted(set(group) - set(per_rank))
    if missing:
        raise ValueError(f"{name} ran on ranks {_ranges(list(group))}, but rank(s) "
                         f"{_ranges(missing)} have no records for it: their files are missing "
                         "or cut short; copy every rank's file of the run into the directory")
    return group, per_rank, groups


def _groups_text(groups: list[tuple[int, ...]], limit: int = 8) -> str:
    text = " | ".join(", ".join(map(str, g)) for g in groups[:limit])
    return text + (f" | ... ({len(groups)} groups)" if len(groups) > limit else "")


def replay_group(files: list[TraceFile], collective: str | None = None,
                 call: int | None = None, nth: int | None = None,
                 rank: int | None = None) -> Replay:
    """``replay``, with what it found out about the call: its group, every group that
    made it, and the elements of each chunk where the steps record them."""
    coll, num, algo, nth, _ = _pick(files, collective, call, nth)
    name = call_name(coll, num, nth)
    group, per_rank, groups = _select(files, (coll, num, algo, nth), rank)
    if group is None:
        _check_one_communicator(name, per_rank)
        group = tuple(sorted(per_rank))
    else:
        _check_step_counts(name, per_rank)
    ranks = sorted(per_rank)
    chunks = None
    if _has_ranges(per_rank):
        per_rank, chunks = _range_steps(per_rank)
    elif algo in WHOLE_BUFFER_ALGOS and not _has_chunks(per_rank):
        # Each message is the whole buffer: chunk 0 of 1.
        per_rank = {r: [_whole_buffer(s) for s in st] for r, st in per_rank.items()}
    elif not _has_chunks(per_rank):
        raise ValueError(f"{name} ({algo}): its steps record who exchanged with whom, not "
                         "which chunks, so there is nothing to replay; see explain's list of "
                         "exchanges instead")
    else:
        per_rank = {r: [_chunk_step(s) for s in st] for r, st in per_rank.items()}
    if chunks is not None:
        nchunks = max(1, len(chunks))
    else:
        # Ring collectives cut the buffer into K chunks; the pipelined ones into S
        # segments (one per step); the parameter server moves one whole buffer.
        nchunks = max([1] + [c + 1 for st in per_rank.values() for s in st
                             for c in (s["_send"] or []) + (s["_recv"] or [])])
        whole = any(s.get("exchange") for st in per_rank.values() for s in st)
        if coll in ("all_reduce", "reduce_scatter", "all_gather") and not whole:
            nchunks = max(nchunks, len(ranks))
    if coll == "all_gather":  # chunk i is the communicator's rank i's
        state = {r: [frozenset([r]) if c < len(group) and group[c] == r else None
                     for c in range(nchunks)] for r in ranks}
    elif coll == "broadcast":
        roots = [r for r in ranks if all(s["_recv"] is None for s in per_rank[r])]
        state = {r: [frozenset([r]) if r in roots else None for _ in range(nchunks)]
                 for r in ranks}
    else:  # all_reduce, reduce_scatter, reduce, ps: everyone starts with its own data
        state = {r: [frozenset([r]) for _ in range(nchunks)] for r in ranks}
    reducing = _reducing(algo)

    queues: dict[tuple[int, int], deque] = defaultdict(deque)
    pos = dict.fromkeys(ranks, 0)  # next step per rank
    sent = dict.fromkeys(ranks, False)  # whether the current step's send happened

    def send(r, s):
        queues[(r, s["dst"])].append((s["_send"], [state[r][c] for c in s["_send"]]))

    def try_step(r) -> bool:
        s = per_rank[r][pos[r]]
        has_send, has_recv = s["_send"] is not None, s["_recv"] is not None
        # Ring steps send one chunk and receive another (the send reads the
        # state before the receive); pipelined steps forward the chunk just received.
        # An exchange (recursive doubling's or halving-doubling's sendrecv) sends what
        # it held before.
        forward = has_send and has_recv and s["_send"] == s["_recv"] and not s.get("exchange")
        if has_send and not forward and not sent[r]:
            send(r, s)
            sent[r] = True
        if has_recv:
            q = queues[(s["src"], r)]
            if not q:
                return False
            chunks, values = q.popleft()
            if chunks != s["_recv"]:
                raise ValueError(f"{coll}#{num}: r{r} expected {_chunks_text(s['_recv'])} from "
                                 f"r{s['src']} but the next one sent was {_chunks_text(chunks)}")
            for chunk, value in zip(chunks, values):
                mine = state[r][chunk]
                if s["phase"] in reducing and mine is not None and value is not None:
                    state[r][chunk] = mine | value
                else:
                    state[r][chunk] = value
        if forward:
            send(r, s)
        pos[r] += 1
        sent[r] = False
        return True

    snapshots = [("start", [], {r: list(v) for r, v in state.items()})]
    rounds = _rounds(per_rank)
    # last[r][i]: rank r's last step in rounds 0..i (-1: none yet).
    last = {r: [-1] * len(rounds) for r in ranks}
    for i, members in enumerate(rounds):
        for r, k in members:
            last[r][i] = k
    for r in ranks:
        for i in range(1, len(rounds)):
            last[r][i] = max(last[r][i], last[r][i - 1])
    longest = max(len(v) for v in per_rank.values())
    for i, members in enumerate(rounds):
        transfers = []
        # Run every rank up to and including its steps of round i; a rank may have to
        # run ahead when such a step waits on a later step of another rank.
        extra = 0
        while any(pos[r] <= last[r][i] for r in ranks):
            progressed = False
            for r in ranks:
                while pos[r] <= last[r][i] + extra and pos[r] < len(per_rank[r]):
                    s = per_rank[r][pos[r]]
                    if not try_step(r):
                        break
                    progressed = True
                    if s["_send"] is not None:
                        transfers.append((r, f"r{r} {_chunks_text(s['_send'])}->r{s['dst']}"))
            if not progressed:
                if extra >= longest:
                    raise ValueError(f"{coll}#{num}: the steps do not match up (a receive "
                                     "without its send); is a rank's file missing or cut short, "
                                     "or left from another run?")
                extra += 1
        steps = [per_rank[r][k] for r, k in members]
        phases = sorted({s["phase"] for s in steps})
        counts = {s["steps"] for s in steps}
        steps_label = "/".join(str(c) for c in sorted(counts))
        idx = sorted({s["step"] + 1 for s in steps})
        label = f"{'+'.join(phases)} step {'/'.join(map(str, idx))}/{steps_label}"
        transfers.sort(key=lambda t: t[0])
        snapshots.append((label, [t for _, t in transfers],
                          {r: list(v) for r, v in state.items()}))
    return Replay((coll, num, algo, nth), ranks, group, groups, snapshots, chunks, per_rank)


def _rounds(per_rank: dict[int, list[dict[str, Any]]]) -> list[list[tuple[int, int]]]:
    """The rounds of the diagram: lists of (rank, step index). Round i is every rank's
    i-th step, unless the ranks ran different sequences of (phase, step): a rank that
    folds out of recursive doubling or halving-doubling runs only the fold and the
    unfold, while the others exchange in between. Then a round is one (phase, step),
    in the order the ranks ran them, and a rank that has no such step waits."""
    seqs = {r: [(s["phase"], s["step"]) for s in st] for r, st in per_rank.items()}
    distinct = {tuple(q) for q in seqs.values()}
    if len(distinct) == 1 or any(len(set(q)) != len(q) for q in seqs.values()):
        n = max(len(q) for q in seqs.values())
        return [[(r, i) for r in sorted(per_rank) if i < len(per_rank[r])] for i in range(n)]
    order: list[tuple[str, int]] = []
    for q in sorted(distinct, key=len, reverse=True):  # each rank's keys, after their predecessor
        for j, key in enumerate(q):
            if key not in order:
                order.insert(order.index(q[j - 1]) + 1 if j else 0, key)
    at = {key: i for i, key in enumerate(order)}
    rounds: list[list[tuple[int, int]]] = [[] for _ in order]
    for r in sorted(per_rank):
        for k, key in enumerate(seqs[r]):
            rounds[at[key]].append((r, k))
    return rounds


def _chunks_text(chunks: list[int]) -> str:
    if not chunks:
        return "nothing"
    return f"c{chunks[0]}" if len(chunks) == 1 else f"c{chunks[0]}-c{chunks[-1]}"


def _reducing(algo: str) -> tuple[str, ...]:
    # The fold hands an even rank's data to the odd one above it, which adds it
    # (recursive doubling and halving-doubling); recursive doubling's exchanges add too.
    return REDUCING_PHASES + (EXCHANGE_REDUCING if algo in WHOLE_BUFFER_ALGOS + RANGE_ALGOS
                              else ())


def _has_chunks(per_rank: dict[int, list[dict[str, Any]]]) -> bool:
    return any(s.get(k) is not None for st in per_rank.values() for s in st
               for k in ("send_chunk", "recv_chunk"))


def _has_ranges(per_rank: dict[int, list[dict[str, Any]]]) -> bool:
    return any(s.get(k) is not None for st in per_rank.values() for s in st
               for k in ("send_range", "recv_range"))


def _chunk_step(s: dict[str, Any]) -> dict[str, Any]:
    out = dict(s)
    has_send = s.get("send_chunk") is not None and s.get("dst") is not None
    has_recv = s.get("recv_chunk") is not None and s.get("src") is not None
    out["_send"] = [int(s["send_chunk"])] if has_send else None
    out["_recv"] = [int(s["recv_chunk"])] if has_recv else None
    return out


def _whole_buffer(s: dict[str, Any]) -> dict[str, Any]:
    out = dict(s)
    out["_send"] = [0] if s.get("dst") is not None else None
    out["_recv"] = [0] if s.get("src") is not None else None
    out["exchange"] = True
    return out


def _range_steps(per_rank: dict[int, list[dict[str, Any]]]):
    """Steps that record the elements they moved, as chunk lists: the chunks are the
    stretches between every range's ends, so that each range is a run of whole chunks."""
    cuts: set[int] = set()
    for st in per_rank.values():
        for s in st:
            for k in ("send_range", "recv_range"):
                if s.get(k) is not None:
                    lo, hi = s[k]
                    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi):
                        raise ValueError(f"r{s.get('rank')}: a step's {k} {s[k]!r} is not a "
                                         "range of elements: the file was edited")
                    cuts.update((lo, hi))
    edges = sorted(cuts | {0})
    chunks = list(zip(edges, edges[1:]))

    def covered(rng) -> list[int]:  # an empty range covers no chunk
        lo, hi = rng
        return [i for i, (a, b) in enumerate(chunks) if lo <= a and b <= hi]

    out = {}
    for r, st in per_rank.items():
        steps = []
        for s in st:
            t = dict(s)
            has_send = s.get("dst") is not None and s.get("send_range") is not None
            has_recv = s.get("src") is not None and s.get("recv_range") is not None
            t["_send"] = covered(s["send_range"]) if has_send else None
            t["_recv"] = covered(s["recv_range"]) if has_recv else None
            t["exchange"] = True  # a sendrecv: what is sent is what was held before
            steps.append(t)
        out[r] = steps
    return out, chunks


def _peers(per_rank: dict[int, list[dict[str, Any]]]) -> set[int]:
    return {p for st in per_rank.values() for s in st for p in (s.get("src"), s.get("dst"))
            if p is not None}


def group_size(per_rank: dict[int, list[dict[str, Any]]]) -> int | None:
    """The size of the communicators a call ran on, when they were smaller than the set
    of ranks that recorded it (tensor- or data-parallel groups: every group counts its
    own ``all_reduce#1``); None when it ran on one communicator of exactly those ranks.

    For steps that do not say which group they ran on (a version-1 file): they name
    peers by their rank within the call's communicator, so ranks that nobody names (or
    peers that recorded nothing) give the groups away."""
    everyone, named = set(per_rank), _peers(per_rank)
    if not named or named == everyone:
        return None
    return max(named) + 1


def _check_one_communicator(name: str, per_rank: dict[int, list[dict[str, Any]]]) -> None:
    """Refuse, with the reason, a call whose steps name no group (a version-1 file) and
    that cannot be replayed as one communicator's."""
    k = group_size(per_rank)
    if k is not None and k < len(per_rank):
        raise ValueError(
            f"{name} was recorded by ranks {_ranges(sorted(per_rank))}, but its steps name only "
            f"peers {_ranges(sorted(_peers(per_rank)))}: it ran on several communicators of "
            f"{k} rank(s) (tensor-, data- or pipeline-parallel groups), each counting its own "
            f"{name.split(' ')[0]}, and these steps (a trace of an older mpiring) name peers "
            "by their rank in the group without saying which group, so the groups cannot be "
            "told apart. Record the run again with this mpiring (its traces say each call's "
            "group), or explain a call of the whole job (--list)")
    if k is not None:
        raise ValueError(
            f"{name}: its steps name rank(s) {_ranges(sorted(_peers(per_rank) - set(per_rank)))}"
            f", which have no records for this call: the call ran on a sub-communicator (its "
            f"ranks differ from the trace's, and a trace of an older mpiring does not say "
            f"which), or some rank files are missing")
    _check_step_counts(name, per_rank)


def _check_step_counts(name: str, per_rank: dict[int, list[dict[str, Any]]]) -> None:
    """Refuse ranks of one call that ran rings of different sizes."""
    counts: dict[tuple[str, int], set[int]] = defaultdict(set)
    for r, st in per_rank.items():
        for s in st:
            counts[(s["phase"], s["steps"])].add(r)
    by_phase: dict[str, set[int]] = defaultdict(set)
    for phase, n in counts:
        by_phase[phase].add(n)
    for phase, ns in by_phase.items():
        if len(ns) > 1 and phase in ("reduce-scatter", "all-gather"):
            a, b = sorted(ns)[:2]
            raise ValueError(
                f"{name}: ranks {_ranges(sorted(counts[(phase, a)]))} ran {a} {phase} step(s), "
                f"ranks {_ranges(sorted(counts[(phase, b)]))} {b}: they were rings of different "
                "sizes, so the files come from different runs (an earlier run's files left in "
                "the directory?) or different communicators; trace each run into its own "
                "directory")


def _ranges(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]}"


def check_final(collective: str, ranks: list[int], state,
                group: tuple[int, ...] | None = None) -> list[str]:
    """What is wrong with the final state for this collective (empty when it is right).

    ``group``: the job ranks in the communicator's rank order (chunk i belongs to its
    rank i); default ``ranks``."""
    everyone = frozenset(ranks)
    order = list(group) if group is not None else list(ranks)
    problems = []
    for r in ranks:
        cells = state[r]
        i = order.index(r)
        if collective == "all_reduce" and any(c != everyone for c in cells):
            problems.append(f"r{r} does not hold the full sum of every chunk")
        if collective == "reduce_scatter" and i < len(cells) and cells[i] != everyone:
            problems.append(f"r{r} does not hold chunk {i} fully reduced")
        if collective == "all_gather" and any(
                c != frozenset([order[j]] if j < len(order) else []) for j, c in enumerate(cells)):
            problems.append(f"r{r} does not hold every chunk from its owner")
        if collective == "broadcast" and any(c is None or len(c) != 1 for c in cells):
            problems.append(f"r{r} does not hold every segment of the root's data")
    if collective in ("reduce", "ps") and not any(all(c == everyone for c in state[r])
                                                  for r in ranks):
        problems.append("no rank holds the full reduction")
    return problems


def _where(ranks: list[int], files: list[TraceFile]) -> str:
    """``on 4 ranks`` for a call of the whole job, ``on ranks 1, 2, 3`` for a group's."""
    if ranks == job_ranks(files):
        return f"on {len(ranks)} ranks"
    return f"on ranks {_ranges(ranks)}"


def _groups_line(group: tuple[int, ...], groups: list[tuple[int, ...]]) -> list[str]:
    if len(groups) <= 1:
        return []
    return [f"group {groups.index(group) + 1} of the {len(groups)} that made this call: "
            f"{_groups_text(groups)} (--rank R explains the group of job rank R)"]


def _exchanges(name: str, algo: str, per_rank: dict[int, list[dict[str, Any]]],
               where: str) -> str:
    """Who sent how many bytes to whom, round by round: for steps that do not say which
    part of the buffer moved (halving-doubling's, in a version-1 file), so that a
    replay of chunk contents would be made up."""
    ranks = sorted(per_rank)
    out = [f"{name} ({algo}) {where}: its steps record who exchanged how many "
           "bytes with whom, not which chunks, so the chunk table is not replayed", ""]
    for i in range(max(len(st) for st in per_rank.values())):
        moves = []
        for r in ranks:
            if i < len(per_rank[r]):
                s = per_rank[r][i]
                if s.get("dst") is not None:
                    moves.append(f"r{r}->r{s['dst']} {s.get('bytes_sent', 0)} B")
        label = ", ".join(sorted({f"{per_rank[r][i]['phase']} {per_rank[r][i]['step'] + 1}/"
                                 f"{per_rank[r][i]['steps']}" for r in ranks
                                 if i < len(per_rank[r])}))
        out.append(f"round {i + 1} ({label}): " + ("  ".join(moves) or "receives only"))
    out.append("")
    out.append("result: not checked (the steps carry no chunk numbers)")
    return "\n".join(out)


def explain(files: list[TraceFile], collective: str | None = None, call: int | None = None,
            nth: int | None = None, rank: int | None = None) -> str:
    """The lecture's step diagram for one traced call, as text.

    Args:
        files: from ``load``.
        collective: which collective (default: the first traced call), or
            "pipeline" (the default when the trace holds a pipeline run): the
            lecture's diagram of one pipeline step.
        call: its call number (``all_reduce#3`` is call 3); the step, for "pipeline"
            (default: the last).
        nth: the n-th call of that name (another communicator's with the same number).
        rank: for a call made by several groups (each tensor-parallel group's
            ``all_reduce#1``), the group holding this job rank (default: the group
            of the lowest rank). Rows are job ranks.
    """
    if collective == "pipeline" or (collective is None and has_pipeline(files)):
        from mpiring.tools import pipeline_trace

        return pipeline_trace.explain(files, call)
    coll, num, algo, nth, _ = _pick(files, collective, call, nth)
    name = call_name(coll, num, nth)
    group, per_rank, groups = _select(files, (coll, num, algo, nth), rank)
    if (algo not in WHOLE_BUFFER_ALGOS and not _has_chunks(per_rank)
            and not _has_ranges(per_rank)):
        if group is None:
            _check_one_communicator(name, per_rank)
        lines = _groups_line(group, groups) if group is not None else []
        text = _exchanges(name, algo, per_rank, _where(sorted(per_rank), files))
        return "\n".join(lines + [text]) if lines else text
    rp = replay_group(files, coll, num, nth + 1, rank)
    ranks, snaps = rp.ranks, rp.snapshots
    everyone = frozenset(ranks)
    nchunks = len(snaps[0][2][ranks[0]])
    sizes = sorted({max(s.get("bytes_sent", 0), s.get("bytes_recv", 0))
                    for st in rp.per_rank.values() for s in st})
    size_text = "/".join(str(b) for b in sizes[:4]) + (" ..." if len(sizes) > 4 else "")
    out = [f"{name} ({algo}) {_where(ranks, files)}, {nchunks} chunk(s), {size_text} B "
           "per message"]
    out += _groups_line(rp.group, rp.groups)
    if rp.chunks is not None:  # the chunks are the stretches the steps moved
        out.append("chunks (elements): " + "  ".join(f"c{i} [{a}, {b})"
                                                     for i, (a, b) in enumerate(rp.chunks)))
    if list(rp.group) != ranks:  # a group whose rank order is not its job ranks' order
        out.append("communicator ranks 0.." + f"{len(ranks) - 1} are job ranks "
                   + ", ".join(map(str, rp.group)))
    out.append("cell: the ranks whose data that chunk of that rank contains "
               f"({'ALL' if len(ranks) > 1 else 'its own'} = every rank; . = not held yet)")
    out.append("")
    for label, transfers, state in snaps:
        out.append(label + (": " + "  ".join(transfers) if transfers else ""))
        out += _table(state, everyone)
        out.append("")
    problems = check_final(coll, ranks, snaps[-1][2], rp.group)
    out.append("result: " + ("as the collective promises" if not problems else
                             "; ".join(problems)))
    return "\n".join(out)
