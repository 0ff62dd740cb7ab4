"""Megatron's two dropout RNG streams, so that dropout keeps replicas identical.

Inside a tensor-parallel region (attention heads, the MLP's hidden columns, a
sequence shard) each rank holds different activations and must draw different
masks; outside (the residual stream, replicated on every rank of the group)
every rank must draw the *same* mask, or the replicas drift apart and the
AllReduces sum inconsistent halves. Megatron keeps two generator states
(``megatron/core/tensor_parallel/random.py``):

    "tensor":  seed + 2718 + tp_rank   different across the TP group
    "shared":  seed                    the same on every rank of the TP group

``with streams.fork("tensor"):`` swaps torch's generator for the stream's
(dropout, ``F.scaled_dot_product_attention``'s included, draws from it) and
saves the stream's advance on the way out. The shared stream is forked too,
rather than trusting torch's global generator, because anything else that
draws from it on one rank only (a data loader, a log line's sample) would
silently break the replicas (Megatron-LM issue 206).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Megatron's offset of the tensor-parallel seed from the shared one.
TENSOR_SEED_OFFSET = 2718
STREAMS = ("tensor", "shared")


class RNGStreams:
    """The two generator states of one rank of a tensor-parallel group.

    Args:
        seed: the shared seed (give data-parallel replicas different ones if
            their masks should differ).
        tp_rank: this rank's index in its tensor-parallel group.
        device: "cpu" or a CUDA device whose generator the streams replace.
    """

    def __init__(self, seed: int, tp_rank: int, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.seeds = {"shared": int(seed), "tensor": int(seed) + TENSOR_SEED_OFFSET + int(tp_rank)}
        self.states = {name: self._fresh(s) for name, s in self.seeds.items()}

    def _fresh(self, seed: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.Generator().manual_seed(seed).get_state()
        return torch.Generator(device=self.device).manual_seed(seed).get_state()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.get_rng_state()
        return torch.cuda.get_rng_state(self.device)

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "tensor") -> Iterator[None]:
        """Draw from stream ``name`` ("tensor" or "shared") inside the block."""
        if name not in self.states:
            raise ValueError(f"unknown RNG stream {name!r}: use one of {', '.join(STREAMS)}")
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Both streams' states (activation recomputation must restore them)."""
        return {k: v.clone() for k, v in self.states.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.states = {k: state[k].clone() for k in STREAMS}
