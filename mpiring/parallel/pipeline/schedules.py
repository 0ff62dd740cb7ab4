"""The schedules as data: one short pure generator per schedule, then one lowering pass.

Each generator returns the compute actions of one stage (F, B, W) in the order
that stage runs them; ``build`` adds the sends and receives (``lower``) for every
stage and returns the per-rank programs the validator checks and the runtime
executes. p = number of stages, m = number of micro-batches, i = this stage::

    GPipe   all m forwards, then all m backwards      m in flight on every stage
    1F1B    min(p-1-i, m) forwards (warm-up), then one forward and one backward
            in turn (steady state), then the backwards left (cool-down)
                                                      min(p-i, m) in flight on stage i
    ZB-H1   1F1B's order with the backward split into B (input gradient) and W
            (weight gradient); stage i holds back its first i W's and runs them
            at the end, where 1F1B would wait: bubble (p-1)(F+B-W) instead of
            (p-1)(F+B+W)                              at most p in flight, as 1F1B's stage 0
    PipeDream  1F1B's order; the runtime updates the weights after each
            backward and keeps (stashes) the weights each forward used
    Interleaved 1F1B  v stages per rank (rank r holds stages r, r + p, ...):
            Megatron's virtual pipeline, micro-batches in rounds of p through each
            of the rank's stages in turn; bubble (p-1)/(vm+p-1)  (m a multiple of p)
    Interleaved ZB  the same order, the backward split as in ZB-H1 and rank r's first
            r W's held back to the end; with equal F, B and W a third of the
            interleaved bubble
    ZB-V    two stages per rank in a V (rank r holds r and 2p-1-r, so rank 0 holds
            both ends), the backward split as in ZB-H1; idle only the lead, p-1
            stage forwards, with equal times and m >= 2p   2p stages, 1F1B's stage-0 count
    DualPipeV  DeepSeek's DualPipe cut in half, on ZB-V's V: a forward of one arm
            beside a full backward of the other in the steady state (a pair a GPU
            overlaps), the backward split only where the warm-up and the cool-down
            would wait; m >= 2p
    Looped BFS  v stages per rank as interleaved, breadth first: every micro-batch
            through the rank's first stage, then its second, ...; the backwards
            the other way round                     v*m in flight, GPipe's on every stage

With equal stage times the GPipe and 1F1B bubble is (p-1)/(m+p-1) of the step.
A schedule's programs are per rank; with one stage per rank (every schedule
but those of ``MULTI``) rank i runs stage i. ``stage_ranks`` gives each
stage's rank for a placement: "loop" (r, r + p, ...) or "v" (ZB-V's and
DualPipeV's).
"""

from __future__ import annotations

import csv
import operator
import os

from mpiring.core.chunking import chunk_bounds
from mpiring.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    parse_cell,
)


def gpipe(p: int, m: int, i: int) -> list[Action]:
    """GPipe: every forward, then every backward (in micro-batch order)."""
    return [Action(i, F, k) for k in range(m)] + [Action(i, B, k) for k in range(m)]


def one_f_one_b(p: int, m: int, i: int) -> list[Action]:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    warm = min(p - 1 - i, m)  # the last stage starts its first backward at once
    out = [Action(i, F, k) for k in range(warm)]
    for k in range(m - warm):
        out += [Action(i, F, warm + k), Action(i, B, k)]
    return out + [Action(i, B, k) for k in range(m - warm, m)]


def zb_h1(p: int, m: int, i: int) -> list[Action]:
    """ZB-H1: 1F1B with B and W split; stage i defers its first i W's to the end."""
    warm = min(p - 1 - i, m)
    out = [Action(i, F, k) for k in range(warm)]
    f, w = warm, 0
    for b in range(m):
        if f < m:
            out.append(Action(i, F, f))
            f += 1
        out.append(Action(i, B, b))
        # Holding back i W's keeps i more micro-batches in flight on stage i
        # (p - i + i = p, stage 0's count in 1F1B) and leaves them to fill the
        # cool-down, where stage i would otherwise wait for stage i + 1.
        if b >= i:
            out.append(Action(i, W, w))
            w += 1
    return out + [Action(i, W, k) for k in range(w, m)]


