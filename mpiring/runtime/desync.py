"""Desync detection: ranks blocked in different calls that wait on each other.

When one rank waits in a collective on communicator A while its peer waits in
another call (on communicator B, or another call number on A) for it, neither
can ever proceed. The deadline would end the job minutes later with stall
reports that do not say why; this detector names both waits within seconds.

How (all of it on the watchdog's monitor thread; the hot path pays nothing):

1. Each wake-up, a rank whose blocking waits have not changed for ``PROBE``
   seconds, and whose threads that run collectives are all blocked (in MPI, or
   a DDP main thread waiting for its communication thread, or that thread idle
   waiting for work), is *stuck*. It posts a wait notice to every rank: its
   world rank, a sequence number, and per wait the communicator's name (the
   same on every rank), its members, the call (collective and call number),
   the blocking call, the peer (world ranks; none for a wait on every rank),
   the caller's line, plus hints from DDP (``add_context``). A rank that stops
   being stuck posts a withdrawal with a new sequence number; MPI keeps one
   sender's messages in order, so the newest message from a rank is its state.
2. Every monitor keeps the newest notice of each rank and looks for a set of
   stuck ranks that wait only on each other (the largest such set: a wait on
   one peer needs that peer, a wait on every rank needs each member that is
   not in the same call, and a rank is stuck for good when every rank each of
   its waits needs is in the set). If that set holds waits of different calls,
   and it stays the same (same sequence numbers) for ``CONFIRM`` seconds while
   this rank is one of them, the rank prints the report, sends it to every
   rank (which print it too) and aborts the job.

A slow rank is never reported: it computes, so it is not stuck, and the ranks
waiting on it are not stuck for good. Ranks in one call that wait on each
other (a ring) are left to the deadline (a lost message, not a desync).
Waits on communicators without a name are ignored, as are jobs of one rank.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable

#: Seconds a rank's waits must stay unchanged before it posts a wait notice.
#: Well above the monitor's period (at most 1 s): a notice that a rank has just
#: withdrawn has reached every rank long before a decision rests on it.
PROBE = 3.0
#: Seconds a desync must be seen unchanged before the rank reports it.
CONFIRM = 1.0
#: Seconds a wait must last before the monitor looks at this rank's threads.
OBSERVE = 0.25
#: Members sent per wait; a wait on every rank of a larger communicator is
#: ignored (it cannot be resolved without them).
MAX_MEMBERS = 256

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = os.path.dirname(threading.__file__) + os.sep
_BLOCKING: set = set()  # code objects of functions that block (anywhere on a stack)
_IDLE: set = set()  # code objects whose frame, innermost, means "idle, waiting for work"
_contexts: list[Callable[[], Callable[[], str] | None]] = []


def probe_seconds() -> float:
    """``MPIRING_DESYNC`` (seconds; ``0``/``off`` disables the detector), else ``PROBE``.

    Raises:
        ValueError: a value that is neither a number of seconds nor on/off
            (``mpiring.init`` reads it first, so the error comes there).
    """
    raw = os.environ.get("MPIRING_DESYNC", "")
    text = raw.strip().lower()
    if text in ("", "on"):
        return PROBE
    if text in ("0", "off", "no", "false"):
        return 0.0
    try:
        seconds = float(text.removesuffix("s"))
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"MPIRING_DESYNC={raw!r}: give the probe time in seconds (e.g. 3), "
                         "or off to turn the desync detector off")
    return seconds


def blocking_code(*functions, idle: bool = False) -> None:
    """Register functions whose frames mean "this thread is blocked".

    ``idle=True``: only when the function's frame is the innermost Python frame
    (a worker loop waiting for its next task; deeper frames mean it runs one).
    """
    (_IDLE if idle else _BLOCKING).update(f.__code__ for f in functions)


def add_context(fn: Callable[[], str]) -> None:
    """Ask ``fn()`` for a line about this rank's state to put into its wait notices
    (e.g. DDP's step). A bound method is held weakly."""
    ref = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
    _contexts.append(ref)


def _context() -> list[str]:
    lines = []
    for ref in list(_contexts):
        fn = ref()
        if fn is None:
            _contexts.remove(ref)
            continue
        try:
            text = fn()
        except Exception:  # noqa: BLE001 - a hint must never stop the detector
            text = ""
        if text:
            lines.append(text[:300])
    return lines[:4]


# --- this rank's state -------------------------------------------------------------
def _thread_state(frame) -> tuple[bool, bool]:
    """(runs collectives, blocked) for a thread whose innermost frame is ``frame``."""
    relevant = blocked = False
    innermost = True
    while frame is not None:
        code = frame.f_code
        if code in _BLOCKING:
            return True, True
        if code in _IDLE:
            relevant = True
            blocked = blocked or innermost
        if not code.co_filename.startswith(_STDLIB):
            innermost = False  # threading's own frames (Condition.wait) do not count
        frame = frame.f_back
    return relevant, blocked


def _user_code(frame) -> bool:
    while frame is not None:
        if not _library(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


def _library(filename: str) -> bool:
    # mpiring, the standard library and installed packages (torch's wrappers):
    # the caller's line is the first frame outside them.
    return (filename.startswith((_PACKAGE, _STDLIB)) or "site-packages" in filename
            or "dist-packages" in filename)


def _site(frame, ident: int) -> str:
    while frame is not None and _library(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        thread = next((t for t in threading.enumerate() if t.ident == ident), None)
        return f"in thread {thread.name}" if thread is not None else "inside mpiring"
    return f"at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def stuck_waits(records, at: float, frames: dict | None = None) -> list[dict] | None:
    """This rank's waits if every thread that runs collectives is blocked, else None.

    Each wait: the communicator (name, members), the call, the blocking call,
    the peer (world ranks; None: every rank), the caller's line, its start stamp.
    """
    frames = sys._current_frames() if frames is None else frames
    main = threading.main_thread().ident
    relevant = {main} | {a.thread for a in records if a.thread}
    for ident, frame in frames.items():
        runs, blocked = _thread_state(frame)
        if runs:
            relevant.add(ident)
    for ident in relevant:
        frame = frames.get(ident)
        if frame is not None and not _thread_state(frame)[1]:
            return None  # a thread computes: it may still make the call the others wait for
    for ident, frame in frames.items():
        # A thread running the user's own code (any frame of its stack outside
        # mpiring, the standard library and installed packages) that has made no
        # collective yet may still make the call the others wait for: the rank is
        # not stuck. Library threads (timers, progress bars) do not count.
        if ident not in relevant and _user_code(frame):
            return None
    waits = []
    for act in records:
        since = act.since
        if not since or act.name is None:
            continue
        world = act.world_ranks if act.world_ranks is not None else list(range(act.size))
        peer = act.peer
        waits.append({
            "c": act.name, "m": list(world) if len(world) <= MAX_MEMBERS else None,
            "k": act.collective or "control call", "n": act.call, "w": act.what,
            "p": world[peer] if peer is not None and 0 <= peer < len(world) else None,
            "s": _site(frames.get(act.thread), act.thread), "since": since,
        })
    return waits or None


# --- the graph ------------------------------------------------------------------------
#: The Communicator's public point-to-point calls, as ``Activity.collective``.
P2P = ("send", "recv")


def _call(w: dict) -> tuple:
    return (w["c"], tuple(w["m"] or ()), w["k"], w["n"])


def _needs(rank: int, w: dict, notices: dict[int, dict]) -> list[int] | None:
    """The ranks wait ``w`` of ``rank`` needs; None when unknown (never stuck for good)."""
    if w["p"] is not None:
        return [w["p"]]
    if not w["m"]:
        return None
    mine = _call(w)
    return [q for q in w["m"] if q != rank and not any(
        _call(v) == mine for v in (notices.get(q) or {}).get("waits") or ())]


def deadlocked(notices: dict[int, dict]) -> set[int]:
    """The largest set of stuck ranks each of whose waits needs only ranks of the set."""
    dead = {r for r, n in notices.items() if n.get("waits")}
    changed = True
    while changed:
        changed = False
        for r in sorted(dead):
            for w in notices[r]["waits"]:
                need = _needs(r, w, notices)
                # Every rank it needs must be stuck too: a wait for all members of
                # a rooted call (Bcast, Reduce) may need a member that computes
                # while another has left the call early and waits for us elsewhere.
                if not need or not all(q in dead for q in need):
                    dead.discard(r)
                    changed = True
                    break
    return dead


def desync(notices: dict[int, dict]) -> set[int]:
    """The deadlocked ranks, if their waits are in different calls (else empty)."""
    dead = deadlocked(notices)
    waits = [w for r in dead for w in notices[r]["waits"]]
    calls = {_call(w) for w in waits}
    if len(calls) > 1 or any(w["k"] in P2P for w in waits):
        return dead
    return set()


def describe(notices: dict[int, dict], dead: set[int]) -> str:
    """One line naming every wait of the desync, grouped by call, and the likely cause."""
    groups: dict[tuple, list] = {}
    for r in sorted(dead):
        for w in notices[r]["waits"]:
            need = sorted(q for q in (_needs(r, w, notices) or ()) if q in dead)
            key = _call(w)
            entry = groups.setdefault(key, [w, [], set()])
            entry[1].append(r)
            entry[2].update(need)
    parts = []
    for w, ranks, need in groups.values():
        who = " and ".join(f"r{r}" for r in ranks)
        verb = "waits" if len(ranks) == 1 else "wait"
        parts.append(f"{who} {verb} in {w['k']}#{w['n']} on comm {w['c']} ({w['w']}, {w['s']}) "
                     f"for {' and '.join(f'r{q}' for q in sorted(need))}")
    text = ", while ".join(parts) if len(parts) == 2 else "; ".join(parts)
    hints = [f"r{r}: {line}" for r in sorted(dead) for line in notices[r].get("ctx") or ()]
    if all(w["k"] in P2P for r in dead for w in notices[r]["waits"]):
        cause = "a send or receive that the peer never matches (both ranks send, or both " \
                "receive, first?)"
    elif hints:
        cause = "a DDP backward that failed on one rank and was caught, or no_sync() on " \
                "some ranks only?"
    else:
        cause = "a rank skipped or added a call, or the ranks use the communicators in a " \
                "different order?"
    line = f"mpiring desync: {text}: the ranks are in different calls and none can proceed " \
           f"({cause})"
    if hints:
        line += ". " + "; ".join(hints)
    return line


# --- the monitor's part ---------------------------------------------------------------
class Detector:
    """The state one process keeps between wake-ups (see the module docstring).

    Args:
        rank: this process's world rank.
        post: sends a notice (bytes) to every other rank.
        collect: returns the notices (bytes) that arrived since the last call.
    """

    def __init__(self, rank: int, post: Callable[[bytes], None],
                 collect: Callable[[], list[bytes]]):
        self.rank, self.post, self.collect = rank, post, collect
        self.notices: dict[int, dict] = {}
        self.alarm: str | None = None  # a desync another rank reported
        self.seq = 0
        self.posted: tuple | None = None  # the identity of the waits last posted
        self.current: tuple | None = None
        self.since = 0.0  # when this rank's waits were first seen in their present form
        self.candidate: tuple | None = None
        self.seen_at = 0.0

    def _receive(self) -> None:
        for raw in self.collect():
            try:
                note = json.loads(raw.decode())
                rank, seq = int(note["r"]), int(note["seq"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not a notice of ours: never act on it
            if isinstance(note.get("alarm"), str):
                self.alarm = self.alarm or note["alarm"][:4000]
            elif rank != self.rank and seq >= self.notices.get(rank, {}).get("seq", -1):
                self.notices[rank] = note

    def _update(self, waits: list[dict] | None, at: float, probe: float) -> None:
        ident = None if waits is None else tuple(sorted(
            (w["c"], w["k"], w["n"], w["w"], w["p"], w["since"]) for w in waits))
        if ident != self.current:
            self.current, self.since = ident, at
        # Posted only once unchanged for ``probe`` seconds since first seen: any
        # thread of this rank that ran meanwhile, or a wait that ended, resets it.
        mine = ident if ident is not None and at - self.since >= probe else None
        if mine == self.posted:
            return
        self.seq += 1
        self.posted = mine
        note = {"r": self.rank, "seq": self.seq, "waits": None, "ctx": []}
        if mine is not None:
            note["waits"] = [{k: v for k, v in w.items() if k != "since"} for w in waits]
            note["ctx"] = _context()
        self.notices[self.rank] = note
        self.post(json.dumps(note).encode())

    def check(self, records, at: float, probe: float) -> str | None:
        """One wake-up: post this rank's state, read the others'. Returns the
        report when a desync that includes this rank has held for ``CONFIRM``
        seconds, or another rank reported one."""
        self._receive()
        if self.alarm is not None:
            return self.alarm
        # Short waits are the normal case: only a wait that lasts is looked into.
        lasting = any(a.since and at - a.since >= OBSERVE and a.name for a in records)
        self._update(stuck_waits(records, at) if lasting else None, at, probe)
        dead = desync(self.notices) if self.posted is not None else set()
        if self.rank not in dead:
            self.candidate = None
            return None
        key = tuple(sorted((r, self.notices[r]["seq"]) for r in dead))
        if key != self.candidate:
            self.candidate, self.seen_at = key, at
            return None
        if at - self.seen_at < CONFIRM:
            return None
        text = describe(self.notices, dead)
        self.post(json.dumps({"r": self.rank, "seq": self.seq, "alarm": text}).encode())
        return text


def stack_of(records) -> str:
    """The innermost frames of this rank's blocked threads, for the report."""
    frames = sys._current_frames()
    lines = []
    for ident in dict.fromkeys(a.thread for a in records if a.since and a.thread):
        frame = frames.get(ident)
        if frame is not None:
            lines.append("".join(traceback.format_stack(frame)[-10:]).rstrip())
    return "\n".join(lines)
