"""A DDP training loop that ends without closing or flushing anything (trace tests).

Usage: MPIRING_TRACE=DIR mpiexec -n K python tests/scripts/ddp_traced.py STEPS
"""

import sys

import torch

import mpiring

steps = int(sys.argv[1])
comm = mpiring.init()
torch.manual_seed(0)
model = mpiring.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
    torch.nn.Linear(64, 4)), comm, bucket_cap_mb=0.001, first_bucket_mb=0.001)  # several buckets
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(comm.rank)
for _ in range(steps):
    opt.zero_grad()
    model(torch.randn(8, 16, generator=g)).square().mean().backward()
    opt.step()
print(f"[r{comm.rank}] trained {steps} steps", flush=True)
