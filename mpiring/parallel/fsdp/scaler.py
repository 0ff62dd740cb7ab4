"""``ShardedGradScaler``: torch's loss scaler, with the skip decision agreed over the ranks.

``torch.amp.GradScaler`` skips ``optimizer.step()`` when a gradient it checks is
inf or nan. Under FSDP (or any sharding) each rank checks only its own shards,
so an overflow in one rank's shard makes that rank alone skip and back off its
scale while the others step: the shards drift apart, and the next backward sums
gradients scaled by different factors. This scaler checks as torch's does, then
takes the max of the found-inf flags over the ranks (one scalar all-reduce on
mpiring's control channel), so every rank skips, or steps, and rescales alike:
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` on a
Communicator instead of a process group.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import GradScaler


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` whose inf/nan check is agreed over ``comm``'s ranks.

    ::

        model = mpiring.FullyShardedDataParallel(net, comm, mixed_precision=torch.float16)
        scaler = mpiring.ShardedGradScaler(model)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()

    Args:
        comm: the ``FullyShardedDataParallel`` model, or the Communicator over
            every rank that must skip together (with a pipeline or tensor
            parallelism around FSDP: the whole world, as torch's default group).
        device: where the scale lives ("cuda" or "cpu"; default: the model's
            device when given a model, else "cuda" if available).
        init_scale, growth_factor, backoff_factor, growth_interval, enabled:
            as ``torch.amp.GradScaler``.

    Every rank must call ``unscale_`` / ``step`` for the same optimizers in the
    same order: each is a collective once the gradients are checked.
    """

    def __init__(self, comm, device: str | None = None, init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        model = comm if hasattr(comm, "shards") and hasattr(comm, "comm") else None
        comm = model.comm if model is not None else comm
        if not (hasattr(comm, "control") and hasattr(comm, "size")):
            raise TypeError(f"ShardedGradScaler(comm): pass the FullyShardedDataParallel model "
                            f"or an mpiring.Communicator, got {type(comm).__name__}")
        if device is None:
            shards = list(model.shards) if model is not None else []
            device = (shards[0].device.type if shards
                      else "cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.comm = comm

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # float16 shards (a model kept in float16) are unscaled in place, as torch's
        # ShardedGradScaler allows: the master copy is the shard itself.
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then agree over the ranks whether any found inf/nan."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not flags:
            # No gradient here (all shards empty): still a vote, and update() needs one.
            flags[self._scale.device] = torch.zeros((), dtype=torch.float32,
                                                    device=self._scale.device)
        local = int(any(float(f) for f in flags.values()))
        # max: one rank's overflow makes every rank skip and back off alike.
        found = self.comm.control.allreduce_scalar(local, "max") if self.comm.size > 1 else local
        for f in flags.values():
            f.fill_(float(found))
