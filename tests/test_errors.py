"""Mismatched arguments and bad input: an error on every rank, before any byte moves.

Each test runs on a fresh ``dup()`` of the 4-rank world (call numbers start at
#1, so messages can be compared exactly). After every error the same
communicator must still run a correct all_reduce: nothing was left in flight.
"""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
from conftest import data

import mpiring
from mpiring.core.buffers import BFLOAT16


@pytest.fixture
def fresh(world):
    """A new communicator over every rank: call numbers start at #1."""
    if world.size < 2:
        pytest.skip("mismatches need at least 2 ranks")
    return world.dup()


def still_works(comm):
    x = data(comm.rank, 37, np.float32)
    comm.all_reduce(x, algo="ring")
    expected = sum(data(r, 37, np.float64) for r in range(comm.size)).astype(np.float32)
    np.testing.assert_array_equal(x, expected)


def row(comm, values):
    return " ".join(f"r{r}={values(r)}" for r in range(comm.size))


# --- mismatch detection: one test per descriptor field ------------------------------

def test_count_mismatch_lists_every_rank(fresh):
    n = 4096 - (fresh.rank == 1)
    x = data(fresh.rank, n, np.float32)
    before = x.copy()
    with pytest.raises(mpiring.MismatchError) as info:
        fresh.all_reduce(x)
    expected = "all_reduce#1: count differs: " + row(fresh, lambda r: 4095 if r == 1 else 4096)
    assert str(info.value) == expected
    assert isinstance(info.value, ValueError)
    np.testing.assert_array_equal(x, before, err_msg="no byte may move before the check")
    still_works(fresh)


def test_dtype_mismatch(fresh):
    odd = min(2, fresh.size - 1)  # rank 2, or the last where there are fewer (NP=2)
    dtype = np.float64 if fresh.rank == odd else np.float32
    with pytest.raises(mpiring.MismatchError, match="^all_reduce#1: dtype differs: " + row(
            fresh, lambda r: "float64" if r == odd else "float32") + "$"):
        fresh.all_reduce(np.zeros(16, dtype=dtype))
    still_works(fresh)


def test_op_mismatch(fresh):
    op = "max" if fresh.rank == fresh.size - 1 else "sum"
    with pytest.raises(mpiring.MismatchError, match="^reduce_scatter#1: op differs: " + row(
            fresh, lambda r: "max" if r == fresh.size - 1 else "sum") + "$"):
        fresh.reduce_scatter(np.zeros(16, dtype=np.float32), op=op)
    still_works(fresh)


def test_root_mismatch(fresh):
    with pytest.raises(mpiring.MismatchError, match="^broadcast#1: root differs: " + row(
            fresh, lambda r: r % 2) + "$"):
        fresh.broadcast(np.zeros(16, dtype=np.float32), root=fresh.rank % 2)
    still_works(fresh)


def test_algo_mismatch(fresh):
    algo = "native" if fresh.rank == 0 else "ring"
    with pytest.raises(mpiring.MismatchError, match="^all_gather#1: algo differs: " + row(
            fresh, lambda r: "native" if r == 0 else "ring") + "$"):
        fresh.all_gather(np.zeros(16, dtype=np.float32), algo=algo)
    still_works(fresh)


def test_chunks_mismatch(fresh):
    chunks = 8 if fresh.rank == 1 else 4
    with pytest.raises(mpiring.MismatchError, match="^reduce#1: chunks differs: " + row(
            fresh, lambda r: 8 if r == 1 else 4) + "$"):
        fresh.reduce(np.zeros(64, dtype=np.float32), algo="pipelined", chunks=chunks)
    still_works(fresh)


@pytest.mark.parametrize("algo", ["ring-seg", "auto", "ring"])
def test_segment_bytes_mismatch(fresh, algo):
    """Ranks that would cut ring-seg's messages differently raise before any byte moves
    (also when the call does not ask for ring-seg: ``auto`` may pick it)."""
    fresh.segment_bytes = 4096 if fresh.rank == 1 else 1 << 20
    with pytest.raises(mpiring.MismatchError, match="^all_reduce#1: segment_bytes differs: " + row(
            fresh, lambda r: 4096 if r == 1 else 1 << 20) + "$"):
        fresh.all_reduce(np.zeros(1 << 16, dtype=np.float32), algo=algo)
    fresh.segment_bytes = 4096
    still_works(fresh)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "1M", True, None])
def test_segment_bytes_must_be_a_positive_int(world, bad):
    comm = world.dup()
    with pytest.raises(ValueError, match="segment_bytes=.*positive number of bytes"):
        comm.segment_bytes = bad
    assert comm.segment_bytes == 4 << 20


