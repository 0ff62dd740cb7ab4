"""Point-to-point on the Communicator: send/recv/isend/irecv/sendrecv/group, on both backends.

Data depends on the sender, the receiver, the tag and the index, so a message
delivered to the wrong buffer, from the wrong peer or out of order changes the
result. World sizes 1-4 come from the ``comm`` fixture, 5 from a nested job.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from conftest import data, np_dtype, sizes
from fake_nccl import fake_backend

import mpiring
from mpiring import Communicator, MismatchError
from mpiring.comm.p2p import check_tag
from mpiring.core.buffers import DTYPES
from mpiring.runtime.trace import Tracer, read_trace
from mpiring.runtime.watchdog import STALL_EXIT_CODE


def message(src: int, dst: int, tag: int, n: int, dtype) -> np.ndarray:
    return data(src, n, np_dtype(dtype) if isinstance(dtype, str) else dtype, salt=7 * dst + tag)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sendrecv_around_the_ring(comm, dtype):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for n in sizes(comm.size):
        out = message(comm.rank, right, 0, n, dtype)
        got = np.full(n, 99, dtype=np_dtype(dtype))
        assert comm.sendrecv(out, right, got, left) is got
        np.testing.assert_array_equal(got, message(left, comm.rank, 0, n, dtype), err_msg=f"n={n}")


def test_blocking_send_and_recv_to_every_peer(comm):
    # Every ordered pair exchanges one message; lower rank sends first, so the
    # blocking calls pair up without a deadlock.
    for peer in range(comm.size):
        if peer == comm.rank:
            continue
        mine = message(comm.rank, peer, 3, 1000 + peer, np.float64)
        got = np.empty(1000 + comm.rank, dtype=np.float64)
        if comm.rank < peer:
            comm.send(mine, peer, tag=3)
            comm.recv(got, peer, tag=3)
        else:
            assert comm.recv(got, peer, tag=3) is got
            comm.send(mine, peer, tag=3)
        np.testing.assert_array_equal(got, message(peer, comm.rank, 3, 1000 + comm.rank, np.float64))


def test_tags_are_matched_and_one_tag_keeps_its_order(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    # Receives are posted in the opposite order to the sends: tags, not order, match them.
    recvs = {tag: comm.irecv(np.empty(17, np.int32), left, tag=tag) for tag in (2, 1)}
    same = [comm.irecv(np.empty(5, np.int64), left, tag=9) for _ in range(3)]
    sends = [comm.isend(message(comm.rank, right, tag, 17, np.int32), right, tag=tag)
             for tag in (1, 2)]
    sends += [comm.isend(np.full(5, 10 * comm.rank + i, np.int64), right, tag=9) for i in range(3)]
    for tag, req in recvs.items():
        np.testing.assert_array_equal(req.wait(), message(left, comm.rank, tag, 17, np.int32))
    for i, req in enumerate(same):  # same peer, same tag: in the order sent
        np.testing.assert_array_equal(req.wait(), np.full(5, 10 * left + i))
    for req in sends:
        req.wait()


def test_group_issues_together_and_completes_at_its_end(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    a, b = np.empty(300, np.float32), np.empty(7, np.float32)
    with comm.group():
        ra = comm.irecv(a, left, tag=0)
        rb = comm.irecv(b, right, tag=1)
        comm.isend(message(comm.rank, right, 0, 300, np.float32), right, tag=0)
        with comm.group():  # nested: the outer block completes it
            comm.isend(message(comm.rank, left, 1, 7, np.float32), left, tag=1)
    assert ra.test() and rb.test()
    np.testing.assert_array_equal(a, message(left, comm.rank, 0, 300, np.float32))
    np.testing.assert_array_equal(b, message(right, comm.rank, 1, 7, np.float32))


def test_test_is_false_until_the_message_is_sent(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    if comm.rank == 1:
        req = comm.irecv(np.empty(4, np.float64), 0, tag=4)
        assert not req.test()  # rank 0 sends only after the barrier below
        comm.control.barrier()
        deadline = time.monotonic() + 30
        while not req.test():
            assert time.monotonic() < deadline, "the message never arrived"
        np.testing.assert_array_equal(req.wait(), np.arange(4.0))
    else:
        comm.control.barrier()
        if comm.rank == 0:
            comm.send(np.arange(4.0), 1, tag=4)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int64))
def test_torch_tensors_of_any_shape(comm, dtype):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = torch.from_numpy(message(comm.rank, right, 0, 24, np.float64)).to(dtype).reshape(2, 3, 4)
    got = torch.zeros(2, 3, 4, dtype=dtype)
    ptr = got.data_ptr()
    comm.sendrecv(out, right, got, left)
    want = torch.from_numpy(message(left, comm.rank, 0, 24, np.float64)).to(dtype).reshape(2, 3, 4)
    assert got.data_ptr() == ptr and torch.equal(got, want)


def test_size_and_dtype_mismatches_name_both_sides(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    cases = [(np.zeros(4, np.float32), np.zeros(5, np.float32), "4 x float32 (16 B)",
              "5 x float32 (20 B)"),
             (np.zeros(8, np.float32), np.zeros(8, np.int32), "8 x float32", "8 x int32"),
             (np.zeros(6, np.float64), np.zeros(3, np.float32), "6 x float64", "3 x float32")]
    for sent, into, theirs, mine in cases:
        if comm.rank == 0:
            comm.send(sent, 1, tag=2)  # returns: the receiver drains what it refuses
        elif comm.rank == 1:
            with pytest.raises(MismatchError) as err:
                comm.recv(into, 0, tag=2)
            assert f"r0 sent {theirs}" in str(err.value) and f"into {mine}" in str(err.value)
        comm.control.barrier()
    # The pair still works afterwards: nothing was left in flight.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.empty(3, np.int32)
    comm.sendrecv(np.full(3, comm.rank, np.int32), right, got, left)
    assert (got == left).all()


def test_bad_arguments_raise_before_anything_moves(comm):
    x = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=rf"dst={comm.size} out of range: use a rank in 0\.\."):
        comm.isend(x, comm.size)
    with pytest.raises(ValueError, match=r"src=-1 out of range"):
        comm.irecv(x, -1)
    with pytest.raises(ValueError, match=r"dst=True out of range"):
        comm.send(x, True)
    with pytest.raises(ValueError, match=r"tag=-3: use an integer in 0\.\."):
        comm.send(x, 0, tag=-3)
    with pytest.raises(ValueError, match=r"tag=1.5"):
        comm.recv(x, 0, tag=1.5)
    with pytest.raises(ValueError, match="requires grad"):
        comm.send(torch.zeros(2, requires_grad=True), 0)
    with pytest.raises(ValueError, match="not contiguous"):
        comm.recv(np.zeros((4, 4), np.float32)[:, 0], 0)
    with pytest.raises(TypeError, match="unsupported buffer type list"):
        comm.send([1, 2], 0)
    assert check_tag(0) == 0
    # Nothing was posted: a message now is the first and only one between the pair.
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.empty(2, np.int64)
    comm.sendrecv(np.array([comm.rank, 5]), right, got, left)
    assert got.tolist() == [left, 5]


def test_without_the_check_no_descriptor_travels(comm):
    fast = Communicator(comm._be.dup(), comm.tracer, check=False)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.empty(1000, np.float32)
    fast.sendrecv(message(comm.rank, right, 0, 1000, np.float32), right, got, left)
    np.testing.assert_array_equal(got, message(left, comm.rank, 0, 1000, np.float32))


def test_every_message_is_one_trace_record(world, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("p2p-trace")) if world.rank == 0 else None
    directory = world.control.bcast_json(directory)
    traced = Communicator(world._be.dup(), Tracer(world.rank, directory))
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    for tag in range(3):
        traced.sendrecv(np.zeros(10 + tag, np.float32), right, np.zeros(10 + tag, np.float32),
                        left, tag=tag)
    traced.tracer.close()
    world.control.barrier()
    mine = [r for r in read_trace(directory) if r.get("type") == "p2p" and r["rank"] == world.rank]
    assert [(r["op"], r["peer"], r["tag"], r["bytes"]) for r in mine] == [
        (op, peer, tag, 4 * (10 + tag)) for tag in range(3)
        for op, peer in (("recv", left), ("send", right))]
    assert all(r["t_end"] >= r["t_start"] for r in mine)


# --- prepared sends and receives ---------------------------------------------------------
@pytest.mark.parametrize("check", (True, False))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int64))
def test_prepared_sends_and_receives_match_the_plain_calls(comm, check, dtype):
    """Prepared on one side, plain on the other and both prepared: each message lands in
    order, with its sender's and index's data, for every size (empty included)."""
    c = Communicator(comm._be.dup(), comm.tracer, check=check)
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    for n in sizes(c.size):
        def out(k, src=c.rank, dst=right, n=n):
            return torch.from_numpy(message(src, dst, k, n, np.float64)).to(dtype).reshape(n, 1)
        send = c.prepare_send(torch.empty(n, 1, dtype=dtype), right, tag=4)
        into = torch.full((n, 1), 99, dtype=dtype)
        recv = c.prepare_recv(into, left, tag=4)
        for k in range(3):
            sent = out(k)
            kinds = [(True, True), (True, False), (False, True)][k]
            r = recv.post() if kinds[1] else c.irecv(into, left, tag=4)
            s = send.post(sent) if kinds[0] else c.isend(sent, right, tag=4)
            assert s.wait() is sent and r.wait() is into
            want = out(k, left, c.rank)
            assert torch.equal(into, want), f"n={n} message {k} kinds {kinds}"


def test_prepared_send_refuses_a_tensor_unlike_the_prepared_one(comm):
    right = (comm.rank + 1) % comm.size
    send = comm.prepare_send(torch.zeros(4, 3), right, tag=6)
    bad = [torch.zeros(4, 3, dtype=torch.float64), torch.zeros(5, 3), torch.zeros(3, 4).t()]
    for x in bad:
        with pytest.raises(ValueError, match=r"prepared send to r\d+ tag 6: got .* prepared for "
                                             r"12 x float32 on cpu, contiguous; prepare"):
            send.post(x)
    with pytest.raises(ValueError, match="dst=-1 out of range"):
        comm.prepare_send(torch.zeros(2), -1)
    with pytest.raises(ValueError, match="tag=-2"):
        comm.prepare_recv(torch.zeros(2), 0, tag=-2)
    # Nothing was posted: the next message between the pair is the first.
    left = (comm.rank - 1) % comm.size
    got = np.empty(1, np.int64)
    comm.sendrecv(np.array([comm.rank]), right, got, left, tag=6)
    assert got[0] == left


def test_prepared_messages_are_traced(world, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("p2p-prepared")) if world.rank == 0 else None
    directory = world.control.bcast_json(directory)
    traced = Communicator(world._be.dup(), Tracer(world.rank, directory), check=False)
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    send = traced.prepare_send(torch.zeros(5), right, tag=2)
    recv = traced.prepare_recv(torch.zeros(5), left, tag=2)
    for _ in range(2):
        r = recv.post()
        send.post(torch.ones(5)).wait()
        while not r.test():
            pass
    traced.tracer.close()
    world.control.barrier()
    mine = [r for r in read_trace(directory) if r.get("type") == "p2p" and r["rank"] == world.rank]
    assert sorted((r["op"], r["peer"], r["bytes"]) for r in mine) == sorted(
        [("send", right, 20)] * 2 + [("recv", left, 20)] * 2)


@pytest.mark.parametrize("check", (False, True))
def test_test_names_a_longer_message_than_the_buffer_and_wait_says_it_again(comm, check):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    c = Communicator(comm._be.dup(), comm.tracer, check=check)
    error = (MismatchError, r"r0 sent 8 x float32 .* into 2 x float32") if check else \
        (ValueError, r"recv from r0 tag 9: the message from r0 is longer than the receive")
    if comm.rank == 1:
        req = c.irecv(np.zeros(2, np.float32), 0, tag=9)
        comm.control.barrier()
        deadline = time.monotonic() + 30
        with pytest.raises(error[0], match=error[1]):
            while not req.test():
                assert time.monotonic() < deadline, "the message never arrived"
        # MPI freed the request when it reported the error: the error must stay.
        with pytest.raises(error[0], match=error[1]):
            req.wait()
        with pytest.raises(error[0], match=error[1]):
            req.test()
    else:
        comm.control.barrier()
        if comm.rank == 0:
            c.send(np.zeros(8, np.float32), 1, tag=9)
    comm.control.barrier()


# --- the NCCL backend's path, with NCCL faked over MPI ------------------------------------
def test_over_nccl_sends_and_receives_go_in_one_group(comm):
    fake = Communicator(fake_backend(comm.mpi_comm), comm.tracer, check=True)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.zeros(1000, np.float32)
    fake.sendrecv(message(comm.rank, right, 0, 1000, np.float32), right, got, left)
    np.testing.assert_array_equal(got, message(left, comm.rank, 0, 1000, np.float32))
    groups = fake._be.nccl.groups
    assert groups[-1] == [("recv", left), ("send", right)], groups
    # isend/irecv outside a group: recorded, then issued together at the first wait.
    a = fake.irecv(np.zeros(9, np.int32), left, tag=3)
    fake.isend(np.full(9, comm.rank, np.int32), right, tag=3)
    assert (a.wait() == left).all()
    assert fake._be.nccl.groups[-1] == [("recv", left), ("send", right)]


def test_over_nccl_a_mismatch_is_refused_before_nccl_moves_data(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    fake = Communicator(fake_backend(comm.mpi_comm), comm.tracer, check=True)
    if comm.rank == 0:
        before = len(fake._be.nccl.groups)
        with pytest.raises(MismatchError, match=r"r1 sent 3 x int32 .* into 4 x int32"):
            fake.recv(np.zeros(4, np.int32), 1, tag=1)
        assert len(fake._be.nccl.groups) == before, "NCCL was asked to move refused data"
    elif comm.rank == 1:
        # Recorded, never issued: its receiver refused the descriptor (a real GPU
        # would leave this send queued; the receiver's error is what ends the job).
        fake.isend(np.zeros(3, np.int32), 0, tag=1)
    comm.control.barrier()


# --- nested jobs: an odd world size, and a receive that nothing matches ------------------
ODD_SCRIPT = """
import numpy as np, mpiring
comm = mpiring.init(); k, r = comm.size, comm.rank
for n in (0, 1, k, 7 * k + 3):
    got = np.empty(n, np.float64)
    comm.sendrecv(np.arange(n) + 100.0 * r, (r + 2) % k, got, (r - 2) % k, tag=n)
    assert (got == np.arange(n) + 100.0 * ((r - 2) % k)).all(), (n, got)
