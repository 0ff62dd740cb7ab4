"""A failed or finished rank ends the job instead of leaving the others waiting.

Installed once per process by ``mpiring.init`` when the job has more than one
rank (``install``):

* An uncaught exception, in the main thread (``sys.excepthook``) or any other
  (``threading.excepthook``), prints ``[r{rank}] uncaught {Type}: {message}``
  with its traceback and aborts the whole job (MPI_Abort, exit 1). Without it
  Python ends that one process and the launcher keeps the others, which wait
  for it in their next collective until the deadline.
* A rank that exits normally (its script ended, ``sys.exit``) sends every other
  rank a small notice from an ``atexit`` hook, on a communicator of its own,
  without waiting for it to be received. The watchdog's monitor looks for
  notices on each wake-up (``watchdog.watch_exits``); a rank blocked in a
  collective of a communicator that includes an exited rank is reported and
  the job aborted after ``EXIT_GRACE`` seconds (the grace lets a last message
  that the exited rank already sent arrive). This was chosen over leaning on
  MPI_Finalize: whether it synchronises is up to the MPI library, and a rank
  waiting in a collective never reaches it anyway.

* Wait notices for the desync detector (``mpiring.runtime.desync``) travel on
  the same communicator, tag ``WAIT_TAG``, as UTF-8 JSON (never pickle), sent
  and received by the monitor thread only (the MPI library runs at
  THREAD_MULTIPLE), so a desync is named on every rank within seconds.

A rank that vanishes without running its ``atexit`` hooks (``os._exit``, a
signal) sends no notice: the launcher ends the job on a kill, the deadline on
a silent exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback

from mpi4py import MPI

from mpiring.backends.control import Control
from mpiring.runtime import desync, watchdog
from mpiring.runtime.trace import flush_all

#: The notice's tag on the lifecycle communicator (no other message travels there).
EXIT_TAG = 7
#: Wait notices and desync reports (``mpiring.runtime.desync``) on that communicator.
WAIT_TAG = 8
#: Bytes a notice may have; a longer message is drained and dropped.
MAX_NOTICE = 1 << 16
_state: dict = {}


def start_mpi() -> str | None:
    """Make MPI ready for mpiring in this process (local, no message).

    Initializes MPI at ``THREAD_MULTIPLE`` when nobody has (``mpi4py.rc.initialize =
    False``). Returns why mpiring cannot run on the MPI it found, or None: its
    monitor thread (exit notices, desync) and DDP's communication thread call MPI
    beside the main thread, which MPI allows only at ``THREAD_MULTIPLE``; below it
    the calls race inside the library (corrupt messages or a crash, not an error).

    Raises:
        RuntimeError: MPI was finalized: it cannot be started again in this process.
    """
    if MPI.Is_finalized():
        exc = RuntimeError("mpiring.init: MPI was already finalized in this process "
                           "(MPI.Finalize() ran) and cannot be started again: call "
                           "mpiring.init() before finalizing, and finalize once, at the end "
                           "(mpi4py does that at exit by itself)")
        exc.on_every_rank = True  # no MPI_Abort is possible after MPI_Finalize
        raise exc
    if not MPI.Is_initialized():
        # The script left MPI to us (mpi4py.rc.initialize = False): the level our
        # threads need. mpi4py then finalizes only what it initialized itself.
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize)
    level = MPI.Query_thread()
    if level >= MPI.THREAD_MULTIPLE:
        return None
    names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED",
             MPI.THREAD_SERIALIZED: "SERIALIZED"}
    return (f"MPI runs at thread level THREAD_{names.get(level, level)}, and mpiring's "
            "monitor and DDP's communication threads call MPI beside the main thread, "
            "which needs THREAD_MULTIPLE: drop mpi4py.rc.thread_level (its default is "
            "'multiple') or set it to 'multiple' before importing mpi4py.MPI, and use an "
            "MPI library built with thread support")


def _finalize() -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()


def exchange(value, timeout: float = watchdog.DEFAULT_TIMEOUT):
    """Every rank's JSON value, in rank order, over the whole job: ``mpiring.init``'s
    agreement on its settings, before any communicator of its own exists (collective
    over ``MPI.COMM_WORLD``: every rank calls it, in the same order).

    Under the deadline ``timeout`` (0: none): a rank that never reaches init (it
    failed before, with no hook installed yet to end the job) gets a stall report
    and the end of the job, not a wait for ever.
    """
    world = MPI.COMM_WORLD
    act = watchdog.Activity(world.Get_rank(), world.Get_size(), timeout=timeout)
    act.collective = "mpiring.init"  # what the stall report names
    return Control(world, act).allgather_json(value)


def install() -> None:
    """Hooks for a multi-rank job: abort on an uncaught exception, announce a normal exit.

    Collective the first time (it duplicates the world communicator); later calls
    do nothing. Call it on every rank, as ``mpiring.init`` does.
    """
    if _state or MPI.COMM_WORLD.Get_size() == 1:
        return
    comm = MPI.COMM_WORLD.Dup()
    _state.update(comm=comm, rank=comm.Get_rank(), size=comm.Get_size(), seen=set(),
                  previous=(sys.excepthook, threading.excepthook))
    sys.excepthook = _uncaught
    threading.excepthook = _uncaught_in_thread
    atexit.register(_announce_exit)
    watchdog.watch_exits(_exits)
    _watch_waits()


def _watch_waits() -> None:
    from mpiring.backends import mpi
    from mpiring.backends.control import Control

    # A thread inside one of these is blocked in MPI (the watchdog reads the
    # stacks; the blocking calls themselves are not changed).
    be = mpi.MPIBackend
    desync.blocking_code(mpi._poll, be.send, be.wait, be.wait_send, be.wait_sends, be.sendrecv,
                         be._wait_p2p, be._collective, Control._run)
    _state["sent"] = []
    watchdog.watch_waits(desync.Detector(_state["rank"], _post, _notices))


def _post(data: bytes) -> None:
    """Send ``data`` to every other rank without waiting (the monitor's thread)."""
    comm, rank = _state["comm"], _state["rank"]
    sent = [r for r in _state["sent"] if not r.Test()]
    buf = bytearray(data)
    sent += [comm.Isend([buf, MPI.BYTE], dest=r, tag=WAIT_TAG)
             for r in range(_state["size"]) if r != rank]
    _state["sent"] = sent


def _notices() -> list[bytes]:
    """The wait notices that arrived since the last call."""
    comm = _state["comm"]
    out = []
    status = MPI.Status()
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=WAIT_TAG, status=status):
        n = status.Get_count(MPI.BYTE)
        buf = bytearray(max(n, 1))
        comm.Recv([buf, n, MPI.BYTE], source=status.Get_source(), tag=WAIT_TAG)
        if n <= MAX_NOTICE:
            out.append(bytes(buf[:n]))
    return out


