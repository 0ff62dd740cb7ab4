"""Differential tests: every ring result against the MPI library's own collective.

World sizes 1-4 come from sub-communicators of the test job (fixture ``comm``);
data depends on rank and index, so a chunk in the wrong place is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FLOATS, OPS, data, np_dtype, sizes

from mpiring.core.buffers import DTYPES


def reference(comm, n, dtype, op, salt=0):
    """What the reduction must be, computed in float64 from every rank's data."""
    stack = np.stack([data(r, n, dtype, op, salt).astype(np.float64) for r in range(comm.size)])
    out = {"sum": stack.sum(0), "avg": stack.sum(0) / comm.size, "max": stack.max(0),
           "min": stack.min(0), "prod": stack.prod(0)}[op]
    return out.astype(np_dtype(dtype))


def valid(op, dtype):
    return not (op == "avg" and dtype not in FLOATS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_all_reduce_ring_equals_native(comm, dtype, op):
    if not valid(op, dtype):
        pytest.skip("avg is not defined for integers (tested in test_errors)")
    for n in sizes(comm.size):
        x = data(comm.rank, n, np_dtype(dtype), op)
        ring = comm.all_reduce(x.copy(), op=op, algo="ring")
        expected = reference(comm, n, dtype, op)
        np.testing.assert_array_equal(ring, expected, err_msg=f"n={n}")
        if dtype != "bfloat16":  # MPI has no bfloat16 reduction
            native = comm.all_reduce(x.copy(), op=op, algo="native")
            np.testing.assert_array_equal(ring, native, err_msg=f"n={n}")


def bits(rank: int, n: int, dtype) -> np.ndarray:
    """Rank- and index-dependent bit patterns (signs included), for the bitwise ops."""
    idx = np.arange(n, dtype=np.int64)
    return ((idx * 37 + rank * 11 + 5) % 251 - 120).astype(dtype)


@pytest.mark.parametrize("dtype", ("int8", "uint8", "int32", "int64"))
@pytest.mark.parametrize("op", ("band", "bor", "bxor"))
def test_bitwise_ops_in_every_algorithm_equal_native(comm, dtype, op):
    # torch's ReduceOp.BAND/BOR/BXOR: the ring's reduction is the op's ufunc.
    ufunc = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    for n in sizes(comm.size):
        x = bits(comm.rank, n, dtype)
        want = ufunc.reduce(np.stack([bits(r, n, dtype) for r in range(comm.size)]), axis=0)
        for algo in ("ring", "ring-seg", "recursive-doubling", "halving-doubling", "auto",
                     "native"):
            np.testing.assert_array_equal(comm.all_reduce(x.copy(), op=op, algo=algo), want,
                                          err_msg=f"{algo} n={n}")
        lo, hi = comm.chunk_bounds(n)[comm.rank]
        for algo in ("ring", "native"):
            view = comm.reduce_scatter(x.copy(), op=op, algo=algo)
            np.testing.assert_array_equal(view, want[lo:hi], err_msg=f"{algo} n={n}")
        for root in range(comm.size):
            y = comm.reduce(x.copy(), root=root, op=op, algo="pipelined", chunks=3)
            np.testing.assert_array_equal(y, want if comm.rank == root else x)


def test_bitwise_ops_refuse_floats_on_every_rank(comm):
    with pytest.raises(ValueError, match="op 'bor' is not defined for floating dtype float32"):
        comm.all_reduce(np.ones(3, np.float32), op="bor")
    x = bits(comm.rank, 5, np.int32)  # and the communicator still works
    np.testing.assert_array_equal(comm.all_reduce(x.copy(), op="bor"),
                                  np.bitwise_or.reduce([bits(r, 5, np.int32)
                                                        for r in range(comm.size)], axis=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ("sum", "avg", "max"))
def test_reduce_scatter_leaves_chunk_r_and_returns_its_view(comm, dtype, op):
    if not valid(op, dtype):
        pytest.skip("avg is not defined for integers")
    for n in sizes(comm.size):
        lo, hi = comm.chunk_bounds(n)[comm.rank]
        x = data(comm.rank, n, np_dtype(dtype), op)
        y = x.copy()
        view = comm.reduce_scatter(y, op=op, algo="ring")
        expected = reference(comm, n, dtype, op)[lo:hi]
        np.testing.assert_array_equal(view, expected, err_msg=f"n={n}")
        assert view.size == 0 or np.shares_memory(view, y), "must return a view of x"
        if dtype != "bfloat16":
            z = x.copy()
            native = comm.reduce_scatter(z, op=op, algo="native")
            np.testing.assert_array_equal(view, native)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algo", ("ring", "native"))
def test_all_gather_fills_every_chunk_from_its_owner(comm, dtype, algo):
    for n in sizes(comm.size):
        bounds = comm.chunk_bounds(n)
        full = np.concatenate([data(r, n, np_dtype(dtype), salt=1)[a:b]
                               for r, (a, b) in enumerate(bounds)]).astype(np_dtype(dtype))
        x = np.full(n, 99, dtype=np_dtype(dtype))  # garbage outside our own chunk
        lo, hi = bounds[comm.rank]
        x[lo:hi] = full[lo:hi]
        comm.all_gather(x, algo=algo)
        np.testing.assert_array_equal(x, full, err_msg=f"n={n}")


@pytest.mark.parametrize("algo,chunks", [("ring", None), ("pipelined", None), ("pipelined", 1),
                                         ("pipelined", 3), ("pipelined", 64), ("native", None)])
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int8", "float64"))
def test_broadcast_from_every_root(comm, algo, chunks, dtype):
    for n in sizes(comm.size):
        for root in range(comm.size):
            x = data(comm.rank, n, np_dtype(dtype), salt=root)
            comm.broadcast(x, root=root, algo=algo, chunks=chunks)
            np.testing.assert_array_equal(x, data(root, n, np_dtype(dtype), salt=root))


@pytest.mark.parametrize("algo,chunks", [("ring", None), ("pipelined", 4), ("pipelined", None),
                                         ("native", None)])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ("float32", "int32", "uint8", "float16", "bfloat16"))
def test_reduce_to_every_root(comm, algo, chunks, op, dtype):
    if not valid(op, dtype) or (algo == "native" and dtype == "bfloat16"):
        pytest.skip("not defined")
    for n in sizes(comm.size):
        for root in range(comm.size):
            x = data(comm.rank, n, np_dtype(dtype), op)
            before = x.copy()
            comm.reduce(x, root=root, op=op, algo=algo, chunks=chunks)
            if comm.rank == root:
                np.testing.assert_array_equal(x, reference(comm, n, dtype, op))
            else:
                np.testing.assert_array_equal(x, before, err_msg="non-root input must not change")


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16", "int64", "uint8"))
def test_torch_tensors_zero_copy(comm, dtype):
    torch = pytest.importorskip("torch")
    tdtype = getattr(torch, dtype)
    for n in sizes(comm.size):
        base = torch.from_numpy(data(comm.rank, n, np.float64)).to(tdtype)
        t = base.clone().reshape(-1, 1) if n else base.clone()
        ptr = t.data_ptr()
        out = comm.all_reduce(t, algo="ring")
        assert out is t and t.data_ptr() == ptr
        expected = torch.from_numpy(reference(comm, n, "float64", "sum")).to(tdtype)
        assert torch.equal(t.reshape(-1), expected)
        view = comm.reduce_scatter(base.clone())
        lo, hi = comm.chunk_bounds(n)[comm.rank]
        assert isinstance(view, torch.Tensor) and torch.equal(view, expected[lo:hi])


def test_avg_float_matches_native(comm):
    x = np.arange(37, dtype=np.float32) * (comm.rank + 1) / 3
    ring = comm.all_reduce(x.copy(), op="avg", algo="ring")
    native = comm.all_reduce(x.copy(), op="avg", algo="native")
    np.testing.assert_allclose(ring, native, rtol=1e-6)


@pytest.mark.parametrize("stream", (False, True), ids=["lecture-loop", "streamed"])
def test_pipelined_broadcast_loop_and_streamed_agree(comm, stream):
    """Both forms of the pipeline: every chunk count, every root, sizes around the chunk count."""
    from mpiring.collectives import pipelined_broadcast

    for root in range(comm.size):
        for n in (0, 1, 5, 1000):
            for chunks in (1, 2, 3, 7, 64):
                src = data(root, n, "float32", "sum", salt=chunks)
                x = src.copy() if comm.rank == root else np.full(n, -1, dtype=np.float32)
                pipelined_broadcast(comm._be, x, root, chunks,
                                    comm.tracer.call("broadcast", 0, "t"), stream=stream)
                np.testing.assert_array_equal(x, src, err_msg=f"root={root} n={n} S={chunks}")


@pytest.mark.parametrize("idle", ("yield", "sleep"))
@pytest.mark.parametrize("algo", ("ring", "ring-seg", "halving-doubling"))
def test_polling_waits_give_the_same_result(comm, idle, algo):
    """The MPI backend's polling waits (more ranks than cores; DDP's comm thread)."""
    if comm.backend != "mpi":
        pytest.skip("MPI backend only")
    saved, comm.idle = comm.idle, idle
    try:
        for n in (0, 3, 1000, 70001):
            x = data(comm.rank, n, "float32", "sum", salt=n)
            got = comm.all_reduce(x.copy(), op="sum", algo=algo)
            want = comm.all_reduce(x.copy(), op="sum", algo="native")
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"n={n}")
            y = np.full(n, comm.rank, dtype=np.int32)
            comm.broadcast(y, root=comm.size - 1, algo="ring")
            assert (y == comm.size - 1).all()
    finally:
        comm.idle = saved


