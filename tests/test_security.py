"""Security: nothing received from a peer is unpickled; files are never written through
a planted symlink.

Two guards against pickle: a scan of the package source for mpi4py's pickling
(lowercase) methods on MPI communicators and for pickle itself, and a run of
every collective path with mpi4py's pickle replaced by a trap.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import data
from mpi4py import MPI

import mpiring
from mpiring.backends import control as wire
from mpiring.runtime.trace import Tracer

PACKAGE = Path(mpiring.__file__).parent

# mpi4py's lowercase communication methods: they pickle what they send and
# unpickle what they receive. (The uppercase ones move typed buffers.)
PICKLING = (
    "bcast", "gather", "allgather", "scatter", "alltoall", "allreduce", "reduce", "scan",
    "exscan", "send", "recv", "sendrecv", "isend", "irecv", "issend", "ssend", "bsend",
    "ibsend", "mprobe", "improbe", "neighbor_allgather", "neighbor_alltoall",
)
# What a raw MPI communicator is called in this package (an mpiring Communicator,
# whose reduce() moves buffers, is usually `comm`; the MPI one `mpi_comm`, and
# `self.comm` inside the MPI backend).
MPI_NAMES = r"(?:\bmpi_comm|\bMPI\.COMM_\w+|\bCOMM_WORLD|\bCOMM_SELF|\bmpi|\bworld_comm)"
CALL = re.compile(MPI_NAMES + r"(?:\(\))?\s*\.\s*(" + "|".join(PICKLING) + r")\s*\(")
BACKEND_CALL = re.compile(r"\bself\.comm\s*\.\s*(" + "|".join(PICKLING) + r")\s*\(")
PICKLE_USE = re.compile(r"^\s*(?:import|from)\s+(?:c?pickle|dill|cloudpickle|marshal)\b"
                        r"|\b(?:c?pickle|dill|cloudpickle|marshal)\.loads?\(", re.M)
TORCH_LOAD = re.compile(r"\btorch\.load\(([^)]*)\)")


def sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), path.read_text()


def code_lines(text):
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.split("#", 1)[0]
        if stripped.strip():
            yield number, stripped


def test_no_pickling_mpi_calls_in_the_package():
    found = []
    for name, text in sources():
        for number, line in code_lines(text):
            if CALL.search(line) or (name.parts[-2:] == ("backends", "mpi.py")
                                     and BACKEND_CALL.search(line)):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, (
        "mpi4py's lowercase methods pickle what they send and unpickle what peers send; "
        "use the buffer methods (Bcast, Allgather, Allreduce...) or mpiring.backends.control "
        "(allreduce_scalar, bcast_json, allgather_json, bcast_bytes...):\n" + "\n".join(found))


def test_the_scan_catches_what_it_must():
    assert CALL.search("x = self.comm.mpi_comm.allgather(desc)")
    assert CALL.search("port = mpi_comm.bcast((port, host), root=0)")
    assert CALL.search("MPI.COMM_WORLD.allreduce(1)")
    assert CALL.search("n = mpi.allreduce(wrong, op=MPI.SUM)")
    assert not CALL.search("mpi_comm.Allgather(values, out)")
    assert not CALL.search("comm.reduce(x, root=0)")  # mpiring's buffer reduce
    assert BACKEND_CALL.search("self.comm.send(obj, dest=1)")
    assert PICKLE_USE.search("import pickle\n") and PICKLE_USE.search("y = pickle.loads(b)")


def test_no_pickle_module_and_torch_load_only_with_weights_only():
    found = []
    for name, text in sources():
        for number, line in code_lines(text):
            if PICKLE_USE.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
        for match in TORCH_LOAD.finditer(text):
            if "weights_only=True" not in match.group(1):
                found.append(f"{name}: torch.load({match.group(1)}) without weights_only=True")
    assert not found, "\n".join(found)


@pytest.fixture
def pickle_trap():
    """mpi4py's pickle replaced by a function that fails the test."""
    used = []

    def refuse(*args, **kwargs):
        used.append(args[:1])
        raise AssertionError("mpi4py pickled something on an mpiring path")

    MPI.pickle.__init__(refuse, refuse)
    try:
        yield used
    finally:
        MPI.pickle.__init__(pickle.dumps, pickle.loads)


