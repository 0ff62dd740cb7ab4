"""Receives from any source: ``comm.recv(x, None)``/``irecv`` and torch's ``recv(t)``.

Compared with torch.distributed over gloo in the same processes (gloo's
``recvAnysource``): many senders to one receiver, the order of each sender's
messages, tags, the source a handle reports (group rank vs job rank), check on
and off. Data depends on the sender, the tag and the message's index, so a
message delivered to the wrong receive, or one sender's descriptor matched with
another's data, changes the result. Run on 2, 3 and 4 ranks.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

from conftest import Job  # noqa: E402
from fake_nccl import fake_backend  # noqa: E402
from torch_gloo import gloo_world  # noqa: E402

import mpiring as dist  # noqa: E402
from mpiring import Communicator, MismatchError  # noqa: E402
from mpiring.runtime.trace import Tracer, read_trace  # noqa: E402
from mpiring.runtime.watchdog import STALL_EXIT_CODE  # noqa: E402

N = 33  # an odd size, not a multiple of any world size


def _msg(src: int, i: int, tag: int = 0, n: int = N) -> torch.Tensor:
    """Message ``i`` of sender ``src`` on ``tag``: unique per (sender, index, tag)."""
    return (torch.arange(n, dtype=torch.float64) * 7 + src * 1000 + i * 100 + tag * 10000)


def _which(t: torch.Tensor, n: int = N) -> tuple[int, int, int]:
    """(sender, index, tag) of a message made by ``_msg``; asserts it is one."""
    tag, rest = divmod(int(t[0]), 10000)
    src, i = rest // 1000, rest % 1000 // 100
    assert torch.equal(t, _msg(src, i, tag, n)), t
    return src, i, tag


def _checked(world, check: bool) -> Communicator:
    return Communicator(world._be.dup(), world.tracer, check=check)


def _needs_two(world):
    if world.size < 2:
        pytest.skip("needs two ranks")


@pytest.mark.parametrize("check", (True, False), ids=("check", "nocheck"))
def test_many_senders_to_one_receiver_as_torch_over_gloo(world, check):
    """A parameter server's loop: every other rank sends M messages, the root does
    ``src = recv(t)`` until all are in. Each message is its sender's, in that
    sender's order, and the ranks returned are the senders: as torch's."""
    _needs_two(world)
    tdist = gloo_world(world)
    comm = _checked(world, check)
    k, me, root, m = world.size, world.rank, world.size - 1, 4
    for lib, group in ((tdist, None), (dist, comm)):
        if me != root:
            for i in range(m):
                lib.send(_msg(me, i), dst=root, group=group)
            continue
        got = []
        for _ in range(m * (k - 1)):
            t = torch.zeros(N, dtype=torch.float64)
            src = lib.recv(t, group=group)
            sender, i, _ = _which(t)
            assert sender == src, (lib.__name__, src, sender)
            got.append((src, i))
        for s in range(k - 1):  # each sender's messages in the order it sent them
            assert [i for src, i in got if src == s] == list(range(m)), (lib.__name__, got)
    world.control.barrier()


@pytest.mark.parametrize("check", (True, False), ids=("check", "nocheck"))
def test_tags_and_handles_as_torch_over_gloo(world, check):
    """irecv(t) with tags posted in the other order than the sends: each handle gets its
    tag's message, and its source_rank() is the sender's, as gloo's."""
    _needs_two(world)
    tdist = gloo_world(world)
    comm = _checked(world, check)
    me, root, sender = world.rank, world.size - 1, 0
    results = []
    for lib, group in ((tdist, None), (dist, comm)):
        if me == sender:
            lib.send(_msg(me, 0, tag=3), dst=root, group=group, tag=3)
            lib.send(_msg(me, 1, tag=5), dst=root, group=group, tag=5)
        elif me == root:
            late, early = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
            works = [lib.irecv(late, group=group, tag=5), lib.irecv(early, group=group, tag=3)]
            # torch's poll (never blocks); gloo's recv handle says complete only once
            # waited for, so the poll is ours alone.
            while lib is dist and not works[0].is_completed():
                pass
            assert all(w.wait() for w in works)
            results.append(([w.source_rank() for w in works], _which(late), _which(early)))
    if me == root:
        assert results[0] == results[1] == ([sender, sender], (sender, 1, 5), (sender, 0, 3))
    world.control.barrier()


