"""Fully sharded data parallelism (ZeRO-3): flat shards, units, the wrapper, full state dicts.

    model = mpiring.FullyShardedDataParallel(model, comm)
    opt = torch.optim.AdamW(model.parameters())   # the shards

Files: ``flat`` (one unit's flat layout and shard), ``unit`` (gather, free,
reduce-scatter, the hooks), ``wrap`` (auto_wrap), ``runner`` (the
communication thread), ``module`` (the wrapper), ``state`` (full state dicts),
``composable`` (``fully_shard``: torch FSDP2's in-place API over the wrapper),
``sharded`` (each rank's own slices, and ``save_sharded`` / ``load_sharded``: a
file per rank),
``precision`` (mixed precision), ``scaler`` (the loss scaler agreed
over the ranks). Files that load at any number of ranks: the full state dicts
saved with ``mpiring.parallel.checkpoint``, or ``save_sharded``'s (no rank ever
holds a whole parameter).
"""

from mpiring.parallel.fsdp.composable import FSDPModule, fully_shard
from mpiring.parallel.fsdp.module import DEFAULT_ALGO, FullyShardedDataParallel
from mpiring.parallel.fsdp.precision import MixedPrecision
from mpiring.parallel.fsdp.scaler import ShardedGradScaler
from mpiring.parallel.fsdp.sharded import (
    load_sharded,
    load_sharded_optim_state_dict,
    load_sharded_state_dict,
    save_sharded,
    sharded_optim_state_dict,
    sharded_state_dict,
)
from mpiring.parallel.fsdp.state import (
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    load_full_state_dict,
)

__all__ = ["DEFAULT_ALGO", "FSDPModule", "FullyShardedDataParallel", "MixedPrecision",
           "ShardedGradScaler", "full_optim_state_dict", "full_state_dict", "fully_shard",
           "load_full_optim_state_dict", "load_full_state_dict", "load_sharded",
           "load_sharded_optim_state_dict", "load_sharded_state_dict", "save_sharded",
           "sharded_optim_state_dict", "sharded_state_dict"]
