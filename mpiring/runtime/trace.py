"""Step-by-step trace of the ring collectives.

Off by default, and then nearly free: the collectives call ``CallTrace.step``
once per ring step, and the disabled tracer hands out a ``CallTrace`` whose
``step`` returns at once.

On with ``MPIRING_TRACE=DIR`` (each rank writes ``DIR/rank{r}.jsonl``, one JSON
object per line) and/or ``MPIRING_LOG=steps`` (one readable line per step on
stderr through ``logging``, rank first)::

    [r1] all_reduce#3 (ring) reduce-scatter 2/3 send c3->r2 recv c2<-r0 4.0 MiB 1.2 ms

Each step record holds: collective, call number, algo, phase, step i of n,
chunk sent and to whom, chunk received and from whom, bytes sent and received,
start and end time (``time.perf_counter`` seconds; the file's first line gives
the offset to wall-clock time so that ranks on one host line up), and the time
spent waiting for data vs reducing it.

Peers (``dst``, ``src``) are ranks of the call's communicator. So that the tools can
tell apart the groups of a 3D run (every tensor-parallel group counts its own
``all_reduce#1``) and name a sub-communicator's peers by their job rank, a step
of a call made through a Communicator carries ``comm``: a small id, defined once
per file by a ``comm`` record holding that communicator's job ranks, in rank
order (``{"type": "comm", "id": 1, "ranks": [2, 3], "name": "world.split1.1"}``).
Steps that move a slice of the buffer other than a ring chunk (halving-doubling's
halves) carry ``send_range`` and ``recv_range``: the ``[start, end)`` elements sent
and received.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import threading
import time
import weakref
from typing import IO, Any

log = logging.getLogger("mpiring.steps")
clock = time.perf_counter


def fmt_bytes(n: float) -> str:
    """Human-readable size with binary units: ``4.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _job(rank, group: tuple[int, ...] | None):
    """A peer named by its rank in the communicator, as its job rank when ``group``
    (the communicator's job ranks) is known."""
    return group[rank] if group is not None and rank is not None else rank


def fmt_step(rec: dict[str, Any], group: tuple[int, ...] | None = None) -> str:
    """One readable line for a step record (the ``MPIRING_LOG=steps`` format); peers are
    job ranks when ``group``, the job ranks of the call's communicator, is given."""
    # The algorithm is named: with algo="auto" it says which one the call ran.
    algo = f" ({rec['algo']})" if rec.get("algo") else ""
    parts = [f"[r{rec['rank']}] {rec['collective']}#{rec['call']}{algo} {rec['phase']} "
             f"{rec['step'] + 1}/{rec['steps']}"]
    if rec.get("send_chunk") is not None:
        parts.append(f"send c{rec['send_chunk']}->r{_job(rec['dst'], group)}")
    if rec.get("recv_chunk") is not None:
        parts.append(f"recv c{rec['recv_chunk']}<-r{_job(rec['src'], group)}")
    nbytes = max(rec.get("bytes_sent", 0), rec.get("bytes_recv", 0))
    parts.append(fmt_bytes(nbytes))
    parts.append(f"{(rec['t_end'] - rec['t_start']) * 1e3:.1f} ms")
    return " ".join(parts)


def fmt_p2p(rec: dict[str, Any], group: tuple[int, ...] | None = None) -> str:
    """One readable line for a point-to-point record: ``[r0] send#3 ->r1 tag 0 4.0 KiB 0.1 ms``
    (the peer as a job rank when ``group`` is given, as ``fmt_step``'s)."""
    arrow = "->" if rec["op"] == "send" else "<-"
    peer = _job(rec["peer"], group)
    return (f"[r{rec['rank']}] {rec['op']}#{rec['call']} {arrow}r{peer} tag {rec['tag']} "
            f"{fmt_bytes(rec['bytes'])} {(rec['t_end'] - rec['t_start']) * 1e3:.1f} ms")


