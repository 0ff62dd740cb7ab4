"""Check a schedule before anything runs: order, matching, and no deadlock (by simulation).

``check`` refuses a program that could not run: a backward before its forward,
a W before its B, a forward on stage s > 0 without the activation received
first, a send with no receive to match it, messages that would arrive in an
order the receiver does not expect, or a cycle of waits (a deadlock).

``simulate`` plays the programs the way the runtime executes them: compute
actions take their cost; a group of consecutive sends and receives is posted
at once. On MPI a send never holds its rank up (the runtime's isend is waited
for at the end of the step), so the group finishes when each of its receives
has met its send. With ``rendezvous=True`` (NCCL, where a group completes as a
whole) it finishes only when its sends have met their receives too. When no
rank can move and some have actions left, that is a deadlock, and the error
shows where each rank is stuck. A schedule that passes the rendezvous model
passes the other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from mpiring.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    groups,
)


class ScheduleError(ValueError):
    """A schedule that cannot run as written (the message says which action and why)."""


@dataclass
class Span:
    """One executed compute action: what, and when (start, end)."""

    action: Action
    start: float
    end: float


def _fail(rank: int, pos: int, a: Action, why: str) -> ScheduleError:
    return ScheduleError(f"rank {rank}, action #{pos} {a}: {why}")


def num_stages(schedule: list[list[Action]]) -> int:
    """The stages a schedule's programs run: one past the highest, at least one per rank."""
    return max(len(schedule), 1 + max((a.stage for prog in schedule for a in prog), default=0))


def check_order(schedule: list[list[Action]], m: int, stages: int | None = None,
                ranks: list[int] | None = None) -> None:
    """Per rank: F, then B, then (optionally) W for every micro-batch, data before use.

    ``stages``: the number of stages (default: ``num_stages``). ``ranks``: each
    stage's rank (``schedules.stage_ranks``); default: rank r runs stages r, r + p,
    ... (one each with as many stages as ranks).
    """
    p = len(schedule)
    n = num_stages(schedule) if stages is None else stages
    if ranks is None:
        if n % p:
            raise ScheduleError(f"{n} stages on {p} ranks: each rank runs the same number of "
                                f"stages (rank r: r, r + {p}, ...); give a multiple of {p}")
        ranks = [s % p for s in range(n)]
    elif len(ranks) != n or any(not 0 <= x < p for x in ranks):
        raise ScheduleError(f"ranks={ranks}: give the rank (0..{p - 1}) of each of {n} stages")
    for r, program in enumerate(schedule):
        done: set[tuple[int, str, int]] = set()
        for pos, a in enumerate(program):
            if a.stage >= n or ranks[a.stage] != r:
                where = (f"rank {ranks[a.stage]}" if a.stage < n
                         else f"no rank (stages 0..{n - 1})")
                raise _fail(r, pos, a, f"stage {a.stage} runs on {where}, not {r}")
            if a.mb >= m:
                raise _fail(r, pos, a, f"micro-batch {a.mb} out of range: the step has {m}")
            if a.peer is not None and not 0 <= a.peer < n:
                raise _fail(r, pos, a, f"no stage {a.peer} to talk to (stages 0..{n - 1})")
            s = a.stage
            if (s, a.kind, a.mb) in done:
                raise _fail(r, pos, a, "appears twice")
            need = {F: [RECV_F] if s > 0 else [], B: [F] + ([RECV_B] if s < n - 1 else []),
                    W: [B], SEND_F: [F], SEND_B: [B], RECV_F: [], RECV_B: []}[a.kind]
            for k in need:
                if (s, k, a.mb) not in done:
                    raise _fail(r, pos, a, f"needs {s}{k}{a.mb} earlier on this rank")
            done.add((s, a.kind, a.mb))
        for s in (s for s in range(n) if ranks[s] == r):
            for k in range(m):
                want = [F, B] + ([SEND_F] if s < n - 1 else []) + ([SEND_B] if s > 0 else [])
                missing = [f"{s}{x}{k}" for x in want if (s, x, k) not in done]
                if missing:
                    raise ScheduleError(f"rank {r} never runs {', '.join(missing)}")


