"""Deadlines for blocking waits, and a stall report instead of a hang.

Every communicator owns an ``Activity``: a small record of what it is doing.
The communicator writes the collective and call number when a call starts, the
ring code reports each finished step through the ``CallTrace`` interface it
already calls (``Activity.step``), and the backend stamps the record around
every blocking call (``blocked(what, peer)`` before, ``since = 0.0`` after).
That is a few attribute stores per blocking call: the hot path pays nothing
else.

One daemon thread per process (the monitor) wakes a few times a second, looks
at every live record and, when a blocking call has lasted longer than its
communicator's deadline, prints a report in the spirit of Horovod's stall
inspector and aborts the whole job::

    [r3] mpiring stall: all_reduce#12 (algo ring, 4 ranks) reduce-scatter step 2/3:
    blocked 300.0 s in Wait for data from r2 (deadline 300 s) ...

Each record is written only by the thread that runs the communicator's
collectives and read by the monitor; a record per communicator keeps a second
thread (the DDP communication thread on a ``dup()``ed communicator) from
overwriting the main thread's. Reads are single attribute loads, so the worst
a race can do is describe a wait that ended a moment ago: the monitor confirms
the same wait is still in progress (same start stamp) before it aborts.

Deadline: ``mpiring.init(timeout=SECONDS)``, ``Communicator.timeout``, or the
environment variable ``MPIRING_TIMEOUT`` (seconds; ``0`` or ``off`` disables);
default ``DEFAULT_TIMEOUT``. The deadline bounds one blocking wait, not a whole
collective: a large AllReduce that keeps making progress never trips it.

Why 300 s by default. Horovod's stall inspector warns after 60 s and by default
never shuts down; torch's NCCL watchdog aborts after 10 minutes (gloo: 30).
A wait legitimately lasts tens of seconds to minutes when one rank does what
the others do not: rank 0 writing a checkpoint or evaluating while the others
wait in the next collective, a first call that compiles (torch.compile), a
slow shared filesystem. 60 s would abort such jobs; 10 minutes leaves a user
staring at a hung job long after it is obvious. The failures that can be
recognised do not wait for the deadline at all: an uncaught exception on any
rank aborts the job at once, and a rank that exits while the others wait for
it is reported ``EXIT_GRACE`` seconds after its exit notice arrives
(``mpiring.backends.lifecycle``, ``watch_exits``). What remains for the
deadline is a rank that is alive but stuck (a sleep, a deadlock inside one
call, a lost message; ranks that wait on each other in different calls are
named within seconds by ``mpiring.runtime.desync``, ``watch_waits``), where 300 s ends the job within five minutes while leaving room for
the slow cases above; tests and interactive runs set ``MPIRING_TIMEOUT=10``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable

from mpiring.runtime import desync
from mpiring.runtime.trace import flush_all

#: Seconds one blocking wait may last before the job is aborted.
DEFAULT_TIMEOUT = 300.0
#: Exit status of a job aborted by the watchdog (the convention of timeout(1)).
STALL_EXIT_CODE = 124
#: Seconds to wait for MPI_Abort to end the process before exiting directly.
ABORT_GRACE = 10.0
#: Seconds between writing a report and MPI_Abort: the abort makes the launcher
#: kill every process at once, and output still in its pipes can be lost.
REPORT_GRACE = 0.5
#: Seconds a collective may still wait after a rank of its communicator announced
#: that it exited (``mpiring.backends.lifecycle``): its last messages, already
#: sent, arrive within that; a wait that outlasts it can never end.
EXIT_GRACE = 2.0
#: The file descriptor reports are written to: stderr. Written with os.write, so a
#: report gets out of a process whose Python buffers an abort would drop; a runner
#: that redirects fd 2 into a file of its own (pytest's capture, which an abort never
#: reads back) points this at a copy of the real stderr.
REPORT_FD = 2

now = time.monotonic

# The phases each ring collective goes through, in order (the names its ring
# code passes to ``trace.step``); used only to name the step in progress.
PHASES = {
    "all_reduce": ("reduce-scatter", "all-gather"),
    "reduce_scatter": ("reduce-scatter",),
    "all_gather": ("all-gather",),
    "broadcast": ("broadcast",),
    "reduce": ("reduce",),
}
# Phases whose step count is K-1 (the others depend on the chunk count).
_RING_PHASES = ("reduce-scatter", "all-gather")


P2P = desync.P2P  # the Communicator's public point-to-point calls


def parse_timeout(value: float | str | None, default: float = DEFAULT_TIMEOUT) -> float:
    """Seconds as a float; ``None`` means ``MPIRING_TIMEOUT`` or the default; 0 disables.

    ``value`` may be a number, a string of seconds (``"300"``, ``"300s"``, ``"off"``)
    or a ``datetime.timedelta``.

    Raises:
        ValueError: not a number of seconds (the message names the fix).
    """
    source = "timeout"
    if hasattr(value, "total_seconds"):  # a datetime.timedelta, as torch.distributed takes
        value = value.total_seconds()
    if value is None:
        value = os.environ.get("MPIRING_TIMEOUT", "")
        source = "MPIRING_TIMEOUT"
        if value.strip() == "":  # set but empty (VAR= in a launch line): the default
            return float(default)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("off", "none", "inf", "never"):
            return 0.0
        try:
            value = float(text.removesuffix("s"))
        except ValueError:
            raise ValueError(f"{source}={value!r} is not a number of seconds: use e.g. 300, "
                             "or 0 / off to disable the deadline") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or value < 0:
        raise ValueError(f"{source}={value!r}: give a non-negative number of seconds "
                         "(0 disables the deadline)")
    return 0.0 if value == float("inf") else float(value)


class Activity:
    """What one communicator is doing right now, for the stall monitor.

    Attributes written by the communicator's thread:
        collective, call, algo: the collective in progress (``name#call``).
        phase, step_done, steps: the last ring step that finished (phase ``None``
            before the first one of this call).
        what, peer: the blocking call in progress and the rank it waits for
            (``None``: every rank, as in an Allgather).
        since: ``time.monotonic()`` when that call began; 0.0 when not blocked.
        recv_peer: source of the last posted receive (what a ``Wait`` waits for).
        thread: ident of the thread that started the collective.
        name: the communicator's name (set by the Communicator, read by the
            desync detector).
    """

    enabled = False  # as a CallTrace it records nothing to files (see ``inner``)

    def __init__(self, rank: int, size: int, *, timeout: float = DEFAULT_TIMEOUT,
                 world_ranks: list[int] | None = None,
                 abort: Callable[[int], None] | None = None, watch: bool = True):
        self.rank = rank
        self.size = size
        self.timeout = timeout
        # Peer numbers are ranks of this communicator; the report also gives the
        # world rank when they differ (sub-communicators).
        self.world_ranks = world_ranks
        self.abort = abort if abort is not None else os._exit
        self.collective: str | None = None
        self.call = 0
        self.algo: str | None = None
        self.phase: str | None = None
        self.step_done = -1
        self.steps = 0
        self.what: str | None = None
        self.peer: int | None = None
        self.recv_peer: int | None = None
        self.since = 0.0
        self.thread = 0
        #: The communicator's name, the same on every rank (``Communicator.name``);
        #: None: unnamed, its waits are left out of desync detection.
        self.name: str | None = None
        self.inner = None
        if watch:
            register(self)

    # --- written by the communicator's thread ----------------------------------
    def begin(self, collective: str, call: int, algo: str | None) -> None:
        """A new collective call starts (before its argument check)."""
        self.collective = collective
        self.call = call
        self.algo = algo
        self.phase = None
        self.step_done = -1
        self.thread = threading.get_ident()

    def steps_to(self, inner):
        """Use this record as the call's ``CallTrace``, forwarding steps to ``inner``."""
        self.inner = inner
        self.enabled = inner.enabled
        return self

    def step(self, phase: str, step: int, steps: int, *, send_chunk=None, dst=None,
             recv_chunk=None, src=None, bytes_sent=0, bytes_recv=0,
             t_start=0.0, t_recv=0.0, t_end=0.0, send_range=None, recv_range=None) -> None:
        """CallTrace interface: the ring code finished ``step`` of ``phase``."""
        # Named parameters, not **fields: with tracing off this runs once per ring
        # step, and packing the fields into a dict doubled its cost.
        self.phase = phase
        self.step_done = step
        self.steps = steps
        if self.enabled:
            self.inner.step(phase, step, steps, send_chunk=send_chunk, dst=dst,
                            recv_chunk=recv_chunk, src=src, bytes_sent=bytes_sent,
                            bytes_recv=bytes_recv, t_start=t_start, t_recv=t_recv, t_end=t_end,
                            send_range=send_range, recv_range=recv_range)

    def ring(self, bounds, itemsize: int, left: int, right: int) -> Activity:
        """CallTrace interface: the ring's geometry (kept by the trace, when it is on)."""
        if self.enabled:
            self.inner.ring(bounds, itemsize, left, right)
        return self

    def chunk_step(self, phase: str, step: int, steps: int, send_chunk: int, recv_chunk: int,
                   t_start: float, t_recv: float) -> None:
        """CallTrace interface: a ring step moved chunk ``send_chunk`` out, ``recv_chunk`` in."""
        self.phase = phase
        self.step_done = step
        self.steps = steps
        if self.enabled:
            self.inner.chunk_step(phase, step, steps, send_chunk, recv_chunk, t_start, t_recv)

    def blocked(self, what: str, peer: int | None) -> None:
        """A blocking call starts; the backend sets ``since = 0.0`` when it returns."""
        self.what = what
        self.peer = peer
        self.since = now()

    # --- read by the monitor ----------------------------------------------------
    def current_step(self) -> str:
        """The ring step in progress, e.g. ``reduce-scatter step 2/3``, or ''."""
        if self.algo == "native" or self.collective is None:
            return ""
        # The phase table describes the lecture's ring algorithms; for any other
        # algorithm only the steps it reported are known.
        phases = PHASES.get(self.collective) if self.algo in ("ring", "pipelined") else None
        ring_steps = self.size - 1
        if self.phase is None:
            if not phases:
                return "first step"
            first = phases[0]
            return _fmt_step(first, 0, ring_steps if first in _RING_PHASES else None)
        if self.step_done + 1 < self.steps:
            return _fmt_step(self.phase, self.step_done + 1, self.steps)
        if phases and self.phase in phases and phases.index(self.phase) + 1 < len(phases):
            nxt = phases[phases.index(self.phase) + 1]
            return _fmt_step(nxt, 0, ring_steps if nxt in _RING_PHASES else None)
        done = f"after {_fmt_step(self.phase, self.step_done, self.steps)}"
        return f"{done} (finishing)" if phases else done

    def _who(self, peer: int) -> str:
        text = f"r{peer}"
        if self.world_ranks is not None and 0 <= peer < len(self.world_ranks) \
                and self.world_ranks[peer] != peer:
            text += f" (world rank {self.world_ranks[peer]})"
        return text

    def report(self, at: float | None = None, since: float | None = None) -> str:
        """The stall report: which collective, which step, which peer, how long."""
        at = now() if at is None else at
        since = self.since if since is None else since
        waited = at - since if since else 0.0
        me = f"[r{self.rank}]"
        # Call 0: a wait outside the numbered calls (mpiring.init's agreement).
        where = (f"{self.collective}#{self.call}" if self.collective and self.call
                 else self.collective or "a blocking call")
        if self.collective and self.algo:
            where += f" (algo {self.algo}, {self.size} ranks)"
        if self.collective in P2P:  # a public message: the wait names it
            stage = ""
        elif self.peer is not None:  # point-to-point: a ring step
            stage = self.current_step()
        elif self.what in ("Allgather", "Allgatherv") and self.collective in PHASES:
            stage = "argument check (before any data moves)"
        else:  # a native collective, barrier, split...
            stage = ""
        if stage:
            where += f" {stage}"
        if self.peer is None and self.collective in P2P:  # a receive from any source
            whom = "waiting for a matching send from any rank"
            hint = ("no rank has sent this rank a message with this tag: they are slow, "
                    "stuck, dead, or using another tag or communicator")
        elif self.peer is None:
            whom = f"waiting for every rank of the {self.size}-rank communicator"
            hint = ("some rank has not reached this call: it is slow, stuck, dead, or "
                    "calling a different collective")
        elif self.collective in P2P and (self.what or "").startswith("Wait(shared slot"):
            whom = f"waiting for {self._who(self.peer)} to write this slot"
            hint = (f"{self._who(self.peer)} has not written this shared-memory slot for this "
                    "step: it is slow, stuck, dead, or in another step")
        elif self.collective in P2P:
            other = "receive" if self.collective == "send" else "send"
            whom = f"waiting for the matching {other} on {self._who(self.peer)}"
            hint = (f"{self._who(self.peer)} has not posted a {other} with this tag for this "
                    "rank: it is slow, stuck, dead, or using another tag or peer")
        else:
            direction = "sending to" if self.what == "Send" else "waiting for data from"
            whom = f"{direction} {self._who(self.peer)}"
            hint = (f"{self._who(self.peer)} has not done its part of this step: it is "
                    "slow, stuck, dead, or running a different collective")
        lines = [
            f"{me} mpiring stall: {where}: blocked {waited:.1f} s in {self.what}, "
            f"{whom} (deadline {self.timeout:g} s)",
            f"{me} {hint}. Aborting the job (exit {STALL_EXIT_CODE}). If this wait is "
            "legitimately slow, raise the deadline: mpiring.init(timeout=SECONDS) or "
            "MPIRING_TIMEOUT=SECONDS.",
        ]
        frame = sys._current_frames().get(self.thread)
        if frame is not None:
            try:
                stack = traceback.format_stack(frame)[-8:]
            except Exception:  # noqa: BLE001
                # The walk runs in this thread while the other may run on between its
                # steps; a frame it returned from can then read as garbage (CPython
                # 3.11 gave a dict for f_back once), and the report matters more.
                stack = ["  (its stack changed while it was being read: the thread moved on)\n"]
            lines.append(f"{me} stack of the stalled thread (most recent call last):")
            lines.append("".join(stack).rstrip())
        return "\n".join(lines) + "\n"


