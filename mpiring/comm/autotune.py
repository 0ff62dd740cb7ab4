r"""``algo="auto"``: pick the fastest algorithm per call from a model fitted to measurements.

The model
---------
For each collective, each candidate algorithm and each world size, ``python -m
mpiring tune`` times the algorithm at sizes 8 B, 32 B, ... (factor 4), every
algorithm interleaved with the others, and keeps the medians. Between measured
sizes the time is interpolated linearly in log(size)-log(time). The fitted
model is reduced to a *decision table*: size intervals and the algorithm that is
fastest on each, found where the interpolated curves cross::

    all_reduce, K=4:   <= 6 KiB   recursive-doubling
                       larger     ring-seg

Two tables come out of one fit. ``own`` ranks only mpiring's algorithms, and it
is the one ``auto`` uses: the default call always runs code a reader can see,
and the library's collective runs only when asked for by name
(``algo="native"``). ``best`` ranks every candidate, ``native`` included, so
that ``tune`` can say how far the best of mpiring's own is from the library's;
there ``native`` is kept unless another algorithm beats it by ``margin`` (5%).
In both, a winner at a single size between two sizes won by another algorithm
gives way to it unless it wins by more than 15% (a burst of load on a shared
machine hits one size, not its neighbours).

Same choice on every rank
-------------------------
A rank that picked a different algorithm than its peers would deadlock. So the
choice is a pure function of values that are identical on every rank: the
collective, the message size in bytes (the argument check compares count and
dtype), and one table, which rank 0 reads and sends to the others once per
communicator, at the first ``auto`` call (one small exchange, inside that call).

Cache
-----
Tables live in a JSON file, one entry per backend, world size and host layout
(ranks per host): ``$MPIRING_CACHE/tune.json``, else
``$XDG_CACHE_HOME/mpiring/tune.json``, else ``~/.cache/mpiring/tune.json``.
Nothing is ever measured implicitly: without an entry, ``auto`` uses the
built-in tables below (docs/design-notes.md says where they come from); refit with
``mpiexec -n K python -m mpiring tune``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

VERSION = 1
#: Candidates per collective, in the order the tuner times them.
CANDIDATES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("recursive-doubling", "halving-doubling", "ring-seg", "ring", "native"),
    "reduce_scatter": ("ring-seg", "ring", "native"),
    "all_gather": ("ring-seg", "ring", "native"),
}
#: ``native`` stays unless another algorithm is this much faster.
MARGIN = 0.05
#: A winner at one size only, between two sizes won by the same other algorithm,
#: gives way to it when that one is at most this much slower there (noise).
ISOLATED = 0.15
INF = None  # the last interval of a table has no upper bound (JSON null)


# --- the decision table (pure) ---------------------------------------------------
@dataclass
class Decision:
    """Size intervals and their algorithm: ``[(upper_bytes or None, algo), ...]``, ascending."""

    intervals: list[tuple[int | None, str]]

    def choose(self, nbytes: int) -> str:
        """The algorithm for a message of ``nbytes`` (the first interval that holds it)."""
        uppers = [u for u, _ in self.intervals[:-1]]
        return self.intervals[bisect.bisect_left(uppers, nbytes)][1]

    def to_json(self) -> list[list[Any]]:
        return [[u, a] for u, a in self.intervals]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[Any]]) -> Decision:
        intervals = [(None if u is None else int(u), str(a)) for u, a in data]
        if not intervals or intervals[-1][0] is not None:
            raise ValueError("a decision table ends with an open interval [null, algo]")
        return cls(intervals)


@dataclass
class AutoTable:
    """What ``auto`` decides for one backend, world size and host layout.

    Attributes:
        key: the cache key it was stored under (or "builtin ...").
        best: per collective, the decision over every candidate.
        own: per collective, the decision over mpiring's own algorithms only.
        measured: the medians it was fitted from (sizes, seconds per algo), if any.
        pipeline: (alpha s, beta B/s) of the pipelined Broadcast/Reduce model, which
            sets their default chunk count S; None: the built-in values.
    """

    key: str
    best: dict[str, Decision]
    own: dict[str, Decision]
    measured: dict[str, Any] = field(default_factory=dict)
    pipeline: tuple[float, float] | None = None

    def choose(self, collective: str, nbytes: int, native_ok: bool = True) -> str:
        """The algorithm for ``collective`` on ``nbytes`` (``native_ok=False``: mpiring's own)."""
        table = self.best if native_ok else self.own
        decision = table.get(collective)
        if decision is None:
            return "ring"
        return decision.choose(nbytes)

    def pipeline_chunks(self, nbytes: int, size: int) -> int:
        """The model's best chunk count S for a pipelined Broadcast/Reduce of ``nbytes``."""
        from mpiring.core.chunking import default_pipeline_chunks

        if self.pipeline is None:
            return default_pipeline_chunks(nbytes, size)
        return default_pipeline_chunks(nbytes, size, *self.pipeline)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key,
                "best": {c: d.to_json() for c, d in self.best.items()},
                "own": {c: d.to_json() for c, d in self.own.items()},
                "measured": self.measured,
                "pipeline": None if self.pipeline is None else list(self.pipeline)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutoTable:
        pipeline = data.get("pipeline")
        if pipeline is not None:
            alpha, beta = (float(v) for v in pipeline)
            if not (alpha > 0 and beta > 0):
                raise ValueError("pipeline needs alpha > 0 and beta > 0")
            pipeline = (alpha, beta)
        return cls(key=str(data.get("key", "")),
                   best={c: Decision.from_json(d) for c, d in data["best"].items()},
                   own={c: Decision.from_json(d) for c, d in data["own"].items()},
                   measured=dict(data.get("measured") or {}), pipeline=pipeline)


def fit_decision(sizes: Sequence[int], times: Mapping[str, Sequence[float]],
                 margin: float = MARGIN, baseline: str | None = "native") -> Decision:
    """Decision table from measured medians.

    Args:
        sizes: ascending message sizes in bytes.
        times: per algorithm, the median seconds at each size (NaN: not measured).
        margin: ``baseline`` is kept unless another algorithm is this much faster.
        baseline: the algorithm that wins ties (None: plain minimum).

    Returns:
        Intervals with crossovers where the log-log interpolated curves of two
        neighbouring winners cross (geometric mean of the two sizes if they do
        not cross in between).
    """
    if not sizes:
        raise ValueError("no measured sizes to fit a decision table to")
    algos = [a for a in times if len(times[a]) == len(sizes)]
    if not algos:
        raise ValueError("no algorithm was measured at every size")

    def winner(i: int) -> str:
        scores = {a: times[a][i] for a in algos if _finite(times[a][i])}
        if not scores:
            return baseline if baseline in algos else algos[0]
        best = min(scores, key=scores.get)
        if baseline in scores and scores[best] > scores[baseline] * (1 - margin):
            return baseline
        return best

    winners = [winner(i) for i in range(len(sizes))]
    for i in range(1, len(sizes) - 1):
        around = winners[i - 1]
        if around == winners[i + 1] != winners[i] and \
                times[around][i] <= times[winners[i]][i] * (1 + ISOLATED):
            winners[i] = around
    intervals: list[tuple[int | None, str]] = []
    for i in range(len(sizes) - 1):
        a, b = winners[i], winners[i + 1]
        if a != b:
            intervals.append((_crossover(sizes[i], sizes[i + 1], times[a][i:i + 2],
                                         times[b][i:i + 2]), a))
    intervals.append((INF, winners[-1]))
    return Decision(_merge(intervals))


def _finite(v: float) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def _crossover(s0: int, s1: int, ta: Sequence[float], tb: Sequence[float]) -> int:
    """Size in [s0, s1) where algorithm a (best at s0) stops winning against b (best at s1)."""
    mid = int(math.sqrt(s0 * s1))
    if not all(_finite(v) for v in (*ta, *tb)):
        return mid
    # log t = log t0 + slope * (log s - log s0) for each; the difference changes sign.
    d0 = math.log(ta[0]) - math.log(tb[0])
    d1 = math.log(ta[1]) - math.log(tb[1])
    if d0 >= 0 or d1 <= 0 or d1 == d0:  # they do not cross inside (margin or noise)
        return mid
    frac = -d0 / (d1 - d0)
    return int(round(math.exp(math.log(s0) + frac * (math.log(s1) - math.log(s0)))))


def _merge(intervals: list[tuple[int | None, str]]) -> list[tuple[int | None, str]]:
    out: list[tuple[int | None, str]] = []
    for upper, algo in intervals:
        if out and out[-1][1] == algo:
            out[-1] = (upper, algo)
        else:
            out.append((upper, algo))
    return out


def fit_pipeline(k: int, samples: Sequence[tuple[int, int, float]]) -> tuple[float, float] | None:
    """(alpha, beta) of ``T = (K-2+S) (alpha + N/(S beta))`` from (N bytes, S, seconds) samples.

    Least squares on the two terms, which are linear in alpha and 1/beta. None when
    the fit is not physical (a negative term: too few or too noisy samples).
    """
    rows, ts = [], []
    for n, s, t in samples:
        if _finite(t) and n > 0 and s >= 1:
            rows.append((k - 2 + s, (k - 2 + s) * n / s))
            ts.append(t)
    if len(rows) < 2:
        return None
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ts), rcond=None)
    if not (alpha > 0 and inv_beta > 0):
        return None
    return float(alpha), float(1.0 / inv_beta)


