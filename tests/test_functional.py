"""torch.distributed's functions on mpiring (``import mpiring as dist``): the results
against the arithmetic, on 1-4 ranks, with sizes that are empty, tiny and odd."""

from __future__ import annotations

import warnings
from collections import namedtuple
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

import mpiring as dist  # noqa: E402 - after the skip: the functions take torch tensors

SIZES = (0, 1, 7)


def _x(rank: int, n: int, dtype=torch.float64, salt: int = 0):
    """Rank- and index-dependent small integers: every sum is exact."""
    return ((torch.arange(n) * 3 + rank * 5 + salt) % 11).to(dtype)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int32])
def test_all_reduce_broadcast_reduce(comm, n, dtype):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    want = sum(_x(r, n, dtype) for r in range(k)) if k else None

    x = _x(me, n, dtype)
    assert dist.all_reduce(x, group=comm) is None
    assert torch.equal(x, want)
    x = _x(me, n, dtype)
    dist.all_reduce(x, op=tdist.ReduceOp.MAX, group=comm)  # torch's own ReduceOp
    assert torch.equal(x, torch.stack([_x(r, n, dtype) for r in range(k)]).amax(0))

    last = k - 1
    x = _x(me, n, dtype, salt=1)
    work = dist.broadcast(x, src=jobs[last], group=comm, async_op=True)
    assert work.wait() and work.is_completed()
    assert torch.equal(x, _x(last, n, dtype, salt=1))

    x = _x(me, n, dtype)
    dist.reduce(x, group_dst=last, op=dist.ReduceOp.SUM, group=comm)
    assert torch.equal(x, want if me == last else _x(me, n, dtype))


def test_one_collective_from_different_lines_runs_as_in_torch(comm):
    # torch's idiom: the root and the others make the same call from their own
    # branch. mpiring's own API compares the call sites; the drop-in must not.
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    if me == 0:
        x = _x(0, 5)
        dist.broadcast(x, src=jobs[0], group=comm)
    else:
        x = torch.empty(5, dtype=torch.float64)
        dist.broadcast(x, src=jobs[0], group=comm)
    assert torch.equal(x, _x(0, 5))
    y = _x(me, 3)
    if me == k - 1:
        dist.all_reduce(y, group=comm)
    else:
        dist.all_reduce(y, group=comm)
    assert torch.equal(y, sum(_x(r, 3) for r in range(k)))
    if k > 1:  # the Communicator's own call still names the two lines
        with pytest.raises(dist.MismatchError, match="call site differs"):
            if me == 0:
                comm.broadcast(_x(0, 5).numpy(), root=0)
            else:
                comm.broadcast(_x(0, 5).numpy(), root=0)


def _strided(values: torch.Tensor) -> torch.Tensor:
    """A tensor equal to ``values`` (1-D) whose memory is every other element of a larger
    one: what a slice or a transposed view hands a collective."""
    base = torch.full((2 * values.numel(),), -99.0, dtype=values.dtype)
    view = base[::2]
    view.copy_(values)
    assert not view.is_contiguous() or values.numel() <= 1
    return view


