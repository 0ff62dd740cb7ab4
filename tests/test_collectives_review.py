"""Adversarial buffers on the collectives and point-to-point calls (a review's findings).

Every algorithm against MPI's own collective and NumPy on odd shapes (0-d, empty,
fewer elements than ranks, uneven), torch views with storage offsets, integer
overflow, NaN and signed zeros; point-to-point with send and receive buffers that
alias, and with read-only send buffers. Data depends on rank and index.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import data
from mpi4py import MPI

from mpiring import MismatchError

ALL_REDUCE = ("ring", "ring-seg", "recursive-doubling", "halving-doubling", "native", "auto")
SCATTER = ("ring", "ring-seg", "native", "auto")
ROOTED = ("ring", "pipelined", "native")


def gathered(comm, x: np.ndarray) -> list[bytes]:
    """Every rank's bytes of ``x``, through mpi4py (not the code under test)."""
    return comm.mpi_comm.allgather(np.ascontiguousarray(x).tobytes())


def signed_zeros_and_nans(rank: int, n: int = 12) -> np.ndarray:
    """+0.0 and -0.0 alternating by rank, NaNs of both signs on some ranks."""
    x = np.where((np.arange(n) + rank) % 2 == 0, 0.0, -0.0).astype(np.float32)
    x[3] = np.nan if rank == 1 else 1.0
    x[5] = -np.nan if rank == 2 else (np.nan if rank == 0 else 2.0)
    x[7] = np.inf if rank == 0 else -np.inf
    return x


@pytest.mark.parametrize("op", ("max", "min"))
@pytest.mark.parametrize("algo", ALL_REDUCE)
def test_max_min_leave_every_rank_the_same_bits(comm, algo, op):
    # Recursive doubling used to combine max(mine, partner's) on both sides: for
    # 0.0 and -0.0 (and two NaNs) np.maximum returns its first operand, so the
    # partners ended with different bits (r0 -0.0, r1 +0.0 on 2 ranks).
    x = signed_zeros_and_nans(comm.rank)
    out = comm.all_reduce(x.copy(), op=op, algo=algo)
    rows = gathered(comm, out)
    assert all(r == rows[0] for r in rows), f"{algo} {op}: ranks hold different bits"
    ufunc = np.maximum if op == "max" else np.minimum
    want = ufunc.reduce(np.stack([signed_zeros_and_nans(r) for r in range(comm.size)]), axis=0)
    if algo != "native":  # MPICH's MPI_MAX is (a > b ? a : b): it may drop a NaN
        np.testing.assert_array_equal(out, want)  # NaN == NaN and 0.0 == -0.0 here


@pytest.mark.parametrize("algo", ALL_REDUCE)
def test_all_reduce_odd_shapes_equal_numpy_and_native(comm, algo):
    k = comm.size
    for n in (0, 1, max(k - 1, 1), k + 1, 3 * k + 2):
        for shape in ((n,), (1, n, 1)):
            x = data(comm.rank, n, np.float32).reshape(shape)
            want = sum(data(r, n, np.float32) for r in range(k)).reshape(shape)
            got = comm.all_reduce(x.copy(), algo=algo)
            np.testing.assert_array_equal(got, want, err_msg=f"n={n} {shape}")
            assert got.shape == shape
    zero_d = np.array(float(comm.rank + 1))
    assert comm.all_reduce(zero_d, algo=algo) is zero_d
    assert zero_d.shape == () and float(zero_d) == k * (k + 1) / 2
    t = torch.tensor(float(comm.rank + 1), dtype=torch.float64)
    assert float(comm.all_reduce(t, algo=algo)) == k * (k + 1) / 2


@pytest.mark.parametrize("algo", SCATTER)
def test_reduce_scatter_and_all_gather_uneven_and_tiny(comm, algo):
    k = comm.size
    for n in (0, 1, max(k - 1, 1), 2 * k + 1, 5 * k + 3):
        x = data(comm.rank, n, np.int32)
        want = sum(data(r, n, np.int32) for r in range(k))
        lo, hi = comm.chunk_bounds(n)[comm.rank]
        mine = comm.reduce_scatter(x, algo=algo)
        np.testing.assert_array_equal(mine, want[lo:hi], err_msg=f"n={n}")
        assert np.shares_memory(mine, x) or hi == lo  # a view of chunk rank of x
        full = np.full(n, -99, np.int32)
        full[lo:hi] = want[lo:hi]
        np.testing.assert_array_equal(comm.all_gather(full, algo=algo), want, err_msg=f"n={n}")


