"""Short bench runs: the sweep, the PS traffic study and the S study in this job, and the
``bench`` command (with gloo) in a nested 2-rank launch."""

import json
import os

import numpy as np
import pytest

from mpiring.core.costmodel import AlphaBeta
from mpiring.tools.bench import report
from mpiring.tools.bench.pipeline import chunks_study
from mpiring.tools.bench.ps import ps_study
from mpiring.tools.bench.sweep import CHUNKED, COLLECTIVES, SweepConfig, resolve_algos, run_sweep


def test_sweep_every_collective_and_algo_is_right(world):
    algos = resolve_algos(COLLECTIVES, None, gloo=False)
    cfg = SweepConfig(COLLECTIVES, algos, sizes=[4, 1000, 4096], iters=2, warmup=1,
                      dtype="float32", op="sum", root=world.size - 1, chunks=3,
                      model=AlphaBeta(1e-5, 1e9))
    rows = run_sweep(world, cfg)
    assert not cfg.notes
    expected = sum(len(a) for a in algos.values()) * 3
    if world.size > 1:  # reduce_scatter/all_gather round 4 B down to 0 elements: skipped
        expected -= sum(len(algos[c]) for c in CHUNKED)
    assert len(rows) == expected
    for r in rows:
        assert set(report.ROW_KEYS) <= set(r)
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0
    ring = [r for r in rows if r["algo"] == "ring" and r["collective"] == "all_reduce"]
    assert all(r["model_us"] is not None for r in ring) or world.size == 1


def test_sweep_skips_what_the_communicator_refuses(world):
    # MPI cannot reduce bfloat16: native is refused on every rank, ring is checked
    # against the NumPy reference instead.
    cfg = SweepConfig(["all_reduce"], {"all_reduce": ["native", "ring"]}, sizes=[256],
                      iters=1, warmup=0, dtype="bfloat16", op="sum")
    rows = run_sweep(world, cfg)
    assert [r["algo"] for r in rows] == ["ring"] and rows[0]["wrong"] == 0
    assert "bfloat16" in cfg.notes[0]