def fit_table(key: str, sizes: Sequence[int], measured: Mapping[str, Mapping[str, Sequence[float]]],
              margin: float = MARGIN) -> AutoTable:
    """An ``AutoTable`` from medians: ``measured[collective][algo][i]`` at ``sizes[i]``."""
    best, own = {}, {}
    for coll, times in measured.items():
        best[coll] = fit_decision(sizes, times, margin)
        ours = {a: t for a, t in times.items() if a != "native"}
        own[coll] = fit_decision(sizes, ours, 0.0, baseline=None) if ours else \
            Decision([(INF, "ring")])
    return AutoTable(key, best, own, {"sizes": list(sizes), "seconds": {
        c: {a: [float(v) for v in t] for a, t in m.items()} for c, m in measured.items()}})


# --- built-in tables ----------------------------------------------------------------
def _d(*intervals) -> Decision:
    return Decision([(u, a) for u, a in intervals])


def builtin(backend: str, size: int, hosts: Sequence[int]) -> AutoTable:
    """The table ``auto`` uses when the cache has no entry for this layout.

    MPI (``own``, what ``auto`` runs): recursive doubling for small messages,
    where its log2 K steps beat the ring's 2(K-1); the segmented ring above,
    where bandwidth counts; with 2 ranks halving-doubling in between (one
    exchange of halves each way). ``best`` (for ``tune``'s comparison) keeps the
    library's own collective where it was not clearly beaten. NCCL: the ring
    (``best``: NCCL's own). ``docs/design-notes.md`` has the measurements the boundaries come from; ``tune`` refits them for your machine.
    """
    key = f"builtin {layout_key(backend, size, hosts)}"
    if backend != "mpi":
        native = {c: _d((INF, "native")) for c in CANDIDATES}
        own = {c: _d((INF, "ring")) for c in CANDIDATES}
        return AutoTable(key, native, own)
    if size <= 1:
        ring = {c: _d((INF, "ring")) for c in CANDIDATES}
        return AutoTable(key, ring, dict(ring))
    all_reduce = _BUILTIN.get(size if len(hosts) == 1 else 0, _BUILTIN[0])
    upto = all_reduce[0][0]
    best = {
        "all_reduce": Decision(list(all_reduce)),
        "reduce_scatter": _d((min(upto, 512 << 10), "native"), (INF, "ring-seg")),
        "all_gather": _d((min(upto, 512 << 10), "native"), (INF, "ring-seg")),
    }
    own = {
        "all_reduce": Decision(list(_OWN.get(size if len(hosts) == 1 else 0, _OWN[0]))),
        "reduce_scatter": _d((INF, "ring-seg")),
        "all_gather": _d((INF, "ring-seg")),
    }
    return AutoTable(key, best, own)