@pytest.mark.parametrize("n", (1, 7))
def test_strided_tensors_are_read_and_written_in_place(comm, n):
    # torch's collectives take a transposed view or a strided slice and write it in place;
    # the old refusal, and a write into a reshape's copy, were both wrong.
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    total = sum(_x(r, n) for r in range(k))
    t = _strided(_x(me, n))
    dist.all_reduce(t, group=comm)
    assert torch.equal(t, total)
    m = _x(me, 6).view(2, 3).t()  # transposed: (3, 2), not contiguous
    dist.all_reduce(m, group=comm)
    assert torch.equal(m, sum(_x(r, 6) for r in range(k)).view(2, 3).t())
    t = _strided(_x(me, n, salt=1))
    dist.broadcast(t, src=jobs[k - 1], group=comm)
    assert torch.equal(t, _x(k - 1, n, salt=1))
    t = _strided(_x(me, n))
    dist.reduce(t, group_dst=0, group=comm)
    assert torch.equal(t, total if me == 0 else _x(me, n))

    outs = [_strided(torch.zeros(n, dtype=torch.float64)) for _ in range(k)]
    dist.all_gather(outs, _strided(_x(me, n)), group=comm)
    assert all(torch.equal(o, _x(r, n)) for r, o in enumerate(outs))
    whole = _strided(torch.zeros(k * n, dtype=torch.float64))
    dist.all_gather_into_tensor(whole, _strided(_x(me, n)), group=comm)
    assert torch.equal(whole, torch.cat([_x(r, n) for r in range(k)]))
    part = _strided(torch.zeros(n, dtype=torch.float64))
    dist.reduce_scatter_tensor(part, _strided(_x(me, k * n)), group=comm)
    assert torch.equal(part, sum(_x(r, k * n) for r in range(k))[me * n:(me + 1) * n])
    part = _strided(torch.zeros(n, dtype=torch.float64))
    dist.reduce_scatter(part, [_strided(_x(me, n, salt=i)) for i in range(k)], group=comm)
    assert torch.equal(part, sum(_x(r, n, salt=me) for r in range(k)))

    root = k - 1  # the root's own part and the others' both strided
    got = [_strided(torch.zeros(n, dtype=torch.float64)) for _ in range(k)] if me == root else None
    dist.gather(_strided(_x(me, n, salt=2)), got, group_dst=root, group=comm)
    if me == root:
        assert all(torch.equal(g, _x(r, n, salt=2)) for r, g in enumerate(got))
    t = _strided(torch.zeros(n, dtype=torch.float64))
    parts = [_strided(_x(r, n, salt=3)) for r in range(k)] if me == root else None
    dist.scatter(t, parts, group_src=root, group=comm)
    assert torch.equal(t, _x(me, n, salt=3))


@pytest.mark.parametrize("n", SIZES)
def test_all_gather_in_each_form(comm, n):
    k, me = comm.size, comm.rank
    parts = [_x(r, n) for r in range(k)]
    flat = torch.full((k * n,), -1.0, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, _x(me, n), group=comm)
    assert torch.equal(flat, torch.cat(parts))
    # torch's stacked form: the same memory order
    stacked = torch.full((k, n), -1.0, dtype=torch.float64)
    dist.all_gather_single(stacked, _x(me, n), group=comm)  # torch 2.13's name
    assert torch.equal(stacked, torch.stack(parts))
    got = [torch.full((n,), -1.0, dtype=torch.float64) for _ in range(k)]
    dist.all_gather(got, _x(me, n), group=comm)
    assert all(torch.equal(g, p) for g, p in zip(got, parts))
    arrays = [np.full(n, -1.0) for _ in range(k)]  # NumPy buffers take the same calls
    dist.all_gather(arrays, _x(me, n).numpy(), group=comm)
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(arrays, parts))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["SUM", "AVG"])
def test_reduce_scatter_tensor_leaves_the_input(comm, n, op):
    k, me = comm.size, comm.rank
    inp = _x(me, k * n)
    before = inp.clone()
    out = torch.full((n,), -1.0, dtype=torch.float64)
    scatter = dist.reduce_scatter_tensor if op == "SUM" else dist.reduce_scatter_single
    scatter(out, inp, op=getattr(dist.ReduceOp, op), group=comm)
    total = sum(_x(r, k * n) for r in range(k))
    if op == "AVG":
        total = total / k
    torch.testing.assert_close(out, total[me * n:(me + 1) * n], rtol=1e-12, atol=1e-12)
    assert torch.equal(inp, before)


