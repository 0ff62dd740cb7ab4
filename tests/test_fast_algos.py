"""The fast algorithms beside the lecture's ring: segmented ring, recursive doubling,
halving-doubling, auto.

Differential tests against the MPI library's own collectives (K = 1..4 through
the ``comm`` fixture, 5 in the odd-size job of test_collectives), the segment
and window corner cases with tiny segments, traces, and ``auto``: the same
choice on every rank, the cache and the refit.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import FLOATS, OPS, data, np_dtype, sizes

from mpiring.collectives import segmented_all_reduce
from mpiring.comm import autotune
from mpiring.core.buffers import BFLOAT16, DTYPES
from mpiring.runtime.trace import Tracer, read_trace


def reference(k, n, dtype, op):
    stack = np.stack([data(r, n, dtype, op).astype(np.float64) for r in range(k)])
    out = {"sum": stack.sum(0), "avg": stack.sum(0) / k, "max": stack.max(0),
           "min": stack.min(0), "prod": stack.prod(0)}[op]
    return out.astype(np_dtype(dtype))


FAST = ("ring-seg", "recursive-doubling", "halving-doubling")
ALL_REDUCE_CASES = [(a, d) for a in FAST for d in DTYPES] + [
    ("auto", "float32"), ("auto", "bfloat16"), ("auto", "int32")]  # auto runs the others


@pytest.mark.parametrize(("algo", "dtype"), ALL_REDUCE_CASES)
def test_all_reduce_equals_native(comm, algo, dtype):
    for op in OPS:
        if op == "avg" and dtype not in FLOATS:
            continue
        for n in sizes(comm.size):
            x = data(comm.rank, n, np_dtype(dtype), op)
            got = comm.all_reduce(x.copy(), op=op, algo=algo)
            np.testing.assert_array_equal(got, reference(comm.size, n, dtype, op),
                                          err_msg=f"{op} n={n}")
            if dtype != "bfloat16":  # MPI cannot reduce bfloat16
                native = comm.all_reduce(x.copy(), op=op, algo="native")
                np.testing.assert_array_equal(got, native, err_msg=f"{op} n={n}")


@pytest.mark.parametrize("algo", ("ring-seg", "auto"))
@pytest.mark.parametrize("dtype", ("float32", "bfloat16", "int8", "float64"))
def test_reduce_scatter_and_all_gather_equal_native(comm, algo, dtype):
    t = np_dtype(dtype)
    for n in sizes(comm.size):
        lo, hi = comm.chunk_bounds(n)[comm.rank]
        for op in ("sum", "avg", "max") if dtype in FLOATS else ("sum", "max"):
            y = data(comm.rank, n, t, op)
            view = comm.reduce_scatter(y, op=op, algo=algo)
            np.testing.assert_array_equal(view, reference(comm.size, n, dtype, op)[lo:hi])
            assert view.size == 0 or np.shares_memory(view, y)
        full = np.concatenate([data(r, n, t, salt=1)[a:b]
                               for r, (a, b) in enumerate(comm.chunk_bounds(n))]).astype(t)
        x = np.zeros(n, dtype=t)
        x[lo:hi] = full[lo:hi]
        np.testing.assert_array_equal(comm.all_gather(x, algo=algo), full, err_msg=f"n={n}")


@pytest.mark.parametrize(("segment_bytes", "counts"), [(8, (7, 61)), (24, (1000,)),
                                                       (1 << 20, (4099,))])
def test_segments_and_windows(comm, segment_bytes, counts):
    """Many tiny segments, every window depth: each message lands in the right place."""
    for n in counts:
        for window in (1, 2, 3, 16):
            x = data(comm.rank, n, np.float64)
            segmented_all_reduce(comm._be, x, "sum", comm.tracer.call("all_reduce", 0, "t"),
                                 segment_bytes=segment_bytes, window=window)
            np.testing.assert_array_equal(x, reference(comm.size, n, "float64", "sum"),
                                          err_msg=f"n={n} window={window}")


def test_communicator_segment_bytes_cuts_the_messages_and_the_receive_buffer(comm):
    """comm.segment_bytes reaches all three segmented collectives; the receive buffer
    is two segments, not a chunk."""
    sub = comm.dup()
    sub.segment_bytes = 64  # 16 float32 per segment
    n = 4099
    x = data(comm.rank, n, np.float32)
    sub.all_reduce(x, algo="ring-seg")
    np.testing.assert_array_equal(x, reference(comm.size, n, "float32", "sum"))
    if comm.size > 1:
        (buf,) = sub._be._scratch.values()
        assert buf.size == 2 * 16, buf.size
    y = data(comm.rank, n, np.float32, salt=1)
    lo, hi = comm.chunk_bounds(n)[comm.rank]
    view = sub.reduce_scatter(y, algo="ring-seg")
    want = sum(data(r, n, np.float64, salt=1) for r in range(comm.size))[lo:hi]
    np.testing.assert_array_equal(view, want.astype(np.float32))
    z = np.zeros(n, dtype=np.float32)
    z[lo:hi] = lo + np.arange(hi - lo)
    sub.all_gather(z, algo="ring-seg")
    np.testing.assert_array_equal(z, np.arange(n, dtype=np.float32))


def test_torch_tensor(comm):
    torch = pytest.importorskip("torch")
    base = torch.from_numpy(data(comm.rank, 1003, np.float64)).to(torch.bfloat16)
    for algo in (*FAST, "auto"):
        t = base.clone()
        assert comm.all_reduce(t, algo=algo) is t
        expected = torch.from_numpy(reference(comm.size, 1003, "float64", "sum")).to(torch.bfloat16)
        assert torch.equal(t, expected), algo


@pytest.mark.parametrize("algo", FAST)
def test_fast_algorithms_record_their_steps(comm, tmp_path, algo):
    from mpiring import Communicator

    tc = Communicator(comm._be, Tracer(comm.rank, str(tmp_path)))
    n = 1001
    tc.all_reduce(data(comm.rank, n, np.float32), algo=algo)
    tc.tracer.close()
    steps = [r for r in read_trace(str(tmp_path)) if r["type"] == "step"]
    k, r = comm.size, comm.rank
    assert all(s["algo"] == algo and s["collective"] == "all_reduce" for s in steps)
    if algo == "ring-seg":  # the same traffic as the literal ring, step for step
        sizes_ = [b - a for a, b in comm.chunk_bounds(n)]
        assert len(steps) == 2 * (k - 1)
        assert [s["phase"] for s in steps] == ["reduce-scatter"] * (k - 1) + ["all-gather"] * (k - 1)
        assert sum(s["bytes_sent"] for s in steps) == \
            (4 * (2 * n - sizes_[r] - sizes_[(r + 1) % k]) if k > 1 else 0)
    else:
        p = 1 << (k.bit_length() - 1)
        log_p = p.bit_length() - 1
        folded = r < 2 * (k - p) and r % 2 == 0
        assert [s["phase"] for s in steps if s["phase"] in ("fold", "unfold")] == \
            (["fold", "unfold"] if r < 2 * (k - p) else [])
        if algo == "recursive-doubling":
            exchanges = [s for s in steps if s["phase"] == "doubling"]
            assert len(exchanges) == (0 if folded else log_p)
            assert all(s["bytes_sent"] == 4 * n for s in exchanges)
        else:  # halving: about M/2, M/4, ... out; doubling: the same back
            rs = [s for s in steps if s["phase"] == "reduce-scatter"]
            ag = [s for s in steps if s["phase"] == "all-gather"]
            assert len(rs) == len(ag) == (0 if folded else log_p)
            for i, s in enumerate(rs):
                assert abs(s["bytes_sent"] - 4 * n / 2 ** (i + 1)) <= 4 * (i + 1)
            assert sum(s["bytes_recv"] for s in ag) == sum(s["bytes_sent"] for s in rs)
    assert all(s["t_end"] >= s["t_start"] and s["wait_s"] >= 0 for s in steps)


# --- auto ---------------------------------------------------------------------------
def test_auto_chooses_alike_on_every_rank_even_from_different_files(comm, tmp_path_factory,
                                                                    monkeypatch):
    """Each rank has its own cache file with a different table: rank 0's one wins everywhere."""
    from mpiring import Communicator

    path = tmp_path_factory.mktemp(f"cache_r{comm.rank}")
    monkeypatch.setenv("MPIRING_CACHE", str(path))
    hosts = autotune.host_layout(comm)
    key = autotune.layout_key("mpi", comm.size, hosts)
    picks = ("ring-seg", "recursive-doubling", "ring", "native")
    mine = picks[comm.rank % len(picks)]
    table = autotune.AutoTable(key, {c: autotune.Decision([(1000, mine), (None, "native")])
                                     for c in ("all_reduce",)},
                               {"all_reduce": autotune.Decision([(None, "ring")])})
    autotune.write_cache(table, str(path / "tune.json"))
    fresh = Communicator(comm._be, comm.tracer)
    x = data(comm.rank, 100, np.float32)
    fresh.all_reduce(x)  # loads and shares the table
    np.testing.assert_array_equal(x, reference(comm.size, 100, "float32", "sum"))
    choices = [fresh._auto.choose("all_reduce", s) for s in (8, 999, 1000, 1001, 1 << 30)]
    everyone = comm._be.exchange_bytes(json.dumps(choices).encode())
    assert len(set(everyone)) == 1, everyone
    if comm.size > 1:
        assert choices[:3] == ["ring-seg"] * 3 and choices[3:] == ["native"] * 2


