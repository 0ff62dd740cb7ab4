"""The layers: every import goes down, and only the backends talk to mpi4py and CuPy.

Read from the source (``ast``), so an import inside a function counts as much
as one at the top of a file. The floors, bottom first (siblings on one floor
may not import each other):

    cli, run                   the commands and the launcher
    tools                      bench, planner, timeline, train, models, info
    parallel                   data (DDP), zero, fsdp, tensor, pipeline, grid, checkpoint
    comm                       the Communicator, agreement, point-to-point, auto
    backends | collectives     how bytes move | the lecture's algorithms
    core | runtime             pure helpers | watchdog, trace, pages
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpiring")

FLOOR = {"core": 0, "runtime": 0, "backends": 1, "collectives": 1, "comm": 2, "parallel": 3,
         "tools": 4, "cli": 5, "run": 5, "__main__": 6}
#: The only places that may import mpi4py or CuPy: the backends, and the array
#: adapters, which hand a CuPy array to the ring without a copy.
MAY_IMPORT_MPI = ("backends",)
MAY_IMPORT_CUPY = ("backends", "core.buffers")


def modules() -> dict[str, list[tuple[str, int]]]:
    """``module -> [(imported module, line)]`` for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            rel = rel.removesuffix(".__init__")
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            imports = []
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "mpiring":
                    # ``from mpiring import x``: a layer if x is one, else the root's names
                    imports.extend((f"mpiring.{a.name}" if a.name in FLOOR else "mpiring",
                                    node.lineno) for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imports.append((node.module, node.lineno))
                elif isinstance(node, ast.ImportFrom) and node.level:
                    imports.append(("<relative>", node.lineno))
                elif isinstance(node, ast.Import):
                    imports.extend((a.name, node.lineno) for a in node.names)
            found[rel] = imports
    return found


def area(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "mpiring" else None


def test_every_module_is_on_a_floor():
    stray = [m for m in modules() if m != "mpiring" and area(m) not in FLOOR]
    assert not stray, f"modules outside the layers (add them to a folder): {stray}"


def test_no_import_runs_back_up_a_layer():
    wrong = []
    for module, imports in modules().items():
        here = area(module)
        if here is None:  # the package itself: the public names, re-exported lazily
            continue
        for target, line in imports:
            if target == "<relative>":
                wrong.append(f"{module}:{line} uses a relative import: write it absolute")
                continue
            if target == "mpiring":
                # The root re-exports every layer's public names: below the tools,
                # importing it would run back up to whatever it re-exports.
                if FLOOR[here] < FLOOR["tools"]:
                    wrong.append(f"{module}:{line} imports the package root: import from "
                                 "the layer that defines the name")
                continue
            there = area(target)
            if there is None or there == here:
                continue
            if FLOOR[there] > FLOOR[here]:
                wrong.append(f"{module}:{line} ({here}, floor {FLOOR[here]}) imports {target} "
                             f"({there}, floor {FLOOR[there]})")
            elif FLOOR[there] == FLOOR[here]:
                wrong.append(f"{module}:{line} imports its sibling layer's {target}")
    assert not wrong, "imports that run back up the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize(("library", "allowed"), [("mpi4py", MAY_IMPORT_MPI),
                                                 ("cupy", MAY_IMPORT_CUPY)])
def test_only_the_backends_import_mpi4py_and_cupy(library, allowed):
    wrong = [f"{module}:{line} imports {target}"
             for module, imports in modules().items()
             for target, line in imports
             if target.split(".")[0] == library and module != "mpiring"
             and not any(module.removeprefix("mpiring.").startswith(a) for a in allowed)]
    assert not wrong, (f"only {', '.join(allowed)} may import {library} (use the "
                       "Communicator, comm.control or mpiring.backends.*):\n" + "\n".join(wrong))


def test_the_package_root_imports_no_mpi_library():
    assert not [t for t, _ in modules()["mpiring"] if t.split(".")[0] in ("mpi4py", "cupy")]


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    # The test above must be able to fail: a module of the lowest floor that
    # imports the Communicator is reported.
    fake = tmp_path / "mpiring" / "core"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from mpiring.comm.communicator import Communicator\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path / "mpiring"))
    with pytest.raises(AssertionError, match=r"mpiring.core.bad:1 \(core, floor 0\) imports"):
        test_no_import_runs_back_up_a_layer()


def test_importing_mpiring_loads_ml_dtypes_only_when_bfloat16_is_asked_for():
    # ml_dtypes takes most of a second to load, in every rank of every launch.
    code = ("import sys, mpiring\n"
            "assert 'ml_dtypes' not in sys.modules, 'import mpiring loaded ml_dtypes'\n"
            "from mpiring.core.buffers import bfloat16\n"
            "assert bfloat16().name == 'bfloat16' and 'ml_dtypes' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_a_bfloat16_tensor_loads_the_dtype_on_first_use(monkeypatch):
    torch = pytest.importorskip("torch")
    from mpiring.core import buffers

    monkeypatch.setattr(buffers, "_BFLOAT16", None)  # as in a process that never asked
    x = torch.arange(-3, 5, dtype=torch.bfloat16) / 4
    buf = buffers.as_buffer(x)
    assert buf.dtype == "bfloat16" and buf.array.dtype.name == "bfloat16"
    assert buf.array.astype("float32").tolist() == x.float().tolist()
    assert buffers.BFLOAT16 is buffers.bfloat16()
