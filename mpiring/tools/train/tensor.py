"""``train --tp N``: the tensor-parallel groups and model of a training job.

Ranks are laid out tensor-parallel fastest, Megatron's order: ``tp_rank = rank % tp``
and ``dp_rank = rank // tp``, so a TP group is ``tp`` adjacent ranks (on one host,
where its two AllReduces per block are cheapest) and data parallelism runs
over the ``dp = world / tp`` ranks that share a ``tp_rank``.
"""

from __future__ import annotations


def split_groups(comm, tp: int):
    """``(tp_comm, dp_comm)`` over ``comm`` (collective: every rank calls it).

    Raises:
        ValueError: ``tp`` does not divide the number of ranks (on every rank).
    """
    if tp < 1 or comm.size % tp:
        raise ValueError(f"tp={tp} does not divide the {comm.size} ranks: choose a tensor-"
                         f"parallel size that divides the world (dp = world / tp)")
    tp_comm = comm.split(comm.rank // tp, key=comm.rank)   # adjacent ranks: one TP group
    dp_comm = comm.split(comm.rank % tp, key=comm.rank)    # the same tp_rank: one DP group
    return tp_comm, dp_comm


def tensor_parallel_model(full, tp_comm, *, sequence_parallel: bool, seed: int):
    """``full`` (the project's GPT) split over ``tp_comm``; its ``loss`` replaces ``lm_loss``."""
    from mpiring.tools.models.gpt_tp import TensorParallelGPT

    return TensorParallelGPT.from_full(full, tp_comm, sequence_parallel=sequence_parallel,
                                       seed=seed)
