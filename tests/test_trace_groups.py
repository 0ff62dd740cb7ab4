"""trace explain on the calls of groups: each tensor-parallel group's all_reduce#1, a
call on a sub-communicator, and halving-doubling's halves, recorded here under MPI."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile

import numpy as np
import pytest
from conftest import data, wait_quietly

from mpiring.cli import main as cli_main
from mpiring.runtime.trace import Tracer
from mpiring.tools import timeline


@contextlib.contextmanager
def recorded(world):
    """A trace directory every rank records into (``Tracer`` per rank, job ranks);
    yields (directory, tracer). Rank 0 reads it after the block; removed at the end."""
    tmp = world.control.bcast_json(
        tempfile.mkdtemp(prefix="mpiring-trace-groups-") if world.rank == 0 else None)
    tracer = Tracer(world.rank, tmp)
    try:
        yield tmp, tracer
    finally:
        tracer.close()
        wait_quietly(world)


def traced(comm, tracer):
    if comm is not None:
        comm.tracer = tracer
    return comm


def cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(["trace", "explain", *map(str, args)])
    return rc, out.getvalue(), err.getvalue()


def finish(world, tmp, check) -> None:
    """Run ``check`` on rank 0 while the others sleep; then remove the directory."""
    try:
        if world.rank == 0:
            check(timeline.load(tmp))
    finally:
        wait_quietly(world)
        if world.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)


# --- tensor-parallel groups: every group counts its own all_reduce#1 -------------------
def test_each_group_of_a_call_is_listed_and_replayed(world):
    """Groups of 2 (ranks 0,1 | 2,3): both record ring all_reduce#1; explain lists both
    and replays either, its rows the group's job ranks."""
    with recorded(world) as (tmp, tracer):
        tp = traced(world.split(color=world.rank // 2, key=world.rank), tracer)
        x = data(world.rank, 9, np.float32)
        tp.all_reduce(x, algo="ring")
        mates = [r for r in range(world.size) if r // 2 == world.rank // 2]
        assert np.array_equal(x, sum(data(r, 9, np.float32) for r in mates))
        tp.free()
    groups = [g for g in [(0, 1), (2, 3)] if g[-1] < world.size]

    def check(files):
        if not groups:  # one rank: nothing moved, nothing traced
            assert timeline.list_calls(files) == []
            return
        ident = ("all_reduce", 1, "ring", 0)
        assert timeline.call_groups(files) == {ident: groups}
        rc, out, _ = cli(tmp, "--list")
        assert rc == 0
        if world.size == 2:  # the one group is the whole job
            assert out.splitlines() == ["all_reduce#1 (ring) on 2 rank(s)"]
        elif world.size == 3:  # rank 2's group of one moved nothing
            assert out.splitlines() == ["all_reduce#1 (ring) on ranks 0, 1"]
        else:
            assert out.splitlines() == [
                "all_reduce#1 (ring) on 4 rank(s) in groups of 2 (one call per group)",
                "  ranks 0, 1: --rank 0", "  ranks 2, 3: --rank 2"]
            assert timeline.group_sizes(files) == {ident: 2}
        for g in groups:
            for r in g:  # either rank of the group picks it
                _, ranks, snaps = timeline.replay(files, "all_reduce", 1, rank=r)
                assert ranks == list(g)
                assert all(cell == frozenset(g) for row in snaps[-1][2].values() for cell in row)
                text = timeline.explain(files, "all_reduce", 1, rank=r)
                assert text.endswith("result: as the collective promises"), text
                # Rows and transfers name job ranks, not the group's 0 and 1.
                assert f"r{g[0]} c1->r{g[1]}" in text and f"r{g[1]} c0->r{g[0]}" in text, text
                rc, out, _ = cli(tmp, "--rank", r)
                assert rc == 0 and out.rstrip("\n") == text
        # By default the group of the lowest rank.
        assert timeline.explain(files) == timeline.explain(files, rank=0)
        if world.size == 4:
            assert timeline.explain(files, rank=3).startswith(
                "all_reduce#1 (ring) on ranks 2, 3, 2 chunk(s), 20 B per message\n"
                "group 2 of the 2 that made this call: 0, 1 | 2, 3 (--rank R explains the "
                "group of job rank R)\n")
        if world.size == 3:  # rank 2 made the call alone: no steps, no group
            rc, _, err = cli(tmp, "--rank", 2)
            assert rc == 2 and "rank 2 took no part in it; it ran on 0, 1" in err, err
        if world.size == 4:
            # Neither file of the group 2, 3 here: not "took no part", which would send
            # the reader looking for a bug in the run rather than for the files.
            part = tempfile.mkdtemp(prefix="mpiring-trace-part-")
            try:
                for r in (0, 1):
                    shutil.copy(f"{tmp}/rank{r}.jsonl", part)
                rc, _, err = cli(part, "--rank", 3)
                assert rc == 2 and ("rank 3 has no file here, so which group it made the "
                                    "call in is unknown") in err, err
            finally:
                shutil.rmtree(part, ignore_errors=True)

    finish(world, tmp, check)


# --- a sub-communicator of ranks 1.. ---------------------------------------------------
ALGOS = ("ring", "halving-doubling")


def test_a_sub_communicator_is_replayed_with_job_ranks(world):
    """Ranks 1..K-1 (rank 0 left out), once in job-rank order and once reversed (its
    rank 0 is the highest job rank): every collective replays and checks out."""
    n = 7
    with recorded(world) as (tmp, tracer):
        inside = world.rank >= 1
        fwd = traced(world.split(color=0 if inside else None, key=world.rank), tracer)
        rev = traced(world.split(color=0 if inside else None, key=-world.rank), tracer)
        members = list(range(1, world.size))
        for sub in (fwd, rev):
            if sub is None:
                continue
            for algo in ALGOS:
                x = data(world.rank, n, np.float64)
                sub.all_reduce(x, algo=algo)
                assert np.array_equal(x, sum(data(r, n, np.float64) for r in members))
            sub.reduce_scatter(data(world.rank, n, np.float64), algo="ring")
            sub.all_gather(data(world.rank, n, np.float64), algo="ring")
            sub.free()

    def check(files):
        if world.size < 3:  # a group of one rank or none: nothing moves
            assert timeline.list_calls(files) == []
            return
        groups = timeline.call_groups(files)
        for nth, order in ((0, tuple(members)), (1, tuple(reversed(members)))):
            for coll, num, algo in (("all_reduce", 1, "ring"), ("all_reduce", 2, "halving-doubling"),
                                    ("reduce_scatter", 1, "ring"), ("all_gather", 1, "ring")):
                assert groups[(coll, num, algo, nth)] == [order]
                text = timeline.explain(files, coll, num, nth + 1)
                assert text.startswith(f"{coll}#{num}" + (" (2nd)" if nth else "")
                                       + f" ({algo}) on ranks {', '.join(map(str, members))}, "), text
                assert text.endswith("result: as the collective promises"), text
                assert "r0 " not in text and "->r0" not in text, text
        rc, out, _ = cli(tmp, "--list")
        assert rc == 0 and out.splitlines()[0] == "all_reduce#1 (ring) on ranks " + ", ".join(
            map(str, members))

    finish(world, tmp, check)


def test_a_sub_communicator_diagram(world):
    """The diagram of halving-doubling on ranks 1, 2, 3 for 2 elements: fewer elements
    than ranks, a fold and an unfold, rows named by job rank."""
    if world.size != 4:
        pytest.skip("the diagram is of ranks 1, 2, 3 of a 4-rank job")
    with recorded(world) as (tmp, tracer):
        sub = traced(world.split(color=0 if world.rank >= 1 else None, key=world.rank), tracer)
        if sub is not None:
            sub.all_reduce(data(world.rank, 2, np.float32), algo="halving-doubling")
            sub.free()

    def check(files):
        assert timeline.explain(files) == EXPECTED_HD_3_OF_4

    finish(world, tmp, check)


EXPECTED_HD_3_OF_4 = """\
all_reduce#1 (halving-doubling) on ranks 1, 2, 3, 2 chunk(s), 4/8 B per message
chunks (elements): c0 [0, 1)  c1 [1, 2)
cell: the ranks whose data that chunk of that rank contains (ALL = every rank; . = not held yet)

start
         c0   c1
  r1      1    1
  r2      2    2
  r3      3    3

fold step 1/1: r1 c0-c1->r2
         c0   c1
  r1      1    1
  r2    1+2  1+2
  r3      3    3

reduce-scatter step 1/1: r2 c1->r3  r3 c0->r2
         c0   c1
  r1      1    1
  r2    ALL  1+2
  r3      3  ALL

all-gather step 1/1: r2 c0->r3  r3 c1->r2
         c0   c1
  r1      1    1
  r2    ALL  ALL
  r3    ALL  ALL

unfold step 1/1: r2 c0-c1->r1
         c0   c1
  r1    ALL  ALL
  r2    ALL  ALL
  r3    ALL  ALL

result: as the collective promises"""


# --- halving-doubling: which halves moved ----------------------------------------------
def test_halving_doubling_is_replayed_and_checked(world):
    """Sizes 0, 1, fewer than the ranks, uneven, and more: each traced call replays to
    every rank holding every rank's contribution to every element."""
    k = world.size
    sizes = [0, 1, max(k - 1, 1), 2 * k + 1, 13]
    with recorded(world) as (tmp, tracer):
        comm = traced(world.dup(), tracer)
        for n in sizes:
            x = data(world.rank, n, np.float32)
            comm.all_reduce(x, algo="halving-doubling")
            assert np.array_equal(x, sum(data(r, n, np.float32) for r in range(k)))
        comm.free()

    def check(files):
        listed = timeline.list_calls(files)
        if k == 1:  # nothing moves on one rank: nothing to explain
            assert listed == []
            with pytest.raises(ValueError, match="no collective calls"):
                timeline.explain(files)
            return
        # The empty buffer moves nothing: its call number is taken, no steps recorded.
        assert [(c, n) for c, n, *_ in listed] == [("all_reduce", i)
                                                   for i in range(2, len(sizes) + 1)]
        for num, n in enumerate(sizes[1:], 2):
            rp = timeline.replay_group(files, "all_reduce", num)
            assert rp.ranks == list(range(k))
            # The chunks are the distinct stretches the steps moved, covering the buffer.
            assert rp.chunks[0][0] == 0 and rp.chunks[-1][1] == n
            assert all(a < b for a, b in rp.chunks)
            assert all(p[1] == q[0] for p, q in zip(rp.chunks, rp.chunks[1:]))
            final = rp.snapshots[-1][2]
            assert all(cell == frozenset(range(k)) for row in final.values() for cell in row)
            text = timeline.explain(files, "all_reduce", num)
            assert text.endswith("result: as the collective promises"), text
            p = 1 << (k.bit_length() - 1)
            assert ("fold step" in text) == (p != k) and ("unfold step" in text) == (p != k)
            assert text.count("reduce-scatter step") == (p.bit_length() - 1)
            if n >= k:  # every rank ends the halving with one piece of its own
                assert len(rp.chunks) >= p

    finish(world, tmp, check)


def test_a_wrong_range_is_caught(world, tmp_path_factory):
    """A recorded range that is not what the partner sent: the replay refuses it, and a
    dropped receive leaves the result incomplete (explain says which rank)."""
    if world.rank != 0:
        wait_quietly(world)
        return
    try:
        tmp = tmp_path_factory.mktemp("wrong")
        _hd_two_ranks(tmp, recv_range_r1=(0, 3))
        with pytest.raises(ValueError, match=r"r1 expected c0-c1 from r0 but the next one sent "
                                             r"was c1-c2"):
            timeline.explain(timeline.load(str(tmp)))
        tmp = tmp_path_factory.mktemp("right")
        _hd_two_ranks(tmp)
        assert timeline.explain(timeline.load(str(tmp))).endswith(
            "result: as the collective promises")
    finally:
        wait_quietly(world)


def _hd_two_ranks(directory, recv_range_r1=(2, 4)) -> None:
    """Halving-doubling of 4 elements on 2 ranks as the runtime writes it."""
    class Comm:  # what ``CallTrace.on`` reads of a communicator
        world_ranks = (0, 1)
        name = "world"

    keep = {0: (0, 2), 1: (2, 4)}
    for r in range(2):
        tracer = Tracer(r, str(directory))
        c = tracer.call("all_reduce", 1, "halving-doubling").on(Comm())
        other = keep[1 - r]
        got = recv_range_r1 if r == 1 else keep[r]
        c.step("reduce-scatter", 0, 1, dst=1 - r, src=1 - r, bytes_sent=8, bytes_recv=8,
               send_range=other, recv_range=got)
        c.step("all-gather", 0, 1, dst=1 - r, src=1 - r, bytes_sent=8, bytes_recv=8,
               send_range=keep[r], recv_range=other)
        tracer.close()


def test_point_to_point_on_a_group_names_job_ranks(world):
    """A pipeline group's messages (ranks 1..K-1, reversed: its rank 0 is the highest job
    rank): the records say the sender's job rank and the group, so the timeline and the
    log line name each peer by its job rank, not by its rank in the group."""
    from mpiring.runtime.trace import fmt_p2p

    with recorded(world) as (tmp, tracer):
        inside = world.rank >= 1
        rev = traced(world.split(color=0 if inside else None, key=-world.rank), tracer)
        if rev is not None and rev.size > 1:
            right, left = (rev.rank + 1) % rev.size, (rev.rank - 1) % rev.size
            got = np.zeros(5, np.float32)
            rev.sendrecv(np.full(5, world.rank, np.float32), right, got, left, tag=4)
            assert np.all(got == rev.world_ranks[left])
        if rev is not None:
            rev.free()

    def check(files):
        members = list(range(1, world.size))
        if len(members) < 2:
            assert not any(r.get("type") == "p2p" for f in files for r in f.records)
            return
        order = list(reversed(members))  # group rank i is job rank order[i]
        spans = [s for s in timeline.chrome_trace(files)["traceEvents"]
                 if s.get("cat") == "p2p" and s["ph"] == "X"]
        seen = set()
        for f in files:
            for rec in (r for r in f.records if r.get("type") == "p2p"):
                assert rec["rank"] == f.rank  # the job rank, as a step record's
                g = f.groups[rec["comm"]]
                assert list(g) == order
                i = order.index(f.rank)
                peer = order[(i + 1) % len(order)] if rec["op"] == "send" else \
                    order[(i - 1) % len(order)]
                arrow = "->" if rec["op"] == "send" else "<-"
                assert fmt_p2p(rec, g).startswith(f"[r{f.rank}] {rec['op']}#") and \
                    f" {arrow}r{peer} tag 4 " in fmt_p2p(rec, g)
                seen.add((f.rank, rec["op"], peer))
        assert len(seen) == 2 * len(members)
        assert sorted((s["pid"], s["name"]) for s in spans) == sorted(
            (r, f"{op} {'->' if op == 'send' else '<-'}r{p} tag 4") for r, op, p in seen)

    finish(world, tmp, check)
