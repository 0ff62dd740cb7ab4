r"""Parameter server vs ring AllReduce: bytes per rank counted from the trace, and time.

The lecture's parameter server, written with collectives: push the gradients
to the server (a Reduce), pull the result back (a Broadcast). A classic server
is a *star*: every worker talks to the server directly::

    push                     pull
    w1 ──M──▶ ┌──────┐       ┌──────┐ ──M──▶ w1
    w2 ──M──▶ │server│       │server│ ──M──▶ w2        server: (K-1) M in, (K-1) M out
    w3 ──M──▶ └──────┘       └──────┘ ──M──▶ w3        worker: M in, M out

so the server's link carries K-1 times what a worker's does and is the
hotspot; with a dedicated server (not also a worker) it is K times M. The ring
AllReduce sends 2(K-1)M/K (about 2M) from every rank, whatever K. The study
also runs the lecture's mapping on mpiring's own ring collectives ("ps-ring":
pipelined ring Reduce to the server, pipelined ring Broadcast back): every link
then carries about M each way, the hotspot is gone, but every byte still
funnels through the server's two links.

Bytes are not computed from formulas here: each method runs once with a
Tracer writing into a temporary directory, and every rank sums ``bytes_sent``
and ``bytes_recv`` of its own step records.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from mpiring.core.chunking import default_pipeline_chunks
from mpiring.core.costmodel import (
    AlphaBeta,
    expected_traffic,
    model_fields,
    parameter_server,
    pipelined_broadcast,
    ring_all_reduce,
)
from mpiring.core.ops import finish, reducer
from mpiring.runtime.trace import Tracer, clock
from mpiring.tools.bench.measure import QUIET_POLL_S, lean_dup, time_interleaved
from mpiring.tools.bench.report import make_row
from mpiring.tools.bench.sweep import count_wrong, rank_data, reference

METHODS = ("ring", "ps", "ps-ring")
_PUSH_TAG, _PULL_TAG = 21, 22


class StarParameterServer:
    """The classic parameter server over a Communicator: star push, reduce, star pull.

    The server (``root``, also a worker) posts a receive from every worker,
    reduces the gradients in the order they arrive, then sends the result to
    every worker. Steps are recorded in the communicator's tracer as collective
    "ps", phases "push" and "pull", one step per worker on the server.

    The messages go over a lean dup of ``comm`` (``measure.lean_dup``): data
    only, as the ring's own messages, so that the comparison is of the
    algorithms and not of a descriptor per message. Creating the server is
    collective over ``comm``.
    """

    def __init__(self, comm, root: int = 0):
        self.comm = comm
        self.root = root
        self.calls = 0
        self._scratch: np.ndarray | None = None
        self._p2p = lean_dup(comm)

    def sync(self, x: np.ndarray, op: str = "sum") -> np.ndarray:
        """Reduce ``x`` over all ranks through the server; every rank gets the result."""
        comm, p2p = self.comm, self._p2p
        rank, k, root = comm.rank, comm.size, self.root
        self.calls += 1
        trace = comm.tracer.call("ps", self.calls, "star")
        flat = x.reshape(-1)
        raw = flat.view(np.uint8)
        nbytes = raw.size
        if k == 1:
            finish(op, flat, k)
            return x
        workers = [r for r in range(k) if r != root]
        if rank != root:
            t0 = clock()
            p2p.send(raw, root, tag=_PUSH_TAG)
            trace.step("push", 0, 1, send_chunk=0, dst=root, bytes_sent=nbytes,
                       t_start=t0, t_recv=t0, t_end=clock())
            t0 = clock()
            p2p.recv(raw, root, tag=_PULL_TAG)
            t1 = clock()
            trace.step("pull", 0, 1, recv_chunk=0, src=root, bytes_recv=nbytes,
                       t_start=t0, t_recv=t1, t_end=t1)
            return x
        need = (k - 1) * flat.size
        if self._scratch is None or self._scratch.dtype != flat.dtype or self._scratch.size < need:
            self._scratch = np.empty(need, dtype=flat.dtype)
        bufs = [self._scratch[i * flat.size:(i + 1) * flat.size] for i in range(k - 1)]
        reduce = reducer(op)
        t0 = clock()
        reqs = [p2p.irecv(b.view(np.uint8), w, tag=_PUSH_TAG) for b, w in zip(bufs, workers)]
        pending = list(range(k - 1))
        for step in range(k - 1):
            i = self._wait_any(reqs, pending)  # reduce whichever gradient arrived first
            t_recv = clock()
            reduce(flat, bufs[i])
            t_end = clock()
            trace.step("push", step, k - 1, recv_chunk=0, src=workers[i], bytes_recv=nbytes,
                       t_start=t0, t_recv=t_recv, t_end=t_end)
            t0 = t_end
        finish(op, flat, k)
        t0 = clock()
        with p2p.group():  # every send in flight at once, all complete at the block's end
            for w in workers:
                p2p.isend(raw, w, tag=_PULL_TAG)
        t1 = clock()
        for step, w in enumerate(workers):
            trace.step("pull", step, k - 1, send_chunk=0, dst=w, bytes_sent=nbytes,
                       t_start=t0, t_recv=t1, t_end=t1)
        return x

    def _wait_any(self, reqs, pending: list[int]) -> int:
        """The index in ``pending`` of a receive that has completed (removed from it).

        MPI_Waitany's job, polled through ``Request.test()``: a rank that shares
        its core (the communicator's idle mode is not "spin") gives it away
        between sweeps, as the backend's own waits do.
        """
        pause = None if self._p2p.idle in (None, "spin") else os.sched_yield
        while True:
            for i in pending:
                if reqs[i].test():
                    pending.remove(i)
                    return i
            if pause is not None:
                pause()


def _sync_fn(method: str, comm, server: StarParameterServer, op: str):
    if method == "ring":
        return lambda x, **kw: comm.all_reduce(x, op=op, algo="ring", **kw)
    if method == "ps":
        return lambda x, **kw: server.sync(x, op)

    def ring_ps(x, **kw):
        comm.reduce(x, root=0, op=op, algo="pipelined", **kw)
        comm.broadcast(x, root=0, algo="pipelined", **kw)
        return x
    return ring_ps


def _count_bytes(path: str) -> tuple[int, int]:
    sent = recv = 0
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("type") == "step":
                sent += int(rec.get("bytes_sent") or 0)
                recv += int(rec.get("bytes_recv") or 0)
    return sent, recv


def _model(method: str, nbytes: int, k: int, ab: AlphaBeta) -> float:
    if method == "ring":
        return ring_all_reduce(nbytes, k, ab)
    if method == "ps":
        return parameter_server(nbytes, k, ab)
    s = default_pipeline_chunks(nbytes, k)
    return 2 * pipelined_broadcast(nbytes, k, s, ab)


def ps_study(world, nbytes: int, ks: list[int] | None = None, *, iters: int = 10,
             warmup: int = 2, dtype: np.dtype | None = None, op: str = "sum",
             model: AlphaBeta | None = None, progress=None) -> list[dict[str, Any]]:
    """Sync an M-byte gradient with each method on K = 2..world.size ranks.

    Sub-communicators of ``world`` (ranks 0..K-1) give the K; ranks outside one
    sleep meanwhile. Returns rows (on every rank) with the ``make_row`` keys plus
    per-rank ``sent``/``recv`` lists (bytes, from the trace), ``server_*`` and
    ``worker_*`` (the busiest non-server rank), and the lecture's expectation as
    ``expect_*``.
    """
    rank = world.rank
    dtype = np.dtype(dtype if dtype is not None else np.float32)
    ks = ks or list(range(2, world.size + 1))
    count = max(1, nbytes // dtype.itemsize)
    nbytes = count * dtype.itemsize
    tmp = world.control.bcast_json(tempfile.mkdtemp(prefix="mpiring-ps-") if rank == 0 else None)
    rows: list[dict[str, Any]] = []
    try:
        for k in ks:
            sub = world.split(0 if rank < k else None, key=rank)
            if sub is None:
                world.control.barrier(poll_s=QUIET_POLL_S)
                if progress:
                    progress.update(f"ps K={k}", len(METHODS))
                continue
            rows.extend(_study_one_k(sub, tmp, k, count, nbytes, dtype, op, iters, warmup,
                                     model, rank, progress))
            world.control.barrier(poll_s=QUIET_POLL_S)
    finally:
        world.control.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    return world.control.bcast_json(rows if rank == 0 else None, root=0)


def _study_one_k(sub, tmp, k, count, nbytes, dtype, op, iters, warmup, model, world_rank,
                 progress) -> list[dict[str, Any]]:
    src = rank_data(sub.rank, count, dtype, op)
    ref = reference("all_reduce", count, k, sub.rank, 0, op, dtype)
    x = src.copy()
    server = StarParameterServer(sub, root=0)
    quiet = sub.tracer
    rows = []
    counted = []
    for method in METHODS:  # 1. one traced run each: bytes per rank, and the check
        if progress:
            progress.show(f"ps K={k} {method}: traced run")
        name = f"K{k}-{method}-rank{world_rank}"
        sub.tracer = Tracer(world_rank, tmp, name=name)
        sync = _sync_fn(method, sub, server, op)
        np.copyto(x, src)
        try:
            sync(x)
        finally:
            sub.tracer.close()
            sub.tracer = quiet
        path = os.path.join(tmp, f"{name}.jsonl")
        sent, recv = _count_bytes(path)
        os.unlink(path)
        wrong = sub.control.allreduce_scalar(count_wrong(x, ref, op))
        counted.append((method, sync, wrong, sub.control.allgather_array([sent, recv])))
    # 2. timed in turns (iteration i runs each method once): fair ratios on a busy machine
    if progress:
        progress.show(f"ps K={k}: timing")
    times = time_interleaved(sub, [lambda f=f: f(x, check=False) for _, f, _, _ in counted],
                             [lambda: np.copyto(x, src)] * len(counted), iters=iters, warmup=warmup)
    for (method, _, wrong, table), t in zip(counted, times):
        seconds = float(np.median(t))
        expect = expected_traffic(method, nbytes, k)
        workers = table[1:] if k > 1 else table
        row = make_row("all_reduce", method, "mpi", k, nbytes, dtype.name, seconds, wrong,
                       count=count, op=op, iters=iters, warmup=warmup,
                       sent=table[:, 0].tolist(), recv=table[:, 1].tolist(),
                       server_sent=int(table[0, 0]), server_recv=int(table[0, 1]),
                       worker_sent=int(workers[:, 0].max()), worker_recv=int(workers[:, 1].max()),
                       **{f"expect_{key}": val for key, val in expect.items()})
        if model is not None:
            pred = _model(method, nbytes, k, model)
            row.update(model_fields(seconds, pred))
        rows.append(row)
        if progress:
            progress.update(f"ps K={k} {method}")
    return rows


def format_ps_table(rows: list[dict[str, Any]]) -> str:
    """The PS vs AllReduce table: traffic per rank in units of M, the lecture's numbers, time."""
    if not rows:
        return "# parameter server vs ring AllReduce: nothing to show (needs 2 or more ranks)"
    m = rows[0]["bytes"]
    out = [
        f"# parameter server vs ring AllReduce: M = {m} B ({rows[0]['dtype']}) per rank; "
        "the server is rank 0 and also a worker",
        "# bytes per rank counted from the trace, in units of M (worker = busiest non-server rank);",
        "# 'lecture' is what the formulas say: ring 2(K-1)/K (about 2) for everyone; star PS",
        "# (K-1) in and out at the server (K with a dedicated server), 1 at a worker",
        "#",
        f"#{'K':>3} {'method':>8} {'worker':>7} {'worker':>7} {'server':>7} {'server':>7}"
        f"  {'lecture':>15} {'time':>10} {'model':>10} {'#wrong':>7}",
        f"#{'':>3} {'':>8} {'sent':>7} {'recv':>7} {'sent':>7} {'recv':>7}"
        f"  {'worker/server':>15} {'(ms)':>10} {'(ms)':>10} {'':>7}",
    ]
    for r in rows:
        lect = f"{r['expect_worker_sent'] / m:.2f}/{r['expect_server_recv'] / m:.2f}"
        model = f"{r['model_us'] / 1e3:.2f}" if r.get("model_us") is not None else "-"
        out.append(f"{r['ranks']:>4} {r['algo']:>8} {r['worker_sent'] / m:>7.2f} "
                   f"{r['worker_recv'] / m:>7.2f} {r['server_sent'] / m:>7.2f} "
                   f"{r['server_recv'] / m:>7.2f}  {lect:>15} {r['time_us'] / 1e3:>10.2f} "
                   f"{model:>10} {r['wrong']:>7}")
    return "\n".join(out)


def plot_ps(rows: list[dict[str, Any]], path: str) -> None:
    """Bytes at the server and at the busiest worker (units of M) against K, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    m = rows[0]["bytes"]
    for method, marker in (("ring", "o"), ("ps", "s"), ("ps-ring", "^")):
        sub = sorted((r for r in rows if r["algo"] == method), key=lambda r: r["ranks"])
        if not sub:
            continue
        ks = [r["ranks"] for r in sub]
        line, = axes[0].plot(ks, [(r["server_recv"] + r["server_sent"]) / m for r in sub],
                             marker=marker, ls="-", label=f"{method}: server")
        axes[0].plot(ks, [(r["worker_recv"] + r["worker_sent"]) / m for r in sub], marker=marker,
                     ls="--", color=line.get_color(), alpha=0.5, label=f"{method}: busiest worker")
        axes[1].plot(ks, [r["time_us"] / 1e3 for r in sub], marker=marker, ls="-", label=method)
    axes[0].set_ylabel("bytes sent + received per sync (units of M)")
    axes[1].set_ylabel("time per sync (ms)")
    ks_all = sorted({r["ranks"] for r in rows})
    for ax in axes:
        ax.set_xticks(ks_all)
        ax.set_xlabel("ranks K")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("traffic (counted from the trace)")
    axes[1].set_title(f"time, M = {m / 2**20:.0f} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