# all_reduce per world size on one host (0: any other layout). With 2 ranks
# halving-doubling (there: one exchange of halves, one add, one exchange back,
# each a single Sendrecv) beat both MPICH and the rings from 1 to 16 MiB.
_BUILTIN: dict[int, tuple[tuple[int | None, str], ...]] = {
    2: ((512 << 10, "native"), (16 << 20, "halving-doubling"), (INF, "ring-seg")),
    3: ((512 << 10, "native"), (INF, "ring-seg")),
    4: ((4 << 20, "native"), (INF, "ring-seg")),
    0: ((16 << 20, "native"), (INF, "ring-seg")),
}

# The same, over mpiring's own algorithms only (what ``auto`` chooses from).
_OWN: dict[int, tuple[tuple[int | None, str], ...]] = {
    2: ((64 << 10, "recursive-doubling"), (16 << 20, "halving-doubling"), (INF, "ring-seg")),
    0: ((64 << 10, "recursive-doubling"), (INF, "ring-seg")),
}


# --- layout, cache file -----------------------------------------------------------
def layout_key(backend: str, size: int, hosts: Sequence[int]) -> str:
    """Cache key: backend, world size and ranks per host, e.g. ``mpi K=4 hosts=4``.

    Hosts are listed by their rank counts in descending order (``hosts=4+4`` is two
    hosts of four ranks each).
    """
    per_host = "+".join(str(n) for n in sorted(hosts, reverse=True)) or "?"
    return f"{backend} K={size} hosts={per_host}"


