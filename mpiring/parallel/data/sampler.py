"""Distributed sampler: each rank gets a disjoint, equally long shard of the indices.

Same semantics as ``torch.utils.data.DistributedSampler`` (and the same indices
for the same seed and epoch): every rank draws the same permutation (seeded by
``seed + epoch``), makes its length a multiple of the number of ranks by padding
with its own first indices (or by dropping the tail with ``drop_last``), and
rank r takes every K-th index starting at r. Equal shard lengths matter: every
rank must run the same number of steps, or the last step's collectives would
wait for a rank that has run out of data.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch


class DistributedSampler:
    """Indices of this rank's shard, reshuffled each epoch in the same way on every rank.

    Args:
        dataset: something with ``len()``, or the number of samples.
        num_replicas: number of ranks (default: ``comm.size``).
        rank: this rank (default: ``comm.rank``).
        shuffle: permute the indices each epoch.
        seed: base seed; every rank must pass the same one.
        drop_last: drop the tail instead of padding to a multiple of the ranks.
        comm: a Communicator to take ``rank`` and ``num_replicas`` from
            (default: the one ``mpiring.init_process_group()`` made, as torch's
            sampler takes the default process group).

    Raises:
        ValueError: rank out of range, or neither the numbers, nor ``comm``,
            nor a default communicator to take them from.
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, *, comm=None):
        if num_replicas is None or rank is None:
            from mpiring.comm.default import resolve

            comm = resolve(comm, "DistributedSampler (num_replicas and rank not given)")
            num_replicas = comm.size if num_replicas is None else num_replicas
            rank = comm.rank if rank is None else rank
        if isinstance(dataset, bool) or not (isinstance(dataset, int) or hasattr(dataset, "__len__")):
            raise TypeError(f"DistributedSampler: dataset={type(dataset).__name__} has no len(): "
                            "pass a map-style dataset or the number of samples")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} with num_replicas={num_replicas}: "
                             f"use a rank in 0..{num_replicas - 1}")
        self.dataset = dataset  # torch's attribute (loops read sampler.dataset)
        self.length = dataset if isinstance(dataset, int) else len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        # Where this rank's shard resumes: a training loop advances it as it uses
        # indices, so a checkpoint of state_dict() records the data position.
        self.start = 0
        if drop_last:
            # Largest multiple of K that fits: every rank gets floor(n / K).
            self.num_samples = self.length // num_replicas
        else:
            self.num_samples = math.ceil(self.length / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Choose the permutation of the next ``iter()`` (call it at each epoch start).

        A new epoch also rewinds ``start`` to the beginning of the shard; the
        epoch already set keeps it, so torch's loop (``set_epoch(epoch)`` at the
        top of every epoch) resumes a restored mid-epoch position.
        """
        # torch's sampler has no position, and its set_epoch only sets the epoch:
        # rewinding on the same epoch would replay what a checkpoint had consumed.
        if int(epoch) != self.epoch:
            self.start = 0
        self.epoch = int(epoch)

    def global_indices(self) -> list[int]:
        """The epoch's indices for all ranks (before the shard is taken), length total_size."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(self.length, generator=g).tolist()
        else:
            indices = list(range(self.length))
        if self.drop_last:
            return indices[:self.total_size]
        short = self.total_size - len(indices)
        if short > 0 and indices:
            # Pad with the permutation's own first indices (repeated if the
            # dataset is smaller than the padding).
            indices += (indices * math.ceil(short / len(indices)))[:short]
        return indices

    def shard(self) -> list[int]:
        """This rank's whole shard for the current epoch (``start`` ignored)."""
        return self.global_indices()[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        """This rank's shard from ``start`` on (the whole shard unless resuming)."""
        return iter(self.shard()[self.start:])

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to continue the same order: seed, epoch, position,
        and the number of ranks the position counts in."""
        return {"seed": self.seed, "epoch": self.epoch, "start": self.start,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore ``state_dict()``'s output, on as many ranks as saved it or another number.

        ``start`` counts this rank's samples, so on another number of ranks it is
        rescaled to the same place in the epoch's order: rank r took positions r,
        r + K, ..., so ``start * K`` positions were used by all ranks together.
        Where that does not divide by the new count it rounds down: up to K' - 1
        samples are seen again, none is skipped.
        """
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        start = int(state.get("start", 0))
        saved = int(state.get("num_replicas", self.num_replicas))  # older states: the same K
        if saved != self.num_replicas:
            start = min(start * saved // self.num_replicas, self.num_samples)
        self.start = start
