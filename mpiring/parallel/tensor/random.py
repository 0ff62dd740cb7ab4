"""Megatron's two dropout RNG streams, so that dropout keeps replicas identical.

Inside a tensor-parallel region (attention heads, the MLP's hidden columns, a
sequence shard) each rank holds different activations and must draw different
masks; outside (the residual stream, replicated on every rank of the group)
every rank must draw the *same* mask, or the replicas drift apart and the
AllReduces sum inconsistent halves. Megatron keeps two generator states
(``megatron/core/tensor_parallel/random.py``):

    "tensor":  seed + 2718 + tp_rank   different across the TP group
    "shared":  seed                    the same on every rank of the TP group

``with streams.fork("tensor", x.device):`` swaps the generator that draws for
``x``'s device (the CPU's, or that CUDA device's) for the stream's (dropout,
``F.scaled_dot_product_attention``'s included, draws from it) and saves the
stream's advance on the way out. The shared stream is forked too,
rather than trusting torch's global generator, because anything else that
draws from it on one rank only (a data loader, a log line's sample) would
silently break the replicas (Megatron-LM issue 206).

Activation recomputation must draw the masks of the first forward again, so every
live ``RNGStreams`` is known here (weakly): ``get_rng_states()`` before the first
forward and ``with replay_rng_states(states):`` around the recomputation, as
Megatron's ``CheckpointFunction`` does with its RNG tracker. ``PipelineStage``'s
recompute does this; for ``torch.utils.checkpoint`` pass
``context_fn=checkpoint_contexts``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

#: Megatron's offset of the tensor-parallel seed from the shared one.
TENSOR_SEED_OFFSET = 2718
STREAMS = ("tensor", "shared")
#: The generators a stream can stand in for (a CUDA state serves any CUDA device).
KINDS = ("cpu", "cuda")

#: Every RNGStreams alive in this process, so that a recompute can replay them all.
_LIVE: weakref.WeakSet[RNGStreams] = weakref.WeakSet()
#: How many ``replay_rng_states`` blocks are open: a fork in backward outside them is a
#: recomputation that nobody replays (``fork`` checks).
_REPLAYING = [0]


def _device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class RNGStreams:
    """The two generator states of one rank of a tensor-parallel group.

    Args:
        seed: the shared seed (give data-parallel replicas different ones if
            their masks should differ).
        tp_rank: this rank's index in its tensor-parallel group.
        device: the device whose generator ``fork()`` replaces when it is not
            given one ("cpu", or a CUDA device).

    Each kind of generator (CPU, CUDA) gets its own pair of states, seeded the
    same way the first time a stream forks it: the masks follow the device of
    the tensors dropped, and a model moved to a GPU is protected there too.
    """

    def __init__(self, seed: int, tp_rank: int, device: str | torch.device = "cpu"):
        self.device = _device(device)
        self.seeds = {"shared": int(seed), "tensor": int(seed) + TENSOR_SEED_OFFSET + int(tp_rank)}
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._kind_states(self.device)
        _LIVE.add(self)

    def __setstate__(self, state: dict) -> None:
        # A copy (copy.deepcopy of a model, unpickling) is a live stream too: registered,
        # or a recomputation would not replay its masks.
        self.__dict__.update(state)
        _LIVE.add(self)

    def _kind_states(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The streams' states for ``device``'s kind of generator, seeded on first use."""
        kind = device.type
        if kind not in self._states:
            if kind not in KINDS:
                raise ValueError(f"RNGStreams: no generator to fork on device {device}: "
                                 "use a CPU or CUDA device")
            self._states[kind] = {name: torch.Generator(device=device).manual_seed(s).get_state()
                                  for name, s in self.seeds.items()}
        return self._states[kind]

    @staticmethod
    def _get(device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return torch.get_rng_state()
        return torch.cuda.get_rng_state(device)

    @staticmethod
    def _set(state: torch.Tensor, device: torch.device) -> None:
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)

    @property
    def states(self) -> dict[str, torch.Tensor]:
        """The default device's two states (``fork()``'s without a device)."""
        return self._kind_states(self.device)

    @contextlib.contextmanager
    def fork(self, name: str = "tensor",
             device: str | torch.device | None = None) -> Iterator[None]:
        """Draw from stream ``name`` ("tensor" or "shared") inside the block.

        ``device``: that of the tensors the block draws for (pass ``x.device``);
        its generator is the one swapped. Default: the streams' ``device``.
        """
        if name not in STREAMS:
            raise ValueError(f"unknown RNG stream {name!r}: use one of {', '.join(STREAMS)}")
        device = self.device if device is None else _device(device)
        if device.type == "meta":  # nothing is drawn on the meta device
            yield
            return
        states = self._kind_states(device)
        outer = self._get(device)
        self._set(states[name], device)
        try:
            yield
        finally:
            states[name] = self._get(device)
            self._set(outer, device)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Both streams' states, per kind of generator used so far (``{"cpu": {...}}``)."""
        return {kind: {k: v.clone() for k, v in states.items()}
                for kind, states in self._states.items()}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore what ``state_dict`` returned (a kind it lacks starts from the seed)."""
        unknown = sorted(set(state) - set(KINDS))
        if unknown:
            raise ValueError(f"RNGStreams state for {unknown}: expected kinds among "
                             f"{', '.join(KINDS)} (a dict from RNGStreams.state_dict())")
        self._states = {kind: {k: state[kind][k].clone() for k in STREAMS} for kind in state}
        self._kind_states(self.device)


def named_rng_streams(module: torch.nn.Module) -> Iterator[tuple[str, RNGStreams]]:
    """Every ``RNGStreams`` that ``module`` or a submodule holds as an attribute, by the
    holder's name and the attribute's (``"blocks.0.streams"``): a checkpoint's keys."""
    for name, m in module.named_modules():
        for attr, value in vars(m).items():
            if isinstance(value, RNGStreams):
                yield (f"{name}.{attr}" if name else attr), value


