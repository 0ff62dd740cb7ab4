"""Inputs that used to give a silently wrong result or a stall: refused on every rank.

A big-endian array, an unaligned view and a sparse tensor on one rank; a
non-integer ``split`` color. Each is refused before any byte moves on the rank
that has it (with the fix), and through the argument agreement on every other
rank, on every path (the default algo, the ring and MPI's native collective).
Afterwards the same communicator still runs a correct all_reduce.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import data
from test_errors import fresh as _fresh
from test_errors import still_works

import mpiring

fresh = _fresh  # the fixture: a new dup() of the world, call numbers from #1


def _big_endian(n):
    return data(2, n, np.float32).astype(">f4")


def _unaligned(n):
    raw = np.zeros(n * 4 + 1, dtype=np.uint8)
    x = raw[1:].view(np.float32)  # a float32 view at a byte offset
    x[:] = data(2, n, np.float32)
    return x


def _sparse(n):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(data(2, n, np.float32)).to_sparse()


# name -> (make the bad rank's buffer, the fix its message must name)
BAD = {
    "big-endian": (_big_endian, r"non-native byte order \(>f4\).*"
                                r"x\.astype\(x\.dtype\.newbyteorder\(\"=\"\)\)"),
    "unaligned": (_unaligned, r"not aligned to its dtype.*x\.copy\(\)"),
    "sparse": (_sparse, r"tensor is sparse \(torch\.sparse_coo\).*x\.to_dense\(\)"),
}


@pytest.mark.parametrize("algo", ["auto", "ring", "native"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_layout_is_refused_on_every_rank_on_every_path(fresh, case, algo):
    make, fix = BAD[case]
    bad_rank = 1
    n = 24
    x = make(n) if fresh.rank == bad_rank else data(fresh.rank, n, np.float32)
    before = np.array(x.to_dense() if hasattr(x, "to_dense") else x, dtype=np.float32)
    if fresh.rank == bad_rank:
        with pytest.raises(ValueError, match=fix):
            fresh.all_reduce(x, algo=algo)
    else:
        with pytest.raises(ValueError, match=f"^all_reduce#1: no rank ran the collective "
                                             f"because r{bad_rank} rejected its input") as info:
            fresh.all_reduce(x, algo=algo)
        assert not isinstance(info.value, mpiring.MismatchError)
        assert re.search(fix, str(info.value)), str(info.value)
    after = np.array(x.to_dense() if hasattr(x, "to_dense") else x, dtype=np.float32)
    np.testing.assert_array_equal(after, before, err_msg="no byte may move before the check")
    still_works(fresh)


def test_the_named_fix_gives_the_right_sum(fresh):
    x = data(fresh.rank, 9, np.float32).astype(">f4")
    x = x.astype(x.dtype.newbyteorder("="))  # what the message says to do
    fresh.all_reduce(x, algo="ring")
    np.testing.assert_array_equal(x, sum(data(r, 9, np.float64) for r in range(fresh.size)))


@pytest.mark.parametrize("bad", ["a", 1.5, True, [0]])
def test_split_with_a_non_integer_color_raises_on_every_rank(fresh, bad):
    bad_rank = fresh.size - 1
    if fresh.rank == bad_rank:
        with pytest.raises(ValueError, match=r"^split: color=.*: use an integer.*or None"):
            fresh.split(bad)
    else:
        with pytest.raises(ValueError, match=rf"^split#1: no rank ran it because r{bad_rank} "
                                             r"rejected its arguments \(ValueError: split: "
                                             r"color="):
            fresh.split(0)
    half = fresh.split(fresh.rank % 2, key=fresh.rank)  # the communicator still splits
    assert half.size == len(range(fresh.rank % 2, fresh.size, 2))
    still_works(half)


def test_split_with_a_non_integer_key_raises_on_every_rank(fresh):
    key = "first" if fresh.rank == 0 else fresh.rank
    with pytest.raises(ValueError, match=r"key='first': use an integer"):
        fresh.split(0, key=key)


def test_split_takes_numpy_integers_and_none(fresh):
    sub = fresh.split(np.int64(0) if fresh.rank else None, key=np.int32(-fresh.rank))
    if fresh.rank == 0:
        assert sub is None
    else:
        assert sub.size == fresh.size - 1 and sub.rank == fresh.size - 1 - fresh.rank
