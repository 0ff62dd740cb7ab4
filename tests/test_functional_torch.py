"""torch.distributed's functions on mpiring against torch's own over gloo: bool and complex
tensors, the bitwise ops, Work handles and futures, and the rest of torch's names a
ported script calls (Backend, is_*_available, object send/receive, subgroups)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from torch_gloo import gloo_world  # noqa: E402

import mpiring as dist  # noqa: E402

BITS = ("BAND", "BOR", "BXOR")


def _flags(rank: int, n: int, salt: int = 0) -> torch.Tensor:
    """Rank- and index-dependent bools: every op's result differs from every other's."""
    return (torch.arange(n) * 3 + rank * 5 + salt) % 4 < 2


def _complex(rank: int, n: int, dtype=torch.complex128) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    return torch.complex(i * 2 + rank, 7 - i * rank).to(dtype)


def _ints(rank: int, n: int) -> torch.Tensor:
    return ((torch.arange(n) * 37 + rank * 11 + 5) % 251 - 120).to(torch.int32)


@pytest.mark.parametrize("op", ("SUM", "PRODUCT", "MIN", "MAX", *BITS))
def test_bool_and_bitwise_reductions_equal_torch_over_gloo(world, op):
    tdist = gloo_world(world)
    ours, theirs = getattr(dist.ReduceOp, op), getattr(tdist.ReduceOp, op)
    for n in (0, 1, 9):
        want = _flags(world.rank, n)
        tdist.all_reduce(want, op=theirs)
        got = _flags(world.rank, n)
        dist.all_reduce(got, op=theirs, group=world)  # torch's own ReduceOp
        assert got.dtype == torch.bool and torch.equal(got, want), (op, n)
        # And each byte 0 or 1: gloo's SUM leaves the count of trues in the byte (2
        # compares equal to True; 256 ranks would wrap to False), mpiring's is an or.
        assert bool((got.view(torch.uint8) <= 1).all())
        if op in BITS:
            want, got = _ints(world.rank, n), _ints(world.rank, n)
            tdist.all_reduce(want, op=theirs)
            dist.all_reduce(got, op=ours, group=world)
            assert torch.equal(got, want), (op, n)
    if op in BITS:  # gloo refuses floats too; here every rank, before anything moves
        with pytest.raises(ValueError, match="not defined for floating dtype float32"):
            dist.all_reduce(torch.ones(3), op=ours, group=world)


@pytest.mark.parametrize("dtype", (torch.complex64, torch.complex128))
def test_complex_reductions_and_moves_equal_torch_over_gloo(world, dtype):
    tdist = gloo_world(world)
    k, me = world.size, world.rank
    for op in ("SUM", "AVG"):
        want = _complex(me, 5, dtype)
        tdist.all_reduce(want, op=getattr(tdist.ReduceOp, op))
        got = torch.zeros(10, dtype=dtype)[::2]  # strided: written back in place
        got.copy_(_complex(me, 5, dtype))
        dist.all_reduce(got, op=getattr(dist.ReduceOp, op), group=world)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="max is not defined on complex tensors"):
        dist.all_reduce(_complex(me, 3, dtype), op=dist.ReduceOp.MAX, group=world)
    want = _complex(me, 4, dtype)
    tdist.broadcast(want, k - 1)
    got = _complex(me, 4, dtype)
    dist.broadcast(got, src=k - 1, group=world)
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", (0, 1, 7))
def test_bool_and_complex_travel_through_every_call(comm, n):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    flags = [_flags(r, n) for r in range(k)]
    out = torch.zeros(k * n, dtype=torch.bool)
    dist.all_gather_into_tensor(out, flags[me], group=comm)
    assert torch.equal(out, torch.cat(flags))
    parts = [torch.zeros(n, dtype=torch.complex64) for _ in range(k)]
    dist.all_gather(parts, _complex(me, n, torch.complex64), group=comm)
    assert all(torch.equal(p, _complex(r, n, torch.complex64)) for r, p in enumerate(parts))
    mine = torch.zeros(n, dtype=torch.complex128)
    whole = torch.cat([_complex(me * 3 + j, n) for j in range(k)])  # part j from rank me
    dist.reduce_scatter_tensor(mine, whole, group=comm)
    assert torch.equal(mine, sum(_complex(r * 3 + me, n) for r in range(k)))
    got = torch.zeros(n, dtype=torch.bool)
    dist.reduce_scatter(got, [_flags(me, n, salt=r) for r in range(k)], op=dist.ReduceOp.PRODUCT,
                        group=comm)
    assert torch.equal(got, torch.stack([_flags(r, n, salt=me) for r in range(k)]).all(0))
    root = k - 1
    gathered = [torch.zeros(n, dtype=torch.complex128) for _ in range(k)] if me == root else None
    dist.gather(_complex(me, n), gathered, group_dst=root, group=comm)
    if me == root:
        assert all(torch.equal(g, _complex(r, n)) for r, g in enumerate(gathered))
    got = torch.zeros(n, dtype=torch.bool)
    dist.scatter(got, [_flags(r, n, salt=1) for r in range(k)] if me == root else None,
                 group_src=root, group=comm)
    assert torch.equal(got, _flags(me, n, salt=1))
    # Uneven complex rows: the split sizes count complex elements, not their floats.
    sizes = [(me + r) % 3 for r in range(k)]
    send = torch.cat([_complex(me * 10 + r, s) for r, s in enumerate(sizes)])
    recv = torch.zeros(sum((r + me) % 3 for r in range(k)), dtype=torch.complex128)
    dist.all_to_all_single(recv, send, [(r + me) % 3 for r in range(k)], sizes, group=comm)
    assert torch.equal(recv, torch.cat([_complex(r * 10 + me, (r + me) % 3) for r in range(k)]))
    if k > 1:
        right, left = jobs[(me + 1) % k], jobs[(me - 1) % k]
        got = torch.zeros(n, dtype=torch.complex64)
        works = [dist.irecv(got, src=left, group=comm),
                 dist.isend(_complex(me, n, torch.complex64), dst=right, group=comm)]
        assert [w.wait() for w in works] == [True, True]  # torch's Work.wait() is True
        assert torch.equal(got, _complex((me - 1) % k, n, torch.complex64))
        assert works[0].source_rank() == left and works[0].is_completed()


def test_async_handles_hold_their_outputs_as_torch_works_do(comm):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    x = torch.full((3,), float(me + 1))
    work = dist.all_reduce(x, group=comm, async_op=True)
    assert work.wait() is True and work.is_completed() and work.is_success()
    value = work.get_future().wait()
    assert len(value) == 1 and value[0] is x and work.result()[0] is x
    assert torch.equal(x, torch.full((3,), float(k * (k + 1) // 2)))
    chained = work.get_future().then(lambda f: f.value()[0] * 2).wait()
    assert torch.equal(chained, 2 * x)
    parts = [torch.zeros(2) for _ in range(k)]
    work = dist.all_gather(parts, torch.full((2,), float(me)), group=comm, async_op=True)
    assert work.get_future().value() == parts
    assert dist.barrier(group=comm, async_op=True).get_future().value() == []
    if k > 1:
        right, left = jobs[(me + 1) % k], jobs[(me - 1) % k]
        got = torch.zeros(2)
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(me)), right, group=comm),
               dist.P2POp(dist.irecv, got, left, group=comm)]
        works = dist.batch_isend_irecv(ops)
        assert [w.wait() for w in works] == [True, True]
        assert works[1].get_future().value()[0] is got
        assert torch.equal(got, torch.full((2,), float((me - 1) % k)))
        with pytest.raises(ValueError, match="only a receive has a source"):
            works[0].source_rank()


def test_a_message_to_ones_own_rank_is_refused(comm):
    me = comm.world_ranks[comm.rank]
    for fn, kw in ((dist.send, "dst"), (dist.isend, "dst"), (dist.recv, "src"),
                   (dist.irecv, "src")):
        with pytest.raises(ValueError, match="is this process's own rank"):
            fn(torch.ones(2), group=comm, **{kw: me})
    with pytest.raises(ValueError, match="invalid destination rank"):
        dist.send_object_list([1], dst=me, group=comm)


def test_backend_names_and_availability(world, monkeypatch):
    assert dist.Backend("GLOO") == "gloo" == dist.Backend.GLOO and dist.Backend.NCCL == "nccl"
    with pytest.raises(ValueError, match="mpiring runs 'mpi' and 'gloo'"):
        dist.Backend("ucc")
    assert dist.is_mpi_available() and dist.is_gloo_available() and not dist.is_ucc_available()
    assert dist.is_backend_available("gloo") and not dist.is_backend_available("ucc")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="fallback_rank"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=5) == 5
    dist.init_process_group("GLOO")
    try:
        assert dist.get_backend() == "gloo" == dist.Backend.GLOO  # what the script asked for
        assert dist.get_node_local_rank() == world.local_rank
        sub = dist.new_group([0])
        if world.rank == 0:
            assert dist.get_backend(sub) == "gloo"
            dist.destroy_process_group(sub)  # torch frees a subgroup so
    finally:
        dist.destroy_process_group()
    dist.init_process_group()
    try:
        assert dist.get_backend() == "mpi"
    finally:
        dist.destroy_process_group()


def test_object_lists_point_to_point(comm):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    if k == 1:
        return
    right, left = jobs[(me + 1) % k], jobs[(me - 1) % k]
    sent = [{"from": me, "w": torch.arange(3) * me}, ("x", me), None]
    box = [None] * 3
    if me % 2 == 0:
        dist.send_object_list(sent, dst=right, group=comm)
        assert dist.recv_object_list(box, src=left, group=comm) == left
    else:
        assert dist.recv_object_list(box, src=left, group=comm) == left
        dist.send_object_list(sent, dst=right, group=comm)
    l_me = (me - 1) % k
    assert box[0]["from"] == l_me and torch.equal(box[0]["w"], torch.arange(3) * l_me)
    assert box[1:] == [("x", l_me), None]
    # A list of the wrong length fails on the receiver, after both messages came: the
    # sender is not left waiting (torch's gloo crashes the process here).
    if me == 0:
        dist.send_object_list([1, 2, 3], dst=jobs[1], group=comm)
    elif me == 1:
        short = [None]
        with pytest.raises(ValueError, match="sent 3 objects and object_list has 1 entries"):
            dist.recv_object_list(short, src=jobs[0], group=comm)
        assert short == [None]
    # From any sender (src=None, as torch's): rank 0 takes each other rank's list, in
    # whatever order they come, each whole from its own sender.
    if me == 0:
        got = {}
        for _ in range(k - 1):
            box = [None] * 2
            src = dist.recv_object_list(box, group=comm)
            got[src] = box
        assert sorted(got) == sorted(jobs[1:])
        for src, box in got.items():
            r = jobs.index(src)
            assert box[0] == ("from", r) and torch.equal(box[1], torch.arange(r * 50 + 7))
    else:
        dist.send_object_list([("from", me), torch.arange(me * 50 + 7)], dst=jobs[0],
                              group=comm)


def test_subgroups_are_made_and_destroyed_as_torch_makes_them(world):
    k, me = world.size, world.rank
    dist.init_process_group()
    try:
        size = 2 if k % 2 == 0 else 1
        cur, subs = dist.new_subgroups(group_size=size)
        assert len(subs) == k // size and subs[me // size] is cur
        assert all(s is dist.GroupMember.NON_GROUP_MEMBER for i, s in enumerate(subs)
                   if i != me // size)
        assert dist.get_process_group_ranks(cur) == list(range(me - me % size,
                                                                me - me % size + size))
        x = torch.full((2,), float(me))
        dist.all_reduce(x, group=cur)
        assert torch.equal(x, torch.full((2,), float(sum(dist.get_process_group_ranks(cur)))))
        for s in subs:  # torch's cleanup loop: a rank passes every group
            dist.destroy_process_group(s)
        cur, subs = dist.new_subgroups()  # one host: its ranks are the job
        assert dist.get_process_group_ranks(cur) == list(range(k)) and subs == [cur]
        dist.destroy_process_group(cur)
        with pytest.raises(ValueError, match="positive divisor"):
            dist.new_subgroups(group_size=k + 1)
        # Odd and even ranks, rank 0 left out of both: its group is None, as torch's.
        lists = [[r for r in range(1, k) if r % 2], [r for r in range(2, k, 2)]]
        lists = [ranks for ranks in lists if ranks] or [[0]]
        cur, subs = dist.new_subgroups_by_enumeration(lists)
        mine = [i for i, ranks in enumerate(lists) if me in ranks]
        if mine:
            assert subs[mine[0]] is cur and dist.get_process_group_ranks(cur) == lists[mine[0]]
        else:
            assert cur is None
        for s in subs:
            dist.destroy_process_group(s)
        if k > 1:
            with pytest.raises(ValueError, match="each in one group at most"):
                dist.new_subgroups_by_enumeration([[0, 1], [1]])
            with pytest.raises(ValueError, match="the ranks differ"):
                dist.new_subgroups_by_enumeration([[me]])
    finally:
        dist.destroy_process_group()


def test_a_group_made_by_its_members_alone(world):
    # torch's new_group(..., use_local_synchronization=True): only the members call it;
    # before, every rank had to, and the members waited for the others to the deadline.
    k, me = world.size, world.rank
    dist.init_process_group()
    try:
        mine = [r for r in range(k) if r % 2 == me % 2]  # evens and odds, at the same time
        group = dist.new_group(mine, use_local_synchronization=True)
        assert dist.get_process_group_ranks(group) == mine
        x = torch.full((2,), float(me))
        dist.all_reduce(x, group=group)
        assert torch.equal(x, torch.full((2,), float(sum(mine))))
        dist.destroy_process_group(group)
        if me == k - 1:  # a group of one, made alone
            alone = dist.new_group([me], use_local_synchronization=True)
            assert dist.get_world_size(alone) == 1
            dist.destroy_process_group(alone)
        with pytest.raises(ValueError, match="give distinct ranks"):
            dist.new_group([me, me], use_local_synchronization=True)
        y = torch.full((1,), float(me))  # the default group is still in step
        dist.all_reduce(y)
        assert y.item() == sum(range(k))
    finally:
        dist.destroy_process_group()