def test_point_to_point_names_job_ranks(comm):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    if k == 1:
        return
    right, left = (me + 1) % k, (me - 1) % k
    got = torch.zeros(5, dtype=torch.float64)
    if me % 2 == 0:
        dist.send(_x(me, 5), dst=jobs[right], group=comm, tag=3)
        assert dist.recv(got, src=jobs[left], group=comm, tag=3) == jobs[left]
    else:
        assert dist.recv(got, group_src=left, group=comm, tag=3) == jobs[left]
        dist.send(_x(me, 5), group_dst=right, group=comm, tag=3)
    assert torch.equal(got, _x(left, 5))
    got = torch.zeros(3, dtype=torch.float64)
    reqs = [dist.irecv(got, src=jobs[left], group=comm),
            dist.isend(_x(me, 3, salt=2), dst=jobs[right], group=comm)]
    for r in reqs:
        r.wait()
    assert torch.equal(got, _x(left, 3, salt=2))
    # src=None: a message from any rank of the group; the sender's job rank comes back.
    if me == 0:
        assert dist.recv(got, group=comm) == jobs[k - 1]
        assert torch.equal(got, _x(k - 1, 3, salt=4))
    elif me == k - 1:
        dist.send(_x(me, 3, salt=4), dst=jobs[0], group=comm)


def test_bad_arguments_raise_on_every_rank_before_anything_moves(comm):
    k, me, last = comm.size, comm.rank, comm.size - 1
    wrong = torch.zeros(k * 2 + (1 if me == last else 0))  # one rank's output is too long
    with pytest.raises(ValueError, match=rf"r{last}: all_gather_into_tensor: output_tensor has "
                                         rf"{k * 2 + 1} elements"):
        dist.all_gather_into_tensor(wrong, torch.ones(2), group=comm)
    with pytest.raises(ValueError, match="tensor_list has"):
        dist.all_gather([torch.zeros(2)] * (k + 1), torch.ones(2), group=comm)
    # (Strided tensors are taken, as torch takes them: test_strided_tensors_are_read_...)
    with pytest.raises(ValueError, match="PREMUL_SUM: multiply the tensor first"):
        dist.all_reduce(torch.ones(2), op=tdist.ReduceOp.PREMUL_SUM, group=comm)
    with pytest.raises(ValueError, match="not in the group"):
        dist.broadcast(torch.ones(2), src=max(comm.world_ranks) + 10, group=comm)
    x = torch.ones(2)  # and the group still works after the refusals
    dist.all_reduce(x, group=comm)
    assert torch.equal(x, torch.full((2,), float(k)))


def test_default_group_and_new_group(world):
    comm = dist.init_process_group()
    try:
        assert dist.is_available() and dist.get_backend() == "mpi"
        assert dist.get_process_group_ranks() == list(range(world.size))
        x = _x(world.rank, 4)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        torch.testing.assert_close(x, sum(_x(r, 4) for r in range(world.size)) / world.size)
        dist.barrier()
        members = sorted({0, world.size - 1})
        sub = dist.new_group(list(reversed(members)))  # torch orders the ranks itself
        outside = sub is dist.GroupMember.NON_GROUP_MEMBER
        assert outside == (world.rank not in members)
        if not outside:
            assert dist.get_process_group_ranks(sub) == members
            assert dist.get_global_rank(sub, len(members) - 1) == members[-1]
            y = torch.full((3,), float(world.rank))
            dist.all_reduce(y, group=sub)
            assert torch.equal(y, torch.full((3,), float(sum(members))))
            z = _x(world.rank, 3)
            dist.broadcast(z, src=members[-1], group=sub)  # a job rank, not the group's
            assert torch.equal(z, _x(members[-1], 3))
            sub.free()
        if world.size > 1:
            with pytest.raises(ValueError, match="the ranks differ"):
                dist.new_group([world.rank])
        with pytest.raises(ValueError, match="distinct ranks"):
            dist.new_group([0, 0])
    finally:
        dist.destroy_process_group()
    assert comm is not None


