"""``python -m mpiring <command>``: the command-line layer (argparse lives here only).

Each command is one module in this package with ``add_arguments(parser)``,
``run(args) -> int`` and a one-line module docstring used as its help. Commands
are found by name, so a new one is a new file.
"""

from __future__ import annotations

import argparse
import importlib
import math
import pkgutil
import sys


def _commands() -> dict[str, object]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found[info.name.replace("_", "-")] = info.name
    return found


#: The variables launchers set to each process's rank, read before MPI starts:
#: Hydra (MPICH, Intel MPI), PMIx and Open MPI.
_LAUNCHER_RANK = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")


def _launched_rank() -> int:
    """This process's rank as the launcher numbered it (0 when not launched by one)."""
    import os

    for name in _LAUNCHER_RANK:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def refuse(message: str) -> int:
    """A command's usage error found before MPI starts: ``message`` on stderr, from the
    launcher's rank 0 only (every rank finds the same error; under ``mpiexec -n 4`` it
    was printed four times). Returns argparse's status for a usage error, 2."""
    if _launched_rank() == 0:
        print(message, file=sys.stderr, flush=True)
    return 2


class _Parser(argparse.ArgumentParser):
    """argparse's parser, speaking on the launcher's rank 0 only: a usage error or
    ``--help`` under ``mpiexec -n 4`` was printed four times. Every rank still
    exits with argparse's status (2 for an error). Its subparsers are of its class."""

    def _print_message(self, message, file=None):
        if _launched_rank() == 0:
            super()._print_message(message, file)


def build_parser(only: str | None = None, *,
                 rank0_speaks: bool = False) -> argparse.ArgumentParser:
    """The command line's parser: every command, or with ``only`` (a command's name)
    that one alone, so that running it imports no other command's module (train's
    import torch). ``rank0_speaks``: usage and help on the launcher's rank 0 only."""
    parser = (_Parser if rank0_speaks else argparse.ArgumentParser)(
        prog="python -m mpiring",
        description="Ring collectives and DDP from first principles. Run collective "
                    "commands under mpiexec, e.g. mpiexec -n 4 python -m mpiring allreduce.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in sorted(_commands().items()):
        if only is not None and name != only:
            continue
        module = importlib.import_module(f"{__name__}.{module_name}")
        doc = (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""
        p = sub.add_parser(name, help=doc, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def add_backend_arguments(p: argparse.ArgumentParser) -> None:
    """The flags every communicating command shares: backend, trace, log."""
    p.add_argument("--backend", choices=("mpi", "nccl"), default="mpi",
                   help="mpi (mpi4py) or nccl (cupy.cuda.nccl, needs a GPU)")
    p.add_argument("--trace", metavar="DIR", default=None,
                   help="write each rank's ring steps as JSON lines into DIR")
    p.add_argument("--log", choices=("steps", "none"), default=None,
                   help="'steps': log every ring step to stderr")


SIZE_FORM = ("a number of bytes with an optional binary suffix K, M or G "
             "(e.g. 4096, 4K, 16M, 1.5G)")


def parse_size(text: str | int) -> int:
    """'64M' -> 67108864; accepts K, M, G (binary) suffixes, an optional B, and integers.

    Raises:
        ValueError: not a finite, non-negative size; the message gives the accepted form.
    """
    if isinstance(text, int) and not isinstance(text, bool):  # parsed already (argparse)
        if text < 0:
            raise ValueError(f"size {text}: a size cannot be negative; use {SIZE_FORM}")
        return text
    raw = str(text)
    body = raw.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    factor = 1
    if body and body[-1] in scale:
        body, factor = body[:-1], scale[body[-1]]
    try:
        value = float(body)
    except ValueError:
        raise ValueError(f"size {raw!r}: use {SIZE_FORM}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"size {raw!r}: use a finite, non-negative size: {SIZE_FORM}")
    nbytes = value * factor
    if nbytes != int(nbytes):
        raise ValueError(f"size {raw!r} is not a whole number of bytes: use {SIZE_FORM}")
    return int(nbytes)


def size_arg(text: str) -> int:
    """argparse type: a positive size (``parse_size``), or a one-line usage error."""
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if nbytes == 0:
        raise argparse.ArgumentTypeError(f"size {text!r}: give at least 1 byte; use {SIZE_FORM}")
    return nbytes


def sizes_arg(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive sizes."""
    return [size_arg(t) for t in text.split(",") if t.strip()] or [size_arg("")]


def output_file(text: str) -> str:
    """argparse type: a file to write at the end, whose folder must exist now.

    Checked while parsing, on every rank alike, so that a typo in the folder is
    one usage error at the start instead of a traceback on rank 0 after the
    whole measurement has run (and been lost).
    """
    import os

    folder = os.path.dirname(os.path.abspath(text))
    if not text or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r}: give a file name, not a folder")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the folder {os.path.dirname(text) or '.'!r} does not exist; "
            "create it first (mkdir -p) or write somewhere else")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder is not writable")
    return text


def check_memory(nbytes: int, local_ranks: int, what: str) -> None:
    """Refuse a run whose buffers cannot fit in this host's memory, before allocating.

    Args:
        nbytes: bytes one rank allocates at its largest.
        local_ranks: ranks on this host (each allocates ``nbytes``).
        what: the flag and value, for the message.

    Raises:
        ValueError: naming the need, the host's memory and the fix.
    """
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: nothing to compare with
        return
    need = nbytes * local_ranks
    if total > 0 and need > total:
        raise ValueError(f"{what}: the {local_ranks} rank(s) on this host would need about "
                         f"{need / 2**30:.1f} GiB of buffers, more than its {total / 2**30:.1f} "
                         "GiB of memory; give a smaller size")


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"{text!r}: use a whole number >= {low}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, or a one-line usage error naming the form."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    # A known command first: only its parser. Anything else (--help, a typo) gets them
    # all, so that the usage lists every command.
    only = argv[0] if argv and argv[0] in _commands() else None
    args = build_parser(only, rank0_speaks=from_command_line).parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except Exception as exc:
        if getattr(exc, "on_every_rank", False):
            # Raised on every rank at once with the same text (a missing backend,
            # init's refused settings): one message, no traceback, no abort.
            from mpiring.backends.mpi import world_rank

            if world_rank() == 0:
                sys.stderr.write(f"python -m mpiring {args.command}: {exc}\n")
            return 2
        # Any other failure must end every rank, not leave the others waiting in
        # their next collective: print it with the rank, then abort the job.
        import traceback

        from mpiring.backends.mpi import abort_world, world_rank, world_size

        # A bad value (ValueError/TypeError, whose messages name the fix) is one
        # line; anything else keeps its traceback, which is what explains a bug.
        bad_value = isinstance(exc, (ValueError, TypeError))
        text = f"{type(exc).__name__}: {exc}\n" if bad_value else traceback.format_exc()
        sys.stdout.flush()
        if world_size() == 1:
            if not bad_value:
                raise
            sys.stderr.write(f"python -m mpiring {args.command}: error: {text}")
            return 2
        sys.stderr.write(f"[r{world_rank()}] python -m mpiring {args.command} failed: "
                         f"{text}")
        sys.stderr.flush()
        abort_world(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
