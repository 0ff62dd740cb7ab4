r"""``DDP.join()``: training on inputs of different lengths per rank (torch's semantics).

Without it, a rank that runs out of batches stops calling backward while the
others wait in their next bucket AllReduce for ever. Inside ``join()``:

* every synced forward of a rank that still trains starts with one small
  AllGather of a flag ("I am still training"), so every rank knows who is;
* a rank that has left its loop (``__exit__``) keeps answering that AllGather
  with "done" and, while anyone still trains, shadows each of their backward
  passes: the same bucket rebuild, buffer broadcast and bucket AllReduces in the
  same order, with zero gradients (``Reducer.shadow_backward``);
* when nobody trains any more, every rank takes the parameters and buffers of
  the highest rank among the last ones to finish, whose optimizer ran every step
  (torch's choice: the MAX over the ranks still training).

The mean is over the initial world size, the joined ranks counting as zeros
(torch's default), or with ``divide_by_initial_world_size=False`` over the ranks
still training. Per rank and step::

    rank 0   |fwd bwd|fwd bwd|fwd bwd|  exit: shadow  |sync model|
    rank 1   |fwd bwd|  exit: shadow  ..  shadow       |sync model|
    flags     [1, 1]  [1, 0]  [1, 0]  [0, 0] -> done

The buffer broadcast's root is the highest rank still training, as in torch.
Optimizer state (momentum, Adam moments) is not synchronised at the end: a
joined rank's optimizer skipped the shadowed steps, as in torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np


class JoinState:
    """Who still trains, for one ``DistributedDataParallel`` inside ``join()``."""

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool,
                 throw_on_early_termination: bool):
        self.ddp = ddp
        self.comm = ddp.comm
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.throw = throw_on_early_termination
        self.last_active: list[int] = list(range(self.comm.size))

    def _flags(self, active: bool) -> np.ndarray:
        flags = self.comm.control.allgather_array([int(active)])[:, 0]
        if self.throw and flags.any() and not flags.all():
            done = ", ".join(f"r{r}" for r in range(self.comm.size) if not flags[r])
            raise RuntimeError(f"DistributedDataParallel.join(throw_on_early_termination=True): "
                               f"rank(s) {done} ran out of inputs; every rank stops here")
        if flags.any():
            self.last_active = [r for r in range(self.comm.size) if flags[r]]
            if not self.divide_by_initial_world_size:
                self.ddp.reducer.divisor = int(flags.sum())
        return flags

    def notify(self) -> int:
        """Called by a training rank at each synced forward; returns the buffers' root."""
        self._flags(True)
        return self.last_active[-1]

    def shadow_until_done(self) -> None:
        """On a rank that is out of inputs: shadow every synced step of the others."""
        while True:
            flags = self._flags(False)
            if not flags.any():
                break
            self.ddp.sync_before_backward(root=self.last_active[-1])
            self.ddp.reducer.shadow_backward()

    def sync_final_model(self) -> None:
        """Every rank takes the model of the highest rank among the last to finish (torch's
        ``_find_common_rank``: the MAX over the ranks still training)."""
        from mpiring.parallel.data.distributed import sync_from_root

        module = self.ddp.module
        tensors = [p.detach() for p in module.parameters()] + list(module.buffers())
        sync_from_root(self.comm, tensors, root=self.last_active[-1], check=False)


@contextmanager
def join(ddp: Any, divide_by_initial_world_size: bool = True, enable: bool = True,
         throw_on_early_termination: bool = False):
    """The context of ``DistributedDataParallel.join`` (see the module docstring).

    Args:
        ddp: the ``DistributedDataParallel`` model.
        divide_by_initial_world_size: divide the sum by the world size (True,
            torch's default: a joined rank counts as a zero gradient) or by the
            number of ranks still training.
        enable: False makes the context do nothing.
        throw_on_early_termination: raise on every rank as soon as one runs out
            of inputs, instead of shadowing.

    Raises:
        RuntimeError: nested ``join()``, or (with throw_on_early_termination)
            a rank ran out of inputs.
    """
    if not enable or ddp.comm.size == 1:
        yield
        return
    if ddp._join is not None:
        raise RuntimeError("DistributedDataParallel.join: already inside join() for this model")
    state = JoinState(ddp, divide_by_initial_world_size, throw_on_early_termination)
    ddp._join = state
    try:
        yield state
        # Only on a normal exit: after an exception the ranks are out of step, and
        # the launcher's abort (mpiring.run) ends the job instead.
        state.shadow_until_done()
        state.sync_final_model()
        # The buffers were just synced; and the ranks' last forwards differ, so the
        # next forward's broadcast must not depend on them.
        ddp.require_forward_param_sync = False
    finally:
        ddp._join = None
        ddp.reducer.divisor = ddp.comm.size