def cache_path() -> str:
    """Where tuned tables are stored (see the module docstring)."""
    base = os.environ.get("MPIRING_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "mpiring")
    return os.path.join(base, "tune.json")


def read_cache(path: str | None = None) -> dict[str, Any]:
    """Every stored entry by key ({} when there is no file or it cannot be read)."""
    path = path or cache_path()
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def write_cache(table: AutoTable, path: str | None = None) -> str:
    """Store ``table`` under its key (other entries are kept); returns the path.

    The file is replaced atomically, so a reader never sees half of it.
    """
    path = path or cache_path()
    entries = read_cache(path)
    entries[table.key] = table.to_json()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=os.path.dirname(path) or ".")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": VERSION, "entries": entries}, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def lookup(backend: str, size: int, hosts: Sequence[int], path: str | None = None) -> AutoTable:
    """The cached table for this layout, or the built-in one."""
    key = layout_key(backend, size, hosts)
    entry = read_cache(path).get(key)
    if entry is not None:
        try:
            return AutoTable.from_json(entry)
        except (AttributeError, KeyError, TypeError, ValueError):
            pass  # a damaged entry: fall back rather than fail a collective
    return builtin(backend, size, hosts)


# --- agreeing on one table (collective) ------------------------------------------------
def host_layout(comm) -> list[int]:
    """Ranks per host, from every rank's (local_rank, local_size). Collective over ``comm``."""
    info = comm.control.allgather_array([comm.local_rank, comm.local_size])
    return [int(n) for lr, n in info if lr == 0]


def shared_table(comm) -> AutoTable:
    """Rank 0's table for ``comm``'s layout, on every rank.

    Collective over ``comm``'s control channel (MPI on both backends): one
    small allgather and one broadcast, without pickle.
    """
    if comm.size == 1:
        return lookup(comm.backend, 1, [1])
    hosts = host_layout(comm)
    data = None
    if comm.rank == 0:
        data = json.dumps(lookup(comm.backend, comm.size, hosts).to_json()).encode()
    raw = comm.control.bcast_bytes(data, root=0)
    return AutoTable.from_json(json.loads(raw.decode()))
