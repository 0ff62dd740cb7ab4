"""Everything about GPUs and NCCL that can be checked without a GPU.

* the NCCL dtype/op tables and the TypeErrors for what NCCL cannot do;
* the NCCL unique id over MPI (CuPy 13's tuple of signed or unsigned chars,
  CuPy 14's bytes);
* the local "can NCCL run here?" probe, the cross-rank agreement, and
  ``init(backend="nccl")`` failing fast and clearly on a machine without a GPU;
* the CUDA-aware MPI decision (environment override, ctypes probe with fakes);
* the device plan per call, and host staging end to end with a fake device
  array that MPI cannot read (so a device pointer reaching MPI would fail);
* the real ring code over the NCCL backend, with NCCL faked over MPI on host
  memory (``tests/fake_nccl.py``): results against a reference, each ring
  step's send and receive in one group, every call on the backend's stream.
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest
from conftest import data
from fake_nccl import BACKEND_STREAM, CALLER_STREAM, fake_backend

import mpiring
import mpiring.backends.gpu as cuda
from mpiring.backends import nccl as nccl_mod
from mpiring.backends.mpi import MPIBackend
from mpiring.comm.communicator import Communicator
from mpiring.core.buffers import BFLOAT16, DTYPES, Buffer
from mpiring.core.ops import BITWISE, OPS


def np_dtype(name):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


# --- tables and errors ----------------------------------------------------------------
def test_nccl_tables_match_nccl_h_and_cover_every_mpiring_dtype_and_op():
    # Values of ncclDataType_t / ncclRedOp_t in nccl.h (PLATFORM.md).
    assert nccl_mod.NCCL_DTYPES["float32"] == 7 and nccl_mod.NCCL_DTYPES["bfloat16"] == 9
    assert nccl_mod.NCCL_DTYPES["float16"] == 6 and nccl_mod.NCCL_DTYPES["int64"] == 4
    assert nccl_mod.NCCL_OPS == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
    assert set(DTYPES) <= set(nccl_mod.NCCL_DTYPES)
    assert set(OPS) - set(BITWISE) == set(nccl_mod.NCCL_OPS)  # NCCL has no bitwise op


def _backend(version=(2, 30, 0)):
    be = object.__new__(nccl_mod.NCCLBackend)
    be.version = version
    return be


def test_check_native_names_what_nccl_cannot_do():
    new, old = _backend(), _backend((2, 8, 4))
    for dtype in DTYPES:
        for op in ("sum", "avg", "max", "min", "prod", None):
            new.check_native("all_reduce", dtype, op)
    with pytest.raises(TypeError, match=r"NCCL 2\.8\.4 has no bfloat16.*algo='ring'"):
        old.check_native("all_reduce", "bfloat16", "sum")
    with pytest.raises(TypeError, match=r"no avg.*op='sum'"):
        old.check_native("reduce", "float32", "avg")
    old.check_native("all_gather", "float32", None)
    with pytest.raises(TypeError, match="NCCL has no int16 type.*algo='ring'"):
        new.check_native("all_reduce", "int16", "sum")
    with pytest.raises(TypeError, match="no op 'xor'"):
        new.check_native("all_reduce", "int32", "xor")
    with pytest.raises(TypeError, match="no op 'bxor'; use algo='ring'"):
        new.check_native("all_reduce", "int32", "bxor")


def test_nccl_version_codes():
    assert cuda.nccl_version_tuple(21003) == (2, 10, 3)
    assert cuda.nccl_version_tuple(23001) == (2, 30, 1)
    assert cuda.nccl_version_tuple(2804) == (2, 8, 4)


def test_cpu_buffer_on_nccl_and_wrong_gpu_raise_type_errors():
    dev = object.__new__(nccl_mod.CupyDevice)
    dev.device_id = 0
    host = Buffer(np.zeros(3), np.zeros(3), "float64", "cpu", "numpy")
    with pytest.raises(TypeError, match="moves GPU memory only.*cupy.asarray"):
        dev.check_buffer(host)
    arr = types.SimpleNamespace(device=types.SimpleNamespace(id=1))
    with pytest.raises(TypeError, match=r"on GPU 1 .* uses GPU 0.*cupy.cuda.Device\(0\)"):
        dev.check_buffer(Buffer(arr, arr, "float32", "cuda", "cupy"))


# --- the unique id ------------------------------------------------------------------------
def _ids(seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, 128, dtype=np.uint8).tobytes()
    return {
        "bytes (CuPy 14)": raw,
        "signed chars (CuPy 13, x86)": tuple(b - 256 if b > 127 else b for b in raw),
        "unsigned chars (CuPy 13, Arm)": tuple(raw),
    }


def test_unique_id_encoding_round_trips_every_representation():
    for name, uid in _ids(0).items():
        back = nccl_mod.decode_unique_id(nccl_mod.encode_unique_id(uid))
        assert back == uid and type(back) is type(uid), name
    with pytest.raises(ValueError, match="127 bytes"):
        nccl_mod.encode_unique_id(b"x" * 127)


def test_unique_id_broadcast_reaches_every_rank(world):
    for name, uid in _ids(42).items():
        mine = uid if world.rank == 0 else None
        got = nccl_mod.broadcast_unique_id(world.mpi_comm, mine)
        assert got == uid and type(got) is type(uid), name


# --- can NCCL run here? -------------------------------------------------------------------
class _FakeRuntime:
    def __init__(self, count):
        self.count = count

    def getDeviceCount(self):  # noqa: N802
        if isinstance(self.count, Exception):
            raise self.count
        return self.count


def _fake_stack(monkeypatch, devices=1, nccl_version=23001, nccl_missing=False):
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_FakeRuntime(devices)))
    monkeypatch.setattr(nccl_mod, "import_cupy", lambda: (cupy, None))
    lib = types.SimpleNamespace(get_version=lambda: nccl_version)
    monkeypatch.setattr(nccl_mod, "import_nccl", lambda: (
        (None, "NCCL library not found (cupy.cuda.nccl.available is False)")
        if nccl_missing else (lib, None)))


def test_probe_names_what_is_missing_and_the_fix(monkeypatch):
    monkeypatch.setattr(nccl_mod, "import_cupy", lambda: (None, "CuPy is not installed"))
    problem, fix, _ = nccl_mod.probe(1)
    assert problem == "CuPy is not installed"
    assert 'pip install "mpiring[gpu]"' in fix and "--backend mpi" in fix

    _fake_stack(monkeypatch, devices=RuntimeError("cudaErrorNoDevice: no CUDA-capable device"))
    problem, fix, _ = nccl_mod.probe(1)
    assert problem.startswith("no usable CUDA device") and "cudaErrorNoDevice" in problem
    assert "nvidia-smi" in fix and "--backend mpi" in fix

    _fake_stack(monkeypatch, devices=0)
    assert nccl_mod.probe(1)[0] == "no CUDA device"

    _fake_stack(monkeypatch, nccl_missing=True)
    problem, fix, _ = nccl_mod.probe(1)
    assert problem.startswith("NCCL library not found") and "nvidia-nccl-cu12" in fix

    _fake_stack(monkeypatch, devices=2)
    assert nccl_mod.probe(2) == (None, "", {"devices": 2, "version": (2, 30, 1)})


def test_probe_allows_two_ranks_per_gpu_only_with_nccl_2_30_and_the_switch(monkeypatch):
    on = {nccl_mod.MULTI_RANK_ENV: "1"}
    _fake_stack(monkeypatch, devices=1, nccl_version=22903)
    problem, fix, _ = nccl_mod.probe(2, env=on)
    assert "2 ranks on this host share 1 GPU(s) and NCCL 2.29.3 allows 1" in problem
    assert "one rank per GPU" in fix and "NCCL_MULTI_RANK_GPU_ENABLE=1" in fix
    _fake_stack(monkeypatch, devices=1, nccl_version=23001)
    assert nccl_mod.probe(2, env={})[0] is not None
    assert nccl_mod.probe(2, env=on)[0] is None
    assert "allows 2" in nccl_mod.probe(3, env=on)[0]


def test_agreement_raises_on_every_rank_with_every_rank_s_problem(world):
    be = MPIBackend(world.mpi_comm.Dup())
    nccl_mod.agree(be, None, "")  # nobody has a problem: no error
    if world.size == 1:
        return
    problem = "no CUDA device" if world.rank == world.size - 1 else None
    with pytest.raises(mpiring.BackendUnavailable) as info:
        nccl_mod.agree(be, problem, "check nvidia-smi")
    text = str(info.value)
    assert f"on r{world.size - 1}: no CUDA device." in text and "Fix: check nvidia-smi" in text


# Python's own excepthook writes a traceback in many small writes, and the two
# ranks' pieces can interleave mid-line in the merged output; one os.write of a
# few hundred bytes to the launcher's pipe arrives whole.
_INIT_NCCL_REPORTING_IN_ONE_WRITE = """
import os, sys, traceback, mpiring
try:
    mpiring.init(backend='nccl')