def test_ps_traffic_counted_from_the_trace_matches_the_lecture(world):
    m = 4 * 840  # 840 elements: whole chunks for K = 2, 3, 4
    rows = ps_study(world, m, iters=1, warmup=0)
    assert len(rows) == 3 * (world.size - 1)
    for r in rows:
        k = r["ranks"]
        assert r["wrong"] == 0
        assert len(r["sent"]) == k
        if r["algo"] == "ring":  # every rank sends and receives 2(K-1)/K M
            assert r["sent"] == [2 * (k - 1) * m // k] * k
            assert r["recv"] == [2 * (k - 1) * m // k] * k
        elif r["algo"] == "ps":  # the server moves (K-1) M each way, a worker M
            assert r["server_recv"] == r["server_sent"] == (k - 1) * m
            assert r["sent"][1:] == [m] * (k - 1)
        else:  # Reduce + Broadcast on the ring: M each way at the server
            assert r["server_recv"] == r["server_sent"] == m
            assert r["worker_sent"] == (2 * m if k >= 3 else m)


def test_chunks_study(world):
    rows = chunks_study(world, 4096, iters=1, warmup=0, model=AlphaBeta(1e-5, 1e9),
                        max_chunks=8)
    assert [r["chunks"] for r in rows] == [None, 1, 2, 4, 8]
    assert all(r["wrong"] == 0 for r in rows)
    assert rows[1]["model_best"] >= 1


@pytest.mark.deadline(150)
def test_bench_command_with_gloo_json_plot_and_model(rank0_subprocess, tmp_path_factory, world):
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("bench") if world.rank == 0 else None
    js = os.path.join(str(tmp), "b.json") if tmp else ""
    png = os.path.join(str(tmp), "b.png") if tmp else ""
    result = rank0_subprocess(2, ["-m", "mpiring", "bench", "-b", "64", "-e", "4K", "-f", "8",
                                  "-n", "2", "-w", "1", "--algo", "ring,native,gloo", "--model",
                                  "--json", js, "--plot", png, "--progress", "on"], timeout=120)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0, out
    for text in ("# all_reduce on 2 ranks", "# -- ring", "# -- native", "# -- gloo",
                 "# memory: single-core memcpy", "x native", "[####"):
        assert text in out, out
    rows = json.loads(open(js).read())
    assert {r["algo"] for r in rows} == {"ring", "native", "gloo"}
    assert [r["bytes"] for r in rows if r["algo"] == "gloo"] == [64, 512, 4096]
    for r in rows:
        assert set(report.ROW_KEYS) <= set(r) and r["wrong"] == 0 and r["ranks"] == 2
        # the paired spread of x native: 1 for native itself, a real range otherwise
        assert 0 < r["vs_native_q1"] <= r["vs_native_q3"], r
        if r["algo"] == "native":
            assert r["vs_native_q1"] == r["vs_native_q3"] == 1.0
    assert open(png, "rb").read(4) == b"\x89PNG"
    assert np.isfinite([r["busbw"] for r in rows]).all()


class _Corrupting:
    """A Communicator whose ring all_reduce gets one element wrong on rank 0."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_reduce(self, x, **kwargs):
        self._comm.all_reduce(x, **kwargs)
        if kwargs.get("algo") == "ring" and self._comm.rank == 0:
            x[3] += 1
        return x


def test_wrong_counts_every_bad_element_on_every_rank(world):
    cfg = SweepConfig(["all_reduce"], {"all_reduce": ["native", "ring"]}, sizes=[400],
                      iters=1, warmup=0)
    rows = run_sweep(_Corrupting(world), cfg)
    assert {r["algo"]: r["wrong"] for r in rows} == {"native": 0, "ring": 1}


def test_time_interleaved_batches_and_rotates(world):
    from mpiring.tools.bench.measure import batch_for, time_interleaved

    assert batch_for(8) == 64 and batch_for(64 << 10) == 64 and batch_for(1 << 20) == 4
    assert batch_for(4 << 20) == 1 and batch_for(1 << 30) == 1 and batch_for(0) == 64
    log: list[str] = []
    calls = [lambda n=n: log.append(n) for n in "abc"]
    resets = [lambda: log.append("|")] * 3
    times = time_interleaved(world, calls, resets, iters=4, warmup=1, batch=2)
    assert times.shape == (3, 4) and (times >= 0).all()
    samples = "".join(log).split("|")[1:]
    assert all(len(s) == 2 and len(set(s)) == 1 for s in samples)  # one call, twice in a row
    orders = ["".join(s[0] for s in samples[i * 3:i * 3 + 3]) for i in range(5)]
    assert orders == ["abc", "bca", "cab", "cba", "acb"]  # balanced_orders(3), from row 0


def test_time_interleaved_gives_every_rank_the_slowest_ranks_time(world):
    import time

    from mpiring.tools.bench.measure import time_interleaved

    slow = world.size - 1  # one rank sleeps in call 0: every rank must see its time
    calls = [lambda: time.sleep(0.02 if world.rank == slow else 0.0), lambda: None]
    times = time_interleaved(world, calls, [lambda: None] * 2, iters=3, warmup=1)
    assert times.shape == (2, 3) and (times[0] >= 0.02).all(), times
    everyone = world.control.allgather_array(times.reshape(-1))
    assert (everyone == everyone[0]).all()  # the same table on every rank


def test_sweep_reports_the_chunk_count_the_communicator_uses(world):
    from mpiring import Communicator
    from mpiring.comm import autotune

    fresh = Communicator(world._be, world.tracer)
    d = {"all_reduce": autotune.Decision([(None, "native")])}
    fresh._auto = autotune.AutoTable("t", d, d, pipeline=(1e-6, 1e9))  # a tuned table: many chunks
    algos = {"broadcast": ["pipelined"]}
    cfg = SweepConfig(["broadcast"], algos, sizes=[1 << 16], iters=1, warmup=0,
                      dtype="float32", op="sum", root=0, chunks=None, model=None)
    (row,) = run_sweep(fresh, cfg)
    assert row["chunks"] == fresh._auto.pipeline_chunks(1 << 16, world.size)
    assert row["chunks"] == fresh.pipeline_chunks(1 << 16)
    assert fresh.pipeline_chunks(0) == 1
    if world.size > 2:
        assert row["chunks"] > 1  # the built-in alpha/beta would give 1 here