def test_collective_mismatch_is_reported_alone(fresh):
    x = np.zeros(16, dtype=np.float32)
    names = lambda r: "broadcast" if r == 1 else "all_reduce"  # noqa: E731
    with pytest.raises(mpiring.MismatchError) as info:
        if fresh.rank == 1:
            fresh.broadcast(x, root=0)
        else:
            fresh.all_reduce(x)
    message = str(info.value)
    assert message == f"{names(fresh.rank)}#1: collective differs: {row(fresh, names)}"
    still_works(fresh)


def test_several_fields_differ_all_are_listed(fresh):
    n = 10 + (fresh.rank == 0)
    dtype = np.float64 if fresh.rank == 0 else np.float32
    with pytest.raises(mpiring.MismatchError) as info:
        fresh.all_reduce(np.zeros(n, dtype=dtype))
    assert "count differs: r0=11 r1=10" in str(info.value)
    assert "; dtype differs: r0=float64 r1=float32" in str(info.value)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather",
                                        "broadcast", "reduce"])
def test_every_collective_is_checked(comm, collective):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    x = np.zeros(100 + (comm.rank == comm.size - 1), dtype=np.float32)
    with pytest.raises(mpiring.MismatchError, match=f"{collective}#\\d+: count differs"):
        getattr(comm, collective)(x)
    still_works(comm)


# --- bad input: a TypeError/ValueError naming the fix, on every rank -----------------

def _torch_grad(n):
    torch = pytest.importorskip("torch")
    return {"x": torch.zeros(n, requires_grad=True)}


class ForeignGpuArray:
    """Host memory posing as another library's GPU array (the mpi4py test suite's trick)."""

    def __init__(self, n):
        self._host = np.zeros(n, dtype=np.float32)
        self.dtype = self._host.dtype
        self.flags = self._host.flags
        self.size = self._host.size
        self.nbytes = self._host.nbytes

    def reshape(self, *shape):
        return self._host.reshape(*shape)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self._host.ctypes.data, False), "version": 3}


class FakeCupyArray(ForeignGpuArray):
    """The same posing as a CuPy array: a CUDA buffer, staged through host memory on
    the MPI backend, which needs CuPy; without it every rank must stop before data moves."""

    __module__ = "cupy"


def _readonly(n):
    x = np.zeros(n, dtype=np.float32)
    x.setflags(write=False)
    return {"x": x}


# name -> (collective, make kwargs for the bad rank, exception, fix the message must name)
BAD = {
    "complex": ("all_reduce", lambda n: {"x": np.zeros(n, dtype=np.complex64)}, TypeError,
                "unsupported dtype complex64.*cast the buffer"),
    "bool": ("all_reduce", lambda n: {"x": np.zeros(n, dtype=bool)}, TypeError,
             "unsupported dtype bool.*cast"),
    "object": ("all_gather", lambda n: {"x": np.zeros(n, dtype=object)}, TypeError,
               "unsupported dtype object.*cast"),
    "not-an-array": ("all_reduce", lambda n: {"x": [0.0] * n}, TypeError,
                     "unsupported buffer type list: pass a numpy array"),
    "non-contiguous": ("all_reduce", lambda n: {"x": np.zeros(2 * n, dtype=np.float32)[::2]},
                       ValueError, "not contiguous.*ascontiguousarray"),
    "read-only": ("all_reduce", _readonly, ValueError, r"read-only.*x\.copy\(\)"),
    "requires-grad": ("all_reduce", _torch_grad, ValueError, r"requires grad.*x\.detach\(\)"),
    "unknown-op": ("all_reduce", lambda n: {"x": np.zeros(n, np.float32), "op": "mean"},
                   ValueError, "unknown op 'mean': use one of sum, avg, max, min, prod"),
    "op-not-a-name": ("reduce", lambda n: {"x": np.zeros(n, np.float32), "op": ["sum"]},
                      ValueError, "unknown op"),
    "unknown-algo": ("all_reduce", lambda n: {"x": np.zeros(n, np.float32), "algo": "tree"},
                     ValueError, "unknown algo 'tree' for all_reduce: use one of .*ring"),
    "avg-on-int": ("all_reduce", lambda n: {"x": np.zeros(n, np.int32), "op": "avg"},
                   ValueError, "avg' is not defined for integer dtype int32.*op='sum'"),
    "root-out-of-range": ("broadcast", lambda n: {"x": np.zeros(n, np.float32), "root": 99},
                          ValueError, r"root=99 out of range: use a rank in 0\.\.\d"),
    "root-not-int": ("reduce", lambda n: {"x": np.zeros(n, np.float32), "root": 1.0},
                     ValueError, "root=1.0 out of range"),
    "negative-chunks": ("broadcast", lambda n: {"x": np.zeros(n, np.float32), "chunks": -2},
                        ValueError, "chunks=-2: the pipeline needs a positive integer"),
    "fractional-chunks": ("reduce", lambda n: {"x": np.zeros(n, np.float32), "chunks": 2.5},
                          ValueError, "chunks=2.5: the pipeline needs a positive integer"),
    "bool-chunks": ("broadcast", lambda n: {"x": np.zeros(n, np.float32), "chunks": True},
                    ValueError, "chunks=True"),
    "foreign-gpu-array": ("all_reduce", lambda n: {"x": ForeignGpuArray(n)}, TypeError,
                          r"unsupported GPU array type ForeignGpuArray.*cupy\.asarray\(x\)"),
    "cuda-without-cupy": ("all_reduce", lambda n: {"x": FakeCupyArray(n)}, TypeError,
                          r"CUDA buffer on the MPI backend needs CuPy: pip install"),
    "native-bfloat16": ("all_reduce", lambda n: {"x": np.zeros(n, BFLOAT16), "algo": "native"},
                        TypeError, "cannot reduce bfloat16.*algo='ring'"),
}


