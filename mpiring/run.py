"""``mpiexec -n K python -m mpiring.run SCRIPT [ARGS]``: torchrun's environment, from MPI.

A script written for ``torchrun`` learns who it is from the environment::

    RANK              this process's rank              (MPI rank in COMM_WORLD)
    LOCAL_RANK        its rank among this host's        (MPI shared-memory split)
    WORLD_SIZE        number of processes               (MPI size)
    LOCAL_WORLD_SIZE  number of processes on this host
    MASTER_ADDR       rank 0's host (127.0.0.1 when every rank is on it)
    MASTER_PORT       a TCP port that was free on rank 0

``mpiexec`` sets none of them, so such a script would run as K separate
single-process trainings. This shim sets them, agreed over MPI, then runs the
script as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` (``-m MODULE`` runs
a module, as ``python -m`` does). It works the same under ``mpirun`` and
``srun``: MPI, not the launcher, is asked.

torchrun's own options before the script are taken as torchrun takes them and
checked against MPI: ``--nproc-per-node N`` (this host's process count),
``--nnodes N`` or ``MIN:MAX`` (the number of hosts), ``--standalone``,
``--master-addr``/``--master-port`` (set MASTER_ADDR/MASTER_PORT), ``-m``/
``--module``; any other option there, a script that is not a file or a module
that cannot be found is refused with exit status 2 and one message.

A variable that is already set is kept if it agrees with MPI (for MASTER_ADDR
and MASTER_PORT: if every rank has the same value) and refused otherwise, on
every rank, before the script starts. An exception that escapes the script
prints its traceback under the rank's name and aborts the whole job, so the
other ranks do not wait for it in their next collective.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import traceback

import mpiring

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT")
USAGE = ("usage: mpiexec -n K python -m mpiring.run [--nproc-per-node N] [--nnodes N] "
         "[--standalone] [--master-addr A] [--master-port P] SCRIPT [ARGS...] | -m MODULE [ARGS...]")
#: Exit status when the environment disagrees with MPI (argparse's for usage errors).
USAGE_EXIT = 2
#: torchrun's options that take a value, by both spellings, and what they become here.
_VALUED = {"--nproc-per-node": "nproc", "--nproc_per_node": "nproc", "--nnodes": "nnodes",
           "--master-addr": "MASTER_ADDR", "--master_addr": "MASTER_ADDR",
           "--master-port": "MASTER_PORT", "--master_port": "MASTER_PORT"}


class UsageError(ValueError):
    """The command line cannot be run (the same on every rank: it is parsed from argv)."""


def parse_args(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Split torchrun's options off the front: ``({option: value}, target)``.

    ``target`` is ``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]``; everything after
    the script or the module is the script's own, dashes and all.

    Raises:
        UsageError: an option torchrun has that means nothing under MPI, an
            unknown one, or no script.
    """
    opts: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "--module"):
        name, eq, value = args[i].partition("=")
        if name == "--standalone":
            i += 1  # one host, a local rendezvous: what MPI gives already
            continue
        if name not in _VALUED:
            raise UsageError(
                f"mpiring.run: {name} is not an option here: mpiexec starts the processes "
                "(-n K, a hostfile) and MPI tells each its rank; mpiring.run takes torchrun's "
                "--nproc-per-node, --nnodes, --standalone, --master-addr, --master-port and -m "
                f"before the script, and passes everything after the script to it. {USAGE}")
        if not eq:
            if i + 1 >= len(args):
                raise UsageError(f"mpiring.run: {name} needs a value. {USAGE}")
            value, i = args[i + 1], i + 1
        opts[_VALUED[name]] = value
        i += 1
    rest = args[i:]
    if rest and rest[0] in ("-m", "--module"):
        if len(rest) < 2:
            raise UsageError(f"mpiring.run: -m needs a module name. {USAGE}")
        return opts, ["-m", *rest[1:]]
    if not rest:
        raise UsageError(f"mpiring.run: no script to run. {USAGE}")
    return opts, rest