def test_parameters_are_written_in_place_as_torch_does(comm):
    # torch's collectives take a parameter (dist.broadcast(p, 0) syncs a model) and write
    # it outside autograd; the Communicator's own calls still refuse one.
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    p = torch.nn.Parameter(_x(me, 4))
    dist.broadcast(p, src=jobs[0], group=comm)
    assert torch.equal(p.detach(), _x(0, 4)) and p.requires_grad and p.grad_fn is None
    dist.all_reduce(p, group=comm)
    assert torch.equal(p.detach(), k * _x(0, 4)) and p.is_leaf
    out = torch.zeros(k * 4, dtype=torch.float64)
    dist.all_gather_into_tensor(out, torch.nn.Parameter(_x(me, 4)), group=comm)
    assert torch.equal(out, torch.cat([_x(r, 4) for r in range(k)])) and not out.requires_grad
    with pytest.raises(ValueError, match="requires grad"):
        comm.all_reduce(p)


@pytest.mark.parametrize("n", SIZES)
def test_gather_and_scatter_at_every_root(comm, n):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    for root in range(k):
        got = [torch.full((n,), -1.0, dtype=torch.float64) for _ in range(k)] if me == root \
            else None
        dist.gather(_x(me, n, salt=root), got, dst=jobs[root], group=comm)
        if me == root:
            assert all(torch.equal(g, _x(r, n, salt=root)) for r, g in enumerate(got))
        mine = torch.full((n,), -1.0, dtype=torch.float64)
        parts = [_x(r, n, salt=7 + root) for r in range(k)] if me == root else None
        dist.scatter(mine, parts, group_src=root, group=comm)
        assert torch.equal(mine, _x(me, n, salt=7 + root))


def test_all_to_all_single_equal_and_uneven(comm):
    k, me = comm.size, comm.rank
    # Equal parts: part b of rank a's input is 100 a + 10 b + (0, 1).
    inp = torch.tensor([100.0 * me + 10 * b + i for b in range(k) for i in range(2)])
    out = torch.full((2 * k,), -1.0)
    dist.all_to_all_single(out, inp, group=comm)
    assert out.tolist() == [100.0 * a + 10 * me + i for a in range(k) for i in range(2)]
    # Rows in uneven splits (MoE): rank a sends (a + b) % 3 rows of width 2 to rank b.
    sends = [(me + b) % 3 for b in range(k)]
    recvs = [(a + me) % 3 for a in range(k)]
    inp = torch.cat([torch.full((s, 2), 10.0 * me + b) for b, s in enumerate(sends)])
    out = torch.full((sum(recvs), 2), -1.0)
    dist.all_to_all_single(out, inp, recvs, sends, group=comm)
    want = torch.cat([torch.full((s, 2), 10.0 * a + me) for a, s in enumerate(recvs)])
    assert torch.equal(out, want)
    # In place, in parts past MPI's eager size: equal parts, then uneven rows laid out
    # differently on the way out and back (rank a sends ((a - b) % k + 1) n rows to b;
    # every rank sends as many rows as it receives, as one tensor both ways needs).
    n = 50_000
    t = torch.cat([torch.full((n,), 100.0 * me + b) for b in range(k)])
    dist.all_to_all_single(t, t, group=comm)
    assert torch.equal(t, torch.cat([torch.full((n,), 100.0 * a + me) for a in range(k)]))
    rows = [n * ((me - b) % k + 1) for b in range(k)]
    back = [n * ((a - me) % k + 1) for a in range(k)]
    t = torch.cat([torch.full((r, 1), 10.0 * me + b) for b, r in enumerate(rows)])
    dist.all_to_all_single(t, t, back, rows, group=comm)
    assert torch.equal(t, torch.cat([torch.full((r, 1), 10.0 * a + me)
                                     for a, r in enumerate(back)]))
    if k > 1:  # what r0 sends and what r1 expects disagree: refused everywhere
        wrong = [s + (1 if me == 1 and b == 0 else 0) for b, s in enumerate(recvs)]
        with pytest.raises(ValueError, match="do not match across ranks"):
            dist.all_to_all_single(torch.zeros(sum(wrong), 2), inp, wrong, sends, group=comm)
    with pytest.raises(ValueError, match="gather_list"):
        dist.gather(torch.ones(2), [torch.ones(3)] * k, group_dst=0, group=comm)


