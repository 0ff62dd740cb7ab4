"""Plain data-parallel checkpoints (``train`` without a grid) resumed at another world size.

A run of plain DDP at 4 ranks (no ``--global-batch``: ``--batch-size`` per rank)
saves the full model and AdamW state. Resumed at 2 ranks and at 1 with the same
global batch (ranks x batch size), it loads: the state saved again there is the
saved bits, and the continued losses equal an uninterrupted one-process run's.
With another global batch the resume fails on every rank, naming
``--global-batch`` as the fix.
"""

from __future__ import annotations

import contextlib

import pytest
from test_train_3d import COMMON, DATA, resume_and_compare, twin_losses

from mpiring.tools.train.checkpointing import Checkpointer, ResumeError
from mpiring.tools.train.job3d import make_job
from mpiring.tools.train.loop import TrainConfig, train

G = 12  # windows a step: 4 x 3, 2 x 6, 1 x 12


def plain(comm, steps: int, batch_size: int, **kw):
    cfg = TrainConfig(steps=steps, batch_size=batch_size, **{**COMMON, **kw})
    j = make_job(comm, cfg, train_data=DATA, val_data=DATA[:4000])
    assert type(j).__name__ == "TrainJob"  # no grid: the plain data-parallel path
    return j


@pytest.mark.deadline(120)
@pytest.mark.parametrize("optimizer", ["adamw", "zero1"])
def test_plain_checkpoint_resumes_at_fewer_ranks(world, subcomms, tmp_path, optimizer):
    from mpiring.backends import control as wire

    if world.size < 4:
        pytest.skip("saves at 4 ranks")
    base = wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)
    want = twin_losses(4, G)
    if subcomms[4] is not None:
        first = plain(subcomms[4], 2, G // 4, optimizer=optimizer)
        train(first, callbacks=[Checkpointer(base, verbose=False)])
        first.close()
    world.barrier()
    for k in (2, 1):
        sub = subcomms[k]
        if sub is not None:
            again = f"{base}/at{k}"
            resume_and_compare(plain(sub, 4, G // k, optimizer=optimizer), base, again, want,
                               f"4 -> {k} ranks", sub.rank == 0)
        world.barrier()


@pytest.mark.deadline(60)
def test_plain_checkpoint_with_another_global_batch_names_the_fix(world, subcomms, tmp_path):
    from mpiring.backends import control as wire

    if world.size < 2:
        pytest.skip("saves at 2 ranks")
    base = wire.bcast_json(world, str(tmp_path) if world.rank == 0 else None)
    if subcomms[2] is not None:
        first = plain(subcomms[2], 1, 3)
        train(first, callbacks=[Checkpointer(base, verbose=False)])
        first.close()
    world.barrier()
    # Every rank of the world resumes with the same --batch-size: another global batch.
    second = plain(world, 3, 3)
    with pytest.raises(ResumeError, match=r"--global-batch 6") if world.size != 2 else \
            contextlib.nullcontext():
        Checkpointer(base, resume=True, verbose=False).load(second)
    second.close()
    world.barrier()

