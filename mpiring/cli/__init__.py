"""``python -m mpiring <command>``: the command-line layer (argparse lives here only).

Each command is one module in this package with ``add_arguments(parser)``,
``run(args) -> int`` and a one-line module docstring used as its help. Commands
are found by name, so a new one is a new file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def _commands() -> dict[str, object]:
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found[info.name.replace("_", "-")] = info.name
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpiring",
        description="Ring collectives and DDP from first principles. Run collective "
                    "commands under mpiexec, e.g. mpiexec -n 4 python -m mpiring allreduce.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in sorted(_commands().items()):
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


def parse_size(text: str) -> int:
    """'64M' -> 67108864; accepts K, M, G (binary) and plain integers."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in scale:
        return int(float(text[:-1]) * scale[text[-1]])
    return int(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mpiring.core.errors import BackendUnavailable

    try:
        return int(args._module.run(args) or 0)
    except BackendUnavailable as exc:
        # Raised on every rank at once with the same text: one message, no traceback.
        from mpiring.backends.mpi import world_rank

        if world_rank() == 0:
            sys.stderr.write(f"python -m mpiring {args.command}: {exc}\n")
        return 2
    except Exception:
        # Any other failure must end every rank, not leave the others waiting in
        # their next collective: print it with the rank, then abort the job.
        from mpiring.backends.mpi import abort_world, world_rank, world_size

        if world_size() == 1:
            raise
        import traceback

        sys.stdout.flush()
        sys.stderr.write(f"[r{world_rank()}] python -m mpiring {args.command} failed:\n"
                         f"{traceback.format_exc()}")
        sys.stderr.flush()
        abort_world(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