@pytest.mark.parametrize("n", [0, 1, 200_003])  # the last is past MPI's eager size: a
def test_batch_isend_irecv_any_order(comm, n):    # blocking post in list order would deadlock
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    right, left = (me + 1) % k, (me - 1) % k
    from_left = torch.full((n,), -1.0, dtype=torch.float64)
    from_right = torch.full((n,), -1.0, dtype=torch.float64)
    sends = [dist.P2POp(dist.isend, _x(me, n, salt=1), jobs[right], group=comm, tag=1),
             dist.P2POp(tdist.isend, _x(me, n, salt=2), group_peer=left, group=comm, tag=2)]
    recvs = [dist.P2POp(dist.irecv, from_left, jobs[left], group=comm, tag=1),
             dist.P2POp(tdist.irecv, from_right, group_peer=right, group=comm, tag=2)]
    # Each rank lists them in another order: sends first on even ranks, receives first
    # on odd ones, and the two sends swapped on every third.
    if me % 3 == 2:
        sends.reverse()
    reqs = dist.batch_isend_irecv(sends + recvs if me % 2 == 0 else recvs + sends)
    assert len(reqs) == 4
    while not all(r.is_completed() for r in reqs):  # torch's poll: never blocks
        pass
    assert torch.equal(from_left, _x(left, n, salt=1))
    assert torch.equal(from_right, _x(right, n, salt=2))


def test_batch_isend_irecv_refuses_a_bad_batch_before_posting(comm):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    right, left = (me + 1) % k, (me - 1) % k
    with pytest.raises(ValueError, match="non-empty list of P2POp"):
        dist.batch_isend_irecv([])
    good = dist.P2POp(dist.isend, torch.ones(3), jobs[right], group=comm)
    with pytest.raises(ValueError, match=r"p2p_op_list\[1\] is tuple, not a P2POp"):
        dist.batch_isend_irecv([good, (dist.isend, torch.ones(3), jobs[right])])
    with pytest.raises(ValueError, match="pass isend or irecv"):
        dist.P2POp(dist.send, torch.ones(3), jobs[right], group=comm)
    with pytest.raises(ValueError, match="any sender"):
        dist.P2POp(dist.irecv, torch.ones(3), group=comm)
    with pytest.raises(ValueError, match="not in the group"):
        dist.P2POp(dist.isend, torch.ones(3), max(jobs) + 10, group=comm)
    with pytest.raises(ValueError, match="contiguous"):
        dist.P2POp(dist.isend, torch.ones(2, 2).t(), jobs[right], group=comm)
    with pytest.raises(ValueError, match="tag"):
        dist.P2POp(dist.isend, torch.ones(3), jobs[right], group=comm, tag=-1)
    other = comm.dup()
    try:
        mixed = [good, dist.P2POp(dist.irecv, torch.ones(3), jobs[left], group=other)]
        with pytest.raises(ValueError, match=r"p2p_op_list\[1\] is on another group"):
            dist.batch_isend_irecv(mixed)
        # Nothing of the refused batches was posted: the next message on comm is this one.
        got = torch.zeros(3, dtype=torch.float64)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, jobs[left], group=comm),
                                       dist.P2POp(dist.isend, _x(me, 3), jobs[right],
                                                  group=comm)])
        for r in reqs:
            r.wait()
        assert torch.equal(got, _x(left, 3))
    finally:
        other.free()


def _obj(r: int):
    """A rank-dependent object of every kind that travels without pickle."""
    return {"rank": r, (r, "t"): ("x" * r, None, 1.5 * r), 7: {r, -r}, "b": bytes(range(r)),
            "arr": np.arange(r * 2, dtype=np.int16).reshape(r, 2), "np": np.float32(r / 4),
            "ten": torch.arange(r, dtype=torch.bfloat16), "nan": float("nan"),
            "fs": frozenset({str(r)}), "empty": []}


