"""Ranks blocked in different calls: the desync detector must name both waits.

Usage: mpiexec -n K python desync.py CASE   (deadline from MPIRING_TIMEOUT)
  cross:       r1 all_reduces on communicator B, every other rank on A
  caught:      DDP with a BatchNorm buffer; r1's backward of step 2 raises and is
               caught; r1's next forward broadcasts the buffers on the model's
               communicator while the others reduce step 2's buckets
  caught_user: DDP without buffers; after the caught failure r1 all_reduces its
               loss on the model's communicator
  no_sync:     DDP with a BatchNorm buffer; r1 runs step 2 under no_sync()
  no_sync_user: DDP without buffers; r1 runs step 2 under no_sync(), then
               all_reduces its loss on the model's communicator
  slow:        r1 sleeps 2 x the probe time, then joins the all_reduce (no error)
  third:       A = {r0, r2}, B = {r1, r2}; r2 sleeps 4 x the probe time, then
               all_reduces on A, then on B (no error: no rank waits on another waiter)
Each rank prints "[rN] entering at T" before the call that desyncs, and
"[rN] CASE: ok" or "[rN] CASE: no error" when its calls return.
"""

import sys
import time

import numpy as np
import torch
from failing import Fail

import mpiring
from mpiring.runtime.desync import probe_seconds

case = sys.argv[1]
comm = mpiring.init()
r = comm.rank


def enter():
    print(f"[r{r}] entering at {time.time():.3f}", flush=True)


def expect_sum(x, parts):
    want = sum(np.arange(x.size, dtype=np.float64) + 10 * q for q in parts)
    assert np.array_equal(x, want), (x, want)


if case == "cross":
    a, b = comm.dup(), comm.dup()
    x = np.arange(6, dtype=np.float64) + 10 * r
    enter()
    (b if r == 1 else a).all_reduce(x)
    print(f"[r{r}] {case}: no error", flush=True)
elif case == "slow":
    x = np.arange(6, dtype=np.float64) + 10 * r
    comm.all_reduce(x.copy())  # everyone in, then r1 is late for the second call
    enter()
    if r == 1:
        time.sleep(2 * probe_seconds())
    comm.all_reduce(x)
    expect_sum(x, range(comm.size))
    print(f"[r{r}] {case}: ok", flush=True)
elif case == "third":
    a = comm.split(0 if r in (0, 2) else None)
    b = comm.split(0 if r in (1, 2) else None)
    xa = np.arange(5, dtype=np.float64) + 10 * r
    xb = xa.copy()
    enter()
    if r == 2:  # long enough for the waits of r0 and r1 to be posted and compared
        time.sleep(4 * probe_seconds())
    if a is not None:
        a.all_reduce(xa)
        expect_sum(xa, (0, 2))
    if b is not None:
        b.all_reduce(xb)
        expect_sum(xb, (1, 2))
    print(f"[r{r}] {case}: ok", flush=True)
else:
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
                print(f"[r{r}] caught {exc}", flush=True)
        if case.endswith("_user"):
            comm.all_reduce(loss.detach().reshape(1).clone())
        opt.step()
    print(f"[r{r}] {case}: no error", flush=True)
