"""DDP keeps replicas identical or stops; a communicator refuses a second thread.

In-process on the test job: a second backward of one forward raises on every
rank before it adds a gradient; a rank whose synced-backward count differs
from the others' (as after a caught failure) makes every rank raise at the end
of that backward; two threads in one communicator's collectives at once are
refused, naming both. A nested job runs the misuse cases end to end
(tests/reliability_cases/ddp_misuse.py).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import Job, data

import mpiring


def _model(comm):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return mpiring.DistributedDataParallel(net, comm, bucket_cap_mb=0.0001)


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()


def test_a_second_backward_of_one_forward_raises_before_adding_gradients(world):
    comm = world.dup()
    model = _model(comm)
    x = torch.randn(4, 5, dtype=torch.float32) + comm.rank
    loss = model(x).pow(2).sum()
    loss.backward(retain_graph=True)
    reduced = _grads(model)
    with pytest.raises(RuntimeError, match=rf"second backward of the same forward's outputs on "
                                           rf"r{comm.rank}.*no_sync\(\)"):
        loss.backward()
    torch.testing.assert_close(_grads(model), reduced, rtol=0, atol=0)
    model(x).sum().backward()  # the next forward trains as usual
    model.close()


def test_ranks_at_different_steps_raise_on_every_rank(world):
    comm = world.dup()
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    model = _model(comm)
    x = torch.randn(3, 5) + comm.rank
    model(x).sum().backward()
    if comm.rank == comm.size - 1:  # as if one of its backwards had failed and been caught
        model.reducer.iteration += 1
    with pytest.raises(RuntimeError, match=r"reduced gradients of different steps \(synced "
                                           r"backward count mod 32: r0=1 .*\): a rank's backward "
                                           r"failed"):
        model(x).sum().backward()
    model.close()


def test_two_threads_in_one_communicator_are_refused_naming_both(world):
    comm = world.dup()
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    x = data(comm.rank, 40, np.float32)
    seen = []

    def intruder():
        time.sleep(0.2)  # the main thread is inside all_reduce, waiting for the last rank
        try:
            comm.all_reduce(np.zeros(4, np.float32), algo="ring")
        except RuntimeError as exc:
            seen.append(str(exc))

    side = threading.Thread(target=intruder, name="intruder") if comm.rank == 0 else None
    if side is not None:
        side.start()
    if comm.rank == comm.size - 1:
        time.sleep(0.6)
    comm.all_reduce(x, algo="ring")
    if side is not None:
        side.join()
        assert len(seen) == 1 and seen[0].startswith(
            "all_reduce: thread 'intruder' called a collective on this communicator while "
            "thread 'MainThread' is inside all_reduce#1: their messages would mix"), seen
    np.testing.assert_array_equal(x, sum(data(r, 40, np.float64) for r in range(comm.size)))
    y = data(comm.rank, 9, np.float32)
    comm.all_reduce(y, algo="ring")  # released: the next call runs
    np.testing.assert_array_equal(y, sum(data(r, 9, np.float64) for r in range(comm.size)))


#: The nested job's cases, each with what its output must say.
MISUSE = [
    ("twice", r"\[r1\] twice: RuntimeError: DistributedDataParallel: a second backward"),
    ("threads", r"\[r\d\] threads: RuntimeError: all_reduce: thread '.*' called a collective"),
    ("unwrapped", r"world rank 1 exited \d+\.\d s ago and will never join this call"),
    ("late", r"mpiring stall: all_reduce#\d+ \(algo ring-seg, 2 ranks\).*\(deadline 4 s\)"),
]


@pytest.mark.deadline(120)
@pytest.mark.parametrize("case,expect", MISUSE, ids=[case for case, _ in MISUSE])
def test_ddp_misuse_ends_the_job_naming_the_cause(side_by_side, request, case, expect):
    import re

    result = side_by_side.run(request, {
        f"test_ddp_misuse_ends_the_job_naming_the_cause[{name}]":
        Job(2, ["tests/reliability_cases/ddp_misuse.py", name], env={"MPIRING_TIMEOUT": "4"})
        for name, _ in MISUSE})
    if result is None:
        return
    rc, out, seconds = result
    assert rc != 0 and "no error after" not in out, out
    assert re.search(expect, out), out
    assert seconds < 30, f"{case}: {seconds:.1f} s\n{out}"


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0, -1.0, "25", True])
def test_a_bucket_size_that_is_not_a_positive_finite_number_is_refused(world, bad):
    with pytest.raises(ValueError, match=r"bucket_cap_mb=.*positive, finite numbers of MiB"):
        mpiring.DistributedDataParallel(torch.nn.Linear(2, 2), world, bucket_cap_mb=bad)


def test_a_model_wrapped_on_some_ranks_only_is_an_error_on_every_rank(world):
    comm = world.dup()
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    names = " ".join(f"r{r}={'all_reduce' if r == 1 else 'DistributedDataParallel'}"
                     for r in range(comm.size))
    with pytest.raises(mpiring.MismatchError, match=rf"#1: collective differs: {names}$"):
        if comm.rank == 1:
            comm.all_reduce(np.zeros(3, np.float32), algo="ring")
        else:
            mpiring.DistributedDataParallel(torch.nn.Linear(2, 2), comm)
    _model(comm).close()  # in step again: every rank wraps