def _count(text: str, option: str) -> tuple[int, int]:
    """``"4"`` -> (4, 4), ``"1:2"`` -> (1, 2) (torchrun's elastic MIN:MAX)."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise UsageError(f"mpiring.run: {option} {text}: give a whole number (mpiexec -n "
                         "decides how many processes run; the option is only checked)") from None
    return lo, hi


def option_problems(comm, opts: dict[str, str], hosts: list[str]) -> list[str]:
    """What in ``opts`` disagrees with MPI on this rank (empty: all agrees)."""
    problems = []
    # torchrun's "auto", "gpu" and "cpu" ask it to count devices: MPI has counted already.
    if "nproc" in opts and opts["nproc"] not in ("auto", "gpu", "cpu", "xpu"):
        lo, hi = _count(opts["nproc"], "--nproc-per-node")
        if not lo <= comm.local_size <= hi:
            problems.append(f"--nproc-per-node {opts['nproc']} (MPI started "
                            f"{comm.local_size} on this host)")
    if "nnodes" in opts:
        lo, hi = _count(opts["nnodes"], "--nnodes")
        n = len(set(hosts))
        if not lo <= n <= hi:
            problems.append(f"--nnodes {opts['nnodes']} (the job spans {n} host(s))")
    return problems


def target_problem(target: list[str]) -> str | None:
    """Why ``target`` cannot start on this rank (None: it can), before any rank runs it."""
    if target[0] == "-m":
        import importlib.util

        try:
            found = importlib.util.find_spec(target[1]) is not None
        except (ImportError, ValueError):  # a parent package missing, or an empty name
            found = False
        return None if found else f"no module named {target[1]!r}"
    if not os.path.isfile(target[0]):
        return f"can't open file {os.path.abspath(target[0])!r}: no such file"
    return None


def free_port(host: str) -> int:
    """A TCP port that was free on ``host``'s interface a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def agreed_environment(comm, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The six torchrun variables for this rank (collective over ``comm``).

    Args:
        comm: a Communicator over every rank of the job.
        environ: the environment to check (default ``os.environ``).

    Returns:
        Variable -> value; existing values that agree are returned unchanged.

    Raises:
        ValueError: on every rank, if any rank has a value that disagrees
            (naming the ranks, the variables and the fix).
    """
    environ = os.environ if environ is None else environ
    host = socket.gethostname()
    hosts = comm.control.allgather_json(host)
    one_host = all(h == hosts[0] for h in hosts)
    # Loopback when every rank shares rank 0's host: nothing needs to resolve a name.
    addr = "127.0.0.1" if one_host else hosts[0]
    port = comm.control.bcast_json(
        free_port(addr if one_host else "") if comm.rank == 0 else None, root=0)
    mine = {"RANK": comm.rank, "LOCAL_RANK": comm.local_rank, "WORLD_SIZE": comm.size,
            "LOCAL_WORLD_SIZE": comm.local_size, "MASTER_ADDR": addr, "MASTER_PORT": port}
    given = {v: environ.get(v) for v in VARIABLES if environ.get(v) not in (None, "")}
    problems = [f"{v}={given[v]} (MPI says {mine[v]})" for v in VARIABLES[:4]
                if v in given and given[v].strip() != str(mine[v])]
    table = comm.control.allgather_json({v: given.get(v) for v in VARIABLES[4:]})
    out = {v: str(mine[v]) for v in VARIABLES}
    for v in VARIABLES[4:]:
        values = {row[v] for row in table}
        if values == {None}:
            continue
        if len(values) == 1:
            out[v] = values.pop()  # the user's choice, the same everywhere: keep it
        else:
            problems.append(f"{v}={given.get(v)!r} (the ranks have {sorted(map(str, values))})")
    everyone = comm.control.allgather_json(problems)
    bad = [(r, p) for r, p in enumerate(everyone) if p]
    if bad:
        shown = "; ".join(f"r{r}: {', '.join(p)}" for r, p in bad)
        raise ValueError(
            f"mpiring.run: the environment disagrees with MPI: {shown}. Unset these variables "
            f"(mpiring.run sets them from MPI), or make them match on every rank; and do not "
            f"start mpiring.run under torchrun: {USAGE}")
    return out


def _abort(comm, code: int) -> None:
    abort = getattr(comm, "abort", None)
    if callable(abort):
        abort(code)
    else:
        # The communicator's watchdog path: flush the traces, MPI_Abort the world.
        comm._act.abort(code)


def _run_target(args: list[str]) -> None:
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = list(args)
    # As ``python SCRIPT`` does: the script's folder comes first on the path.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    """Set the variables, run the target; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        print(USAGE + "\n\n" + (__doc__ or "").split("\n\n", 1)[1].strip())
        return 0 if args and args[0] in ("-h", "--help") else USAGE_EXIT
    comm = mpiring.init(backend="mpi")
    try:
        # Parsed from argv, so the same on every rank: every rank returns here at once.
        opts, args = parse_args(args)
        environ = {**os.environ, **{v: opts[v] for v in VARIABLES[4:] if v in opts}}
        os.environ.update(agreed_environment(comm, environ))
        # Checked on every rank and agreed, before any rank starts the script: a
        # missing file on one host, or a count that disagrees with MPI, must not
        # leave the other ranks waiting in the script's first collective.
        hosts = comm.control.allgather_json(socket.gethostname())
        mine = option_problems(comm, opts, hosts)
        missing = target_problem(args)
        everyone = comm.control.allgather_json([mine, missing])
        bad = [f"r{r}: {', '.join(p)}" for r, (p, _) in enumerate(everyone) if p]
        if bad:
            raise UsageError("mpiring.run: torchrun's options disagree with MPI: "
                             + "; ".join(bad) + ". Drop them (mpiexec -n K decides how many "
                             f"processes run, on which hosts) or make them match. {USAGE}")
        lost = [(r, m) for r, (_, m) in enumerate(everyone) if m]
        if lost:
            ranks = ", ".join(f"r{r}" for r, _ in lost)
            raise UsageError(f"mpiring.run: {lost[0][1]} (on {ranks}); every host needs the "
                             f"script (or the module) at the same path. {USAGE}")
    except ValueError as exc:
        if comm.rank == 0:  # the same text on every rank: say it once
            sys.stderr.write(f"{exc}\n")
        return USAGE_EXIT
    target = " ".join(args[:2] if args[0] == "-m" else args[:1])
    try:
        _run_target(args)
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            return 0
        status = code if isinstance(code, int) else 1
        if comm.size == 1:
            raise
        sys.stdout.flush()
        sys.stderr.write(f"[r{comm.rank}] mpiring.run: {target} exited with {code!r}; "
                         "aborting the job\n")
        sys.stderr.flush()
        _abort(comm, status)
        return status
    except BaseException as exc:
        if comm.size == 1:
            raise
        # As a shell reports a process ended by Ctrl-C (128 + SIGINT); 1 for the rest.
        status = 130 if isinstance(exc, KeyboardInterrupt) else 1
        # One rank's failure must end every rank, not leave them waiting in their
        # next collective: print it under the rank's name, then abort the job.
        sys.stdout.flush()
        sys.stderr.write(f"[r{comm.rank}] mpiring.run: {target} failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        _abort(comm, status)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
