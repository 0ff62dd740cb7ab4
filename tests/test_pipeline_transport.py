"""The pipeline transport's wait, without MPI: polls until done, hands over, restores."""

from __future__ import annotations

import pytest

from mpiring.parallel.pipeline import transport


class FakeRequest:
    """Done after ``polls`` calls of test(); wait() completes it at once."""

    def __init__(self, polls: int):
        self.polls, self.tests, self.waited = polls, 0, False

    def test(self) -> bool:
        self.tests += 1
        return self.tests > self.polls

    def wait(self) -> None:
        self.waited = True


@pytest.mark.parametrize("sleep_s", [None, transport.SLEEP_S])
@pytest.mark.parametrize("expect_s", [0.0, 0.002])
def test_wait_polls_until_done(comm, sleep_s, expect_s):
    reqs = [FakeRequest(0), FakeRequest(3), FakeRequest(40)]
    seconds = transport.wait_all(reqs, sleep_s=sleep_s, expect_s=expect_s)
    assert all(r.tests > r.polls for r in reqs) and not any(r.waited for r in reqs)
    assert seconds > 0
    assert transport.wait_all([FakeRequest(0)]) == 0.0  # already there: no wait at all


def test_wait_hands_over_to_the_communicators_wait(comm, monkeypatch):
    # A message that has not come within POLL_S: the communicator's own wait (its
    # deadline and stall report) takes over.
    monkeypatch.setattr(transport, "POLL_S", 0.01)
    late = FakeRequest(10**9)
    transport.wait_all([late, FakeRequest(1)])
    assert late.waited


def test_timer_slack_put_back(comm):
    before = transport._timer_slack(None)
    if before is None:
        pytest.skip("no prctl timer slack on this system")
    transport.wait_all([FakeRequest(20)], spin_s=0.0)
    assert transport._timer_slack(None) == before


def test_every_wait_starts_with_a_tight_poll(comm, monkeypatch):
    # A message that came during the compute is copied out by a later test than the
    # one that found it: no sleep may come between them.
    sleeps = []
    monkeypatch.setattr(transport.time, "sleep", lambda s: sleeps.append(s))
    # A clock of 1 us per reading: on a loaded machine a rank descheduled between two
    # polls would pass FIRST_S on the real one, which says nothing about the loop.
    clock = [0.0]

    def tick() -> float:
        clock[0] += 1e-6
        return clock[0]
    monkeypatch.setattr(transport.time, "perf_counter", tick)
    transport.wait_all([FakeRequest(5)], sleep_s=transport.SLEEP_S, expect_s=1.0)
    assert sleeps == []
    # Past FIRST_S, with the message not due yet (expect_s), the wait sleeps between polls.
    monkeypatch.setattr(transport, "FIRST_S", 0.0)
    transport.wait_all([FakeRequest(5)], sleep_s=transport.SLEEP_S, expect_s=1.0)
    assert len(sleeps) == 5


def test_a_changed_shape_names_renegotiate(comm):
    import torch

    from mpiring.parallel.pipeline.actions import SEND_F, Action

    if comm.size == 1:
        pytest.skip("a send needs a neighbour")
    t = transport.Transport(comm)
    t.fresh = False  # a fast step: the shapes were agreed
    if comm.rank == 0:
        a = Action(0, SEND_F, 3)
        t.prepared_sends[transport.key_of(a)] = t.fast.prepare_send(torch.zeros(2, 4), 1,
                                                                    transport.tag_of(a))
        with pytest.raises(ValueError, match=r"0SEND_F3: this micro-batch's tensor is not the "
                                             r"shape agreed .* sched.renegotiate\(\)"):
            t.send(a, torch.zeros(3, 4), [])
        # The same number of elements in another shape: the bytes alone would fit the
        # receiver's buffer, so the agreed shape itself is compared.
        t.sent[transport.key_of(a)] = (1, (2, 4), torch.float32, ("F", 1, 3))
        for other in (torch.zeros(4, 2), torch.zeros(2, 4, dtype=torch.int32)):
            with pytest.raises(ValueError, match=r"agreed torch.float32 of shape \(2, 4\)"):
                t.send(a, other, [])