except Exception:
    os.write(2, traceback.format_exc().encode())
    sys.exit(1)
"""


@pytest.mark.deadline(90)
def test_init_nccl_without_gpu_fails_fast_and_clearly_on_every_rank(rank0_subprocess):
    if nccl_mod.probe(1)[0] is None:
        pytest.skip("NCCL can run on this machine: the no-GPU error cannot be produced")
    result = rank0_subprocess(2, ["-c", _INIT_NCCL_REPORTING_IN_ONE_WRITE], 60)
    if result is None:
        return
    rc, out, seconds = result
    assert rc != 0, out
    assert seconds < 30, f"took {seconds:.0f} s"
    assert out.count("BackendUnavailable: backend='nccl' cannot start") == 2, out  # both ranks
    assert "Fix:" in out and "--backend mpi" in out
    assert "cupy_backends" not in out and "cupy/" not in out, "a raw CuPy traceback leaked"


# --- CUDA-aware MPI -------------------------------------------------------------------------
def test_cuda_awareness_environment_override(monkeypatch):
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1")
    assert cuda.cuda_aware_mpi() == (True, "MPIRING_CUDA_AWARE=1")
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "off")
    assert cuda.cuda_aware_mpi()[0] is False
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "perhaps")
    with pytest.raises(ValueError, match="use 1, 0 or auto"):
        cuda.cuda_aware_mpi()


def test_cuda_awareness_probe_with_fake_libraries():
    def lib(answer):
        return types.SimpleNamespace(MPIX_Query_cuda_support=lambda: answer)

    assert cuda.probe_cuda_aware([lib(1)]) == (True, "MPIX_Query_cuda_support()")
    assert cuda.probe_cuda_aware([lib(0)])[0] is False
    # The first library that answers decides; one without the symbol is skipped.
    assert cuda.probe_cuda_aware([types.SimpleNamespace(), lib(1)])[0] is True
    answer, how = cuda.probe_cuda_aware([types.SimpleNamespace()])
    assert answer is None and "no MPIX_Query_cuda_support" in how


def test_loaded_libmpi_is_found_in_the_process_map():
    maps = "\n".join([
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/mpi/lib/libmpi.so.40.30.0",
        "7f01-7f02 r-xp 00000000 08:01 2 /opt/mpi/lib/libmpi_mpifh.so.40",
        "7f02-7f03 r-xp 00000000 08:01 3 /usr/lib/libmpich.so.12",
        "7f03-7f04 rw-p 00000000 00:00 0 ",
        "7f04-7f05 r-xp 00000000 08:01 1 /opt/mpi/lib/libmpi.so.40.30.0",
    ])
    assert cuda.loaded_libmpi_paths(maps) == ["/opt/mpi/lib/libmpi.so.40.30.0",
                                             "/usr/lib/libmpich.so.12"]
    # This process: mpi4py's libmpi is mapped and answers the query (the PyPI
    # MPI wheels are not CUDA-aware).
    paths = cuda.loaded_libmpi_paths()
    assert paths, "mpi4py's libmpi should be mapped into the process"
    answer = cuda.query_cuda_support(ctypes.CDLL(paths[0]))
    assert answer in (True, False, None)


# --- the device plan and host staging ---------------------------------------------------------
class FakeDeviceArray:
    """A 'CUDA' array over host memory that MPI cannot take: no buffer protocol, no DLPack.

    Its module looks like CuPy's so that ``as_buffer`` treats it as a CuPy array.
    """

    __module__ = "cupy._fake"

    def __init__(self, host: np.ndarray):
        self._host = host
        self.dtype = host.dtype
        self.size = host.size
        self.nbytes = host.nbytes
        self.flags = types.SimpleNamespace(c_contiguous=True)

    @property
    def __cuda_array_interface__(self):
        return {"data": (self._host.ctypes.data, False), "shape": self._host.shape,
                "typestr": self._host.dtype.str, "version": 3}

    def reshape(self, *shape):
        return FakeDeviceArray(self._host.reshape(*shape))

    def __getitem__(self, key):
        return FakeDeviceArray(self._host[key])


class HostCopies:
    """Stand-in for ``cuda._CupyOps``: memcpy on the host, counted."""

    def __init__(self):
        self.copies: list[str] = []
        stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
        self.current_stream = lambda: stream

    def alloc_pinned(self, nbytes):
        return np.zeros(nbytes, dtype=np.uint8)

    def copy(self, dst, src, nbytes, kind, stream):
        self.copies.append(kind)
        ctypes.memmove(dst, src, nbytes)

    def record(self, stream):
        return types.SimpleNamespace(synchronize=lambda: None)


def test_device_plan_per_backend_and_awareness(monkeypatch, world):
    be = world._be
    monkeypatch.setattr(cuda, "_OPS", object())  # plans for CUDA buffers load the CUDA calls
    host = Buffer(np.zeros(4), np.zeros(4), "float64", "cpu", "numpy")
    dev_arr = FakeDeviceArray(np.zeros(4))
    dev = Buffer(dev_arr, dev_arr, "float64", "cuda", "cupy")
    assert cuda.device_plan(be, host, "all_reduce", "ring", "sum").path == "host"
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "0")
    assert cuda.device_plan(be, dev, "all_reduce", "ring", "sum").path == "staged"
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1")
    assert cuda.device_plan(be, dev, "all_reduce", "ring", "sum").path == "cuda-aware"
    seen = []
    nccl_like = types.SimpleNamespace(accepts_cuda=True,
                                      check_buffer=lambda *args: seen.append(args[1:]))
    assert cuda.device_plan(nccl_like, dev, "reduce", "native", "max").path == "nccl"
    assert seen == [("reduce", "native", "max")]


@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_staging_runs_the_collective_on_host_memory_and_copies_once_each_way(
        comm, monkeypatch, algo):
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "0")
    ops = HostCopies()
    monkeypatch.setattr(cuda, "_OPS", ops)
    n, k = 1003, comm.size
    everyone = np.stack([data(r, n, np.float32) for r in range(k)])
    x = data(comm.rank, n, np.float32)
    out = comm.all_reduce(FakeDeviceArray(x), op="sum", algo=algo)
    assert isinstance(out, FakeDeviceArray)
    np.testing.assert_array_equal(x, everyone.sum(0))
    assert ops.copies == ["d2h", "h2d"]

    x = data(comm.rank, n, BFLOAT16, salt=1)  # bfloat16 staged: reduced on the host
    comm.all_reduce(FakeDeviceArray(x), op="max", algo="ring")
    expected = np.stack([data(r, n, BFLOAT16, salt=1) for r in range(k)]).max(0)
    np.testing.assert_array_equal(x, expected)

    y = data(comm.rank, n, np.float64)
    view = comm.reduce_scatter(FakeDeviceArray(y), op="avg", algo=algo)
    lo, hi = comm.chunk_bounds(n)[comm.rank]
    np.testing.assert_allclose(view._host, everyone.astype(np.float64)[:, lo:hi].mean(0))
    z = data(comm.rank, n, np.int32)
    comm.broadcast(FakeDeviceArray(z), root=k - 1, algo="native" if algo == "native" else "pipelined",
                   chunks=3)
    np.testing.assert_array_equal(z, data(k - 1, n, np.int32))


# --- the ring over NCCL, with NCCL faked over MPI ------------------------------------------
@pytest.fixture
def fake_nccl_comm(comm):
    be = fake_backend(comm.mpi_comm)
    return Communicator(be, comm.tracer, check=True)


def _reference(k, n, dtype, op, salt=0):
    stack = np.stack([data(r, n, dtype, op, salt).astype(np.float64) for r in range(k)])
    out = {"sum": stack.sum(0), "avg": stack.sum(0) / k, "max": stack.max(0),
           "min": stack.min(0), "prod": stack.prod(0)}[op]
    return out.astype(dtype)


@pytest.mark.parametrize("algo", ("ring", "ring-seg", "native"))
def test_ring_and_native_over_fake_nccl_match_the_reference(fake_nccl_comm, algo):
    c = fake_nccl_comm
    k, rank = c.size, c.rank
    for n in (0, 1, k, 4 * k, 4 * k + 3, 1001):
        for dtype, op in (("float32", "sum"), ("bfloat16", "avg"), ("int32", "max"),
                          ("float64", "prod"), ("uint8", "min")):
            dt = np_dtype(dtype)
            x = data(rank, n, dt, op)
            c.all_reduce(x, op=op, algo=algo)
            np.testing.assert_array_equal(x, _reference(k, n, dt, op), err_msg=f"{dtype} n={n}")

        lo, hi = c.chunk_bounds(n)[rank]
        y = data(rank, n, np.float32)
        view = c.reduce_scatter(y, op="sum", algo=algo)
        np.testing.assert_array_equal(view, _reference(k, n, np.float32, "sum")[lo:hi])

        bounds = c.chunk_bounds(n)
        full = np.concatenate([data(r, n, np.int64, salt=2)[a:b] for r, (a, b) in
                               enumerate(bounds)]).astype(np.int64)
        g = np.zeros(n, dtype=np.int64)
        g[lo:hi] = full[lo:hi]
        c.all_gather(g, algo=algo)
        np.testing.assert_array_equal(g, full)

        root = (n + 1) % k
        b = data(rank, n, np.float16, salt=3)
        c.broadcast(b, root=root, algo="native" if algo == "native" else "pipelined", chunks=3)
        np.testing.assert_array_equal(b, data(root, n, np.float16, salt=3))

        r = data(rank, n, np.float32, salt=4)
        mine = r.copy()
        c.reduce(r, root=root, op="sum", algo="native" if algo == "native" else "pipelined", chunks=2)
        expected = _reference(k, n, np.float32, "sum", salt=4) if rank == root else mine
        np.testing.assert_array_equal(r, expected)


@pytest.mark.parametrize("where", ("ring send", "native"))
def test_a_collective_that_raises_midway_hands_the_caller_stream_back(fake_nccl_comm, monkeypatch,
                                                                      where):
    # Every rank fails at the same point (an NCCL error), so nothing waits. Before,
    # the backend's stream stayed current for the caller's next GPU work, and the
    # ring's recorded receive was issued by the next call's first send.
    c = fake_nccl_comm
    be, device = c._be, c._be.device

    def nccl_error(*args):
        raise RuntimeError("NCCL error: unhandled cuda error")

    x = data(c.rank, 4 * c.size + 1, np.float32)
    if where == "native":
        monkeypatch.setattr(be.nccl, "_allReduce", nccl_error)
    elif c.size > 1:
        monkeypatch.setattr(be, "send", nccl_error)
    else:
        pytest.skip("one rank's ring sends nothing")
    with pytest.raises(RuntimeError, match="unhandled cuda error"):
        c.all_reduce(x, algo="native" if where == "native" else "ring")
    assert device.current == CALLER_STREAM and device.log == ["enter", "leave"]
    assert be._pending == []
    monkeypatch.undo()
    y = data(c.rank, 4 * c.size + 1, np.float32, salt=1)
    c.all_reduce(y, algo="ring")  # the next call is whole, and hands the stream back too
    np.testing.assert_array_equal(y, _reference(c.size, y.size, np.float32, "sum", salt=1))
    assert device.current == CALLER_STREAM


def test_each_ring_step_sends_and_receives_in_one_group_on_the_backend_stream(fake_nccl_comm):
    c = fake_nccl_comm
    k, be = c.size, c._be
    left, right = (c.rank - 1) % k, (c.rank + 1) % k
    fake, device = be.nccl, be.device
    x = data(c.rank, 10 * k, np.float32)
    c.all_reduce(x, algo="ring")
    if k == 1:
        assert fake.groups == []
    else:
        # K-1 reduce-scatter steps (Irecv + Send + Wait) then K-1 all-gather steps
        # (Sendrecv): each one group of exactly one receive and one send.
        rs = [[("recv", left), ("send", right)]] * (k - 1)
        ag = [[("send", right), ("recv", left)]] * (k - 1)
        assert fake.groups == rs + ag
    assert fake.streams <= {BACKEND_STREAM}, "NCCL calls must go to the backend's stream"
    assert device.log == ["enter", "leave"]  # the caller's stream handed back once
    assert be._pending == []

    fake.groups.clear()
    c.broadcast(x, root=0, algo="pipelined", chunks=4)
    pos = c.rank  # root 0: position == rank
    if k > 1 and 0 < pos < k - 1:
        # Forwarding ranks: receive chunk 0 alone, then each next receive goes
        # with the send of the chunk before, then the last send alone.
        assert fake.groups == ([[("recv", left)]]
                               + [[("recv", left), ("send", right)]] * 3 + [[("send", right)]])



def test_other_algorithms_over_fake_nccl(fake_nccl_comm):
    # Recursive doubling (fold/unfold for K=3: lone sends and receives), the
    # segmented ring (no isend on NCCL: the literal ring runs) and "auto".
    c = fake_nccl_comm
    for n in (0, 5, 1001):
        for algo in ("recursive-doubling", "ring-seg", "auto"):
            x = data(c.rank, n, np.float32)
            c.all_reduce(x, op="sum", algo=algo)
            np.testing.assert_array_equal(x, _reference(c.size, n, np.float32, "sum"),
                                          err_msg=f"{algo} n={n}")


def test_a_freed_nccl_communicator_destroys_its_nccl_and_mpi_parts(fake_nccl_comm):
    d = fake_nccl_comm.dup()
    nccl = d._be.nccl
    d.free()
    assert nccl.destroyed
    with pytest.raises(RuntimeError, match="was freed"):
        d.barrier()