def test_auto_bfloat16_never_picks_native(comm):
    from mpiring import Communicator

    fresh = Communicator(comm._be, comm.tracer)
    fresh._auto = autotune.AutoTable("t", {"all_reduce": autotune.Decision([(None, "native")])},
                                     {"all_reduce": autotune.Decision([(None, "ring-seg")])})
    x = data(comm.rank, 50, BFLOAT16)
    fresh.all_reduce(x)  # native would raise TypeError: MPI has no bfloat16
    np.testing.assert_array_equal(x, reference(comm.size, 50, "bfloat16", "sum"))


def test_auto_remembers_each_choice_until_the_table_changes(comm):
    from mpiring import Communicator

    def table(algo):
        d = {"all_reduce": autotune.Decision([(None, algo)])}
        return autotune.AutoTable(algo, d, d)

    fresh = Communicator(comm._be, comm.tracer)
    fresh._auto = table("native")
    for algo in ("native", "native", "ring-seg", "ring-seg"):
        if fresh._auto.key != algo:
            fresh._auto = table(algo)  # a refit: the remembered choices are forgotten
        x = data(comm.rank, 50, "float32")
        fresh.all_reduce(x)
        assert fresh._act.algo == algo
        np.testing.assert_array_equal(x, reference(comm.size, 50, "float32", "sum"))
        assert fresh._auto_seen[("all_reduce", 200, "float32", "sum")] == algo
    fresh.all_reduce(data(comm.rank, 50, BFLOAT16))  # another key: native cannot, so ring-seg
    assert len(fresh._auto_seen) == 2


