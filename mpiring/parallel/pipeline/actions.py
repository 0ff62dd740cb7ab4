"""The instruction set a pipeline schedule is written in.

An ``Action`` is one thing one stage does for one micro-batch. Its string form
is torch.distributed.pipelining's ``"{stage}{kind}{mb}"``: ``2F0`` is stage 2's
forward of micro-batch 0, ``1SEND_B3`` stage 1 sending micro-batch 3's input
gradient back to stage 0.

Compute kinds follow the zero-bubble paper:

* ``F``: forward.
* ``B``: backward for the stage's input. When the schedule has no ``W`` for the
  same (stage, micro-batch), ``B`` is the whole backward (input and weights).
* ``W``: backward for the weights, deferred out of ``B`` (zero bubble).

Communication kinds: ``SEND_F``/``RECV_F`` move an activation forward (stage s
to s + 1), ``SEND_B``/``RECV_B`` a gradient backward (s + 1 to s). Consecutive
communication actions on one rank form one group: they are posted together
and all complete before the rank's next compute action.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
_PEER = {SEND_F: 1, RECV_F: -1, SEND_B: -1, RECV_B: 1}
_REGEX = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One stage's step for one micro-batch (``str()``: ``"1F3"``, ``"0RECV_B2"``)."""

    stage: int
    kind: str
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + COMMS:
            raise ValueError(f"unknown action kind {self.kind!r}: use one of "
                             f"{', '.join(COMPUTE + COMMS)}")
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"action {self.kind} stage={self.stage} mb={self.mb}: stage and "
                             "micro-batch are numbered from 0")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    __repr__ = __str__

    @property
    def is_comm(self) -> bool:
        return self.kind in COMMS

    @property
    def peer(self) -> int | None:
        """The stage at the other end of a send or receive (None for compute)."""
        step = _PEER.get(self.kind)
        return None if step is None else self.stage + step

    @property
    def channel(self) -> str | None:
        """"F" for activations, "B" for gradients: one ordered channel each per pair."""
        return self.kind[-1] if self.is_comm else None


def parse(text: str) -> Action:
    """``"1F3"`` -> ``Action(1, "F", 3)``; the inverse of ``str(action)``.

    torch's ``I`` (its backward for the input, beside a ``W``) reads as ``B``: here a
    ``B`` is the input's backward whenever the schedule has the ``W``, and the whole
    backward otherwise, as torch's ``B``.
    """
    m = _REGEX.match(text.strip())
    if m is None:
        raise ValueError(f"cannot read {text!r} as an action: write STAGE KIND MB, "
                         "e.g. 1F3, 0B2, 2W0, 1SEND_F3, 2RECV_B0")
    kind = B if m.group(2) == "I" else m.group(2)
    return Action(int(m.group(1)), kind, int(m.group(3)))


def parse_cell(text: str) -> list[Action]:
    """One cell of a dumped schedule: an action, or torch's overlapped pair
    ``"(0F3;1B2)OVERLAP_F_B"`` (DualPipeV's forward of one stage beside a backward of
    another), read as its actions in order, one after the other, as mpiring runs them."""
    t = text.strip()
    if t.startswith("(") and t.endswith(")OVERLAP_F_B"):
        return [parse(x) for x in t[1:-len(")OVERLAP_F_B")].split(";") if x.strip()]
    return [parse(t)]


def parse_schedule(rows: list[str]) -> list[list[Action]]:
    """One whitespace-separated row of actions per rank, e.g. ``["0F0 0SEND_F0 ..."]``."""
    return [[parse(t) for t in row.split()] for row in rows]


def format_schedule(schedule: list[list[Action]]) -> list[str]:
    """The inverse of ``parse_schedule``: one row of action strings per rank."""
    return [" ".join(str(a) for a in row) for row in schedule]


def groups(program: list[Action]) -> list[list[Action]]:
    """Split one rank's program into runs: a compute action alone, or a group of
    consecutive communication actions (posted together)."""
    out: list[list[Action]] = []
    for a in program:
        if a.is_comm and out and out[-1][0].is_comm:
            out[-1].append(a)
        else:
            out.append([a])
    return out