def _rounds(p: int, m: int, r: int, v: int) -> tuple[list[Action], list[Action], int]:
    """Rank r's forwards and backwards in the interleaved order, and the first round's size.

    The forwards go in rounds of p micro-batches (m // p rounds of near-equal size
    when p does not divide m): round 0 through the rank's first stage, then its
    second, ..., then round 1; the backwards in the same order, the stages reversed.
    """
    # Rounds of at least p micro-batches (each stage's first round fills the pipeline),
    # as even as m allows: m // p rounds, sizes differing by one. With a short last
    # round (p = 4, m = 5: 4 + 1) the warm-up no longer covers the loop back to rank 0
    # and the schedule deadlocks; even rounds do not (every p <= 6, v <= 4, m <= 32
    # simulated in the tests).
    rounds = chunk_bounds(m, max(1, m // p))
    order = [(mb, c) for lo, hi in rounds for c in range(v) for mb in range(lo, hi)]
    fwd = [Action(c * p + r, F, mb) for mb, c in order]
    bwd = [Action((v - 1 - c) * p + r, B, mb) for mb, c in order]
    return fwd, bwd, rounds[0][1] - rounds[0][0]


def interleaved_1f1b(p: int, m: int, r: int, v: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline) on rank r.

    Rank r holds the v stages r, r + p, ..., r + (v-1)p of a model cut into vp,
    and runs them in ``_rounds``' order. Each stage is 1/v of a rank's work, so the
    warm-up's wait, (p-1) stage-times in 1F1B, is (p-1)/v of them: the bubble
    shrinks v times, for v times the messages.
    """
    if v == 1:  # one stage per rank: plain 1F1B (Megatron's schedule without interleaving)
        return one_f_one_b(p, m, r)
    fwd, bwd, size = _rounds(p, m, r, v)
    # Megatron's and torch's warm-up: the other v-1 stages' first round, and two
    # forwards per rank downstream (one is in flight each way when the first
    # backward comes round).
    warm = min(len(fwd), (v - 1) * size + 2 * (p - 1 - r))
    out = fwd[:warm]
    for k in range(len(fwd) - warm):
        out += [fwd[warm + k], bwd[k]]
    return out + bwd[len(fwd) - warm:]


def interleaved_zb(p: int, m: int, r: int, v: int) -> list[Action]:
    """Interleaved zero bubble (the zero-bubble paper's ZB-H1 on v stages per rank; torch's
    ScheduleInterleavedZeroBubble) on rank r.

    Interleaved 1F1B's order with each backward split into B and W, as in ZB-H1:
    the warm-up is one forward per rank downstream, not two (a split B comes back
    sooner), and rank r holds back its first r W's, which fill the cool-down where
    it would wait for the ranks after it. With equal F, B and W times the bubble is
    a third of interleaved 1F1B's (tested), with fewer micro-batches in flight.
    """
    if v == 1:
        return zb_h1(p, m, r)
    fwd, bwd, size = _rounds(p, m, r, v)
    warm = min(len(fwd), (v - 1) * size + (p - 1 - r))
    out = fwd[:warm]
    for k, b in enumerate(bwd):
        if warm + k < len(fwd):
            out.append(fwd[warm + k])
        out.append(b)
        if k >= r:  # the W of the backward r places back
            out.append(Action(bwd[k - r].stage, W, bwd[k - r].mb))
    return out + [Action(b.stage, W, b.mb) for b in bwd[max(0, len(bwd) - r):]]


def zb_v(p: int, m: int, r: int, v: int = 2) -> list[Action]:
    """ZB-V (the zero-bubble paper's V schedule, torch's ScheduleZBVZeroBubble) on rank r.

    The model is cut into 2p stages placed in a V: rank r holds stage r (its
    chunk 0, on the way down) and stage 2p-1-r (chunk 1, on the way back), so the
    last stage's activations turn round on rank p-1 without a message, and rank 0
    holds both ends (the loss and the input). Each backward is split into B and W.

    Warm-up: rank r runs 2(p-r)-1 chunk-0 forwards while the first micro-batch goes
    down and back up to it, then alternates chunk 1 and chunk 0 forwards, then
    starts chunk 1's backwards. Steady state: F0, B0+W0 (once chunk 1's gradient
    came round), F1, B1+W1. Cool-down: the backwards left, every W held back to
    the end, where the rank would wait for the gradients coming down. With equal
    F, B and W times and m >= 2p the only idle is the lead: rank p-1 waits p-1
    stage forwards for its first input (tested), half of ZB-H1's (p-1)(F+B-W) on
    stages twice the size. At most 2p stage micro-batches in flight on a rank,
    1F1B's stage-0 count (p micro-batches of a stage twice as large; tested).
    """
    if v != 2:
        raise ValueError(f"ZB-V places 2 stages per rank, not {v}: give stages_per_rank=2")
    down, up = r, 2 * p - 1 - r
    out: list[Action] = []
    done = {F: [0, 0], B: [0, 0]}  # per kind: chunk 0's and chunk 1's count so far

    def run(kind: str, chunk: int, weights: bool = True) -> None:
        k = done[kind][chunk]
        stage = down if chunk == 0 else up
        out.append(Action(stage, kind, k))
        if kind == B and weights:
            out.append(Action(stage, W, k))
        done[kind][chunk] += 1

    def can(kind: str, chunk: int) -> bool:
        if kind == F:
            return done[F][chunk] < m
        # A backward needs its forward; chunk 0's also needs chunk 1's backward before it
        # (the gradient comes down through the V's other arm first).
        return done[B][chunk] < done[F][chunk] and (chunk == 1 or done[B][0] < done[B][1])

    for _ in range(min(m, 2 * (p - r) - 1)):
        run(F, 0)
    for _ in range(r):
        for chunk in (1, 0):
            if can(F, chunk):
                run(F, chunk)
    for _ in range(p - r):
        for kind in (F, B):
            if can(kind, 1):
                run(kind, 1)
    while done[F][0] < m or done[F][1] < m:
        for kind, chunk in ((F, 0), (B, 0), (F, 1), (B, 1)):
            if can(kind, chunk):
                run(kind, chunk)
    held = []
    while done[B][0] < m or done[B][1] < m:
        for chunk in (1, 0):
            if done[B][chunk] < m:
                held.append(Action(down if chunk == 0 else up, W, done[B][chunk]))
                run(B, chunk, weights=False)
    return out + held


def dualpipe_v(p: int, m: int, r: int, v: int = 2) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half; torch's ScheduleDualPipeV) on rank r.

    ZB-V's stages (rank r holds stage r, chunk 0, and 2p-1-r, chunk 1) in the
    eight phases of DeepSeek's reference: chunk-0 forwards while the first
    micro-batch goes down, then both chunks' forwards in turn, then chunk 1's
    first backwards split (B now, its W at once after: the gradient goes back
    sooner); the steady state pairs a forward of one chunk with a full backward
    of the other (F0 B1, F1 B0: the pair DualPipe overlaps on a GPU, its
    all-to-all hidden behind the other's compute; here one runs after the
    other); the cool-down's backwards, split from the middle of the rank's last
    pairs on, with the W's held back to fill the end. Needs m >= 2p (every stage's
    first micro-batch on its way before the steady state).
    """
    if v != 2:
        raise ValueError(f"DualPipeV places 2 stages per rank in a V, not {v}: give "
                         "stages_per_rank=2")
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least one micro-batch per stage, 2p = {2 * p}, "
                         f"not n_microbatches={m}: give more micro-batches, or use zbv")
    down, up = r, 2 * p - 1 - r
    out: list[Action] = []
    nxt = {(F, down): 0, (F, up): 0, (B, down): 0, (B, up): 0}
    held: list[Action] = []  # the split backwards' W's, oldest first

    def run(kind: str, stage: int, split: bool = False) -> None:
        k = nxt[(kind, stage)]
        nxt[(kind, stage)] = k + 1
        out.append(Action(stage, kind, k))
        if split:
            held.append(Action(stage, W, k))

    def weight() -> None:
        if held:
            out.append(held.pop(0))

    for _ in range(2 * (p - 1 - r)):  # 1: chunk 0 fills the way down
        run(F, down)
    for _ in range(r + 1):  # 2: both chunks
        run(F, down)
        run(F, up)
    for _ in range(p - 1 - r):  # 3: chunk 1's first backwards, split
        run(B, up, split=True)
        weight()
        run(F, up)
    for _ in range(m - 2 * p + r + 1):  # 4: the steady state, F0 B1 then F1 B0
        run(F, down)
        run(B, up)
        run(F, up)
        run(B, down)
    for _ in range(p - 1 - r):  # 5: chunk 0's forwards are done
        run(B, up)
        run(F, up)
        run(B, down)
    split, half = False, (r + 1) // 2
    for i in range(r + 1):  # 6: the backwards left, split from the middle on
        # Odd and even ranks start splitting half a pair apart, as in the reference.
        split = split or (i == half and r % 2 == 1)
        run(B, up, split=split)
        split = split or (i == half and r % 2 == 0)
        run(B, down, split=split)
    for _ in range(p - 1 - r):  # 7: a held W, then chunk 0's next backward
        weight()
        run(B, down, split=True)
    while held:  # 8: the W's left
        weight()
    return out


