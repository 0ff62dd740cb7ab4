"""Review of the torch.distributed drop-in against torch over gloo in the same processes:
the group_src/group_dst/group_peer keyword forms on a group whose ranks are not the
job's, torch's ReduceOp objects, dtypes gloo refuses, and gather/scatter given a
tensor unlike the root's list (or different roots): an error on every rank.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from torch_gloo import gloo_world  # noqa: E402

import mpiring as dist  # noqa: E402


def _x(rank: int, n: int, dtype=torch.float64, salt: int = 0) -> torch.Tensor:
    """Rank- and index-dependent small integers: every sum and product below is exact."""
    return ((torch.arange(n) * 5 + rank * 3 + salt) % 7 + 1).to(dtype)


def _outcomes(comm, call) -> list:
    """Run ``call`` and return every rank's outcome (None, or the exception's type and
    message), the same list on every rank: a test asserts on all of them together, so
    a call that raised on some ranks only fails the test on every rank alike."""
    try:
        call()
        mine = None
    except Exception as exc:  # noqa: BLE001 - any outcome is compared across ranks
        mine = [type(exc).__name__, str(exc)]
    return comm.control.allgather_json(mine) if comm.size > 1 else [mine]


def _cases(comm):
    """(name, call) pairs where one rank's tensor is unlike what the root expects."""
    k, me, last = comm.size, comm.rank, comm.size - 1

    def gather(n_of, dtype_of, root):
        def call():
            want = [torch.zeros(5, dtype=torch.float32) for _ in range(k)] if me == root else None
            dist.gather(torch.full((n_of(me),), float(me + 1), dtype=dtype_of(me)), want,
                        group_dst=root, group=comm)
        return call

    def scatter(n_of, dtype_of, root):
        def call():
            parts = [torch.full((5,), float(r + 1)) for r in range(k)] if me == root else None
            dist.scatter(torch.zeros(n_of(me), dtype=dtype_of(me)), parts, group_src=root,
                         group=comm)
        return call

    def f32(r):
        return torch.float32

    def f64(r):
        return torch.float64 if r == last else torch.float32

    return [
        ("gather: a longer tensor on the last rank", gather(lambda r: 5 + (r == last), f32, 0)),
        ("gather: a shorter tensor on the last rank", gather(lambda r: 5 - (r == last), f32, 0)),
        ("gather: float64 on the last rank", gather(lambda r: 5, f64, 0)),
        ("gather: a longer tensor on rank 0, root last",
         gather(lambda r: 5 + (r == 0), f32, last)),
        ("scatter: a longer tensor on the last rank", scatter(lambda r: 5 + (r == last), f32, 0)),
        ("scatter: a shorter tensor on the last rank",
         scatter(lambda r: 5 - (r == last), f32, 0)),
        ("scatter: float64 on the last rank", scatter(lambda r: 5, f64, 0)),
    ]


def test_gather_scatter_refuse_a_tensor_unlike_the_roots_on_every_rank(comm):
    # Before the fix: the root (gather) or the odd rank (scatter) raised MismatchError
    # alone and every other rank returned as if the call had worked.
    k, me = comm.size, comm.rank
    if k < 2:
        pytest.skip("one rank: its tensor is the root's")
    for name, call in _cases(comm):
        got = _outcomes(comm, call)
        assert all(o is not None and o[0] == "ValueError" for o in got), (name, got)
        assert len({o[1] for o in got}) == 1, (name, got)  # one message, every rank
        assert "root's size and dtype" in got[0][1], (name, got)
    # And the group still works: nothing was left in flight.
    x = _x(me, 3)
    dist.all_reduce(x, group=comm)
    assert torch.equal(x, sum(_x(r, 3) for r in range(k)))


