"""DDP misuse on some ranks: every rank must stop with an error naming the cause.

Usage: mpiexec -n K python ddp_misuse.py CASE   (deadline from MPIRING_TIMEOUT)
  late:      r1 sleeps 60 s between forward and backward of step 2
  twice:     every rank runs a second backward of one forward (retain_graph)
  caught:    r1's backward of step 2 raises; r1 catches it and trains on
  no_sync:   r1 runs step 2 under no_sync(), the others synchronise
  unwrapped: r1 never wraps its model (it exits); the others wrap theirs
  threads:   two threads run all_reduce on one communicator at once
Each rank prints "[rN] CASE: TYPE: MESSAGE" for the error it got, or "[rN] CASE:
no error after 4 steps" (a silent divergence or a missed misuse).
"""

import sys
import threading
import time

import numpy as np
import torch
from failing import Fail

import mpiring

case = sys.argv[1]
comm = mpiring.init()
torch.manual_seed(0)


def report(what):
    print(f"[r{comm.rank}] {case}: {what}", flush=True)


try:
    if case == "threads":
        x = np.ones(1 << 12, np.float32)
        errors = []

        def loop():
            try:
                for _ in range(200):
                    comm.all_reduce(x.copy(), algo="ring")
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        ts = [threading.Thread(target=loop) for _ in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        if errors:
            raise errors[0]
        report("no error after 2 x 200 calls")
        sys.exit(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    if case == "unwrapped" and comm.rank == 1:
        report("leaving without wrapping")
        sys.exit(0)
    ddp = mpiring.DistributedDataParallel(model, comm, bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(4, 6) + comm.rank
        opt.zero_grad()
        if case == "no_sync" and comm.rank == 1 and step == 2:
            with ddp.no_sync():
                ddp(x).sum().backward()
        else:
            out = ddp(x)
            if case == "caught" and comm.rank == 1 and step == 2:
                out = Fail.apply(out)
            loss = out.pow(2).sum()
            if case == "late" and comm.rank == 1 and step == 2:
                time.sleep(60)
            try:
                loss.backward(retain_graph=case == "twice")
            except RuntimeError as exc:
                if case != "caught":
                    raise
                report(f"caught {exc}")
            if case == "twice":
                loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    table = comm.control.allgather_array(flat.double().numpy())
    same = bool((table == table[0]).all())
    report(f"no error after 4 steps; replicas {'identical' if same else 'DIFFER'}")
except Exception as exc:  # noqa: BLE001
    report(f"{type(exc).__name__}: {str(exc)[:300]}")
    sys.exit(3)
