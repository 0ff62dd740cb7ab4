"""Starting mpiring: the Communicator over every rank of the job (``mpiring.init``).

``init`` reads its arguments and every ``MPIRING_*`` variable on each rank, and
the ranks agree on them before anything else happens: a bad value (on any rank,
even one whose host set the variable differently) and a setting the ranks must
share but do not (the argument check, the backend) raise ``ConfigError`` on
every rank, naming the variable or argument and the fix. That costs two small
exchanges of text at init: the settings, then whether each rank could open its
trace file (opened only once the settings are agreed, so that a typo elsewhere
never wipes an earlier trace).
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any

import numpy as np

from mpiring.backends import BACKENDS
from mpiring.comm.communicator import Communicator
from mpiring.runtime.env import FALSE, TRUE, env_flag

#: Every variable mpiring reads (docs/configuration.md); any other ``MPIRING_*``
#: is a typo (a TIMOUT for TIMEOUT would leave the deadline at 300 s) and refused.
KNOWN = ("MPIRING_TIMEOUT", "MPIRING_CHECK", "MPIRING_TRACE", "MPIRING_LOG", "MPIRING_IDLE",
         "MPIRING_PP_SHARED", "MPIRING_DESYNC", "MPIRING_CACHE", "MPIRING_HUGE_PAGES",
         "MPIRING_STEADY_MALLOC", "MPIRING_CUDA_AWARE", "MPIRING_VENV",
         "MPIRING_TEST_STACKS_DIR")
#: Variables of earlier versions, and what replaced them.
REMOVED = {
    "MPIRING_YIELD": "MPIRING_IDLE=yield (or comm.idle)",
    "MPIRING_DDP_SLEEP": "MPIRING_IDLE=sleep (or comm.idle)",
    "MPIRING_QUIET_WAIT": "DistributedDataParallel(..., quiet_wait=True)",
    "MPIRING_TEST_CRASH": "nothing: the crash-test hook lives in the tests",
}


class ConfigError(ValueError):
    """A setting of ``mpiring.init`` that cannot work: a bad argument or ``MPIRING_*``
    value, or one the ranks must share but do not.

    Raised on every rank together (the ranks agree first), so an uncaught one ends
    each rank by itself: no rank is left waiting and the job is not aborted.
    """

    on_every_rank = True


def init(backend: str = "mpi", *, trace: str | os.PathLike | None = None,
         log: str | None = None, check: bool | None = None,
         timeout: Any = None) -> Communicator:
    """Start (or join) the MPI job and return a Communicator over all ranks.

    Collective: every rank calls it. It may be called again (a second Communicator
    over all ranks, e.g. ``init`` and then ``init_process_group``); with the same
    trace directory both write into the one file of each rank.

    Args:
        backend: "mpi" (mpi4py) or "nccl" (cupy.cuda.nccl; MPI still launches
            the ranks and carries the NCCL id). The same on every rank.
        trace: directory for per-rank JSON-lines step traces (default:
            ``MPIRING_TRACE``). Created if missing; one job per directory.
        log: "steps" to log every ring step to stderr, "off" or None for no log
            (default: ``MPIRING_LOG``).
        check: True or False: compare every collective's arguments across ranks
            before moving data (default on; ``MPIRING_CHECK=0`` turns it off).
            The same on every rank.
        timeout: seconds (a number, a string such as "300s" or "off", or a
            ``datetime.timedelta``) one blocking wait may last before this rank
            prints a stall report (collective, ring step, peer) and aborts the job
            (default ``MPIRING_TIMEOUT`` or 300; 0 disables). See
            ``mpiring.runtime.watchdog``.

    Raises:
        ConfigError: on every rank, before any communicator exists: a bad
            argument, a bad or unknown ``MPIRING_*`` variable, a trace directory
            some rank cannot write (or another job writes), MPI below
            ``THREAD_MULTIPLE``, or ranks that disagree on ``backend`` or
            ``check``; the message names the setting, the ranks and the fix.
        RuntimeError: MPI was already finalized in this process.
        BackendUnavailable: the backend cannot run here; the message says why
            and how to fix it.
    """
    return start(backend, trace=trace, log=log, check=check, timeout=timeout)


def start(backend: str = "mpi", *, trace=None, log=None, check=None, timeout=None,
          problems: list[str] | tuple[str, ...] = (), launcher: bool = True) -> Communicator:
    """``init``, with ``problems`` the caller found in its own arguments (text naming
    the fix) agreed with the rest, so that they too raise on every rank
    (``init_process_group``'s, which checks the launcher's variables itself:
    ``launcher=False``)."""
    from mpiring.backends import lifecycle
    from mpiring.backends.mpi import world_backend

    thread_problem = lifecycle.start_mpi()  # may initialize MPI; local
    mine, agreed, settings = _settings(backend, log, check, timeout)
    problems = [*problems, *mine] + ([thread_problem] if thread_problem else [])
    if launcher:
        problems += launcher_problems()
    # The one exchange before anything: bad values anywhere, and settings the
    # ranks must share, raise the same error on every rank (nothing waits).
    everyone = lifecycle.exchange({"problems": problems, "agreed": agreed, "job": _job_id()},
                                  settings["timeout"])
    shared = _disagreements([e["agreed"] for e in everyone])  # the same list on every rank
    _refuse([e["problems"] + shared for e in everyone])
    tracer = _tracer(lifecycle, trace, settings["log_steps"], settings["timeout"],
                     job=everyone[0]["job"], world=len(everyone))
    # A rank that raises or exits while the others wait for it ends the job in
    # seconds instead of at the deadline (collective the first time; then free).
    lifecycle.install()
    if settings["backend"] == "mpi":
        be = world_backend()
    else:
        from mpiring.backends.nccl import make_backend

        be = make_backend()
    return Communicator(be, tracer, check=settings["check"], timeout=settings["timeout"])


def _settings(backend, log, check, timeout) -> tuple[list[str], dict, dict]:
    """This rank's problems (text), the settings every rank must share, and its settings."""
    from mpiring.runtime.trace import parse_log
    from mpiring.runtime.watchdog import parse_timeout

    problems = environment_problems()
    settings: dict[str, Any] = {"backend": backend, "check": True, "timeout": 300.0,
                                "log_steps": False}
    if not isinstance(backend, str) or backend not in BACKENDS:
        problems.append(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    # A truthy string ("no") or a number would have switched checking silently.
    if check is not None and not isinstance(check, (bool, np.bool_)):
        problems.append(f"check={check!r}: pass True or False (or leave it out: "
                        "MPIRING_CHECK, default on)")
    else:
        try:
            settings["check"] = bool(check) if check is not None else \
                env_flag("MPIRING_CHECK", True)
        except ValueError:
            pass  # a bad MPIRING_CHECK: environment_problems named it
    # The variables' own bad values are named by environment_problems; an argument's here.
    try:
        settings["timeout"] = parse_timeout(timeout)
    except ValueError as exc:
        if timeout is not None:
            problems.append(str(exc))
    try:
        settings["log_steps"] = parse_log(log if log is not None else
                                          os.environ.get("MPIRING_LOG", ""), "log")
    except ValueError as exc:
        if log is not None:
            problems.append(str(exc))
    raw = os.environ.get("MPIRING_CHECK", "")
    source = f"check={check!r}" if check is not None else \
        f"MPIRING_CHECK={raw!r}" if raw.strip() else "default"
    agreed = {"backend": repr(backend),
              "check": f"{'on' if settings['check'] else 'off'} ({source})"}
    return problems, agreed, settings


def environment_problems() -> list[str]:
    """What is wrong with this process's ``MPIRING_*`` variables, one line each (local).

    Every variable is checked here, at ``init``, even those read later (the
    pipeline's, the page allocator's, the GPU staging's): a value they would
    ignore or reject deep into a run is named before anything starts.
    """
    from mpiring.backends.mpi import IDLE_MODES
    from mpiring.runtime.desync import probe_seconds
    from mpiring.runtime.watchdog import parse_timeout

    env = os.environ
    problems = []
    for name in sorted(k for k in env if k.startswith("MPIRING_")):
        if name in REMOVED:
            problems.append(f"{name} is no longer read: use {REMOVED[name]} (and unset it)")
        elif name not in KNOWN:
            # Compared without the shared prefix, which alone would make every name "close".
            tail = {k[len("MPIRING_"):]: k for k in KNOWN}
            near = [tail[t] for t in difflib.get_close_matches(name[len("MPIRING_"):], tail,
                                                               n=1, cutoff=0.75)]
            if near:  # a misspelt setting would be ignored while the user believes it set
                problems.append(f"{name} is not a variable mpiring reads (did you mean "
                                f"{near[0]}?): unset it")
            else:  # like no setting of ours: the user's own, perhaps; said, not refused
                warnings.warn(f"{name} is not a variable mpiring reads (see "
                              "docs/configuration.md); it is ignored", stacklevel=3)

    def value(name: str) -> str:
        return env.get(name, "").strip().lower()

    def check(name: str, allowed: tuple[str, ...], fix: str) -> None:
        if value(name) not in allowed:
            problems.append(f"{name}={env[name]!r}: {fix}")

    checks = {
        "MPIRING_CHECK": (("",) + TRUE + FALSE, "use 1 or 0 (true/false, yes/no, on/off)"),
        "MPIRING_IDLE": (("",) + IDLE_MODES, f"use one of {', '.join(IDLE_MODES)} (or unset "
                                             "it: yield when oversubscribed, else spin)"),
        # The sets their readers accept (parallel/pipeline/shared.py, runtime/pages.py,
        # backends/gpu.py); pages reads anything but 0 as on, so "off" was ignored.
        "MPIRING_PP_SHARED": (("", "0", "1", "on", "off"), "use 1 (shared memory between "
                                                           "stages on one host) or 0"),
        "MPIRING_HUGE_PAGES": (("", "0", "1"), "use 1 (huge pages, the default) or 0"),
        "MPIRING_STEADY_MALLOC": (("", "0", "1"), "use 1 (the default) or 0"),
        "MPIRING_CUDA_AWARE": (("", "auto") + TRUE + FALSE, "use 1, 0 or auto"),
        "MPIRING_LOG": (("steps", "", "off", "0", "none", "no", "false"),
                        "use 'steps' (one line per ring step on stderr) or unset it"),
    }
    for name, (allowed, fix) in checks.items():
        if name in env:
            check(name, allowed, fix)
    if value("MPIRING_TIMEOUT"):
        try:
            parse_timeout(env["MPIRING_TIMEOUT"])
        except ValueError:
            problems.append(f"MPIRING_TIMEOUT={env['MPIRING_TIMEOUT']!r}: give seconds (e.g. "
                            "300), or 0 / off for no deadline")
    if value("MPIRING_DESYNC"):
        try:
            probe_seconds()
        except ValueError as exc:
            problems.append(str(exc))
    cache = env.get("MPIRING_CACHE", "")
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        problems.append(f"MPIRING_CACHE={cache!r} is a file: give a directory (tune.json "
                        "goes in it)")
    return problems


def launcher_problems() -> list[str]:
    """A ``WORLD_SIZE`` or ``RANK`` (torch's launcher variables) that a one-process MPI
    world contradicts.

    Under ``torchrun`` each process is an MPI job of its own (a singleton): every
    one would get ``size == 1`` and train alone, silently. Only that case is
    refused here: in a larger world ``mpiring.run`` checks these variables
    itself, after init, with its own message and exit status.
    """
    from mpiring.backends.mpi import world_rank, world_size

    out = []
    if world_size() != 1:
        return out
    for var, value in (("WORLD_SIZE", world_size()), ("RANK", world_rank())):
        text = os.environ.get(var, "").strip()
        if text and text != str(value):
            out.append(f"{var}={text}, but MPI gives this process {var.lower()} {value}: "
                       "mpiring takes rank and size from MPI: launch with mpiexec -n K "
                       "python SCRIPT (or python -m mpiring.run SCRIPT), not torchrun, "
                       f"and unset {var} or make it match")
    return out


def _disagreements(agreed: list[dict]) -> list[str]:
    """One problem per setting whose value differs between ranks."""
    out = []
    for key in agreed[0]:
        values = [a[key] for a in agreed]
        if len(set(values)) == 1:
            continue
        ranks: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            ranks.setdefault(v, []).append(r)
        shown = "; ".join(f"{v} on {_ranks(rs)}" for v, rs in ranks.items())
        if key == "check":
            fix = ("a rank that checks sends a descriptor the others do not expect (a crash "
                   "or hang at the first collective): set MPIRING_CHECK the same on every "
                   "rank (hosts of a hostfile, or a per-rank -env, may differ) and pass the "
                   "same check= everywhere")
        else:
            fix = "pass the same backend= on every rank"
        out.append(f"the ranks disagree on {key}: {shown}: {fix}")
    return out


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(f"r{r}" for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _refuse(per_rank: list[list[str]]) -> None:
    """Raise ``ConfigError`` (on every rank, as every rank has the same lists) if any
    rank has a problem; each problem says which ranks have it unless all do."""
    size = len(per_rank)
    where: dict[str, list[int]] = {}
    for r, problems in enumerate(per_rank):
        for p in problems:
            where.setdefault(p, [])
            if r not in where[p]:
                where[p].append(r)
    if not where:
        return
    lines = [p if len(rs) == size else f"{p} (on {_ranks(rs)})"
             for p, rs in where.items()]
    raise ConfigError("mpiring.init: " + ";\n  ".join(lines))


_JOB_ID: list[str] = []


def _job_id() -> str:
    """A random id for this process, made once: rank 0's names the job in every rank's
    trace header (an init again in the same job, after destroy, names it alike)."""
    if not _JOB_ID:
        import uuid

        _JOB_ID.append(uuid.uuid4().hex[:12])
    return _JOB_ID[0]


def _tracer(lifecycle, trace, log_steps: bool, timeout: float, *, job: str, world: int):
    """This rank's Tracer, once every rank could open its trace file (else ConfigError
    on every rank)."""
    from mpiring.backends.mpi import world_rank
    from mpiring.runtime.trace import TraceInUse, Tracer

    rank = world_rank()
    source = "trace" if trace is not None else "MPIRING_TRACE"
    directory = trace if trace is not None else os.environ.get("MPIRING_TRACE") or None
    tracer, problem = None, ""
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        problem = f"trace={directory!r}: give a directory (a str or path) or None"
    else:
        try:
            tracer = Tracer(rank, os.fspath(directory) if directory else None,
                            log_steps=log_steps, job=job, world=world)
        except TraceInUse as exc:
            problem = f"{source}={os.fspath(directory)!r}: {exc.strerror}"
        except OSError as exc:
            why = str(exc) if exc.filename is None else f"{exc.strerror} ({exc.filename})"
            problem = (f"{source}={os.fspath(directory)!r}: cannot write this rank's trace "
                       f"file: {why}: give a directory every rank can create and write "
                       "(each host writes its own ranks' files)")
    # Only when some rank traces would a failure be possible, but whether one does can
    # differ between ranks: the exchange is made by all.
    try:
        _refuse([[p] if p else [] for p in lifecycle.exchange(problem, timeout)])
    except ConfigError:
        if tracer is not None:
            tracer.close()
        raise
    return tracer