def unit_costs(f: float = 1.0, b: float = 1.0, w: float = 1.0) -> Callable[[Action, bool], float]:
    """Cost of an action: F=f, split B=b, W=w, a whole backward (B with no W) b + w."""
    def cost(a: Action, split: bool) -> float:
        if a.kind == F:
            return f
        if a.kind == W:
            return w
        return b if split else b + w
    return cost


def simulate(schedule: list[list[Action]], cost: Callable[[Action, bool], float] | None = None,
             *, rendezvous: bool = False, transfer: float = 0.0) -> list[list[Span]]:
    """Run the programs in simulated time; each rank's compute spans, in order.

    Args:
        cost: ``cost(action, split)`` in any time unit (default ``unit_costs()``).
        rendezvous: a send completes only when its receive is posted (NCCL groups).
        transfer: a message's time from its send to its receive's completion (the
            schedule's transfer step; 0: instantaneous).

    Raises:
        ScheduleError: messages that would meet the wrong micro-batch, or a deadlock.
    """
    cost = cost or unit_costs()
    split = {(a.stage, a.mb) for prog in schedule for a in prog if a.kind == W}
    runs = [groups(prog) for prog in schedule]
    pc = [0] * len(schedule)
    clock = [0.0] * len(schedule)
    spans: list[list[Span]] = [[] for _ in schedule]
    # (src stage, dst stage, channel) -> posted sends / receives, in order: [(action,
    # time)]. Each pair of stages talks on tags of its own (the runtime's transport),
    # so only messages between the same two stages must meet in order.
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    posted: dict[int, list[tuple[dict, tuple, int, float]]] = {}  # rank -> its group's entries
    # A message between two stages of one rank (ZB-V's turn) is a hand-over: no
    # transfer, and no rendezvous (its receive comes later in the same program).
    rank_of = {a.stage: r for r, prog in enumerate(schedule) for a in prog}

    def post(r: int, group: list[Action]) -> None:
        entries = []
        for a in group:
            send = a.kind in (SEND_F, SEND_B)
            key = (a.stage, a.peer, a.channel) if send else (a.peer, a.stage, a.channel)
            table = sends if send else recvs
            table[key].append((a, clock[r]))
            local = rank_of.get(a.peer) == r
            if (rendezvous and not local) or not send:
                # A receive is done ``transfer`` after its send; a rendezvous send
                # only needs its receive posted.
                entries.append((recvs if send else sends, key, len(table[key]) - 1,
                                0.0 if send or local else transfer))
        posted[r] = entries

    def matched(r: int) -> float | None:
        t = clock[r]
        for other, key, idx, delay in posted[r]:
            if len(other[key]) <= idx:
                return None
            t = max(t, other[key][idx][1] + delay)
        return t

    moved = True
    while moved:
        moved = False
        for r, run in enumerate(runs):
            while pc[r] < len(run):
                group = run[pc[r]]
                if not group[0].is_comm:
                    a = group[0]
                    end = clock[r] + cost(a, (a.stage, a.mb) in split)
                    spans[r].append(Span(a, clock[r], end))
                    clock[r] = end
                elif r not in posted:
                    post(r, group)
                    continue
                else:
                    t = matched(r)
                    if t is None:
                        break
                    clock[r] = t
                    del posted[r]
                pc[r] += 1
                moved = True
    stuck = [r for r, run in enumerate(runs) if pc[r] < len(run)]
    if stuck:
        where = "; ".join(f"rank {r} waits in {' '.join(map(str, runs[r][pc[r]]))}" for r in stuck)
        raise ScheduleError(f"deadlock: {where}. Reorder the sends and receives (a receive "
                            "must be reachable before the peer's matching send blocks)")
    _check_pairs(sends, recvs)
    return spans