def _fmt_step(phase: str, index: int, total: int | None) -> str:
    return f"{phase} step {index + 1}/{total}" if total else f"{phase} step {index + 1}"


# --- the monitor thread -----------------------------------------------------------
_lock = threading.Lock()
_records: weakref.WeakSet[Activity] = weakref.WeakSet()
_thread: threading.Thread | None = None
_wake = threading.Event()
_fired = False
_exit_probes: list[Callable[[], list[int]]] = []
_exited: dict[int, float] = {}  # world rank -> when its exit notice arrived
_detector = None  # mpiring.runtime.desync.Detector, once a multi-rank job installs one


def watch_waits(detector) -> None:
    """Run ``detector.check`` (``mpiring.runtime.desync``) on every wake-up: ranks
    blocked in different calls that wait on each other are reported within seconds
    and the job aborted, whatever the deadline."""
    global _detector
    with _lock:
        _detector = detector
        if _thread is None:
            _start()


def watch_exits(probe: Callable[[], list[int]]) -> None:
    """Ask ``probe()`` on every wake-up for world ranks that exited since the last call.

    A record blocked in a collective of a communicator that includes an exited
    rank for more than ``EXIT_GRACE`` seconds after the notice is reported and
    the job aborted, whatever the deadline (that wait cannot end).
    """
    with _lock:
        _exit_probes.append(probe)
        if _thread is None:
            _start()