def looped_bfs(p: int, m: int, r: int, v: int) -> list[Action]:
    """Looped BFS (Lamy-Poirier's breadth-first pipeline; torch's ScheduleLoopedBFS) on rank r.

    The interleaved placement (rank r holds stages r, r + p, ...), run breadth
    first: every micro-batch's forward through the rank's first stage, then
    through its second, ..., then the backwards, last stage first, each in
    reverse micro-batch order (torch's). Every micro-batch is in flight on every
    stage at the turn, as in GPipe, and each stage runs its m forwards (and
    backwards) back to back: the order that lets a sharded stage gather its
    weights once per step.
    """
    stages = [c * p + r for c in range(v)]
    out = [Action(s, F, k) for s in stages for k in range(m)]
    return out + [Action(s, B, k) for s in reversed(stages) for k in reversed(range(m))]


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zb_h1, "pipedream": one_f_one_b}
#: Schedules that run several stages per rank (``build``'s ``stages_per_rank``).
MULTI = {"interleaved": interleaved_1f1b, "interleaved-zb": interleaved_zb, "zbv": zb_v,
         "dualpipev": dualpipe_v, "looped-bfs": looped_bfs}
#: Where a multi-stage schedule places its stages (``stage_ranks``); the others: "loop".
PLACEMENT = {"zbv": "v", "dualpipev": "v"}


