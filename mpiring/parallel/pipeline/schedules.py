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

With equal stage times the GPipe and 1F1B bubble is (p-1)/(m+p-1) of the step.
"""

from __future__ import annotations

import csv
import os

from mpiring.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
    parse,
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


GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zb_h1, "pipedream": one_f_one_b}


def lower(compute: list[Action], p: int) -> list[Action]:
    """Add the communication to one stage's compute actions.

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


def check_sizes(p: int, m: int) -> None:
    """ValueError naming the fix unless p and m are positive integers."""
    for name, v in (("num_stages", p), ("n_microbatches", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: give a positive integer")


def build(name: str, p: int, m: int) -> list[list[Action]]:
    """Every rank's program (compute and communication) for schedule ``name``.

    Args:
        name: "gpipe", "1f1b", "zb" (ZB-H1) or "pipedream".
        p: number of stages (one per rank).
        m: number of micro-batches per step.
    """
    if name not in GENERATORS:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(GENERATORS)}")
    check_sizes(p, m)
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
    cells, torch's idle slots, are skipped). A file of compute actions only gets its
    sends and receives added (``lower``), as torch's ``compute_only`` format does.
    Give the result to ``PipelineSchedule(stage, m, loss_fn, actions=...)``: it is
    checked on every rank before anything runs.

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
                    program.append(parse(cell))
                except ValueError as exc:
                    raise ValueError(f"{os.fspath(path)}: row {r + 1}, column {c + 1}: "
                                     f"{exc}") from None
            programs.append(program)
    if not any(a.is_comm for program in programs for a in program):
        programs = [lower(program, len(programs)) for program in programs]
    return programs
