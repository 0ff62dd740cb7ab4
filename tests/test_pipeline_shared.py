"""Stages on one host: messages through a shared-memory window, and the fallbacks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from fake_nccl import fake_backend

from mpiring import Communicator
from mpiring.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleZeroBubble
from mpiring.parallel.pipeline import shared as shared_mod
from mpiring.tools.models.gpt import GPT, GPTConfig, lm_loss
from mpiring.tools.train.pipeline import split_gpt

CFG = GPTConfig(vocab_size=11, seq_len=5, d_model=8, n_layers=2, n_heads=2)


def test_shared_window_segments_are_seen_by_every_rank(comm):
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
    win.free()  # a second free does nothing


def test_no_shared_window_over_nccl(comm):
    fake = Communicator(fake_backend(comm.mpi_comm), comm.tracer, check=True)
    assert fake.shared_window(64) is None


def _run(comm, make, steps=3):
    torch.manual_seed(5)
    full = GPT(CFG).double()
    module, tied = split_gpt(copy.deepcopy(full), comm.size, comm.rank)
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = make(stage)
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 11, (7, 5), generator=g)
        y = torch.randint(0, 11, (7, 5), generator=g)
        module.zero_grad(set_to_none=True)
        losses: list = []
        sched.step(x if stage.is_first else None, target=y if stage.is_last else None,
                   losses=losses if stage.is_last else None)
        out.append(([float(v) for v in losses], [p.grad.clone() for p in module.parameters()]))
    return out, sched.transport


@pytest.mark.parametrize("make", [lambda st: Schedule1F1B(st, 3, lm_loss),
                                  lambda st: ScheduleZeroBubble(st, 4, lm_loss)],
                         ids=["1f1b", "zb"])
def test_shared_and_mpi_paths_give_the_same_bits(comm, monkeypatch, make):
    shared, t_shared = _run(comm, make)
    assert t_shared.shared_on == (comm.size > 1)  # one host: past the first step, shared
    monkeypatch.setenv("MPIRING_PP_SHARED", "0")
    plain, t_plain = _run(comm, make)
    assert not t_plain.shared_on
    for (la, ga), (lb, gb) in zip(shared, plain, strict=True):
        assert la == lb
        for a, b in zip(ga, gb, strict=True):
            assert torch.equal(a, b)


def test_a_new_input_shape_lays_the_slots_out_again(comm):
    torch.manual_seed(2)
    module, tied = split_gpt(GPT(CFG).double(), comm.size, comm.rank)
    stage = PipelineStage(module, comm.rank, comm.size, comm, tied_parameters=tied)
    sched = Schedule1F1B(stage, 2, lm_loss)
    for rows in (4, 4, 6, 6, 4):  # 6 rows: new shapes, a new window; then back
        x = torch.randint(0, 11, (rows, 5))
        sched.step(x if stage.is_first else None, target=x if stage.is_last else None)
        if comm.size > 1:
            got = sched.transport.shared.buffer("F" if not stage.is_first else "B", 0)
            assert got.shape[0] == rows // 2


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("MPIRING_PP_SHARED", "maybe")
    with pytest.raises(ValueError, match=r"MPIRING_PP_SHARED='maybe': use 1 .* or 0"):
        shared_mod.enabled()