def stage_ranks(p: int, n: int, placement: str = "loop") -> list[int]:
    """The rank of each of ``n`` stages on ``p`` ranks.

    "loop": stage s on rank s % p (one stage per rank: s; interleaved: r, r + p, ...).
    "v": ZB-V's, 2p stages, rank r holding r and 2p-1-r.
    """
    if placement == "loop":
        return [s % p for s in range(n)]
    if placement == "v":
        if n != 2 * p:
            raise ValueError(f"the V placement holds 2 stages per rank: {2 * p} stages on "
                             f"{p} ranks, not {n}")
        return [s if s < p else 2 * p - 1 - s for s in range(n)]
    raise ValueError(f"unknown placement {placement!r}: use 'loop' or 'v'")


def stages_of(rank: int, p: int, n: int, placement: str = "loop") -> list[int]:
    """The stages ``rank`` holds, in order (``stage_ranks``)."""
    return [s for s, r in enumerate(stage_ranks(p, n, placement)) if r == rank]


def lower(compute: list[Action], p: int) -> list[Action]:
    """Add the communication to one rank's compute actions (``p``: the number of stages).

    A forward receives its input from the stage before (unless it is the first)
    and sends its output on (unless it is the last); a backward receives the
    output's gradient from the stage after and sends its input's gradient back.
    The send after one compute action and the receive before the next end up
    side by side, so they form one group: neighbours exchange in one step
    (Megatron's send_forward_recv_backward) instead of waiting on each other.
    """
    out: list[Action] = []
    for a in compute:
        s = a.stage
        if a.kind == F and s > 0:
            out.append(Action(s, RECV_F, a.mb))
        if a.kind == B and s < p - 1:
            out.append(Action(s, RECV_B, a.mb))
        out.append(a)
        if a.kind == F and s < p - 1:
            out.append(Action(s, SEND_F, a.mb))
        if a.kind == B and s > 0:
            out.append(Action(s, SEND_B, a.mb))
    return out