def _same(a, b) -> bool:
    """Deep equality that also asks the same types (and NaN equal to itself)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_object_calls_without_pickle(comm):
    k, me, jobs = comm.size, comm.rank, comm.world_ranks
    got = [None] * k
    assert dist.all_gather_object(got, _obj(me), group=comm) is None
    assert all(_same(g, _obj(r)) for r, g in enumerate(got)), got
    for root in range(k):
        mine = [_obj(me), ("from", me), None]
        kept = list(mine)
        dist.broadcast_object_list(mine, src=jobs[root], group=comm)
        if me == root:
            assert all(m is o for m, o in zip(mine, kept))  # the source's list is left alone
        assert _same(mine, [_obj(root), ("from", root), None])
        into = [None] * k if me == root else None
        dist.gather_object(_obj(me), into, group_dst=root, group=comm)
        assert into is None or all(_same(g, _obj(r)) for r, g in enumerate(into))
        out = [None]
        dist.scatter_object_list(out, [(r, root) for r in range(k)] if me == root else None,
                                 src=jobs[root], group=comm)
        assert out == [(me, root)]


def test_object_calls_refuse_on_every_rank(comm):
    k, me, last = comm.size, comm.rank, comm.size - 1
    bad = {"f": print} if me == last else {"f": 1}
    with pytest.raises(TypeError, match=rf"r{last}: all_gather_object: obj\['f'\] is a "
                                        r"builtins.builtin_function_or_method"):
        dist.all_gather_object([None] * k, bad, group=comm)
    with pytest.raises(ValueError, match=rf"r0: all_gather_object: object_list has {k + 1} "
                                         "entries"):
        dist.all_gather_object([None] * (k + (1 if me == 0 else 0)), me, group=comm)
    if k > 1:
        with pytest.raises(ValueError, match=r"the lists differ in length \(r0: 2, r1: 3"):
            dist.broadcast_object_list([1, 2] if me == 0 else [None] * 3, group_src=0,
                                       group=comm)
    point = namedtuple("Point", "x y")  # a tuple subclass: it would come back a plain tuple
    with pytest.raises(TypeError, match=r"r0: broadcast_object_list: object_list\[0\] is a "
                                        r".*Point.*x._asdict\(\)"):
        dist.broadcast_object_list([point(1, 2)], group_src=0, group=comm)
    with pytest.raises(ValueError, match=rf"r{last}: scatter_object_list: "
                                         rf"scatter_object_input_list has {k + 1} entries"):
        dist.scatter_object_list([None], [0] * (k + 1) if me == last else None, group_src=last,
                                 group=comm)
    got = [None] * k  # and nothing of the refused calls is left to meet the next one
    dist.all_gather_object(got, ("ok", me), group=comm)
    assert got == [("ok", r) for r in range(k)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["SUM", "MAX"])
def test_reduce_scatter_list_form(comm, n, op):
    k, me = comm.size, comm.rank
    inputs = [_x(me, n, salt=r) for r in range(k)]
    before = [t.clone() for t in inputs]
    out = torch.full((n,), -1.0, dtype=torch.float64)
    dist.reduce_scatter(out, inputs, op=getattr(dist.ReduceOp, op), group=comm)
    everyone = torch.stack([_x(a, n, salt=me) for a in range(k)])
    assert torch.equal(out, everyone.sum(0) if op == "SUM" else everyone.amax(0))
    assert all(torch.equal(t, b) for t, b in zip(inputs, before))
    with pytest.raises(ValueError, match=rf"r0: reduce_scatter: input_list has {k + 1} "):
        dist.reduce_scatter(out, inputs + [out] if me == 0 else inputs, group=comm)


def test_all_to_all_list_form_with_a_size_per_pair(comm):
    k, me = comm.size, comm.rank
    size = lambda a, b: (a * 2 + b * 3) % 4  # noqa: E731 - rank a's part for rank b
    # Rank me's part for rank b, strided for b odd (sent from a copy), and what it expects.
    ins = [_x(me, size(me, b), salt=b) if b % 2 == 0
           else _x(me, 2 * size(me, b), salt=b)[::2] for b in range(k)]
    outs = [torch.full((size(a, me),), -1.0, dtype=torch.float64) for a in range(k)]
    dist.all_to_all(outs, ins, group=comm)
    for a in range(k):
        want = (_x(a, size(a, me), salt=me) if me % 2 == 0
                else _x(a, 2 * size(a, me), salt=me)[::2])
        assert torch.equal(outs[a], want), (a, outs[a], want)
    # In place, as torch's list form is often called: one list as input and output, in
    # parts past MPI's eager size (a receive would land while its buffer is still sent).
    both = [_x(me, 50_000, salt=b) for b in range(k)]
    dist.all_to_all(both, both, group=comm)
    assert all(torch.equal(both[a], _x(a, 50_000, salt=me)) for a in range(k))
    if k > 1:  # r0 expects one element too many from r1: every rank hears of it
        wrong = [torch.zeros(size(a, me) + (1 if me == 0 and a == 1 else 0),
                             dtype=torch.float64) for a in range(k)]
        with pytest.raises(ValueError, match=r"all_to_all: the sizes do not match across "
                                             r"ranks: r1 sends \d+ elements to r0, which "
                                             r"expects \d+"):
            dist.all_to_all(wrong, ins, group=comm)
        mixed = [t.float() for t in ins] if me == k - 1 else ins
        outs32 = [t.float() for t in outs] if me == k - 1 else outs
        with pytest.raises(ValueError, match=r"differ in dtype"):
            dist.all_to_all(outs32, mixed, group=comm)


def test_group_world_and_group_ranks(world):
    assert dist.group.WORLD is None  # before init_process_group, as torch's
    dist.init_process_group()
    try:
        assert dist.group.WORLD is dist.GroupMember.WORLD is dist.comm.default.default_comm()
        x = _x(world.rank, 3)
        dist.all_reduce(x, group=dist.group.WORLD)
        assert torch.equal(x, sum(_x(r, 3) for r in range(world.size)))
        kept = world.timeout
        dist.monitored_barrier(dist.group.WORLD, timeout=timedelta(seconds=7))
        assert world.timeout == kept
        with pytest.raises(ValueError, match="non-negative number of seconds"):
            dist.monitored_barrier(timeout=-1)  # refused before the barrier, on every rank
        assert world.timeout == kept
        last = world.size - 1
        sub = dist.new_group([last])
        if world.rank == last:
            assert dist.get_group_rank(sub, last) == 0
            with pytest.raises(ValueError, match="not in the group"):
                dist.get_group_rank(sub, last + 1)
        else:  # torch's rule: outside the group a call does nothing, with a warning
            assert sub is dist.GroupMember.NON_GROUP_MEMBER
            y = _x(world.rank, 3)
            with pytest.warns(UserWarning, match="all_reduce: this rank is not in the group"):
                assert dist.all_reduce(y, group=sub) is None
            assert torch.equal(y, _x(world.rank, 3))
            assert dist.get_rank(sub) == dist.get_world_size(sub) == -1
            with pytest.raises(ValueError, match="not in the group .*NON_GROUP_MEMBER"):
                dist.get_process_group_ranks(sub)
        # Every rank calls the group's collective, as a torch script does: no hang.
        z = torch.ones(2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce(z, group=sub)
            dist.barrier(group=sub)
        assert torch.equal(z, torch.ones(2))
        if world.rank == last:
            sub.free()
    finally:
        dist.destroy_process_group()


def test_roots_are_job_ranks_where_group_and_job_ranks_differ(world):
    """A group whose rank order is the job's reversed: src is a job rank, group_src the
    group's, and the *_object calls' default root is the job's rank 0 (group rank k-1)."""
    k, me = world.size, world.rank
    rev = world.split(0, key=-me)
    try:
        assert list(rev.world_ranks) == list(reversed(range(k)))
        x = _x(me, 4)
        dist.broadcast(x, src=k - 1, group=rev)  # job rank k-1 = group rank 0
        assert torch.equal(x, _x(k - 1, 4))
        y = _x(me, 4, salt=1)
        dist.broadcast(y, group_src=k - 1, group=rev)  # group rank k-1 = job rank 0
        assert torch.equal(y, _x(0, 4, salt=1))
        box = [("from", me)]
        dist.broadcast_object_list(box, group=rev)
        assert box == [("from", 0)]
        into = [None] * k if me == 0 else None
        dist.gather_object(me, into, group=rev)  # group rank r is job rank k-1-r
        assert into is None or into == list(reversed(range(k)))
        assert dist.get_group_rank(rev, 0) == k - 1 and dist.get_global_rank(rev, 0) == k - 1
    finally:
        rev.free()