class CallTrace:
    """Records the steps of one collective call. The disabled one does nothing."""

    __slots__ = ("tracer", "collective", "call", "algo", "bounds", "itemsize", "left", "right",
                 "group")
    enabled = True

    def __init__(self, tracer: Tracer, collective: str, call: int, algo: str):
        self.tracer = tracer
        self.collective = collective
        self.call = call
        self.algo = algo
        self.group: int | None = None  # the communicator's id in this file (``on``)

    def on(self, comm) -> CallTrace:
        """Say which communicator the call runs on (its job ranks, ``world_ranks``): the
        steps then carry its id. Only called on an enabled recorder, so that the
        untraced path never builds the rank tuple."""
        self.group = self.tracer.group_id(comm)
        return self

    def ring(self, bounds, itemsize: int, left: int, right: int) -> CallTrace:
        """Remember the ring's geometry, so that ``chunk_step`` needs only chunk numbers."""
        self.bounds, self.itemsize, self.left, self.right = bounds, itemsize, left, right
        return self

    def chunk_step(self, phase: str, step: int, steps: int, send_chunk: int, recv_chunk: int,
                   t_start: float, t_recv: float) -> None:
        """Record one ring step that sent chunk ``send_chunk`` right and received
        ``recv_chunk`` from the left (bytes from the bounds given to ``ring``)."""
        s0, s1 = self.bounds[send_chunk]
        r0, r1 = self.bounds[recv_chunk]
        self.step(phase, step, steps, send_chunk=send_chunk, dst=self.right,
                  recv_chunk=recv_chunk, src=self.left, bytes_sent=(s1 - s0) * self.itemsize,
                  bytes_recv=(r1 - r0) * self.itemsize, t_start=t_start, t_recv=t_recv,
                  t_end=clock())

    def step(self, phase: str, step: int, steps: int, *, send_chunk=None, dst=None,
             recv_chunk=None, src=None, bytes_sent=0, bytes_recv=0,
             t_start=0.0, t_recv=0.0, t_end=0.0, send_range=None, recv_range=None) -> None:
        """Record one ring step: what went where, and how long waiting and reducing took
        (``t_recv=None``: a step that only sends, all of it waiting on the send).
        ``send_range``/``recv_range``: the ``(start, end)`` elements moved, for steps
        whose slices are not ring chunks."""
        if t_recv is None:
            t_recv = t_end
        rec = {
            "type": "step", "rank": self.tracer.rank, "collective": self.collective,
            "call": self.call, "algo": self.algo, "phase": phase, "step": step,
            "steps": steps, "send_chunk": send_chunk, "dst": dst,
            "recv_chunk": recv_chunk, "src": src, "bytes_sent": bytes_sent,
            "bytes_recv": bytes_recv, "t_start": t_start, "t_end": t_end,
            "wait_s": t_recv - t_start, "reduce_s": t_end - t_recv,
        }
        # Only the fields a step has: every record of a long run pays for a key.
        if self.group is not None:
            rec["comm"] = self.group
        if send_range is not None:
            rec["send_range"] = list(send_range)
        if recv_range is not None:
            rec["recv_range"] = list(recv_range)
        self.tracer.write(rec)


class _NullCallTrace(CallTrace):
    __slots__ = ()
    enabled = False

    def __init__(self):  # no tracer behind it
        pass

    def step(self, *args, **kwargs) -> None:
        return None

    def ring(self, *args) -> CallTrace:
        return self

    def on(self, comm) -> CallTrace:
        return self

    def chunk_step(self, *args) -> None:
        return None


NULL_CALL = _NullCallTrace()


#: The trace format (the header's "version"): a writer that changes the records bumps it,
#: and the tools refuse a file of another version rather than misread it.
#: Version 2 added the ``comm`` records and the steps' ``comm``, ``send_range`` and
#: ``recv_range`` (a version-1 file is a version-2 file without them).
FORMAT_VERSION = 2