def as_int(v) -> int | None:
    """``v`` as a plain int if it is an integer of any type (a NumPy integer from a
    config or an arange counts, as torch takes it; bool does not), else None."""
    if isinstance(v, bool):
        return None
    try:
        return int(operator.index(v))
    except TypeError:
        return None


def positive_int(name: str, v) -> int:
    """``v`` as an int (``as_int``), or ValueError naming the fix."""
    n = as_int(v)
    if n is None or n < 1:
        raise ValueError(f"{name}={v!r}: give a positive integer")
    return n


def check_sizes(p: int, m: int) -> tuple[int, int]:
    """(p, m) as ints, or ValueError naming the fix unless both are positive integers."""
    return positive_int("num_stages", p), positive_int("n_microbatches", m)


def build(name: str, p: int, m: int, stages_per_rank: int = 1) -> list[list[Action]]:
    """Every rank's program (compute and communication) for schedule ``name``.

    Args:
        name: "gpipe", "1f1b", "zb" (ZB-H1), "pipedream", or one of several stages per
            rank (``MULTI``): "interleaved", "interleaved-zb", "zbv", "dualpipev" or
            "looped-bfs".
        p: number of ranks (one stage each, or ``stages_per_rank`` for ``MULTI``).
        m: number of micro-batches per step.
        stages_per_rank: v, the stages each rank holds (``MULTI`` only; "zbv" and
            "dualpipev": 2).
    """
    if name not in GENERATORS and name not in MULTI:
        raise ValueError(f"unknown schedule {name!r}: use one of "
                         f"{', '.join([*GENERATORS, *MULTI])}")
    p, m = check_sizes(p, m)
    v = positive_int("stages_per_rank", stages_per_rank)
    if name in MULTI:
        return [lower(MULTI[name](p, m, r, v), p * v) for r in range(p)]
    if v != 1:
        raise ValueError(f"{name} runs one stage per rank, not {v}: use one of "
                         f"{', '.join(map(repr, MULTI))} for several stages per rank")
    return [lower(GENERATORS[name](p, m, i), p) for i in range(p)]


def compute_only(program: list[Action]) -> list[Action]:
    """The compute actions of a program, in order (what the diagram draws)."""
    return [a for a in program if not a.is_comm]


def dump_csv(programs: list[list[Action]], path: str | os.PathLike) -> None:
    """Write every rank's program as CSV: a row per rank, an action per cell (torch's
    ``_dump_csv`` layout), for a spreadsheet or a hand-edited schedule."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        for program in programs:
            writer.writerow([str(a) for a in program])


def load_csv(path: str | os.PathLike) -> list[list[Action]]:
    """Every rank's program from CSV (``dump_csv``'s, or torch's ``_dump_csv``; empty
    cells, torch's idle slots, are skipped; an overlapped pair, ``(0F3;1B2)OVERLAP_F_B``,
    reads as its two actions in order). A file of compute actions only gets its
    sends and receives added (``lower``), as torch's ``compute_only`` format does.
    Give the result to ``PipelineSchedule(stage, m, loss_fn, actions=...)``
    (``placement="v"`` for a ZB-V program): it is checked on every rank before
    anything runs.

    Raises:
        ValueError: a cell that is not an action, naming its row and column.
    """
    programs = []
    with open(path, newline="") as fh:
        for r, row in enumerate(csv.reader(fh)):
            program = []
            for c, cell in enumerate(row):
                if not cell.strip():
                    continue
                try:
                    program += parse_cell(cell)
                except ValueError as exc:
                    raise ValueError(f"{os.fspath(path)}: row {r + 1}, column {c + 1}: "
                                     f"{exc}") from None
            programs.append(program)
    if not any(a.is_comm for program in programs for a in program):
        stages = 1 + max((a.stage for program in programs for a in program), default=0)
        programs = [lower(program, stages) for program in programs]
    return programs
