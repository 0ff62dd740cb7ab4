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