def _abort_for(kind: str, exc_type, exc, tb, where: str = "") -> None:
    rank, size = _state["rank"], _state["size"]
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    message = (f"{text}[r{rank}] uncaught {exc_type.__name__}{where}: {exc}\n"
               f"[r{rank}] aborting the {size}-rank job (exit 1) so that no rank waits "
               "for this one\n")
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the report matters more than stdout
        pass
    os.write(watchdog.REPORT_FD, message.encode(errors="replace"))
    flush_all()
    time.sleep(watchdog.REPORT_GRACE)  # let the launcher forward the report
    from mpiring.backends.mpi import forget_shared_memory

    forget_shared_memory()
    MPI.COMM_WORLD.Abort(1)


def _uncaught(exc_type, exc, tb) -> None:
    # Ctrl-C reaches every rank, and an error the ranks raise together (agreed
    # before it was raised) ends every rank alike: no one waits, nothing to abort.
    if issubclass(exc_type, KeyboardInterrupt) or getattr(exc, "on_every_rank", False):
        _state["previous"][0](exc_type, exc, tb)
        return
    _abort_for("main", exc_type, exc, tb)


def _uncaught_in_thread(args) -> None:
    if args.exc_type is SystemExit:  # a thread's sys.exit ends only that thread
        return
    name = f" in thread {args.thread.name!r}" if args.thread is not None else " in a thread"
    _abort_for("thread", args.exc_type, args.exc_value, args.exc_traceback, name)


def _announce_exit() -> None:
    comm, rank = _state["comm"], _state["rank"]
    if MPI.Is_finalized():
        return
    note = bytearray(rank.to_bytes(4, "little"))
    reqs = [comm.Isend([note, MPI.BYTE], dest=r, tag=EXIT_TAG)
            for r in range(_state["size"]) if r != rank]
    # A 4-byte message leaves at once (eager); never hold the exit for a receiver.
    deadline = time.monotonic() + 0.5
    while not MPI.Request.Testall(reqs) and time.monotonic() < deadline:
        time.sleep(0.001)


def _exits() -> list[int]:
    """World ranks whose exit notice arrived since the last call (the monitor's probe)."""
    comm = _state["comm"]
    new = []
    status = MPI.Status()
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=EXIT_TAG, status=status):
        note = bytearray(4)
        comm.Recv([note, MPI.BYTE], source=status.Get_source(), tag=EXIT_TAG)
        rank = int.from_bytes(note, "little")
        if rank not in _state["seen"]:
            _state["seen"].add(rank)
            new.append(rank)
    return new