# Before the fix this hung (the rank that named another root waited for a message
# nobody sends) until the desync detector aborted the job.
def test_gather_scatter_refuse_roots_that_differ_on_every_rank(comm):
    k, me, last = comm.size, comm.rank, comm.size - 1
    if k < 2:
        pytest.skip("one rank: one root")
    root = 1 if me == last else 0  # the last rank names another root than the others

    def gather():
        parts = [torch.zeros(2) for _ in range(k)] if me == root else None
        dist.gather(torch.full((2,), float(me)), parts, group_dst=root, group=comm)

    def scatter():
        parts = [torch.full((2,), float(r)) for r in range(k)] if me == root else None
        dist.scatter(torch.zeros(2), parts, group_src=root, group=comm)

    for call in (gather, scatter):
        got = _outcomes(comm, call)
        assert all(o is not None and "name different roots" in o[1] for o in got), got


@pytest.mark.parametrize("op", ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BXOR"))
def test_torch_reduce_op_objects_equal_torch_over_gloo(world, op):
    # torch.distributed.ReduceOp(RedOpType) is the object torch's own code passes (its
    # RedOpType sits in .op); the drop-in refused it as an unknown op.
    tdist = gloo_world(world)
    me = world.rank
    dtype = torch.int64 if op in ("BAND", "BXOR") else torch.float64
    obj = tdist.ReduceOp(getattr(tdist.ReduceOp, op))
    for n in (1, 9):
        want, got = _x(me, n, dtype), _x(me, n, dtype)
        tdist.all_reduce(want, op=obj)
        dist.all_reduce(got, op=obj, group=world)
        assert torch.equal(got, want), (op, n)
        want, got = _x(me, n * world.size, dtype), torch.zeros(n, dtype=dtype)
        dist.reduce_scatter_tensor(got, want.clone(), op=obj, group=world)
        tdist.all_reduce(want, op=obj)
        assert torch.equal(got, want[me * n:(me + 1) * n]), (op, n)


def test_group_keyword_forms_equal_torch_over_gloo(world):
    """torch 2.13's group_src/group_dst/group_peer on a group of job ranks 1..k-1, where a
    group rank is not the job rank: every call's result equals torch's over gloo."""
    tdist = gloo_world(world)
    k, me = world.size, world.rank
    members = list(range(1, k))
    if not members:
        pytest.skip("needs 2 ranks")
    tg = tdist.new_group(members)  # collective over every gloo rank
    ours = world.split(0 if me in members else None, key=me)
    if ours is None:
        return
    try:
        g, m, last = me - 1, len(members), len(members) - 1
        a, b = _x(me, 5), _x(me, 5)
        dist.broadcast(a, group=ours, group_src=last)
        tdist.broadcast(b, group=tg, group_src=last)
        assert torch.equal(a, b) and torch.equal(a, _x(members[last], 5))
        a, b = _x(me, 5), _x(me, 5)
        dist.reduce(a, group=ours, group_dst=0)
        tdist.reduce(b, group=tg, group_dst=0)
        assert g != 0 or torch.equal(a, b)  # the root's: the others' are torch's scratch
        lists = [[torch.zeros(3) for _ in range(m)] if g == last else None for _ in range(2)]
        dist.gather(_x(me, 3, torch.float32), lists[0], group=ours, group_dst=last)
        tdist.gather(_x(me, 3, torch.float32), lists[1], group=tg, group_dst=last)
        if g == last:
            assert all(torch.equal(x, y) for x, y in zip(*lists))
        a, b = torch.zeros(3), torch.zeros(3)
        parts = [_x(r, 3, torch.float32, salt=2) for r in range(m)] if g == 0 else None
        dist.scatter(a, parts, group=ours, group_src=0)
        tdist.scatter(b, parts, group=tg, group_src=0)
        assert torch.equal(a, b) and torch.equal(a, _x(g, 3, torch.float32, salt=2))
        boxes = [[("from", me), me] if g == last else [None, None] for _ in range(2)]
        dist.broadcast_object_list(boxes[0], group=ours, group_src=last)
        tdist.broadcast_object_list(boxes[1], group=tg, group_src=last)
        assert boxes[0] == boxes[1] == [("from", members[last]), members[last]]
        into = [[None] * m if g == 0 else None for _ in range(2)]
        dist.gather_object({"r": me}, into[0], group=ours, group_dst=0)
        tdist.gather_object({"r": me}, into[1], group=tg, group_dst=0)
        assert into[0] == into[1]
        outs = [[None], [None]]
        dist.scatter_object_list(outs[0], list(range(10, 10 + m)) if g == last else None,
                                 group=ours, group_src=last)
        tdist.scatter_object_list(outs[1], list(range(10, 10 + m)) if g == last else None,
                                  group=tg, group_src=last)
        assert outs[0] == outs[1] == [10 + g]
        if m < 2:
            return
        peer_g = (g + 1) % m  # a ring over the group, by group rank
        back_g = (g - 1) % m
        recvd = [torch.zeros(4), torch.zeros(4)]
        for lib, grp, out in ((dist, ours, recvd[0]), (tdist, tg, recvd[1])):
            works = lib.batch_isend_irecv([
                lib.P2POp(lib.isend, _x(me, 4, torch.float32), group=grp, group_peer=peer_g),
                lib.P2POp(lib.irecv, out, group=grp, group_peer=back_g)])
            for w in works:
                w.wait()
        assert torch.equal(recvd[0], recvd[1])
        assert torch.equal(recvd[0], _x(members[back_g], 4, torch.float32))
        if g in (0, 1):  # send/recv and the object pair, group rank 0 -> 1
            for lib, grp in ((dist, ours), (tdist, tg)):
                if g == 0:
                    lib.send(_x(me, 2), group=grp, group_dst=1)
                    lib.send_object_list([{"k": (me, 1.5)}], group=grp, group_dst=1)
                else:
                    t, box = torch.zeros(2, dtype=torch.float64), [None]
                    assert lib.recv(t, group=grp, group_src=0) == members[0]
                    assert torch.equal(t, _x(members[0], 2))
                    assert lib.recv_object_list(box, group=grp, group_src=0) == members[0]
                    assert box == [{"k": (members[0], 1.5)}]
        assert (dist.get_global_rank(ours, last), dist.get_group_rank(ours, me)) == \
            (tdist.get_global_rank(tg, last), tdist.get_group_rank(tg, me))
    finally:
        ours.free()


@pytest.mark.parametrize("dtype", (torch.int16, torch.uint16, torch.uint32,
                                   torch.float8_e4m3fn))
def test_dtypes_gloo_refuses_are_refused_on_every_rank(world, dtype):
    """gloo refuses int16, uint16, uint32 and float8 tensors ("Invalid scalar type");
    mpiring refuses them too, on every rank even when one rank alone passes one, and
    the others' error names that rank."""
    tdist = gloo_world(world)
    k, me, last = world.size, world.rank, world.size - 1
    with pytest.raises(RuntimeError, match="Invalid scalar type"):
        tdist.all_reduce(torch.zeros(3, dtype=dtype))
    odd = torch.zeros(3, dtype=dtype) if me == last else torch.zeros(3, dtype=torch.int32)
    for call in (lambda: dist.all_reduce(odd, group=world),
                 lambda: dist.broadcast(odd, src=0, group=world),
                 lambda: dist.all_gather_into_tensor(torch.zeros(3 * k, dtype=odd.dtype), odd,
                                                     group=world)):
        got = _outcomes(world, call)
        assert all(o is not None for o in got), got
        assert all(str(dtype).removeprefix("torch.") in o[1] for o in got), got
        assert all(f"r{last}" in o[1] for r, o in enumerate(got) if r != last), got
    x = _x(me, 4)  # the group still works
    dist.all_reduce(x, group=world)
    assert torch.equal(x, sum(_x(r, 4) for r in range(k)))
