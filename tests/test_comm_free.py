"""Communicator.free(): MPI's few thousand communicators per process come back.

A schedule, a job and a grid each make communicators (dup, split); without
free() a long-lived process (a test suite, a sweep in a notebook) runs out of
context ids after a few thousand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mpiring.parallel.pipeline import PipelineStage, Schedule1F1B


def test_freed_communicators_come_back(comm):
    # More dup()s than MPI has context ids (2048 in MPICH): only freeing lets this end.
    for _ in range(2500):
        comm.dup().free()
    d = comm.dup()
    d.free()
    d.free()  # twice: nothing
    with pytest.raises(RuntimeError, match=r"communicator .*dup\d+ was freed \(free\(\)\): "
                                           r"build a new one"):
        d.all_reduce(np.ones(3))
    x = np.full(3, float(comm.rank))
    comm.all_reduce(x)  # the parent is untouched
    assert x.tolist() == [sum(range(comm.size))] * 3


def test_a_freed_schedule_and_stage(comm):
    stage = PipelineStage(nn.Linear(3, 3).double(), comm.rank, comm.size, comm)
    sched = Schedule1F1B(stage, 2, lambda o, t: ((o - t) ** 2).mean())
    x = torch.zeros(4, 3, dtype=torch.float64)
    ins = (x,) if stage.is_first else ()
    sched.step(*ins, target=x if stage.is_last else None)
    sched.eval(*ins)
    sched.free()
    with pytest.raises(RuntimeError, match="was freed"):
        sched.transport.fast.barrier()
    with pytest.raises(RuntimeError, match="was freed"):
        sched._eval.transport.fast.barrier()
    stage.free()
    with pytest.raises(RuntimeError, match="was freed"):
        stage.comm.barrier()


def test_free_waits_for_no_thread_it_would_cut_off(comm):
    # Another thread inside a collective on it: refused, naming the thread; the
    # communicator still works once that thread is out.
    import threading

    d = comm.dup()
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with d._busy:
            d._owner, d._owner_call = threading.get_ident(), "all_reduce"
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=hold, name="holder")
    t.start()
    inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match=r"free: thread .* while thread 'holder' is "
                                               r"inside all_reduce"):
            d.free()
    finally:
        leave.set()
        t.join(10)
    x = np.ones(2)
    d.all_reduce(x)
    assert x.tolist() == [comm.size] * 2
    d.free()