def _start() -> None:
    global _thread
    _thread = threading.Thread(target=_monitor, name="mpiring-watchdog", daemon=True)
    _thread.start()


def waiting_on_exited(at: float, records: list[Activity] | None = None,
                      exited: dict[int, float] | None = None) -> list[tuple[Activity, float, int]]:
    """The records blocked in a collective that an exited rank will never join:
    (record, its wait's start stamp, the exited world rank)."""
    exited = _exited if exited is None else exited
    if not exited:
        return []
    late = []
    for act in _watched(records):
        since = act.since
        if not since or act.collective in P2P:  # a message between two live ranks may wait
            continue
        members = act.world_ranks if act.world_ranks is not None else range(act.size)
        for rank, when in exited.items():
            if rank in members and at - max(since, when) > EXIT_GRACE:
                late.append((act, since, rank))
                break
    return late


def exit_report(act: Activity, rank: int, at: float, since: float, when: float) -> str:
    """The stall report, with the line that says which rank left and when."""
    first, rest = act.report(at, since).split("\n", 1)
    return (f"{first}\n[r{act.rank}] world rank {rank} exited {at - when:.1f} s ago and "
            "will never join this call: it skipped a call that this rank makes, or "
            f"ended early.\n{rest}")


def _watched(records: list[Activity] | None) -> list[Activity]:
    if records is not None:
        return records
    with _lock:
        return list(_records)


