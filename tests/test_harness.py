"""The harness itself: a failure or a hang on one rank ends the whole job fast, named.

These launch nested ``mpiexec`` jobs from rank 0, side by side (conftest's
``SideBySide``), while the other ranks wait without spinning.
"""

import re

import pytest
from conftest import Job

HARNESS = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]


def _case(n: int, case: str) -> Job:
    return Job(n, [*HARNESS, f"tests/harness_cases/{case}"])


JOBS = {
    "test_failure_on_one_rank_ends_the_job_fast": _case(3, "case_fail.py"),
    "test_hang_hits_the_deadline_and_aborts_with_a_traceback": _case(2, "case_hang.py"),
    "test_a_timeout_prints_the_stacks_of_the_other_ranks": _case(2, "case_stuck_in_c.py"),
    "test_an_mpiring_stall_inside_a_test_is_reported_not_swallowed":
        _case(2, "case_mpiring_stall.py"),
    "test_passing_run_reads_like_one_report": _case(3, "case_pass.py"),
    "test_odd_world_size[5]": Job(5, ["tests/scripts/check_collectives.py"], timeout=100),
}


def aborted_job(side_by_side, request) -> str | None:
    """This test's harness case, which must abort the job fast; its output (None off rank 0)."""
    result = side_by_side.run(request, JOBS)
    if result is None:
        return None
    rc, out, seconds = result
    assert rc != 0, out
    assert seconds < 30, f"took {seconds:.1f} s:\n{out}"
    return out


@pytest.mark.deadline(90)
def test_failure_on_one_rank_ends_the_job_fast(side_by_side, request):
    out = aborted_job(side_by_side, request)
    if out is None:
        return
    assert "[r1] FAILED tests/harness_cases/case_fail.py::test_rank1_fails" in out, out
    assert "deliberate failure on rank 1" in out, out


@pytest.mark.deadline(90)
def test_hang_hits_the_deadline_and_aborts_with_a_traceback(side_by_side, request):
    out = aborted_job(side_by_side, request)
    if out is None:
        return
    # Both ranks are stuck (r0 sleeping, r1 in the barrier); whichever deadline
    # fires first names itself and aborts the job.
    assert re.search(r"\[r[01]\] TIMEOUT tests/harness_cases/case_hang.py::test_rank0_hangs", out), out
    assert "case_hang.py\", line" in out, "the stack dump must show where it hung"


@pytest.mark.deadline(90)
def test_a_timeout_prints_the_stacks_of_the_other_ranks(side_by_side, request):
    """Rank 0 is stuck in C with the GIL held and cannot report; rank 1's report shows where."""
    out = aborted_job(side_by_side, request)
    if out is None:
        return
    assert "[r1] TIMEOUT tests/harness_cases/case_stuck_in_c.py::test_rank0_stuck_in_c" in out, out
    assert re.search(r"\[r1\] stacks of r0 \(pid \d+\), asked for when r1 timed out", out), out
    after = out.split("stacks of r0", 1)[1]
    assert "hold_the_gil_in_c" in after, f"rank 0's dump must show where it is stuck:\n{out}"


@pytest.mark.deadline(90)
def test_an_mpiring_stall_inside_a_test_is_reported_not_swallowed(side_by_side, request):
    """mpiring's watchdog writes its report and aborts: pytest's capture of fd 2 must not
    keep it (it did: the job ended with exit 124 and printed nothing)."""
    out = aborted_job(side_by_side, request)
    if out is None:
        return
    assert re.search(r"\[r[01]\] mpiring (stall|desync)", out), out
    assert "case_mpiring_stall.py" in out, f"the report must say where:\n{out}"


@pytest.mark.deadline(90)
def test_passing_run_reads_like_one_report(side_by_side, request):
    result = side_by_side.run(request, JOBS)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0, out
    assert out.count("1 passed") == 1, f"only rank 0 should print the summary:\n{out}"


@pytest.mark.deadline(120)
@pytest.mark.parametrize("k", [5])
def test_odd_world_size(side_by_side, request, k):
    result = side_by_side.run(request, JOBS)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0, out
    assert f"OK K={k}" in out, out
