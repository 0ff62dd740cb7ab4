"""Print a schedule as the lecture draws it: one line per device, time to the right.

    设备 1: [F1][F2][F3][B1][B2][B3]            bubble 50%
    设备 2:    [F1][F2][F3][B1][B2][B3]         bubble 50%

Each compute action is a box as wide as its time (simulated unit costs, or a
real run's measured spans); blanks are the bubble. Micro-batches are numbered
from 1 as in the lecture (the actions' own strings, ``1F0``, count from 0).
When a device holds several stages (interleaved 1F1B), a prime marks its
second stage, two its third: ``[F1][F2][F1'][F2']``.
"""

from __future__ import annotations

from mpiring.parallel.pipeline.actions import Action
from mpiring.parallel.pipeline.validate import Span, bubble, simulate, unit_costs


def _box(a: Action, width: int, one_based: bool, ranks: int) -> str:
    text = f"{a.kind}{a.mb + (1 if one_based else 0)}" + "'" * (a.stage // ranks)
    if width >= len(text) + 2:
        return "[" + text.ljust(width - 2) + "]"
    return (text + a.kind * width)[:width]  # too narrow for brackets: the name, cut


def draw(spans: list[list[Span]], *, chars_per_unit: float | None = None, width: int = 160,
         one_based: bool = True, label: str = "设备", show_bubble: bool = True) -> str:
    """The per-device timeline of ``spans`` (from ``simulate`` or a measured run).

    Args:
        chars_per_unit: columns per time unit; default: the longest action gets at
            least 4 columns, the whole step at most ``width`` where that allows.
        one_based: number micro-batches from 1, as the lecture does.
        label: the word before each device's number ("设备" as in the lecture).
    """
    t0 = min((s[0].start for s in spans if s), default=0.0)
    t1 = max((s[-1].end for s in spans if s), default=0.0)
    if chars_per_unit is None:
        shortest = min((x.end - x.start for s in spans for x in s if x.end > x.start),
                       default=1.0)
        primes = max((x.action.stage // len(spans) for s in spans for x in s), default=0)
        chars_per_unit = (4.0 + primes) / shortest  # "[F1]" (or "[F1']") fits the shortest
        if (t1 - t0) * chars_per_unit > width:  # a long step: fit the width, boxes shrink
            chars_per_unit = width / max(t1 - t0, 1e-12)
    fractions = bubble(spans)
    lines = []
    for r, row in enumerate(spans):
        line, col = [], 0
        for x in row:
            a, b = round((x.start - t0) * chars_per_unit), round((x.end - t0) * chars_per_unit)
            a = max(a, col)  # rounding must not overlap the box before
            line.append(" " * (a - col) + _box(x.action, max(b - a, 1), one_based, len(spans)))
            col = a + max(b - a, 1)
        text = f"{label} {r + 1}: " + "".join(line)
        if show_bubble:
            end = round((t1 - t0) * chars_per_unit)
            text += " " * max(end - col, 0) + f"  bubble {fractions[r]:.0%}"
        lines.append(text.rstrip() if not show_bubble else text)
    return "\n".join(lines)


def draw_schedule(schedule: list[list[Action]], f: float = 1.0, b: float = 1.0, w: float = 1.0,
                  **kwargs) -> str:
    """Simulate ``schedule`` with costs F=f, B=b, W=w (a whole backward b + w) and draw it."""
    return draw(simulate(schedule, unit_costs(f, b, w)), **kwargs)
