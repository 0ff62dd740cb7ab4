"""Ranks blocked in different calls are named on every rank within seconds.

The graph logic of ``mpiring.runtime.desync`` on hand-made notices (a cycle
across communicators fires; a ring in one call, a slow rank, a withdrawn or
stale notice do not), then nested jobs (tests/reliability_cases/desync.py)
with the default 300 s deadline and a probe time of 2 s: a plain
cross-communicator deadlock on 2 and 3 ranks, a caught DDP backward failure
followed by the buffer broadcast or a user all_reduce, no_sync() on one rank
followed by a user all_reduce, and two that must end normally, at the same
time in one job on ranks of their own (a rank late by more than twice the probe
time; a third rank late while two others wait on it in different
communicators).
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import Job

from mpiring.runtime import desync
from mpiring.runtime.desync import PROBE, Detector, deadlocked, describe
from mpiring.runtime.watchdog import STALL_EXIT_CODE, Activity


def _wait(comm, k, n, peer=None, members=(0, 1), what="Allgather", site="at t.py:1"):
    return {"c": comm, "m": list(members), "k": k, "n": n, "w": what, "p": peer, "s": site}


def _notices(*per_rank):
    return {r: {"r": r, "seq": 1, "waits": waits, "ctx": []} for r, waits in per_rank}


@pytest.mark.parametrize("value, seconds", [("", PROBE), ("on", PROBE), ("off", 0.0),
                                            ("0", 0.0), ("5", 5.0), (" 2.5s ", 2.5)])
def test_the_probe_time_from_the_environment(monkeypatch, value, seconds):
    monkeypatch.setenv("MPIRING_DESYNC", value)
    assert desync.probe_seconds() == seconds


@pytest.mark.parametrize("value", ["soon", "-1", "inf", "nan"])
def test_a_bad_probe_time_is_refused_at_init_naming_the_fix(monkeypatch, value):
    import mpiring

    monkeypatch.setenv("MPIRING_DESYNC", value)
    with pytest.raises(ValueError, match=rf"MPIRING_DESYNC='{value}': give the probe time in "
                                         r"seconds \(e\.g\. 3\), or off"):
        mpiring.init()


def test_a_cycle_across_communicators_is_a_desync_naming_both_waits():
    notices = _notices((0, [_wait("world", "all_reduce", 7, peer=1, site="at train.py:41")]),
                       (1, [_wait("world.dup1", "all_reduce", 3)]))
    assert desync.desync(notices) == {0, 1}
    text = describe(notices, {0, 1})
    assert text.startswith("mpiring desync: r0 waits in all_reduce#7 on comm world (Allgather, "
                           "at train.py:41) for r1, while r1 waits in all_reduce#3 on comm "
                           "world.dup1 (Allgather, at t.py:1) for r0: the ranks are in "
                           "different calls"), text


def test_waits_that_need_a_rank_that_computes_or_share_one_call_are_not_a_desync():
    ring = _notices(*[(r, [_wait("w", "all_reduce", 2, peer=(r - 1) % 3, members=(0, 1, 2))])
                      for r in range(3)])
    assert deadlocked(ring) == {0, 1, 2} and desync.desync(ring) == set()  # one call
    # r2 computes (no notice): r0 waits for it on A, r1 on B; neither waits on the other.
    slow = _notices((0, [_wait("A", "all_reduce", 1, members=(0, 2))]),
                    (1, [_wait("B", "all_reduce", 1, members=(1, 2))]))
    assert deadlocked(slow) == set()
    # A wait on every rank needs only the members that are not in the same call.
    same = _notices((0, [_wait("A", "all_reduce", 1, members=(0, 1, 2))]),
                    (1, [_wait("A", "all_reduce", 1, members=(0, 1, 2))]))
    assert deadlocked(same) == set()
    # Two threads of r1: one waits on r0 in B, the other on r2 (computing): r1 may proceed.
    two = _notices((0, [_wait("A", "all_reduce", 1, peer=1)]),
                   (1, [_wait("B", "all_reduce", 1, peer=0), _wait("C", "recv", 1, peer=2)]))
    assert deadlocked(two) == set()


def test_a_rooted_call_left_early_while_a_third_rank_computes_is_not_a_desync():
    # r1 left the Reduce early (it is not the root) and waits for r0 in a barrier
    # on a sub-communicator; r0 still waits in the Reduce, for r2 too, which
    # computes (no notice). Nothing is stuck for good.
    rooted = _notices((0, [_wait("world", "reduce", 1, members=(0, 1, 2), what="Reduce")]),
                      (1, [_wait("world.split1.0", "barrier", 1, members=(0, 1))]))
    assert deadlocked(rooted) == set() and desync.desync(rooted) == set()


def test_a_user_thread_in_its_own_code_keeps_the_rank_from_being_stuck():
    import sys
    import threading

    go, done = threading.Event(), threading.Event()

    def user_code():  # a thread that will make its call later: runs user code now
        go.set()
        while not done.is_set():
            pass

    t = threading.Thread(target=user_code, daemon=True)
    t.start()
    go.wait()
    try:
        act = Activity(0, 2, watch=False)
        act.name, act.since, act.collective, act.call = "world", 1.0, "barrier", 1
        frames = sys._current_frames()
        # The main thread is made to look blocked (it runs this test): only the
        # user thread's state decides.
        frames = {k: v for k, v in frames.items() if k != threading.main_thread().ident}
        assert desync.stuck_waits([act], 2.0, frames) is None
    finally:
        done.set()
        t.join()


def test_a_three_rank_desync_names_every_wait():
    three = _notices((0, [_wait("A", "all_reduce", 1, members=(0, 1, 2))]),
                     (1, [_wait("B", "all_reduce", 1, members=(0, 1, 2))]),
                     (2, [_wait("A", "all_reduce", 1, members=(0, 1, 2))]))
    assert desync.desync(three) == {0, 1, 2}
    text = describe(three, {0, 1, 2})
    assert "r0 and r2 wait in all_reduce#1 on comm A (Allgather, at t.py:1) for r1, while r1 " \
           "waits in all_reduce#1 on comm B (Allgather, at t.py:1) for r0 and r2" in text, text


class _Wire:
    def __init__(self):
        self.sent, self.inbox = [], []

    def post(self, data):
        self.sent.append(json.loads(data))

    def collect(self):
        out, self.inbox = self.inbox, []
        return out


def test_the_detector_posts_only_lasting_waits_and_fires_only_on_a_current_cycle(monkeypatch):
    monkeypatch.setattr(desync, "stuck_waits", lambda records, at: [
        dict(_wait("world", "all_reduce", 5, peer=1), since=records[0].since)]
        if records[0].since else None)
    act = Activity(0, 2, world_ranks=[0, 1], watch=False)
    act.name, act.since, act.collective = "world", 100.0, "all_reduce"
    wire = _Wire()
    det = Detector(0, wire.post, wire.collect)
    peer = {"r": 1, "seq": 4, "waits": [_wait("world.dup1", "all_reduce", 2)], "ctx": ["x"]}
    wire.inbox = [json.dumps(peer).encode()]
    t = 100.0 + 0.5
    assert det.check([act], t, PROBE) is None and wire.sent == []  # not yet lasting
    assert det.check([act], t + PROBE, PROBE) is None and wire.sent[-1]["waits"]  # posted
    assert det.check([act], t + PROBE + 0.5, PROBE) is None  # seen, not yet confirmed
    # The peer withdraws (a newer sequence); an older notice arriving late is ignored.
    wire.inbox = [json.dumps({"r": 1, "seq": 5, "waits": None}).encode(),
                  json.dumps(peer).encode()]
    assert det.check([act], t + PROBE + 2, PROBE) is None
    assert det.notices[1]["seq"] == 5
    wire.inbox = [json.dumps(dict(peer, seq=6)).encode()]
    assert det.check([act], t + PROBE + 3, PROBE) is None  # a new cycle: confirm again
    text = det.check([act], t + PROBE + 3 + desync.CONFIRM, PROBE)
    assert text and "r1 waits in all_reduce#2 on comm world.dup1" in text and "r1: x" in text
    assert wire.sent[-1]["alarm"] == text  # sent to every rank, which print it too
    act.since = 0.0  # this rank's wait ended: withdrawn at once, whatever the others say
    det2 = Detector(0, wire.post, wire.collect)
    det2.posted, det2.notices = (1,), {1: dict(peer, seq=6)}
    assert det2.check([act], t + 50, PROBE) is None and wire.sent[-1]["waits"] is None


#: A probe time of 2 s, not the default 3: still two of the monitors' wake-ups (1 s apart
#: at this deadline), and every case waits it out, once a desync has formed or while a
#: rank is late. The deadline is the default: the end must not wait for it.
ENV = {"MPIRING_TIMEOUT": "300", "MPIRING_DESYNC": "2"}
#: The slow case on 2 ranks of its own, the third-rank one on 3 (see the late-rank test).
LATE = {"slow": [0, 1], "third": [2, 3, 4]}


def _job(n, *cases):
    return Job(n, ["tests/reliability_cases/desync.py", *cases], timeout=90, env=ENV)


JOBS = {
    "test_a_cross_communicator_deadlock_is_named_on_every_rank[2-ranks]": _job(2, "cross"),
    "test_a_cross_communicator_deadlock_is_named_on_every_rank[3-ranks]": _job(3, "cross"),
    **{f"test_a_ddp_desync_names_the_bucket_wait_the_other_call_and_the_cause[{case}]":
       _job(2, case) for case in ("caught", "caught_user", "no_sync_user")},
    "test_a_late_rank_is_not_a_desync":
        _job(5, *(f"{case}:{len(ranks)}" for case, ranks in LATE.items())),
}


def _run(side_by_side, request):
    """This test's job (started with the file's others): rc, output, and how long after
    its last rank entered the case it ended."""
    result = side_by_side.run(request, JOBS)
    if result is None:
        return None
    rc, out, _ = result
    entered = [float(t) for t in re.findall(r"\[r\d\] entering at (\d+\.\d+)", out)]
    assert entered, out
    return rc, out, result.ended - max(entered)


def _bodies(out: str, n: int) -> str:
    found = {int(r): b for r, b in re.findall(r"\[r(\d)\] (mpiring desync: .*)", out)}
    assert sorted(found) == list(range(n)), f"not every rank reported the desync:\n{out}"
    assert len(set(found.values())) == 1, out
    return found[0]


@pytest.mark.deadline(120)
@pytest.mark.parametrize("n,names", [
    (2, r"r0 waits in all_reduce#1 on comm world\.dup1 \(Allgather, at desync\.py:\d+\) for r1, "
        r"while r1 waits in all_reduce#1 on comm world\.dup2 \(Allgather, at desync\.py:\d+\) "
        r"for r0: the ranks are in different calls"),
    (3, r"r0 and r2 wait in all_reduce#1 on comm world\.dup1 \(.*\) for r1, while r1 waits in "
        r"all_reduce#1 on comm world\.dup2 \(.*\) for r0 and r2"),
], ids=["2-ranks", "3-ranks"])
def test_a_cross_communicator_deadlock_is_named_on_every_rank(side_by_side, request, n, names):
    result = _run(side_by_side, request)
    if result is None:
        return
    rc, out, seconds = result
    assert rc == STALL_EXIT_CODE and "no error" not in out and "mpiring stall" not in out, out
    assert re.match(names, _bodies(out, n)[len("mpiring desync: "):]), out
    assert seconds < 20, f"ended {seconds:.1f} s after the desync:\n{out}"


@pytest.mark.deadline(120)
@pytest.mark.parametrize("case,mine,hint", [
    ("caught", r"broadcast#\d+ on comm world \(\w+, at desync\.py:\d+\)",
     r"r1: DDP: the backward of synced forward #3 never ran on this rank \(it failed and was "
     r"caught\?\)"),
    ("caught_user", r"all_reduce#3 on comm world \(Allgather, at desync\.py:\d+\)",
     r"r1: DDP ran synced forward #3; its backward has not run"),
    ("no_sync_user", r"all_reduce#3 on comm world \(Allgather, at desync\.py:\d+\)",
     r"r1: DDP finished synced backward #2; 1 forward\(s\) under no_sync\(\) since then"),
], ids=["caught", "caught_user", "no_sync_user"])
def test_a_ddp_desync_names_the_bucket_wait_the_other_call_and_the_cause(
        side_by_side, request, case, mine, hint):
    result = _run(side_by_side, request)
    if result is None:
        return
    rc, out, seconds = result
    assert rc == STALL_EXIT_CODE and "no error" not in out and "mpiring stall" not in out, out
    body = _bodies(out, 2)
    assert re.search(r"r0 waits in all_reduce#\d+ on comm world\.dup1 \(Ibarrier, in thread "
                     rf"mpiring-ddp-r0\) for r1, while r1 waits in {mine} for r0", body), body
    assert "(a DDP backward that failed on one rank and was caught, or no_sync() on some " \
           "ranks only?)" in body, body
    assert re.search(r"r0: DDP is reducing the gradients of synced backward #3 \(buckets on "
                     r"comm world\.dup1\)", body) and re.search(hint, body), body
    assert seconds < 20, f"ended {seconds:.1f} s after the desync:\n{out}"


@pytest.mark.deadline(120)
def test_a_late_rank_is_not_a_desync(side_by_side, request):
    # Both cases in one 5-rank job, at the same time, each on ranks of its own (slow on
    # 2, third on 3): a job's start costs seconds (every rank's imports, on shared
    # cores), and so does each case's late rank, which then sleep together. Every
    # rank's detector sees the waits of both.
    result = _run(side_by_side, request)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0 and "desync" not in out and "stall" not in out, out
    for case, ranks in LATE.items():
        assert sorted(int(r) for r in re.findall(rf"\[r(\d)\] {case}: ok", out)) == ranks, out