def test_idle_mode_is_checked(comm):
    if comm.backend != "mpi":
        pytest.skip("MPI backend only")
    assert comm.idle in ("spin", "yield", "sleep")
    with pytest.raises(ValueError, match="use one of spin, yield, sleep"):
        comm.idle = "nap"
    assert comm.idle in ("spin", "yield", "sleep")


@pytest.mark.deadline(120)
@pytest.mark.slow
def test_256_mib_all_reduce(world):
    """At least 256 MiB through the ring, compared with MPI_Allreduce."""
    n = (256 << 20) // 4
    x = np.empty(n, dtype=np.float32)
    x[:] = (np.arange(n, dtype=np.int64) % 1009 + world.rank).astype(np.float32)
    ring = world.all_reduce(x.copy(), algo="ring")
    native = world.all_reduce(x, algo="native")
    assert np.array_equal(ring, native)
    del ring, native, x


def test_receive_buffer_is_allocated_once_and_reused(comm):
    """No allocation per step, nor per call once the cache is warm."""
    x = data(comm.rank, 4096, np.float32)
    comm.all_reduce(x.copy(), algo="ring")
    cached = dict(comm._be._scratch)
    if comm.size > 1:  # the ring received into it (one rank sends nothing)
        assert cached, "the ring allocated no receive buffer: did the ring run?"
    comm.all_reduce(x.copy(), algo="ring")
    comm.all_reduce(x[: 1000].copy(), algo="ring")
    assert {k: id(v) for k, v in comm._be._scratch.items()} == {k: id(v) for k, v in cached.items()}


def test_idle_mode_from_the_environment(monkeypatch):
    from mpiring.backends.mpi import _idle_mode

    monkeypatch.setenv("MPIRING_IDLE", "sleep")
    assert _idle_mode(1) == "sleep"
    monkeypatch.setenv("MPIRING_IDLE", "nap")
    with pytest.raises(ValueError, match="spin, yield, sleep"):
        _idle_mode(1)
    monkeypatch.setenv("MPIRING_IDLE", "yield")
    assert _idle_mode(1) == "yield"
    monkeypatch.setenv("MPIRING_IDLE", "spin")
    assert _idle_mode(10 ** 6) == "spin"
    monkeypatch.delenv("MPIRING_IDLE")
    assert _idle_mode(10 ** 6) == "yield"  # more ranks than cores: give the core away
