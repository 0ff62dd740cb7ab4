"""Tracing under MPI: the step records add up to the lecture's traffic formula."""

import logging

import numpy as np
import pytest

from mpiring import Communicator
from mpiring.runtime.trace import Tracer, read_trace


def traced(comm, directory, **kw):
    """The same ranks as ``comm``, recording into ``directory``."""
    return Communicator(comm._be, Tracer(comm.rank, str(directory), **kw))


@pytest.mark.parametrize("n", [4 * 3 * 5 * 64, 1001])
def test_all_reduce_sends_two_k_minus_one_chunks(comm, tmp_path, n):
    tc = traced(comm, tmp_path)
    x = np.arange(n, dtype=np.float32) + comm.rank
    tc.all_reduce(x, algo="ring")  # the lecture's ring (the default 'auto' may pick another)
    tc.tracer.close()
    steps = [r for r in read_trace(str(tmp_path)) if r["type"] == "step"]
    k, r = comm.size, comm.rank
    sizes = [b - a for a, b in comm.chunk_bounds(n)]
    sent = sum(s["bytes_sent"] for s in steps)
    received = sum(s["bytes_recv"] for s in steps)
    # ReduceScatter sends every chunk but r, AllGather every chunk but r+1.
    expected = 4 * (2 * n - sizes[r] - sizes[(r + 1) % k]) if k > 1 else 0
    assert sent == expected
    assert received == 4 * (2 * n - sizes[(r - 1) % k] - sizes[r]) if k > 1 else received == 0
    assert len(steps) == 2 * (k - 1)
    if n % k == 0:
        assert sent == 2 * (k - 1) * (4 * n) // k  # exactly 2(K-1)M/K bytes
    phases = [s["phase"] for s in steps]
    assert phases == ["reduce-scatter"] * (k - 1) + ["all-gather"] * (k - 1)
    for s in steps:
        assert s["collective"] == "all_reduce" and s["call"] == 1 and s["algo"] == "ring"
        assert s["dst"] == (r + 1) % k and s["src"] == (r - 1) % k
        assert s["t_end"] >= s["t_start"] and s["wait_s"] >= 0 and s["reduce_s"] >= 0


def test_pipelined_broadcast_trace_counts_chunks(comm, tmp_path):
    tc = traced(comm, tmp_path)
    x = np.arange(1000, dtype=np.float64) * (comm.rank == 1 % comm.size)
    tc.broadcast(x, root=1 % comm.size, algo="pipelined", chunks=5)
    tc.tracer.close()
    steps = [r for r in read_trace(str(tmp_path)) if r["type"] == "step"]
    if comm.size == 1:
        assert steps == []
        return
    assert len(steps) == 5
    pos = (comm.rank - 1) % comm.size
    assert sum(s["bytes_recv"] for s in steps) == (0 if pos == 0 else 8000)
    assert sum(s["bytes_sent"] for s in steps) == (0 if pos == comm.size - 1 else 8000)
    if pos == 0:  # the root only sends: its steps wait on the send and reduce nothing
        assert all(s["reduce_s"] == 0 and s["wait_s"] >= 0 for s in steps), steps


@pytest.mark.parametrize("algo", ["ring", "pipelined"])
def test_a_reduce_leaf_that_only_sends_reduces_nothing(comm, tmp_path, algo):
    tc = traced(comm, tmp_path)
    x = np.arange(1000, dtype=np.float64) + comm.rank
    tc.reduce(x, root=0, algo=algo, chunks=4)
    tc.tracer.close()
    steps = [r for r in read_trace(str(tmp_path)) if r["type"] == "step"]
    sends_only = [s for s in steps if s["bytes_recv"] == 0]
    assert all(s["reduce_s"] == 0 for s in sends_only), sends_only


def test_step_log_lines_rank_first(comm, tmp_path, caplog):
    tc = Communicator(comm._be, Tracer(comm.rank, None, log_steps=True))
    logger = logging.getLogger("mpiring.steps")
    logger.addHandler(caplog.handler)
    try:
        tc.all_reduce(np.ones(8 * comm.size, dtype=np.float32), algo="ring")
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.name == "mpiring.steps"]
    assert len(lines) == 2 * (comm.size - 1)
    for line in lines:
        assert line.startswith(f"[r{comm.rank}] all_reduce#1 ")
        assert f"->r{(comm.rank + 1) % comm.size}" in line and " ms" in line


def test_comm_attributes_and_split(world):
    assert world.backend == "mpi" and 0 <= world.rank < world.size
    assert 0 <= world.local_rank < world.local_size <= world.size
    half = world.split(world.rank % 2, key=-world.rank)  # reversed order inside each half
    members = list(range(world.rank % 2, world.size, 2))
    assert half.size == len(members)
    assert half.rank == sorted(members, reverse=True).index(world.rank)
    x = np.array([world.rank], dtype=np.int64)
    assert half.all_reduce(x)[0] == sum(members)
    assert world.split(None) is None


def test_unknown_backend_lists_valid_names():
    import mpiring

    with pytest.raises(ValueError, match="use one of mpi, nccl"):
        mpiring.init(backend="gloo")


@pytest.mark.deadline(120)
def test_a_ddp_run_that_ends_normally_keeps_every_event(rank0_subprocess, tmp_path_factory,
                                                        world, monkeypatch):
    # The script never calls close() or flush(): the buffered tail must still
    # reach the file (at exit), every step's backward and every bucket's AllReduce.
    directory = world.control.bcast_json(
        str(tmp_path_factory.mktemp("ddp-trace")) if world.rank == 0 else None)
    monkeypatch.setenv("MPIRING_TRACE", directory)
    steps = 300
    result = rank0_subprocess(2, ["tests/scripts/ddp_traced.py", str(steps)], timeout=90)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0, out
    records = read_trace(directory)
    for rank in (0, 1):
        mine = [r for r in records if r.get("rank") == rank and r.get("type") == "event"]
        backward = [r for r in mine if r["name"] == "ddp.backward"]
        assert len(backward) == steps, f"r{rank}: {len(backward)} of {steps} ddp.backward events"
        buckets = {r["bucket"] for r in mine if r["name"] == "ddp.all_reduce"}
        per_step = len([r for r in mine if r["name"] == "ddp.all_reduce"]) / steps
        assert len(buckets) > 1 and per_step == len(buckets), (buckets, per_step)
