"""Ranks blocked in different calls: the desync detector must name both waits.

Usage: mpiexec -n K python desync.py CASE   (deadline from MPIRING_TIMEOUT)
       mpiexec -n K python desync.py CASE:K1 CASE:K2 ...   (K = K1 + K2 + ...)
The second form runs the cases at the same time, each on ranks of its own (the
first K1 ranks, the next K2, ...); "rN" below is a rank of the case's group.
  cross:       r1 all_reduces on communicator B, every other rank on A
  caught:      DDP with a BatchNorm buffer; r1's backward of step 2 raises and is
               caught; r1's next forward broadcasts the buffers on the model's
               communicator while the others reduce step 2's buckets
  caught_user: DDP without buffers; after the caught failure r1 all_reduces its
               loss on the model's communicator
  no_sync:     DDP with a BatchNorm buffer; r1 runs step 2 under no_sync()
  no_sync_user: DDP without buffers; r1 runs step 2 under no_sync(), then
               all_reduces its loss on the model's communicator
  slow:        r1 sleeps late(), then joins the all_reduce the others wait in
               (no error)
  third:       A = {r0, r2}, B = {r1, r2}; r2 sleeps late(), then
               all_reduces on A, then on B (no error: no rank waits on another waiter)
Each rank prints "[rN] entering at T" before the call that desyncs, and
"[rN] CASE: ok" or "[rN] CASE: no error" when its calls return, N its rank in
the whole job.
"""

import itertools
import sys
import time

import numpy as np

import mpiring
from mpiring.runtime.desync import CONFIRM, probe_seconds

world = mpiring.init()
me = f"[r{world.rank}]"


def enter():
    print(f"{me} entering at {time.time():.3f}", flush=True)


def late() -> float:
    """How late the late rank of slow and third is: long enough for the others' waits
    to be posted and compared. A detector that took them for a desync would report
    it 1-2 s after they have held for the probe time and CONFIRM (the monitors wake
    up to 1 s apart; measured); 3 s leave a second to spare."""
    return probe_seconds() + CONFIRM + 3


def expect_sum(x, parts):
    want = sum(np.arange(x.size, dtype=np.float64) + 10 * q for q in parts)
    assert np.array_equal(x, want), (x, want)


def run(case, comm):
    r = comm.rank
    if case == "cross":
        a, b = comm.dup(), comm.dup()
        x = np.arange(6, dtype=np.float64) + 10 * r
        enter()
        (b if r == 1 else a).all_reduce(x)
        print(f"{me} {case}: no error", flush=True)
    elif case == "slow":
        x = np.arange(6, dtype=np.float64) + 10 * r
        comm.all_reduce(x.copy())  # everyone in, then r1 is late for the second call
        enter()
        if r == 1:
            time.sleep(late())
        comm.all_reduce(x)
        expect_sum(x, range(comm.size))
        print(f"{me} {case}: ok", flush=True)
    elif case == "third":
        a = comm.split(0 if r in (0, 2) else None)
        b = comm.split(0 if r in (1, 2) else None)
        xa = np.arange(5, dtype=np.float64) + 10 * r
        xb = xa.copy()
        enter()
        if r == 2:
            time.sleep(late())
        if a is not None:
            a.all_reduce(xa)
            expect_sum(xa, (0, 2))
        if b is not None:
            b.all_reduce(xb)
            expect_sum(xb, (1, 2))
        print(f"{me} {case}: ok", flush=True)
    else:
        # Only the DDP cases import torch: seconds of CPU a rank, on shared cores.
        import torch
        from failing import Fail

        torch.manual_seed(0)
        layers = [torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)]
        if case in ("caught", "no_sync"):
            layers.insert(1, torch.nn.BatchNorm1d(5))  # buffers: each forward broadcasts them
        ddp = mpiring.DistributedDataParallel(torch.nn.Sequential(*layers), comm,
                                              bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(4, 6) + r
            opt.zero_grad()
            odd = r == 1 and step == 2
            if step == 2 or (step == 3 and case in ("caught", "no_sync")):
                enter()
            if case.startswith("no_sync") and odd:
                with ddp.no_sync():
                    loss = ddp(x).pow(2).sum()
                    loss.backward()
            else:
                out = ddp(x)
                loss = (Fail.apply(out) if case.startswith("caught") and odd else out).pow(2).sum()
                try:
                    loss.backward()
                except RuntimeError as exc:
                    print(f"{me} caught {exc}", flush=True)
            if case.endswith("_user"):
                comm.all_reduce(loss.detach().reshape(1).clone())
            opt.step()
        print(f"{me} {case}: no error", flush=True)


if len(sys.argv) == 2 and ":" not in sys.argv[1]:
    run(sys.argv[1], world)
else:
    cases = [arg.partition(":") for arg in sys.argv[1:]]
    ends = list(itertools.accumulate(int(k) for _, _, k in cases))
    assert ends[-1] == world.size, f"{sys.argv[1:]}: the groups need {ends[-1]} ranks"
    group = next(i for i, end in enumerate(ends) if world.rank < end)
    run(cases[group][0], world.split(group))
