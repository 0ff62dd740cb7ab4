"""Property-based tests: random world sizes, sizes, dtypes, ops, roots and algorithms
against a NumPy reference.

Under MPI every rank must run the same examples in the same order, or the ranks
would call different collectives and hang. Hypothesis is made deterministic
(``derandomize=True``: the examples follow from the test's code, identical on
every rank; no database, no deadline, no shrinking, health checks off), and
each example is hashed and the hashes compared across the world before it
runs, so a divergence fails loudly on every rank instead of hanging. The
outcome is agreed the same way: if any rank's result is wrong, every rank
fails that example.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import data

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mpiring.comm.communicator import ALGOS, REDUCING  # noqa: E402
from mpiring.core.buffers import BFLOAT16, DTYPES, FLOAT_DTYPES  # noqa: E402

EXAMPLES = 100
SETTINGS = settings(
    derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck),
    print_blob=False)


@dataclass(frozen=True)
class Case:
    k: int
    collective: str
    algo: str
    n: int
    dtype: str
    op: str | None
    root: int | None
    chunks: int | None
    salt: int


@st.composite
def cases(draw) -> Case:
    # sampled_from draws evenly; st.integers would favour the smallest values.
    k = draw(st.sampled_from((4, 3, 2, 1)))
    collective = draw(st.sampled_from(sorted(ALGOS)))
    dtype = draw(st.sampled_from(DTYPES))
    reducing = collective in REDUCING
    op = None
    if reducing:
        op = draw(st.sampled_from(("sum", "avg", "max", "min", "prod")
                                  if dtype in FLOAT_DTYPES else ("sum", "max", "min", "prod")))
    # Ring algorithms and MPI's own; MPI cannot reduce bfloat16.
    algos = [a for a in ALGOS[collective] if a in ("ring", "pipelined", "native")
             and not (a == "native" and reducing and dtype == "bfloat16")]
    algo = draw(st.sampled_from(algos))
    # Sizes around the chunk boundaries (0, fewer elements than ranks) and larger.
    n = draw(st.one_of(st.sampled_from(range(2 * k + 2)), st.integers(0, 5000)))
    root = draw(st.sampled_from(range(k - 1, -1, -1))) if collective in ("broadcast", "reduce") else None
    chunks = draw(st.sampled_from((None, 1, 2, 3, 7, 12))) if algo == "pipelined" else None
    return Case(k, collective, algo, n, dtype, op, root, chunks, draw(st.integers(0, 6)))


def np_dtype(name: str):
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def reduced(case: Case) -> np.ndarray:
    """The reduction over the case's ranks, in float64 and then the case's dtype."""
    stack = np.stack([data(r, case.n, np.float64, case.op, case.salt) for r in range(case.k)])
    out = {"sum": stack.sum(0), "avg": stack.sum(0) / case.k, "max": stack.max(0),
           "min": stack.min(0), "prod": stack.prod(0)}[case.op]
    return out.astype(np_dtype(case.dtype))


def run_case(comm, case: Case) -> None:
    """Run the case on this rank of ``comm`` and assert the result."""
    dtype = np_dtype(case.dtype)
    x = data(comm.rank, case.n, dtype, case.op or "sum", case.salt)
    bounds = comm.chunk_bounds(case.n)
    if case.collective == "all_reduce":
        comm.all_reduce(x, op=case.op, algo=case.algo)
        np.testing.assert_array_equal(x, reduced(case))
    elif case.collective == "reduce_scatter":
        lo, hi = bounds[comm.rank]
        view = comm.reduce_scatter(x, op=case.op, algo=case.algo)
        np.testing.assert_array_equal(view, reduced(case)[lo:hi])
    elif case.collective == "all_gather":
        full = np.concatenate([data(r, case.n, dtype, salt=case.salt)[a:b]
                               for r, (a, b) in enumerate(bounds)]).astype(dtype)
        lo, hi = bounds[comm.rank]
        x[:] = 0
        x[lo:hi] = full[lo:hi]
        comm.all_gather(x, algo=case.algo)
        np.testing.assert_array_equal(x, full)
    elif case.collective == "broadcast":
        comm.broadcast(x, root=case.root, algo=case.algo, chunks=case.chunks)
        np.testing.assert_array_equal(x, data(case.root, case.n, dtype, salt=case.salt))
    else:
        before = x.copy()
        comm.reduce(x, root=case.root, op=case.op, algo=case.algo, chunks=case.chunks)
        np.testing.assert_array_equal(x, reduced(case) if comm.rank == case.root else before)


def agree(world, value: int, what: str) -> np.ndarray:
    """Every rank's ``value`` (one int64) as a table; raises on every rank if they differ."""
    table = world._be.exchange(np.array([value], dtype=np.int64))[:, 0]
    if (table != table[0]).any():
        raise AssertionError(f"{what} differs between ranks: {table.tolist()}")
    return table


def digest(case: Case) -> int:
    return int.from_bytes(hashlib.blake2b(repr(case).encode(), digest_size=8).digest(),
                          "little", signed=True)


@pytest.mark.deadline(90)
@SETTINGS
@given(case=cases())
def test_collectives_match_numpy(world, subcomms, case):
    if case.k > world.size:
        return  # the same decision on every rank
    agree(world, digest(case), f"the example {case}")  # fail loudly instead of hanging
    comm = subcomms[case.k]
    failure = None
    if comm is not None:
        try:
            run_case(comm, case)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of any failure
            failure = exc
    flags = world._be.exchange(np.array([failure is not None], dtype=np.int64))[:, 0]
    if failure is not None:
        raise failure
    if flags.any():
        failed = ", ".join(f"r{r}" for r in np.flatnonzero(flags))
        raise AssertionError(f"{case}: wrong result on {failed}")
