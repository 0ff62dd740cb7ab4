"""What recursive doubling and halving-doubling share: the fold to a power of two,
the unfold back, the virtual-rank map, and their step recorder.

K not a power of two: with p the largest power of two <= K and rem = K - p, the
2*rem lowest ranks fold in pairs (even r sends its buffer to r+1 and waits), the
p that stay run the power-of-two algorithm under virtual ranks 0..p-1, and each
odd r < 2*rem sends the result back to r-1 at the end.
"""

from __future__ import annotations

from mpiring.runtime.trace import clock


class StepRecorder:
    """``trace.step`` with these algorithms' fields; clock reads only when tracing.

    ``sent``/``got`` are element counts (times ``itemsize`` in the record).
    """

    __slots__ = ("trace", "itemsize", "now")

    def __init__(self, trace, itemsize: int):
        self.trace = trace
        self.itemsize = itemsize
        # Small messages are these algorithms' domain: with tracing off, no clock reads.
        self.now = clock if trace.enabled else _zero

    def __call__(self, phase, i, n, t0, t1, dst=None, src=None, sent=0, got=0):
        if not self.trace.enabled:  # the watchdog still learns which step finished
            self.trace.step(phase, i, n)
            return
        self.trace.step(phase, i, n, dst=dst, src=src, bytes_sent=sent * self.itemsize,
                        bytes_recv=got * self.itemsize, t_start=t0, t_recv=t1, t_end=clock())


def fold(be, x, buffer, reduce, rem: int, record: StepRecorder) -> int:
    """Fold the 2*rem lowest ranks in pairs; return this rank's virtual rank (-1: folded out)."""
    rank = be.rank
    if rank >= 2 * rem:
        return rank - rem
    t0 = record.now()
    if rank % 2 == 0:
        be.send(x, rank + 1)
        record("fold", 0, 1, t0, t0, dst=rank + 1, sent=x.size)
        return -1  # out until the unfold
    be.wait(be.irecv(buffer, rank - 1))
    t1 = record.now()
    reduce(x, buffer)
    record("fold", 0, 1, t0, t1, src=rank - 1, got=x.size)
    return rank // 2


def unfold(be, x, rem: int, record: StepRecorder) -> None:
    """The odd ranks below 2*rem give the result back to the even ones that folded."""
    rank = be.rank
    if rank >= 2 * rem:
        return
    t0 = record.now()
    if rank % 2 == 0:
        be.wait(be.irecv(x, rank + 1))
        record("unfold", 0, 1, t0, record.now(), src=rank + 1, got=x.size)
    else:
        be.send(x, rank - 1)
        record("unfold", 0, 1, t0, t0, dst=rank - 1, sent=x.size)


def real_rank(v: int, rem: int) -> int:
    """Virtual rank among the p that stay -> rank (the odd ones below 2*rem, then the rest)."""
    return 2 * v + 1 if v < rem else v + rem


def _zero() -> float:
    return 0.0