def test_source_rank_is_the_group_rank_and_recv_returns_the_job_rank(world):
    """On a group of job ranks 1..k-1 (group rank = job rank - 1): recv(t, group=g)
    returns the sender's job rank, and an irecv handle's source_rank() the sender's
    group rank, from any source and from a named one, as torch's over gloo."""
    tdist = gloo_world(world)
    k, me = world.size, world.rank
    members = list(range(1, k))
    if len(members) < 2:
        pytest.skip("needs 3 ranks")
    tg = tdist.new_group(members)  # collective over every gloo rank
    ours = world.split(0 if me in members else None, key=me)
    if ours is None:
        return
    receiver, sender = members[0], members[-1]
    outcomes = []
    for lib, group in ((tdist, tg), (dist, ours)):
        if me == sender:
            for i in range(3):
                lib.send(_msg(me, i), dst=receiver, group=group)
        elif me == receiver:
            t = torch.zeros(N, dtype=torch.float64)
            first = lib.recv(t, group=group)
            w_any = lib.irecv(torch.zeros(N, dtype=torch.float64), group=group)
            w_any.wait()
            w_named = lib.irecv(torch.zeros(N, dtype=torch.float64), src=sender, group=group)
            w_named.wait()
            outcomes.append((first, w_any.source_rank(), w_named.source_rank()))
    if me == receiver:  # torch's first, then ours
        assert outcomes[0] == outcomes[1] == (sender, sender - 1, sender - 1), outcomes
    ours.free()


@pytest.mark.parametrize("check", (True, False), ids=("check", "nocheck"))
def test_a_named_receive_posted_after_an_any_source_one_takes_the_next_message(world, check):
    """irecv(from any), irecv(from s), irecv(from any), one tag, waited for in the other
    order: s's messages go to the receives in the order they were posted (MPI's rule).
    With the check on, the named receive must not take the data that goes with the
    descriptor the first one took. (gloo gives a named receive precedence over an
    earlier any-source one, so torch over gloo is not the reference here.)"""
    _needs_two(world)
    comm = _checked(world, check)
    me, root, s, n = world.rank, world.size - 1, 0, N * 1000  # 264 KB: a large message
    if me == s:
        for i in range(3):
            dist.send(_msg(me, i, n=n), dst=root, group=comm, tag=2)
    elif me == root:
        a, b, c = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
        wa = dist.irecv(a, group=comm, tag=2)
        wb = dist.irecv(b, src=s, group=comm, tag=2)
        wc = dist.irecv(c, group=comm, tag=2)
        for w in (wc, wb, wa):
            w.wait()
        assert [_which(x, n)[:2] for x in (a, b, c)] == [(s, 0), (s, 1), (s, 2)]
        assert [w.source_rank() for w in (wa, wb, wc)] == [s] * 3
    world.control.barrier()


