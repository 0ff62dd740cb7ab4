"""Differential check of every collective at the launched world size (used for odd K).

Run as ``mpiexec -n K python tests/scripts/check_collectives.py``; prints
``OK K=<size> checks=<n>`` on rank 0 and exits 0, or raises (and mpi4py aborts).
"""

import numpy as np

import mpiring
from mpiring.core.buffers import BFLOAT16


def main():
    comm = mpiring.init()
    k, r = comm.size, comm.rank
    checks = 0
    for n in (0, 1, k - 1, k, 7 * k + 3, 10007):
        for dtype in (np.float32, np.int32, np.float16, BFLOAT16, np.uint8):
            base = ((np.arange(n) * 5 + r * 3) % 7).astype(dtype)
            ref = sum(((np.arange(n) * 5 + q * 3) % 7) for q in range(k)) if n else np.zeros(0)
            x = comm.all_reduce(base.copy())
            assert np.array_equal(x.astype(np.float64), np.asarray(ref, dtype=np.float64)), (n, dtype)
            if dtype is not BFLOAT16:
                assert np.array_equal(x, comm.all_reduce(base.copy(), algo="native"))
                y = base.copy()
                mx = comm.all_reduce(base.copy(), op="max", algo="native")
                assert np.array_equal(comm.all_reduce(y, op="max"), mx)
            lo, hi = comm.chunk_bounds(n)[r]
            v = comm.reduce_scatter(base.copy())
            assert np.array_equal(v, x[lo:hi])
            z = np.zeros(n, dtype=dtype)
            z[lo:hi] = x[lo:hi]
            assert np.array_equal(comm.all_gather(z), x)
            for root in range(k):
                b = comm.broadcast(base.copy(), root=root, chunks=3)
                assert np.array_equal(b, ((np.arange(n) * 5 + root * 3) % 7).astype(dtype))
                red = comm.reduce(base.copy(), root=root, algo="pipelined", chunks=2)
                assert np.array_equal(red, x if r == root else base)
            checks += 1
    if r == 0:
        print(f"OK K={k} checks={checks}", flush=True)


if __name__ == "__main__":
    main()