def test_every_collective_path_moves_buffers_only(world, pickle_trap):
    comm = mpiring.init()  # Dup, local rank
    half = comm.split(comm.rank % 2, key=comm.rank)
    twin = half.dup()
    for c in (comm, half, twin):
        for algo in ("ring", "native"):
            x = data(c.rank, 50, np.float32)
            c.all_reduce(x, algo=algo)
            c.reduce_scatter(x.copy(), op="max", algo=algo)
            c.all_gather(x, algo=algo)
        for algo in ("ring", "pipelined", "native"):
            c.broadcast(x, root=c.size - 1, algo=algo)
            c.reduce(x, root=0, algo=algo)
        c.barrier()
    if comm.size > 1:  # the error paths exchange descriptors and messages
        with pytest.raises(mpiring.MismatchError):
            comm.all_reduce(np.zeros(3 + comm.rank, np.float32))
        with pytest.raises((TypeError, ValueError)):
            comm.all_reduce(np.zeros(3, np.complex64 if comm.rank == 0 else np.float32))
    assert wire.allreduce_scalar(comm, comm.rank, "max") == comm.size - 1
    assert wire.bcast_json(comm, {"a": [1, "b"]} if comm.rank == 0 else None) == {"a": [1, "b"]}
    assert wire.allgather_json(comm, [comm.rank]) == [[r] for r in range(comm.size)]
    assert wire.bcast_bytes(comm, b"\x00id" if comm.rank == 1 % comm.size else None,
                            root=1 % comm.size) == b"\x00id"
    assert pickle_trap == []


def test_wire_helpers(world):
    assert wire.allreduce_scalar(world, 1) == world.size
    assert isinstance(wire.allreduce_scalar(world, 0.5, "min"), float)
    table = wire.allgather_array(world.mpi_comm, [world.rank, 2 * world.rank])
    assert table.tolist() == [[r, 2 * r] for r in range(world.size)]
    assert wire.allgather_bytes(world, b"x" * world.rank) == [b"x" * r for r in range(world.size)]
    assert wire.bcast_bytes(world, b"" if world.rank == 0 else None) == b""
    with pytest.raises(ValueError, match="unknown op 'avg'"):
        wire.allreduce_scalar(world, 1, "avg")


# --- files: created in the given directory, never through a symlink ---------------------

def test_trace_file_is_not_written_through_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    traces = tmp_path / "traces"
    traces.mkdir()
    os.symlink(victim, traces / "rank0.jsonl")
    with pytest.raises(OSError):
        Tracer(0, str(traces))
    assert victim.read_text() == "precious"
    os.unlink(traces / "rank0.jsonl")
    tracer = Tracer(0, str(traces))  # a plain file is fine
    tracer.close()
    assert (traces / "rank0.jsonl").is_file() and not (traces / "rank0.jsonl").is_symlink()


class _Boom:
    def __reduce__(self):  # what a pickle would run on the receiving rank
        return (os.system, ("echo pwned",))


@pytest.mark.one_rank
def test_objects_from_a_peer_make_values_and_never_run_code():
    """dist.*_object's bytes: a pickle, a callable's name or an object dtype is refused."""
    from mpiring.core import objects

    with pytest.raises(ValueError, match="not an encoded object"):
        objects.decode(pickle.dumps(_Boom()))
    with pytest.raises(TypeError, match="_Boom, which mpiring does not send"):
        objects.encode({"x": _Boom()})
    forged = [b'{"~":"tensor","dtype":"load","shape":[],"v":""}',     # torch.load by name
              b'{"~":"ndarray","dtype":"|O","shape":[1],"v":"AAAAAAAAAAA="}',  # object dtype
              b'{"~":"os.system","v":"echo pwned"}']
    for blob in forged:
        with pytest.raises(ValueError, match="not an encoded object"):
            objects.decode(blob)
    assert objects.decode(objects.encode((1, {"~": "tuple"}))) == (1, {"~": "tuple"})