def test_data_comes_from_the_sender_of_the_descriptor(world):
    """Check on, a message is a descriptor and then its data. Here A's data is late
    (the descriptor, then B's whole message, then A's data): the receive that took A's
    descriptor must take A's data, never B's, which arrived first."""
    if world.size < 3:
        pytest.skip("needs 3 ranks")
    from mpiring.backends import P2P_TAG0
    from mpiring.comm.p2p import descriptor
    from mpiring.core.buffers import as_buffer

    comm, side = _checked(world, True), world.dup()  # side: the ordering tokens
    me, a, b, root, tag = world.rank, 0, 1, world.size - 1, 7
    token = np.zeros(1)
    if me == a:
        data = _msg(a, 0).numpy()
        raw = comm._be.comm  # the descriptor now, the data later: a slow network
        raw.Send(descriptor(as_buffer(data)), dest=root, tag=P2P_TAG0 + 2 * tag)
        side.recv(token, root)  # the root has posted its receives
        side.send(token, b)
        side.recv(token, b)  # B's whole message has gone
        raw.Send(data.view(np.uint8), dest=root, tag=P2P_TAG0 + 2 * tag + 1)
    elif me == b:
        side.recv(token, a)
        comm.send(_msg(b, 0).numpy(), root, tag=tag)
        side.send(token, a)
    elif me == root:
        x, y = np.zeros(N), np.zeros(N)
        first, second = comm.irecv(x, None, tag), comm.irecv(y, None, tag)
        side.send(token, a)
        first.wait()
        second.wait()
        assert (first.source, second.source) == (a, b)
        assert _which(torch.from_numpy(x)) == (a, 0, 0) and _which(torch.from_numpy(y)) == (b, 0, 0)
    world.control.barrier()


def test_a_pending_any_source_receive_does_not_stall_other_messages(world):
    """Check on, the data of a message from any source is received once its descriptor
    is in: a rank blocked in another receive still takes it, so a sender whose large
    message waits for that receive gets on to the message the receiver waits for."""
    _needs_two(world)
    comm = _checked(world, True)
    me, root, s = world.rank, world.size - 1, 0
    big = 1 << 20  # 8 MB: past any eager limit, the send waits for the receive
    if me == s:
        comm.send(np.arange(big, dtype=np.float64), root, tag=1)
        comm.send(np.full(3, 7.0), root, tag=2)
    elif me == root:
        x, y = np.zeros(big), np.zeros(3)
        req = comm.irecv(x, None, tag=1)
        comm.recv(y, s, tag=2)
        assert (y == 7.0).all()
        assert req.test() or req.wait() is x
        assert req.source == s and (x == np.arange(big)).all()
    world.control.barrier()


@pytest.mark.parametrize("check", (True, False), ids=("check", "nocheck"))
def test_a_wrong_size_from_any_source_names_the_sender(world, check):
    _needs_two(world)
    comm = _checked(world, check)
    me, root, s = world.rank, world.size - 1, 0
    if me == s:
        comm.send(np.zeros(5, np.float32), root, tag=4)
        comm.send(np.zeros(5, np.float32), root, tag=4)
        comm.send(np.arange(3, dtype=np.float32), root, tag=4)
    elif me == root:
        want = (rf"recv#\d+ from any source tag 4: r{s} sent 5 x float32 \(20 B\), this rank "
                r"receives into 3 x float32" if check else
                rf"from any source tag 4\)?: the message from r{s} is longer")
        for poll in (True, False):  # torch's is_completed() loop, then a plain wait
            req = comm.irecv(np.zeros(3, np.float32), None, tag=4)
            with pytest.raises(MismatchError if check else ValueError, match=want):
                while poll and not req.test():
                    pass
                req.wait()
            with pytest.raises(MismatchError if check else ValueError, match=want):
                req.wait()  # said again, not a buffer handed back as if it were fine
        # The refused message was drained: the next one from the same sender is intact.
        got = comm.recv(np.zeros(3, np.float32), None, tag=4)
        assert got.tolist() == [0.0, 1.0, 2.0]
    world.control.barrier()