@pytest.mark.parametrize("algo", ALL_REDUCE)
def test_torch_view_with_storage_offset_reduces_only_itself(comm, algo):
    base = torch.arange(40, dtype=torch.float32) * 3 + comm.rank
    view = base[7:30]  # storage offset 7, 23 elements: no K from 2 to 4 divides it
    comm.all_reduce(view, algo=algo)
    want = sum(torch.arange(40, dtype=torch.float32) * 3 + r for r in range(comm.size))
    torch.testing.assert_close(base[7:30], want[7:30], rtol=0, atol=0)
    torch.testing.assert_close(base[:7], torch.arange(7, dtype=torch.float32) * 3 + comm.rank)
    torch.testing.assert_close(base[30:], torch.arange(30, 40, dtype=torch.float32) * 3 + comm.rank)


@pytest.mark.parametrize("dtype", ("int8", "uint8", "int32"))
@pytest.mark.parametrize("algo", ALL_REDUCE)
def test_integer_overflow_wraps_as_in_mpi_allreduce(comm, algo, dtype):
    info = np.iinfo(dtype)
    x = (info.max - np.arange(9) * 3 - comm.rank).astype(dtype)
    want = x.copy()
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, want, MPI.SUM)
    np.testing.assert_array_equal(comm.all_reduce(x, algo=algo), want)


@pytest.mark.parametrize("algo", ROOTED)
def test_broadcast_and_reduce_from_every_root_on_tiny_buffers(comm, algo):
    k = comm.size
    for root in range(k):
        for n in (0, 1, k + 1):
            for chunks in (None, 1, 3 * n + 2):
                x = data(comm.rank, n, np.float64)
                np.testing.assert_array_equal(
                    comm.broadcast(x.copy(), root=root, algo=algo, chunks=chunks),
                    data(root, n, np.float64))
                want = sum(data(r, n, np.float64) for r in range(k)) if comm.rank == root else x
                np.testing.assert_array_equal(
                    comm.reduce(x.copy(), root=root, algo=algo, chunks=chunks), want)


def test_other_dtype_on_one_rank_is_refused_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    for algo in ALL_REDUCE:
        x = data(comm.rank, 6, np.float64 if comm.rank == comm.size - 1 else np.int64)
        with pytest.raises((MismatchError, ValueError), match="dtype"):
            comm.all_reduce(x, algo=algo)
        np.testing.assert_array_equal(x, data(comm.rank, 6, x.dtype))  # nothing moved


@pytest.mark.parametrize("bad", ("requires_grad", "big-endian", "read-only", "fortran"))
def test_a_bad_buffer_on_one_rank_is_refused_on_every_rank(comm, bad):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    odd = comm.rank == comm.size - 1
    for collective, algos in (("all_reduce", ALL_REDUCE), ("reduce_scatter", SCATTER),
                              ("all_gather", SCATTER), ("broadcast", ROOTED),
                              ("reduce", ROOTED)):
        for algo in algos:
            x = torch.arange(12, dtype=torch.float32).reshape(3, 4) + comm.rank
            if odd and bad == "requires_grad":
                x.requires_grad_(True)
            elif bad != "requires_grad":
                x = x.numpy()
                if odd and bad == "big-endian":
                    x = x.astype(">f4")
                elif odd and bad == "read-only":
                    x.setflags(write=False)
                elif odd:
                    x = np.asfortranarray(x)
            with pytest.raises(ValueError) as info:
                getattr(comm, collective)(x, algo=algo)
            if not odd:  # the others quote the rank that refused its input
                assert f"r{comm.size - 1} rejected its input" in str(info.value)
            expect = (np.arange(12, dtype=np.float32) + comm.rank).reshape(3, 4)
            np.testing.assert_array_equal(np.asarray(x.detach() if bad == "requires_grad"
                                                     else x), expect)  # nothing moved


# --- point-to-point ----------------------------------------------------------

# 1 MiB of float64: over MPICH's eager limit, so the send is read from our memory
# only once the peer is ready (where an aliased receive has already landed).
BIG = 1 << 17


@pytest.mark.parametrize("n", (0, 1, 5, BIG))
def test_sendrecv_with_the_same_buffer_sends_the_old_contents(comm, n):
    # comm.sendrecv(x, right, x, left) used to post the receive into x before the
    # send from x: with 64 Ki elements or more a rank got its neighbour's new data
    # (or its own) instead of what the neighbour held: silently wrong on 2-4 ranks.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = data(comm.rank, n, np.float64, salt=3)
    assert comm.sendrecv(x, right, x, left) is x
    np.testing.assert_array_equal(x, data(left, n, np.float64, salt=3))

    t = torch.from_numpy(data(comm.rank, n, np.float32, salt=5))
    comm.sendrecv(t, right, t, left)  # the same tensor passed twice
    np.testing.assert_array_equal(t.numpy(), data(left, n, np.float32, salt=5))


