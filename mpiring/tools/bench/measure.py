"""Timing primitives shared by the benchmarks.

* ``time_iterations``: run a call ``iters`` times after ``warmup`` and return, per
  iteration, the time of the slowest rank (the collective is done when the last
  rank is done).
* ``pingpong`` and ``ring_exchange``: the point-to-point times the alpha-beta
  model is fitted to.
* ``memory_bandwidth``: single-core memcpy and add speed, the ingredients of the
  memory-bandwidth bound (``mpiring.core.costmodel.membw_busbw_bound``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from mpiring.core.costmodel import AlphaBeta, MemoryBound, fit_alpha_beta
from mpiring.runtime.trace import Tracer

clock = time.perf_counter

#: Sleep between polls of ``comm.control.barrier(poll_s=QUIET_POLL_S)``, the barrier
#: of ranks that sit out a measurement: MPICH's blocking calls spin, and a rank
#: idling in a plain barrier would steal a core from the ranks being measured
#: when ranks outnumber cores.
QUIET_POLL_S = 0.002


def lean_dup(comm):
    """A dup of ``comm`` for point-to-point baselines: no descriptor check, no trace.

    Its messages carry nothing but the data (``check=False``: no 24-byte
    descriptor ahead of each one) and write no trace record; nothing else on
    ``comm`` can match them. Collective.
    """
    lean = comm.dup()
    lean.check = False
    lean.tracer = Tracer(comm.rank)  # no directory, no log: off
    return lean


def _ring_link(comm):
    """The point-to-point calls a ring step makes (the backend's ``send``, ``irecv``,
    ``wait``, ``sendrecv``), on a lean dup of ``comm``. Collective.

    The fitted alpha is meant to be what a ring step pays. The Communicator's
    public send/recv add a request object, the argument checks and the trace
    hook to every message: Python work that no ring step does, and that would
    dominate a small message's time on one host.
    """
    return lean_dup(comm)._be


def time_iterations(comm, call: Callable[[], object], *, iters: int,
                    warmup: int, reset: Callable[[], object] | None = None) -> np.ndarray:
    """Per-iteration time of the slowest rank, in seconds (``iters`` values).

    Every iteration resets the buffers (outside the timed region), lines the
    ranks up with a barrier, then times ``call`` on each rank; one exchange at
    the end turns the local times into the slowest rank's. Collective over
    ``comm`` (a Communicator).
    """
    # One call taking turns with nobody: the same loop as time_interleaved.
    return time_interleaved(comm, [call], [reset or (lambda: None)],
                            iters=iters, warmup=warmup)[0]


BATCH_BYTES = 4 << 20


def batch_for(nbytes: int) -> int:
    """Calls per timed sample: min(64, 4 MiB / size), at least one.

    Back-to-back calls (as nccl-tests and the OSU benchmarks time small
    messages) keep the barrier's exit skew, a few microseconds, from dominating
    a small message's sample, and average a mid-size sample over the scheduler's
    time slices when ranks share cores (one preempted call is then a fraction of
    the sample, not all of it).
    """
    return max(1, min(64, BATCH_BYTES // max(nbytes, 1)))


def balanced_orders(n: int) -> list[list[int]]:
    """Orders for n calls taking turns: each first, and after every other, equally often.

    A call can leave something behind for the next one (cache contents, which
    rank is late, how the scheduler treats a rank that has just polled), so
    which call runs just before another one matters on a busy machine. Plain
    rotation (a b c, b c a, c a b) always puts the same call before each one.
    These are a Williams design: row 0 is 0, 1, n-1, 2, n-2, ...; row r adds r
    (mod n); for odd n the rows are also taken backwards. Over all rows every
    call runs in every position equally often and right after every other call
    equally often (once for even n, twice for odd n).
    """
    if n <= 1:
        return [list(range(n))]
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(c + r) % n for c in first] for r in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def time_interleaved(comm, calls: Sequence[Callable[[], object]],
                     resets: Sequence[Callable[[], object]], *, iters: int,
                     warmup: int, batch: int = 1) -> np.ndarray:
    """Like ``time_iterations`` for several calls at once, taking turns.

    Iteration i times every call once, one after the other, so that a burst of
    load from outside hits every call alike and their ratios stay meaningful on
    a shared machine; the order changes from one iteration to the next (see
    ``balanced_orders``), so that no call always runs first or always right
    after the same other one. Each sample is ``batch`` calls back to back (see
    ``batch_for``), divided by ``batch``; the buffers are reset before each
    sample only. Returns an array (calls, iters) of the slowest rank's times
    per call. Collective over ``comm`` (a Communicator).
    """
    control = comm.control
    local = np.zeros((len(calls), max(iters, 0)), dtype=np.float64)
    orders = balanced_orders(len(calls))
    for i in range(warmup + iters):
        for j in orders[i % len(orders)]:
            call, reset = calls[j], resets[j]
            reset()
            control.barrier()  # poll_s=0: the lowest exit skew
            t0 = clock()
            for _ in range(batch):
                call()
            dt = (clock() - t0) / batch
            if i >= warmup:
                local[j, i - warmup] = dt
    # Every rank's times, then the slowest per sample: an elementwise max over ranks.
    return control.allgather_array(local.reshape(-1)).max(axis=0).reshape(local.shape)


def pingpong_sizes(max_bytes: int = 16 << 20, min_bytes: int = 8, factor: int = 4) -> list[int]:
    """8 B, 32 B, ... up to ``max_bytes``: the sizes the model is fitted on."""
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= factor
    return sizes


def _reps(nbytes: int, reps: int) -> int:
    # Small messages are cheap and noisy: take more of them.
    return reps * 4 if nbytes < (64 << 10) else reps


def pingpong(comm, sizes: Sequence[int], reps: int = 5,
             a: int = 0, b: int = 1) -> list[tuple[int, float]]:
    """One-way time between ranks ``a`` and ``b`` (half the median round trip).

    The other ranks sleep meanwhile, so this measures the link alone. Every
    rank returns the same list (broadcast from ``a``). Collective over ``comm``.
    """
    link = _ring_link(comm)
    rank = comm.rank
    results: list[tuple[int, float]] = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        rtts = []
        if rank in (a, b):
            peer = b if rank == a else a
            for i in range(_reps(n, reps) + 1):
                t0 = clock()
                if rank == a:
                    link.send(buf, peer)
                    link.wait(link.irecv(buf, peer))
                else:
                    link.wait(link.irecv(buf, peer))
                    link.send(buf, peer)
                if i:  # the first round trip sets up the connection
                    rtts.append(clock() - t0)
        comm.control.barrier(poll_s=QUIET_POLL_S)
        one_way = float(np.median(rtts)) / 2 if rtts else 0.0
        results.append((n, float(comm.control.bcast_json(one_way, root=a))))
    return results


def ring_exchange(comm, sizes: Sequence[int], reps: int = 5) -> list[tuple[int, float]]:
    """Time of one ring step: every rank sends n bytes right and receives n from the left.

    This is exactly what a ring collective does at each step, with every rank
    busy at once, so it includes what the pair ping-pong leaves out: ranks
    competing for cores and memory bandwidth. Returns the median of the slowest
    rank's time per size. Collective over ``comm``.
    """
    link = _ring_link(comm)
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    results = []
    for n in sizes:
        send = np.zeros(n, dtype=np.uint8)
        recv = np.empty_like(send)
        times = time_iterations(
            comm, lambda s=send, r=recv: link.sendrecv(s, right, r, left),
            iters=_reps(n, reps), warmup=1)
        results.append((n, float(np.median(times))))
    return results


def fit_pingpong(comm, max_bytes: int = 16 << 20,
                 reps: int = 5) -> tuple[dict[str, AlphaBeta], dict[str, str]]:
    """Fit the alpha-beta model both ways: ``pair`` (ping-pong r0<->r1) and ``ring``.

    Returns ``(fits, failures)``: the fits by source, and for a source whose
    points could not be fitted (a machine so busy that times do not grow with
    size) the reason. Both are empty on one rank (there is no neighbour). Every
    rank gets the same answer: the points are broadcast or max-reduced.
    """
    fits: dict[str, AlphaBeta] = {}
    failures: dict[str, str] = {}
    if comm.size < 2:
        return fits, failures
    sizes = pingpong_sizes(max_bytes)
    for source, points in (("pair", pingpong(comm, sizes, reps)),
                           ("ring", ring_exchange(comm, sizes, reps))):
        ns, ts = zip(*points)
        try:
            fits[source] = fit_alpha_beta(ns, ts, source=source)
        except ValueError as exc:
            failures[source] = str(exc)
    return fits, failures


def memory_bandwidth(comm, nbytes: int = 64 << 20,
                     reps: int = 5) -> MemoryBound:
    """Single-core memcpy and add bandwidth, measured on rank 0 while the others sleep.

    The buffers (64 MiB) are far larger than the caches, so this is the memory
    system's speed for one core. ``cores`` is how many cores the ranks of one host
    can use at once: min(ranks on the host, CPUs this process may run on).
    Collective over ``comm``.
    """
    control = comm.control
    copy_bw = add_bw = 0.0
    if comm.rank == 0:
        n = nbytes // 4
        a = np.arange(n, dtype=np.float32)
        b = np.zeros_like(a)
        copies, adds = [], []
        for _ in range(reps):
            t0 = clock()
            np.copyto(b, a)
            copies.append(clock() - t0)
            t0 = clock()
            np.add(b, a, out=b)
            adds.append(clock() - t0)
        # Best of reps: the machine's capability, not its worst moment.
        copy_bw, add_bw = a.nbytes / min(copies), a.nbytes / min(adds)
    control.barrier(poll_s=QUIET_POLL_S)
    copy_bw, add_bw = control.bcast_json((copy_bw, add_bw), root=0)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    cores = int(control.bcast_json(min(comm.local_size, cpus), root=0))
    return MemoryBound(copy_bw, add_bw, cores)