def get_rng_states() -> weakref.WeakKeyDictionary:
    """Every live ``RNGStreams``' states now (cheap: generator states are replaced, never
    changed in place, so nothing is copied)."""
    return weakref.WeakKeyDictionary(
        {s: {kind: dict(states) for kind, states in s._states.items()} for s in list(_LIVE)})


def set_rng_states(states: weakref.WeakKeyDictionary) -> None:
    """Put every stream in ``states`` (from ``get_rng_states``) back where it was."""
    for streams, saved in list(states.items()):
        streams._states = {kind: dict(kind_states) for kind, kind_states in saved.items()}


@contextlib.contextmanager
def replay_rng_states(states: weakref.WeakKeyDictionary) -> Iterator[None]:
    """Inside: every stream as in ``states``, to draw the same masks again; after: every
    stream as it was before the block (``torch.random.fork_rng``'s way), so a
    recomputation does not advance them."""
    outer = get_rng_states()
    set_rng_states(states)
    _REPLAYING[0] += 1
    try:
        yield
    finally:
        _REPLAYING[0] -= 1
        set_rng_states(outer)


def check_recompute(draws: bool) -> None:
    """Refuse a forward that draws dropout masks from the streams and runs again during
    backward outside ``replay_rng_states`` (``torch.utils.checkpoint`` without
    ``context_fn=checkpoint_contexts``): it would draw where the streams got to, not
    the first forward's masks, and the gradients would silently be other masks'.

    Call it where every rank of the group decides alike (a block's entry, with its
    training flag and dropout rates), before any collective: whether a rank's own
    fork draws can differ (a rank with no heads, or no tokens of a sequence shard,
    draws nothing), and an error on some ranks only would leave the others in the
    block's next collective.
    """
    if draws and not _REPLAYING[0] and torch._C._current_graph_task_id() != -1:
        raise RuntimeError(
            "a forward that draws tensor-parallel dropout masks is being recomputed during "
            "backward without replaying the streams, so its masks would differ from the "
            "first forward's and the gradients would be wrong: pass use_reentrant=False, "
            "context_fn=mpiring.parallel.tensor.checkpoint_contexts to "
            "torch.utils.checkpoint (or recompute inside replay_rng_states)")


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager,
                                   contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint(fn, ..., use_reentrant=False, context_fn=checkpoint_contexts)``:
    the recomputation draws the tensor-parallel streams' masks of the first forward."""
    saved = {}

    @contextlib.contextmanager
    def first() -> Iterator[None]:
        saved["states"] = get_rng_states()
        yield

    @contextlib.contextmanager
    def again() -> Iterator[None]:
        with replay_rng_states(saved["states"]):
            yield

    return first(), again()
