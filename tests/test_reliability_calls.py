"""Calls are matched, not just compared: a rank that skips a call is caught at the next one.

Each rank counts its own calls, so after a skipped call the counts still match
and two same-shaped calls would be paired (the result silently mixing them).
The descriptor carries the caller's line (``mpiring.comm.callsite``); the
error names both ranks' lines.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import data
from test_errors import fresh as _fresh
from test_errors import still_works

import mpiring
from mpiring.comm import callsite

fresh = _fresh  # the fixture: a new dup() of the world, call numbers from #1


def _line(fn, marker: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def _sequence(comm, skipper: int):
    a, b, c = (data(comm.rank, 3, np.float64, salt=s) for s in range(3))
    comm.all_reduce(a, algo="ring")  # first
    if comm.rank != skipper:
        comm.all_reduce(b, algo="ring")  # second
    comm.all_reduce(c, algo="ring")  # third
    return a, b, c


def test_a_skipped_call_is_named_on_every_rank(fresh):
    skipper = fresh.size - 1
    second, third = _line(_sequence, "# second"), _line(_sequence, "# third")
    with pytest.raises(mpiring.MismatchError) as info:
        _sequence(fresh, skipper)
    sites = " ".join(f"r{r}=test_reliability_calls.py:{third if r == skipper else second}"
                     for r in range(fresh.size))
    assert str(info.value).startswith(f"all_reduce#2: call site differs: {sites} (the ranks "
                                      "are in different calls"), str(info.value)
    assert "count differs" not in str(info.value)
    still_works(fresh)


def test_same_line_calls_in_a_loop_still_match(fresh):
    """The usual training loop: every call from one line, on every rank."""
    for i in range(4):
        x = data(fresh.rank, 11, np.float32, salt=i)
        fresh.all_reduce(x, algo="ring")
        np.testing.assert_array_equal(x, sum(data(r, 11, np.float64, salt=i)
                                             for r in range(fresh.size)))


def test_site_code_names_the_first_frame_outside_mpiring():
    code = callsite.site_code(0)
    here = _line(test_site_code_names_the_first_frame_outside_mpiring, "site_code(0)")
    assert callsite.site_name(code) == f"test_reliability_calls.py:{here}"
    assert callsite.site_code(0) != code  # another line: another code
    assert re.fullmatch(r"site [0-9a-f]{8}", callsite.site_name(0x1234567))
