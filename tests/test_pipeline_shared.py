"""Stages on one host: messages through a shared-memory window, and the fallbacks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from fake_nccl import fake_backend
from torch import nn

from mpiring import Communicator
from mpiring.backends import mpi as mpi_backend
from mpiring.parallel.pipeline import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    SchedulePipeDream,
    ScheduleZeroBubble,
)
from mpiring.parallel.pipeline import shared as shared_mod
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import split_gpt

CFG = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)


@pytest.fixture(autouse=True)
def _shared_on(monkeypatch):
    monkeypatch.setenv("MPIRING_PP_SHARED", "1")  # whatever the caller's environment says


def needs_shared_memory(comm) -> None:
    """Skip, on every rank alike, where this job cannot have a shared window (ranks on
    several hosts, no room in /dev/shm): there the steps stay on MPI by design."""
    if comm.size == 1:
        return
    probe = comm.shared_window(64)
    if probe is None:
        pytest.skip("no shared-memory window for these ranks (several hosts, or no room)")
    probe.free()


def test_shared_window_segments_are_seen_by_every_rank(comm):
    needs_shared_memory(comm)
    sizes = [8 * (3 + r) for r in range(comm.size)]  # uneven, one per rank
    win = comm.shared_window(sizes[comm.rank])
    assert [len(s) for s in win.segments] == sizes
    right = (comm.rank + 1) % comm.size
    mine = win.segments[right].view(np.int64)
    mine[:] = 100 * comm.rank + np.arange(len(mine))  # into the right neighbour's segment
    win.sync()
    comm.barrier()
    win.sync()
    left = (comm.rank - 1) % comm.size
    got = win.segments[comm.rank].view(np.int64)
    np.testing.assert_array_equal(got, 100 * left + np.arange(len(got)))
    comm.barrier()
    win.free()
    win.free()  # a second free does nothing, and neither does a sync after it
    win.sync()


def test_no_window_without_room_in_dev_shm_or_over_nccl(comm, monkeypatch):
    fake = Communicator(fake_backend(comm.mpi_comm), comm.tracer, check=True)
    assert fake.shared_window(64) is None
    # One rank short of room is enough for none on every rank (the call stays collective).
    monkeypatch.setattr(mpi_backend, "_shm_room", lambda: 0 if comm.rank == 0 else 1 << 40)
    assert comm.shared_window(64) is None
    with pytest.raises(ValueError, match=r"shared_window: nbytes=-1: give this rank's size"):
        comm.shared_window(-1 if comm.rank == comm.size - 1 else 8)


SCHEDULES = {
    "gpipe": lambda st: ScheduleGPipe(st, 3, lm_loss),
    "gpipe-recompute": lambda st: ScheduleGPipe(st, 3, lm_loss, recompute=True),
    "1f1b": lambda st: Schedule1F1B(st, 3, lm_loss),
    "zb": lambda st: ScheduleZeroBubble(st, 4, lm_loss),
    "pipedream": lambda st: SchedulePipeDream(
        st, 2, lm_loss, optimizer=torch.optim.SGD(st.module.parameters(), lr=0.1)),
}
ROWS = (7, 7, 9, 9, 7, 7)  # a new input shape (a new window), then back (the same one)


def _run(comm, name):
    torch.manual_seed(5)
    full = GPT(CFG).double()
    if name == "pipedream":  # PipeDream refuses tied weights
        full.head.weight = nn.Parameter(full.head.weight.detach().clone())
    module, tied = split_gpt(copy.deepcopy(full), comm.size, comm.rank)
    tied = [] if name == "pipedream" else tied
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = SCHEDULES[name](stage)
    g = torch.Generator().manual_seed(9)
    out, on = [], []
    for rows in ROWS + (7,):
        if len(out) == len(ROWS):
            sched.close()  # collective; the step after it goes over MPI
        x = torch.randint(0, 11, (rows, 5), generator=g)
        y = torch.randint(0, 11, (rows, 5), generator=g)
        module.zero_grad(set_to_none=True)
        losses: list = []
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
                   losses=losses if stage.is_last else None)
        out.append(([float(v) for v in losses], [p.detach().clone() for p in module.parameters()],
                    [None if p.grad is None else p.grad.clone() for p in module.parameters()]))
        on.append(sched.transport.shared_on)
    return out, on, sched.transport


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_shared_and_mpi_paths_give_the_same_bits(comm, monkeypatch, name):
    needs_shared_memory(comm)
    shared, on, transport = _run(comm, name)
    # One host: slots laid out at the end of each first step of a shape; none after close().
    assert on == [comm.size > 1] * 6 + [False]
    assert len(transport.retired) == 0  # close() freed them
    monkeypatch.setenv("MPIRING_PP_SHARED", "0")
    plain, on_plain, _ = _run(comm, name)
    assert not any(on_plain)
    for k, ((la, pa, ga), (lb, pb, gb)) in enumerate(zip(shared, plain, strict=True)):
        assert la == lb, f"step {k}"
        for a, b in zip(pa + ga, pb + gb, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), f"step {k}"


def test_a_larger_shape_takes_a_new_window_and_keeps_the_old_one_mapped(comm):
    if comm.size == 1:
        pytest.skip("one stage sends nothing")
    needs_shared_memory(comm)
    torch.manual_seed(2)
    module, tied = split_gpt(GPT(CFG).double(), comm.size, comm.rank)
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = Schedule1F1B(stage, 2, lm_loss)
    t = sched.transport
    kept = []
    for k, rows in enumerate((4, 4, 8, 8, 4, 4)):
        x = torch.randint(0, 11, (rows, 5))
        sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
        channel = "B" if stage.is_first else "F"
        kept.append(t.shared.buffer((channel, comm.rank, 0)))
        assert kept[-1].shape[0] == rows // 2
        if k in (0, 2, 4):  # a layout was just made (the window reused at k = 4): every
            # flag reads 0, whatever the memory held (old data where a flag now sits)
            assert all(int(flag[0]) == 0 for _, flag, *_ in t.shared._recv.values()), k
    assert len(t.retired) == 1 and t.shared.window is not t.retired[0]  # 4 -> 8: a new one
    kept[0].sum()  # a tensor over the retired window is still mapped memory
    windows = [t.shared.window, *t.retired]
    sched.close()
    assert t.shared is None and t.retired == []
    assert all(w.segments == [] for w in windows), "close() did not free every window"


def test_stages_on_several_hosts_stay_on_mpi(comm, monkeypatch):
    monkeypatch.setattr(Communicator, "shared_window", lambda self, nbytes: None)
    out, on, _ = _run(comm, "1f1b")
    assert not any(on) and len(out) == 7


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("MPIRING_PP_SHARED", "maybe")
    with pytest.raises(ValueError, match=r"MPIRING_PP_SHARED='maybe': use 1 .* or 0"):
        shared_mod.enabled()


def test_a_wait_on_a_slot_counts_as_blocked_for_the_desync_detector():
    from mpiring.runtime import desync

    assert Communicator.wait_until.__code__ in desync._BLOCKING


def test_every_message_through_a_slot_is_one_trace_record(world, tmp_path_factory):
    from mpiring.runtime.trace import Tracer, read_trace

    if world.size == 1:
        pytest.skip("one stage sends nothing")
    needs_shared_memory(world)
    directory = str(tmp_path_factory.mktemp("pp-shared")) if world.rank == 0 else None
    directory = world.control.bcast_json(directory)
    traced = Communicator(world._be.dup(), Tracer(world.rank, directory))
    m = 3
    stage = PipelineStage(nn.Linear(4, 4).double(), traced.rank, traced.size, traced)
    sched = Schedule1F1B(stage, m, lambda o, t: ((o - t) ** 2).mean())
    x = torch.ones(6, 4, dtype=torch.float64)
    for _ in range(2):  # the second step goes through the slots
        sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
    sched.close()
    traced.tracer.close()
    world.barrier()
    mine = [r for r in read_trace(directory) if r.get("type") == "p2p"
            and r["rank"] == world.rank and r.get("via") == "shared"]
    r, p = world.rank, world.size
    sends = m * ((r < p - 1) + (r > 0))  # activations right, gradients left
    assert sorted(x["op"] for x in mine) == ["recv"] * sends + ["send"] * sends
    assert all(x["bytes"] == 2 * 4 * 8 and x["dtype"] == "float64" for x in mine)
    assert all(x["t_end"] >= x["t_start"] for x in mine)