@pytest.mark.parametrize("case,who", [(case, "one") for case in BAD] + [
    ("complex", "all"), ("read-only", "all"), ("root-out-of-range", "all")])
def test_bad_input_raises_on_every_rank_before_data_moves(fresh, case, who):
    collective, make, exc_type, fix = BAD[case]
    if case == "cuda-without-cupy" and importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: this fake would be staged (tests/test_gpu_cpu_side.py)")
    n = 24
    bad_rank = 2 % fresh.size
    is_bad = who == "all" or fresh.rank == bad_rank
    kwargs = make(n) if is_bad else {"x": data(fresh.rank, n, np.float32)}
    x = kwargs["x"]
    before = x.copy() if isinstance(x, np.ndarray) else None
    if is_bad:
        with pytest.raises(exc_type, match=fix):
            getattr(fresh, collective)(**kwargs)
    else:
        with pytest.raises(ValueError, match=f"^{collective}#1: no rank ran the collective "
                                             f"because r{bad_rank} rejected its input "
                                             f"\\({exc_type.__name__}: ") as info:
            getattr(fresh, collective)(**kwargs)
        assert not isinstance(info.value, mpiring.MismatchError)
        assert re.search(fix, str(info.value)), "the message must carry the bad rank's fix"
    if before is not None:
        np.testing.assert_array_equal(x, before, err_msg="no byte may move before the check")
    still_works(fresh)


def test_bad_input_on_a_single_rank_communicator(subcomms, world):
    one = subcomms[1]
    if one is None:
        pytest.skip("rank 0 only")
    with pytest.raises(TypeError, match="unsupported dtype complex128"):
        one.all_reduce(np.zeros(4, dtype=np.complex128))


# --- switching the check off ----------------------------------------------------------

class CountingExchange:
    def __init__(self, be):
        self.be, self.real, self.calls = be, be.exchange, 0

    def __call__(self, values):
        self.calls += 1
        return self.real(values)


def test_check_false_per_call_skips_the_exchange(fresh):
    counter = CountingExchange(fresh._be)
    fresh._be.exchange = counter
    try:
        x = data(fresh.rank, 50, np.float32)
        fresh.all_reduce(x.copy(), algo="ring")
        assert counter.calls == 1
        fresh.all_reduce(x.copy(), algo="ring", check=False)
        fresh.broadcast(x.copy(), check=False)
        assert counter.calls == 1, "check=False must not exchange descriptors"
    finally:
        del fresh._be.exchange
    still_works(fresh)


def test_mpiring_check_0_turns_it_off_for_new_communicators(world, monkeypatch):
    monkeypatch.setenv("MPIRING_CHECK", "0")
    quiet = mpiring.init()
    assert quiet.check is False
    assert quiet.dup().check is False
    counter = CountingExchange(quiet._be)
    quiet._be.exchange = counter
    still_works(quiet)
    assert counter.calls == 0
    quiet.all_reduce(np.zeros(3, np.float32), algo="ring", check=True)  # per call wins
    assert counter.calls == (1 if quiet.size > 1 else 0)


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown backend 'bogus': use one of mpi, nccl"):
        mpiring.init(backend="bogus")


def test_check_cost_command_runs(world, capsys):
    from argparse import Namespace

    from mpiring.cli import check_cost

    assert check_cost.run(Namespace(sizes=[1024], iters=3)) == 0  # as the parser gives it
    out = capsys.readouterr().out
    if world.rank == 0:
        assert "check on" in out and "1.0 KiB" in out and "watchdog stamp" in out, out


def test_an_extra_call_on_one_rank_is_named(fresh):
    x = np.zeros(8, dtype=np.float32)
    if fresh.rank == 0:  # as if r0 had made one all_reduce more than the others
        fresh._calls["all_reduce"] = 1
    expected = "^all_reduce#\\d: call differs: " + row(fresh, lambda r: 2 if r == 0 else 1)
    with pytest.raises(mpiring.MismatchError, match=expected + " \\(a rank made more or fewer "
                                                    "all_reduce calls"):
        fresh.all_reduce(x, algo="ring")
    fresh._calls["all_reduce"] = 0  # back in step