class Tracer:
    """Per-rank trace sink: a JSON-lines file, a step log on stderr, or nothing.

    ``job`` and ``world`` (``mpiring.init`` gives both: rank 0's id for the job, the
    number of ranks) go into the file's header, so that the tools tell two runs'
    files in one directory apart, and a rank's missing file, exactly.
    """

    def __init__(self, rank: int, directory: str | None = None, log_steps: bool = False,
                 name: str | None = None, *, job: str | None = None, world: int | None = None):
        self.rank = rank
        self.directory = directory
        self.log_steps = log_steps
        self._file: _TraceFile | None = None
        self._name = name or f"rank{rank}"
        # Communicators' job ranks -> their id in this file (see ``group_id``).
        self._groups: dict[tuple[int, ...], int] = {}
        self._ranks_of: dict[int, tuple[int, ...]] = {}  # the same, id -> job ranks
        self._groups_lock = threading.Lock()
        if directory:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"{self._name}.jsonl")
            self._file, fresh = _TraceFile.open(path)
            _OPEN.add(self)  # flushed at exit and before an abort: no lost tail
            if fresh:  # a second tracer of this process on the file adds to it, header once
                header = {"type": "header", "version": FORMAT_VERSION, "rank": rank,
                          "pid": os.getpid(), "wall_minus_clock": time.time() - clock()}
                if job is not None:
                    header.update(job=job, world=world)
                self._file.write(json.dumps(header) + "\n")
        if log_steps:
            _ensure_stderr_handler()

    @classmethod
    def from_env(cls, rank: int, directory: str | None = None, log: str | None = None,
                 name: str | None = None) -> Tracer:
        """Build from explicit settings, falling back to MPIRING_TRACE and MPIRING_LOG.

        Raises:
            ValueError: a ``log`` (or ``MPIRING_LOG``) other than "steps" or off.
            OSError: the trace file cannot be written (``TraceInUse``: another
                process writes it).
        """
        directory = directory if directory is not None else os.environ.get("MPIRING_TRACE") or None
        if log is None:
            steps = parse_log(os.environ.get("MPIRING_LOG", ""), "MPIRING_LOG")
        else:
            steps = parse_log(log, "log")
        return cls(rank, os.fspath(directory) if directory else None, log_steps=steps, name=name)

    @property
    def enabled(self) -> bool:
        return self._file is not None or self.log_steps

    def call(self, collective: str, call: int, algo: str) -> CallTrace:
        """A recorder for one call, or the shared no-op one when tracing is off."""
        if not self.enabled:
            return NULL_CALL
        return CallTrace(self, collective, call, algo)

    def group_id(self, comm) -> int:
        """The id of ``comm``'s group of ranks in this file, its ``comm`` record written
        the first time. Keyed by the job ranks, not the communicator: a ``dup`` is the
        same group (explain tells its calls apart by their order, as before)."""
        ranks = tuple(comm.world_ranks)
        gid = self._groups.get(ranks)
        if gid is None:
            # A DDP communication thread shares the tracer: one id per group, once.
            with self._groups_lock:
                gid = self._groups.get(ranks)
                if gid is None:
                    gid = len(self._groups)
                    self.write({"type": "comm", "rank": self.rank, "id": gid,
                                "ranks": list(ranks), "name": getattr(comm, "name", None)})
                    self._ranks_of[gid] = ranks
                    self._groups[ranks] = gid
        return gid

    def write(self, rec: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
        if self.log_steps:
            kind = rec.get("type")
            group = self._ranks_of.get(rec.get("comm"))
            if kind == "step":
                log.info(fmt_step(rec, group))
            elif kind == "p2p":
                log.info(fmt_p2p(rec, group))

    def event(self, name: str, cat: str, t_start: float, t_end: float, **fields: Any) -> None:
        """Record a span that is not a ring step (a DDP bucket, a backward pass...)."""
        if self.enabled:
            self.write({"type": "event", "rank": self.rank, "name": name, "cat": cat,
                        "t_start": t_start, "t_end": t_end, **fields})

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.release()
            self._file = None


#: What ``log=``/``MPIRING_LOG`` accept: "steps" logs every step, these turn it off.
LOG_OFF = ("", "off", "0", "none", "no", "false")


def parse_log(value: Any, source: str = "log") -> bool:
    """Whether ``value`` (``log=`` or ``MPIRING_LOG``) asks for the step log.

    Raises:
        ValueError: anything but "steps" or off; the message names ``source``
            and the values (a silently ignored ``MPIRING_LOG=1`` logs nothing).
    """
    text = value.strip().lower() if isinstance(value, str) else value
    if text == "steps":
        return True
    if text in LOG_OFF or value is None or value is False:
        return False
    raise ValueError(f"{source}={value!r}: use 'steps' (one line per ring step on stderr) "
                     "or leave it unset / 'off'")


class TraceInUse(OSError):
    """Another process holds the trace file: two jobs were given one trace directory."""


class _TraceFile:
    """One open trace file of this process, shared by every Tracer writing it.

    Two tracers of one process on one path (``mpiring.init()`` twice with
    ``MPIRING_TRACE`` set, e.g. ``init`` and then ``init_process_group``) write
    through one file object, in order: opened twice, the second open would empty
    the file and both would write from their own offsets, over each other's
    records. Another *process* writing the same file (a second job given the same
    directory) holds its lock: refused.
    """

    _by_path: weakref.WeakValueDictionary[str, _TraceFile] = weakref.WeakValueDictionary()

    def __init__(self, fh: IO[str]):
        self.fh = fh
        self.users = 1
        self.write = fh.write  # the file's own method: no extra call per record

    @classmethod
    def open(cls, path: str) -> tuple[_TraceFile, bool]:
        """The file for ``path`` and whether it is new (truncated, needs a header)."""
        key = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        shared = cls._by_path.get(key)
        if shared is not None and not shared.fh.closed:
            shared.users += 1
            return shared, False
        # O_NOFOLLOW: never write through a symlink someone planted in DIR. No
        # O_TRUNC: the file is emptied only once its lock shows no other process
        # is writing it (truncating first would wipe the other job's records).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            _lock(fd, path)
            os.ftruncate(fd, 0)
        except BaseException:
            os.close(fd)
            raise
        shared = cls(os.fdopen(fd, "w", buffering=1 << 16))
        cls._by_path[key] = shared
        return shared, True

    def flush(self) -> None:
        self.fh.flush()

    def release(self) -> None:
        """One tracer is done with the file; the last one closes it."""
        self.users -= 1
        if self.users <= 0:
            self.fh.close()


def _lock(fd: int, path: str) -> None:
    """Hold an exclusive lock on the trace file for as long as it is open."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock, as before
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise TraceInUse(errno.EBUSY, f"{path} is being written by another running process "
                         "(two jobs given one trace directory would overwrite each other's "
                         "records): give each job its own directory") from None
    except OSError:  # a filesystem without locks (ENOLCK, EOPNOTSUPP): write unlocked
        pass


# Every tracer with a file: a buffered tail would be lost when the process ends
# without closing it (a script that never calls close) or is aborted (MPI_Abort
# and os._exit skip Python's own cleanup).
_OPEN: weakref.WeakSet[Tracer] = weakref.WeakSet()


def flush_all() -> None:
    """Write out every open trace file's buffer (at exit, and before an abort)."""
    for tracer in list(_OPEN):
        try:
            tracer.flush()
        except (OSError, ValueError):  # a closed or broken file: nothing more to save
            pass


atexit.register(flush_all)


def _ensure_stderr_handler() -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def read_trace(directory: str) -> list[dict[str, Any]]:
    """All records of all ranks' files in ``directory`` (header lines included)."""
    records = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as fh:
                records.extend(json.loads(line) for line in fh if line.strip())
    return records