def register(activity: Activity) -> None:
    """Watch ``activity``; starts the monitor thread on first use."""
    with _lock:
        _records.add(activity)
        if _thread is None:
            _start()
    _wake.set()  # re-read the deadlines (a shorter one shortens the poll period)


def expired(at: float, records: list[Activity] | None = None) -> list[tuple[Activity, float]]:
    """The records (default: every watched one) whose blocking call has outlived its
    deadline at time ``at``, each with that call's start stamp."""
    late = []
    for act in _watched(records):
        since = act.since
        if since and act.timeout > 0 and at - since > act.timeout:
            late.append((act, since))
    return late


def _period() -> float:
    with _lock:
        timeouts = [a.timeout for a in _records if a.timeout > 0]
    # A tenth of the shortest deadline (the report is late by at most that), at
    # most one wake-up a second.
    return min([1.0] + [max(0.02, t / 10) for t in timeouts])


def _monitor() -> None:
    while True:
        _wake.wait(_period())
        _wake.clear()
        at = now()
        for probe in list(_exit_probes):
            try:
                for rank in probe():
                    _exited.setdefault(rank, now())
            except Exception:  # noqa: BLE001 - a broken probe must not stop the deadlines
                _exit_probes.remove(probe)
        for act, since, rank in waiting_on_exited(at):
            if act.since == since:
                fire(act, exit_report(act, rank, at, since, _exited[rank]))
        _check_desync(at)
        for act, since in expired(at):
            try:
                text = act.report(at, since)
            except Exception as exc:  # noqa: BLE001 - a broken report must not save the hang
                text = (f"[r{act.rank}] mpiring stall: a blocking call outlived its deadline "
                        f"({act.timeout:g} s); the report failed ({exc!r}). Aborting the job "
                        f"(exit {STALL_EXIT_CODE}).\n")
            if act.since == since:  # still the same wait: not a race with its end
                fire(act, text)