def test_a_list_that_holds_no_tensor_is_refused_on_every_rank(comm):
    k, me, last = comm.size, comm.rank, comm.size - 1
    parts = [torch.zeros(2) for _ in range(k)]
    odd = [None if (me == last and r == 0) else t for r, t in enumerate(parts)]
    with pytest.raises(ValueError, match=rf"r{last}: reduce_scatter: input_list\[0\] is a "
                                         "NoneType: give tensors"):
        dist.reduce_scatter(torch.zeros(2), odd, group=comm)
    with pytest.raises(ValueError, match=rf"r{last}: all_to_all: the lists hold a NoneType"):
        dist.all_to_all(parts, odd, group=comm)
    with pytest.raises(ValueError, match=rf"r{last}: gather_object: dst=\[0\] is not a rank"):
        dist.gather_object(1, [None] * k, dst=[0] if me == last else comm.world_ranks[0],
                           group=comm)


def test_object_calls_agree_on_the_root_and_on_every_failure(comm):
    k, me, jobs, last = comm.size, comm.rank, comm.world_ranks, comm.size - 1
    # torch's default root is the job's rank 0 (in every test group here).
    into = [None] * k if jobs[me] == 0 else None
    dist.gather_object(("g", me), into, group=comm)
    assert into is None or into == [("g", r) for r in range(k)]
    box = [{"t": torch.tensor([float("nan"), 2.0], requires_grad=True)}] if me == 0 else [None]
    dist.broadcast_object_list(box, group=comm, device="cpu")
    t = box[0]["t"]
    assert t.requires_grad and t.is_leaf and torch.isnan(t[0]) and t[1] == 2.0
    # Failures other than a type on one rank reach every rank before anything is unpacked.
    loop = []
    loop.append(loop)
    with pytest.raises(ValueError, match=rf"r{last}: all_gather_object: the object nests "
                                         "too deeply or contains itself"):
        dist.all_gather_object([None] * k, loop if me == last else [1], group=comm)
    with pytest.raises(ValueError, match=rf"r{last}: all_gather_object: ValueError: "):
        dist.all_gather_object([None] * k, 10 ** 5000 if me == last else 1, group=comm)
    with pytest.raises(ValueError, match=rf"r{last}: gather_object: dst=\d+ is not in the "
                                         "group"):
        dist.gather_object(1, [None] * k, dst=max(jobs) + 1 if me == last else jobs[0],
                           group=comm)
    if k > 1:  # each rank its own root: every rank hears of it
        with pytest.raises(ValueError, match=r"the ranks name different roots \(r0: group "
                                             r"rank 0, r1: group rank 1"):
            dist.gather_object(1, [None] * k, group_dst=me, group=comm)
        with pytest.raises(ValueError, match="the ranks name different roots"):
            dist.scatter_object_list([None], list(range(k)), group_src=me, group=comm)
    got = [None] * k
    dist.all_gather_object(got, me, group=comm)
    assert got == list(range(k))


def test_p2pop_keeps_the_callers_function(comm):
    right = comm.world_ranks[(comm.rank + 1) % comm.size]
    for fn in (dist.isend, tdist.isend):
        assert dist.P2POp(fn, torch.ones(1), right, group=comm).op is fn