def test_trace_names_the_sender_and_group_takes_any_source(world, tmp_path_factory):
    """A traced receive from any source records the sender as its peer (never a -1 or
    -2 for "any") and says it was from any source; inside comm.group() on the MPI
    backend, an any-source receive completes at the group's end."""
    _needs_two(world)
    directory = str(tmp_path_factory.mktemp("any-trace")) if world.rank == 0 else None
    directory = world.control.bcast_json(directory)
    traced = Communicator(world._be.dup(), Tracer(world.rank, directory))
    me, root, s = world.rank, world.size - 1, 0
    if me == s:
        traced.send(np.full(4, 1.0 + me), root, tag=6)
        traced.send(np.full(4, 2.0 + me), root, tag=6)
    elif me == root:
        x, y = np.zeros(4), np.zeros(4)
        req = traced.irecv(x, None, tag=6)
        req.wait()
        with traced.group():
            grouped = traced.irecv(y, None, tag=6)
        assert grouped._done and grouped.source == s and (y == 2.0 + s).all()
        assert req.source == s and (x == 1.0 + s).all()
    traced.tracer.close()
    world.control.barrier()
    if me == root:
        mine = [r for r in read_trace(directory) if r.get("type") == "p2p" and r["rank"] == me]
        assert [(r["op"], r["peer"], r["tag"], r.get("any_source")) for r in mine] == [
            ("recv", s, 6, True)] * 2


def test_batch_refuses_any_source_as_torch_does(world):
    tdist = gloo_world(world)
    with pytest.raises(ValueError):
        tdist.P2POp(tdist.irecv, torch.zeros(3))
    with pytest.raises(ValueError, match=r"peer=None \(any sender\) is not offered in a "
                                         r"batch.*irecv\(tensor\) \(src=None\) outside"):
        dist.P2POp(dist.irecv, torch.zeros(3), group=world)


def test_nccl_refuses_any_source_before_anything_is_posted(world):
    fake = Communicator(fake_backend(world.mpi_comm), world.tracer, check=True)
    be = fake._be
    groups, pending = len(be.nccl.groups), list(be._p2p_pending)
    want = r"recv from any source tag 3: the nccl backend has no receive from any source.*" \
           r"post a receive per possible sender"
    with pytest.raises(ValueError, match=want):
        fake.irecv(np.zeros(4, np.float32), None, tag=3)
    with pytest.raises(ValueError, match=want):
        fake.recv(np.zeros(4, np.float32), None, tag=3)
    with pytest.raises(ValueError, match="post a receive per possible sender"):
        dist.recv(torch.zeros(4), group=fake, tag=3)
    assert len(be.nccl.groups) == groups and be._p2p_pending == pending
    assert fake._p2p_calls == 0  # no call number taken: nothing was posted


def test_prepared_receive_names_its_sender(world):
    with pytest.raises(ValueError, match=r"prepared receive names its sender.*irecv\(x, None"):
        world.prepare_recv(np.zeros(3), None)


# --- a nested job: a receive from any source that nothing matches ---------------------
NO_SENDER = """
import time
import numpy as np
import mpiring
comm = mpiring.init()
x = np.zeros(16, dtype=np.float32)
print(f"[r{comm.rank}] entering", flush=True)
if comm.rank == 0:
    comm.isend(x, 1, tag=6)  # another tag: never matches
    time.sleep(120)
else:
    comm.irecv(x, None, tag=5).wait()
print(f"[r{comm.rank}] the receive returned: the stall was not detected", flush=True)
"""


@pytest.mark.deadline(90)
@pytest.mark.parametrize("check", ("1", "0"), ids=("check", "nocheck"))
def test_a_receive_from_any_source_nothing_matches_ends_at_the_deadline(
        side_by_side, request, check):
    result = side_by_side.run(request, {
        f"test_a_receive_from_any_source_nothing_matches_ends_at_the_deadline[{name}]":
        Job(2, ["-c", NO_SENDER], env={"MPIRING_TIMEOUT": "2", "MPIRING_CHECK": value})
        for name, value in (("check", "1"), ("nocheck", "0"))})
    if result is None:
        return
    rc, out, _ = result
    assert rc == STALL_EXIT_CODE, out
    assert re.search(r"\[r1\] mpiring stall: recv#1: blocked \d+\.\d s in "
                     r"Wait\(recv#1 from any source tag 5\)", out), out
    assert "the receive returned" not in out
    assert "waiting for a matching send from any rank" in out, out  # not "every rank"
    assert not re.search(r"r-\d", out), out  # no "any" number leaking out as a rank
