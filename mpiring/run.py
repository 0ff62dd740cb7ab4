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
USAGE = "usage: mpiexec -n K python -m mpiring.run SCRIPT [ARGS...] | -m MODULE [ARGS...]"
#: Exit status when the environment disagrees with MPI (argparse's for usage errors).
USAGE_EXIT = 2


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
        os.environ.update(agreed_environment(comm))
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
    except BaseException:
        if comm.size == 1:
            raise
        # One rank's failure must end every rank, not leave them waiting in their
        # next collective: print it under the rank's name, then abort the job.
        sys.stdout.flush()
        sys.stderr.write(f"[r{comm.rank}] mpiring.run: {target} failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        _abort(comm, 1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