if r == 0:
    print(f"OK K={k}", flush=True)
"""


@pytest.mark.deadline(90)
def test_odd_world_size_five(rank0_subprocess):
    result = rank0_subprocess(5, ["-c", ODD_SCRIPT], timeout=60)
    if result is None:
        return
    rc, out, _ = result
    assert rc == 0 and "OK K=5" in out, out


@pytest.mark.deadline(90)
def test_a_receive_nothing_matches_ends_at_the_deadline_naming_peer_and_tag(
        rank0_subprocess, monkeypatch):
    monkeypatch.setenv("MPIRING_TIMEOUT", "3")
    result = rank0_subprocess(2, ["tests/reliability_cases/p2p_no_sender.py"], timeout=60)
    if result is None:
        return
    rc, out, _ = result
    assert rc == STALL_EXIT_CODE, out
    assert re.search(r"\[r1\] mpiring stall: recv#1: blocked \d+\.\d s in "
                     r"Wait\(recv#1 from r0 tag 5\), waiting for the matching send on r0 "
                     r"\(deadline 3 s\)", out), out
    assert "the receive returned" not in out


def test_init_default_world_has_the_calls():
    assert all(callable(getattr(mpiring.Communicator, name))
               for name in ("send", "recv", "isend", "irecv", "sendrecv", "group"))


@pytest.mark.one_rank
@pytest.mark.parametrize("yield_s, yields, sleeps", [(0.0, 0, 3), (60.0, 3, 0)])
def test_an_arrival_yields_for_a_moment_then_sleeps(monkeypatch, yield_s, yields, sleeps):
    from mpiring.backends import control

    seen = {"yield": 0, "sleep": 0}
    monkeypatch.setattr(control, "YIELD_S", yield_s)
    monkeypatch.setattr(control.os, "sched_yield", lambda: seen.__setitem__("yield", seen["yield"] + 1))
    monkeypatch.setattr(control.time, "sleep", lambda s: seen.__setitem__("sleep", seen["sleep"] + 1))
    left = iter([False, False, False, True])
    control.arrive(lambda: next(left), "yield")
    assert seen == {"yield": yields, "sleep": sleeps}
    left = iter([False, True])
    control.arrive(lambda: next(left), "sleep")  # a sleeping rank only sleeps
    assert seen == {"yield": yields, "sleep": sleeps + 1}


@pytest.mark.parametrize("idle", ["yield", "spin"])
def test_control_values_and_new_communicators_wait_by_arrival_unless_spinning(comm, monkeypatch,
                                                                             idle):
    from mpiring.backends import control, mpi

    calls = []

    def counted(done, how, real=control.arrive):
        calls.append(how)
        real(done, how)

    monkeypatch.setattr(control, "arrive", counted)
    monkeypatch.setattr(mpi, "arrive", counted)
    before, comm.idle = comm.idle, idle
    try:
        rows = comm.control.allgather_array([comm.rank * 10 + 1, comm.size])
        assert rows.tolist() == [[r * 10 + 1, comm.size] for r in range(comm.size)]
        assert comm.control.allreduce_scalar(comm.rank + 1) == comm.size * (comm.size + 1) // 2
        assert comm.control.bcast_json({"from": comm.rank} if comm.rank == comm.size - 1 else None,
                                       root=comm.size - 1) == {"from": comm.size - 1}
        assert comm.control.allgather_json([comm.rank] * comm.rank) == [[r] * r for r in
                                                                        range(comm.size)]
        exchanged = len(calls)
        twin = comm.dup()  # made and freed by every rank: an arrival first, where it waits
        twin.idle = idle  # (a new communicator picks its own mode)
        twin.free()
    finally:
        comm.idle = before
    if idle == "spin":
        assert calls == []
    else:  # each control exchange (one rank: some are local), then dup and free
        assert set(calls) == {"yield"} and exchanged >= 6, calls
        assert len(calls) > exchanged, calls