def _check_pairs(sends: dict, recvs: dict) -> None:
    for key in set(sends) | set(recvs):
        s, rcv = sends.get(key, []), recvs.get(key, [])
        for (a, _), (b, _) in zip(s, rcv):
            if a.mb != b.mb:
                raise ScheduleError(f"{a} would be received by {b}: messages between a pair "
                                    "arrive in order, so both sides must list them in the "
                                    "same micro-batch order")
        if len(s) != len(rcv):
            extra = s[len(rcv):] or rcv[len(s):]
            raise ScheduleError(f"{extra[0][0]} has no matching "
                                f"{'receive' if len(s) > len(rcv) else 'send'}")


def check(schedule: list[list[Action]], m: int, stages: int | None = None, *,
          rendezvous: bool = True, ranks: list[int] | None = None) -> list[list[Span]]:
    """Every check, under both send models; returns the unit-cost simulation (MPI's).

    ``stages``: the number of stages, when a rank runs several, and ``ranks``
    each one's rank, when not r, r + p, ... (``check_order``).
    ``rendezvous=False``: the MPI model only (a schedule that runs on MPI alone,
    such as the interleaved one: its sends cross, and only MPI's isend lets them).

    Raises:
        ScheduleError: naming the first action that cannot run, and why.
    """
    check_order(schedule, m, stages, ranks)
    if rendezvous:
        simulate(schedule, rendezvous=True)
    return simulate(schedule)


def bubble(spans: list[list[Span]]) -> list[float]:
    """Per rank: the fraction of the step (first start to last end, over all ranks) idle."""
    t0 = min((s[0].start for s in spans if s), default=0.0)
    t1 = max((s[-1].end for s in spans if s), default=0.0)
    total = t1 - t0
    if total <= 0:
        return [0.0 for _ in spans]
    return [1.0 - sum(x.end - x.start for x in s) / total for s in spans]


def idle_time(spans: list[list[Span]]) -> list[float]:
    """Per rank: the step's length minus this rank's busy time (the bubble in time units)."""
    t0 = min((s[0].start for s in spans if s), default=0.0)
    t1 = max((s[-1].end for s in spans if s), default=0.0)
    return [(t1 - t0) - sum(x.end - x.start for x in s) for s in spans]


def in_flight(program: list[Action]) -> int:
    """Peak number of micro-batches whose activations a rank holds (F done, last backward
    not); with several stages per rank, each stage's micro-batch counts once."""
    split = {(a.stage, a.mb) for a in program if a.kind == W}
    live = peak = 0
    for a in program:
        if a.kind == F:
            live += 1
            peak = max(peak, live)
        elif a.kind == W or (a.kind == B and (a.stage, a.mb) not in split):
            live -= 1
    return peak


def measured_costs(schedule: list[list[Action]], spans: list[list[Span]]
                   ) -> Callable[[Action, bool], float]:
    """A ``simulate`` cost from a real run: each stage's mean F, B (split or whole) and W time."""
    split = {(a.stage, a.mb) for prog in schedule for a in prog if a.kind == W}
    times: dict[tuple[int, str, bool], list[float]] = defaultdict(list)
    for row in spans:
        for s in row:
            a = s.action
            times[(a.stage, a.kind, a.kind == B and (a.stage, a.mb) in split)].append(s.end - s.start)
    means = {k: sum(v) / len(v) for k, v in times.items()}

    def cost(a: Action, sp: bool) -> float:
        return means.get((a.stage, a.kind, sp if a.kind == B else False), 0.0)
    return cost


def replay_costs(spans: list[list[Span]]) -> Callable[[Action, bool], float]:
    """A ``simulate`` cost from a real run: each action's own measured time."""
    times = {s.action: s.end - s.start for row in spans for s in row}
    return lambda a, sp: times.get(a, 0.0)


def predicted_bubble(schedule: list[list[Action]], spans: list[list[Span]], *,
                     transfer: float = 0.0, replay: bool = False) -> list[float]:
    """Per rank: the bubble the schedule predicts from a run's measured times.

    Args:
        transfer: each message's measured time (``simulate``'s transfer step).
        replay: each action's own time instead of its stage's mean F, B or W.
    """
    cost = replay_costs(spans) if replay else measured_costs(schedule, spans)
    return bubble(simulate(schedule, cost, transfer=transfer))