def test_sendrecv_with_overlapping_slices(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    half = BIG // 2
    a = np.zeros(BIG + half, np.float64)
    a[:BIG] = data(comm.rank, BIG, np.float64)
    comm.sendrecv(a[:BIG], right, a[half:], left)  # overlap: a[half:BIG]
    np.testing.assert_array_equal(a[half:], data(left, BIG, np.float64))
    np.testing.assert_array_equal(a[:half], data(comm.rank, half, np.float64))


@pytest.mark.parametrize("how", ("isend", "prepared"))
def test_send_and_receive_of_one_buffer_in_a_group_is_refused(comm, how):
    # Posted together, a receive into x lands while the send from x waits for its
    # peer: the neighbour got our new data, silently (comm.sendrecv did this too).
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    tag = 977  # a tag of its own: the refused group leaves a receive posted
    x = torch.full((BIG,), float(comm.rank), dtype=torch.float64)
    prepared = comm.prepare_send(x, right, tag=tag) if how == "prepared" else None
    with pytest.raises(ValueError, match="overlaps.*sendrecv"):
        with comm.group():
            comm.irecv(x, left, tag=tag)
            if prepared is None:
                comm.isend(x[BIG // 2:], right, tag=tag)  # refused before it is posted
            else:
                prepared.post(x)  # the raw-pointer path of a torch CPU tensor
    # Nothing was sent: give the receive that the group left posted its message.
    comm.send(torch.full((BIG,), float(comm.rank), dtype=torch.float64), right, tag=tag)
    comm.mpi_comm.Barrier()
    assert bool((x == float(left)).all())


def read_only(values: np.ndarray, how: str) -> np.ndarray:
    if how == "frombuffer":
        return np.frombuffer(values.tobytes(), dtype=values.dtype)
    out = values.copy()
    out.setflags(write=False)
    return out


@pytest.mark.parametrize("how", ("frombuffer", "setflags"))
def test_read_only_buffers_can_be_sent(comm, how):
    # A send only reads its buffer, and MPI sends from read-only memory; the
    # writable check (meant for collectives, which write) used to refuse it.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for n in (0, 1, 7, BIG):
        out = read_only(data(comm.rank, n, np.float32, salt=n), how)
        got = np.full(n, -1, np.float32)
        comm.sendrecv(out, right, got, left)
        np.testing.assert_array_equal(got, data(left, n, np.float32, salt=n))
        with comm.group():
            comm.irecv(got, left, tag=4)
            comm.isend(out, right, tag=4)
        np.testing.assert_array_equal(got, data(left, n, np.float32, salt=n))
        prepared = comm.prepare_send(out, right, tag=5)
        with comm.group():
            comm.irecv(got, left, tag=5)
            prepared.post(out)
        np.testing.assert_array_equal(got, data(left, n, np.float32, salt=n))


def test_read_only_buffers_are_still_refused_where_written_or_malformed(comm):
    ro = read_only(np.arange(8, dtype=np.float32), "setflags")
    with pytest.raises(ValueError, match="read-only"):
        comm.irecv(ro, 0)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(ro)
    with pytest.raises(ValueError, match="contiguous"):
        comm.isend(read_only(np.arange(8, dtype=np.float32), "setflags")[::2], 0)
    with pytest.raises(ValueError, match="byte order"):
        comm.isend(read_only(np.arange(8, dtype=">f4"), "frombuffer"), 0)
    with pytest.raises(TypeError, match="dtype"):
        comm.isend(read_only(np.arange(8, dtype=np.int16), "frombuffer"), 0)


def test_sendrecv_with_a_bad_send_buffer_posts_nothing(comm):
    # The receive used to be posted before the send buffer was checked: a refused
    # sendrecv left it behind, and it took the next message on that tag, so the
    # next receive waited for ever (here: until the 10 s below).
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    tag = 978
    got = np.full(4, -1.0)
    with pytest.raises(ValueError, match="contiguous"):
        comm.sendrecv(np.arange(8.0)[::2], right, got, left, tag=tag)
    req = comm.irecv(got, left, tag=tag)
    comm.isend(np.full(4, float(comm.rank)), right, tag=tag).wait()
    deadline = time.monotonic() + 10
    while not req.test():
        assert time.monotonic() < deadline, "the receive got no message: a leaked one took it"
        time.sleep(0.001)
    np.testing.assert_array_equal(got, float(left))