def test_pipeline_chunks_are_remembered_until_the_table_changes(comm):
    from mpiring import Communicator

    d = {"all_reduce": autotune.Decision([(None, "native")])}
    fresh = Communicator(comm._be, comm.tracer)
    fresh._auto = autotune.AutoTable("slow", d, d, pipeline=(1.0, 1e9))  # alpha 1 s: one chunk
    n = 1 << 20
    assert fresh.pipeline_chunks(n) == 1
    fresh._auto = autotune.AutoTable("fast", d, d, pipeline=(1e-7, 1e9))  # a refit
    many = fresh.pipeline_chunks(n)
    assert many == (fresh._auto.pipeline_chunks(n, comm.size) if comm.size > 2 else 1)
    if comm.size > 2:
        assert many > 1 and fresh._chunks_seen == {n: many}
    x = np.full(n // 4, comm.rank, np.float32)
    fresh.broadcast(x, root=0)  # runs with the remembered S
    assert (x == 0).all()


def test_fit_decision_picks_crossovers_and_keeps_native_within_margin():
    sizes = [8, 64, 512, 4096, 32768]
    times = {
        "native": [10.0, 12.0, 20.0, 60.0, 400.0],
        "recursive-doubling": [5.0, 6.0, 19.8, 90.0, 800.0],  # within 3% at 512: native
        "ring-seg": [50.0, 50.0, 60.0, 70.0, 200.0],
    }
    d = autotune.fit_decision(sizes, times)
    assert [a for _, a in d.intervals] == ["recursive-doubling", "native", "ring-seg"]
    assert 64 <= d.intervals[0][0] < 512 and 4096 <= d.intervals[1][0] < 32768
    assert d.choose(8) == "recursive-doubling" and d.choose(512) == "native"
    assert d.choose(1 << 40) == "ring-seg"
    assert autotune.Decision.from_json(d.to_json()) == d


def test_cache_round_trip_refit_and_fallbacks(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIRING_CACHE", str(tmp_path))
    path = autotune.cache_path()
    assert path == os.path.join(str(tmp_path), "tune.json")
    assert autotune.lookup("mpi", 4, [4]).key.startswith("builtin ")  # no file yet
    measured = {"all_reduce": {"native": [1.0, 2.0], "ring-seg": [3.0, 1.0]}}
    first = autotune.fit_table("mpi K=4 hosts=4", [8, 64], measured)
    autotune.write_cache(first)
    assert autotune.lookup("mpi", 4, [4]).choose("all_reduce", 1 << 20) == "ring-seg"
    # a refit replaces the entry for that layout and keeps the others
    autotune.write_cache(autotune.fit_table("mpi K=2 hosts=2", [8], {"all_reduce": {"native": [1.0]}}))
    measured["all_reduce"]["ring-seg"] = [3.0, 5.0]
    autotune.write_cache(autotune.fit_table("mpi K=4 hosts=4", [8, 64], measured))
    assert autotune.lookup("mpi", 4, [4]).choose("all_reduce", 1 << 20) == "native"
    assert set(autotune.read_cache()) == {"mpi K=4 hosts=4", "mpi K=2 hosts=2"}
    # a damaged file or entry falls back to the built-in table instead of failing a call
    with open(path, "w") as fh:
        fh.write("{not json")
    assert autotune.lookup("mpi", 4, [4]).key.startswith("builtin ")
    with open(path, "w") as fh:
        json.dump({"version": autotune.VERSION, "entries": {"mpi K=4 hosts=4": {"best": 1}}}, fh)
    assert autotune.lookup("mpi", 4, [4]).key.startswith("builtin ")
    assert autotune.layout_key("mpi", 8, [4, 4]) == "mpi K=8 hosts=4+4"


@pytest.mark.deadline(120)
def test_tune_command_stores_a_table_that_auto_then_uses(world, rank0_subprocess, tmp_path_factory):
    if world.size < 2:
        pytest.skip("needs 2 ranks")
    cache = str(tmp_path_factory.mktemp("tune", numbered=True))
    cache = world._be.exchange_bytes(cache.encode())[0].decode()  # rank 0's directory
    os.environ["MPIRING_CACHE"] = cache
    try:
        result = rank0_subprocess(2, ["-m", "mpiring", "tune", "--max-size", "512", "--reps", "1",
                                      "-c", "all_reduce"], timeout=90)
        if world.rank == 0:
            rc, out, _ = result
            assert rc == 0, out
            assert "auto decision table for mpi K=2" in out and "stored under" in out
            entries = autotune.read_cache()
            assert list(entries) == ["mpi K=2 hosts=2"]
            table = autotune.AutoTable.from_json(entries["mpi K=2 hosts=2"])
            assert table.measured["sizes"] == [8, 32, 128, 512]
            assert table.choose("all_reduce", 100) in autotune.CANDIDATES["all_reduce"]
    finally:
        del os.environ["MPIRING_CACHE"]
