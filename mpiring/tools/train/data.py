"""Byte-level text from the running interpreter's standard library, split by file.

Real text that every machine with Python has, offline: the ``.py`` files of the
standard library, in sorted order, every ``val_every``-th file held out for
validation (split by file, so no validation window shares a file with a
training window). Tokens are bytes (vocabulary 256).

Rank 0 reads the files and broadcasts the bytes, so that every rank trains on
identical data even where ranks run different Python installations.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch


def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files (no site-packages), sorted by relative path."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in ("site-packages", "dist-packages", "__pycache__"))
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


def read_corpus(max_bytes: int, val_every: int = 10) -> tuple[np.ndarray, np.ndarray, int]:
    """Read files until ``max_bytes``; return (train bytes, validation bytes, files read)."""
    train, val, total, count = [], [], 0, 0
    for j, path in enumerate(stdlib_files()):
        if total >= max_bytes:
            break
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        (val if j % val_every == val_every - 1 else train).append(data)
        total += len(data)
        count += 1
    join = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8).copy()  # noqa: E731
    return join(train), join(val), count


def shared_corpus(comm, max_bytes: int, val_every: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """``read_corpus`` on rank 0, broadcast to every rank (collective)."""
    if comm.rank == 0:
        train, val, _ = read_corpus(max_bytes, val_every)
        sizes = np.array([train.size, val.size], dtype=np.int64)
    else:
        sizes = np.zeros(2, dtype=np.int64)
    comm.broadcast(sizes, root=0)
    if comm.rank != 0:
        train = np.empty(int(sizes[0]), dtype=np.uint8)
        val = np.empty(int(sizes[1]), dtype=np.uint8)
    for arr in (train, val):
        if arr.size:
            comm.broadcast(arr, root=0)
    return train, val


@dataclass
class Windows:
    """Non-overlapping windows of ``seq_len + 1`` bytes: input and next-byte target."""

    data: np.ndarray
    seq_len: int

    def __len__(self) -> int:
        return max(0, (self.data.size - 1) // self.seq_len)

    def batch(self, indices, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets for window ``indices``, each ``(len(indices), seq_len)`` int64."""
        t = self.seq_len
        rows = np.stack([self.data[i * t:i * t + t + 1] for i in indices]).astype(np.int64)
        rows = torch.from_numpy(rows).to(device)
        return rows[:, :-1], rows[:, 1:]