def _check_desync(at: float) -> None:
    global _detector
    detector = _detector
    try:
        probe = desync.probe_seconds()
    except ValueError:  # checked at init; changed since by the program itself
        probe = desync.PROBE
    if detector is None or not probe or _fired:
        return
    records = _watched(None)
    try:
        text = detector.check(records, at, probe)
    except Exception as exc:  # noqa: BLE001 - a broken detector must not stop the deadlines
        _detector = None
        os.write(REPORT_FD,
                 f"[r{detector.rank}] mpiring: desync detection stopped: {exc!r}\n".encode())
        return
    if text is None or not records:
        return
    me = f"[r{detector.rank}]"
    stack = desync.stack_of(records)
    report = (f"{me} {text}\n{me} Aborting the job (exit {STALL_EXIT_CODE}); "
              "MPIRING_DESYNC=off turns this detector off.\n")
    if stack:
        report += f"{me} stack of the waiting thread(s) (most recent call last):\n{stack}\n"
    # Long enough for every other rank's monitor to wake, read the report and print it.
    fire(records[0], report, grace=REPORT_GRACE + min(1.0, _period()))


def fire(act: Activity, text: str, grace: float = REPORT_GRACE) -> None:
    """Print the stall report and abort the job; exits directly if the abort hangs."""
    global _fired
    if _fired:
        return
    _fired = True
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the report matters more than stdout
        pass
    os.write(REPORT_FD, text.encode(errors="replace"))
    flush_all()  # the trace up to the stall is what explains it
    time.sleep(grace)
    backstop = threading.Timer(ABORT_GRACE, os._exit, args=(STALL_EXIT_CODE,))
    backstop.daemon = True
    backstop.start()
    act.abort(STALL_EXIT_CODE)
