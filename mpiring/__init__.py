"""mpiring: ring collectives from first principles, over MPI and NCCL, feeding a DDP reducer.

    import mpiring
    comm = mpiring.init(backend="mpi")
    comm.all_reduce(x, op="sum", algo="ring")
"""

from __future__ import annotations

from mpiring.backends import BACKENDS
from mpiring.comm.communicator import Communicator
from mpiring.comm.start import ConfigError, init
from mpiring.core.errors import BackendUnavailable, MismatchError, MpiringTimeout
from mpiring.runtime import pages  # huge-page buffers and steady_malloc (no torch needed to import)

__version__ = "0.1.0"

# Public names that need torch (or a heavier import) live in their layer and are
# imported on first use: ``import mpiring`` stays cheap and torch stays optional.
_LAZY = {
    "DistributedDataParallel": "mpiring.parallel.data",
    "DistributedSampler": "mpiring.parallel.data",
    "ZeroRedundancyOptimizer": "mpiring.parallel.zero",
    "FullyShardedDataParallel": "mpiring.parallel.fsdp",
    "ShardedGradScaler": "mpiring.parallel.fsdp",
    "fully_shard": "mpiring.parallel.fsdp",
    "FSDPModule": "mpiring.parallel.fsdp",
    "ProcessGrid": "mpiring.parallel.grid",
    "ColumnParallelLinear": "mpiring.parallel.tensor",
    "RowParallelLinear": "mpiring.parallel.tensor",
    "VocabParallelEmbedding": "mpiring.parallel.tensor",
    "vocab_parallel_cross_entropy": "mpiring.parallel.tensor",
    "PipelineStage": "mpiring.parallel.pipeline",
    "ScheduleGPipe": "mpiring.parallel.pipeline",
    "Schedule1F1B": "mpiring.parallel.pipeline",
    "ScheduleZeroBubble": "mpiring.parallel.pipeline",
    "ScheduleInterleaved1F1B": "mpiring.parallel.pipeline",
    "ScheduleInterleavedZeroBubble": "mpiring.parallel.pipeline",
    "ScheduleZBVZeroBubble": "mpiring.parallel.pipeline",
    "ScheduleDualPipeV": "mpiring.parallel.pipeline",
    "ScheduleLoopedBFS": "mpiring.parallel.pipeline",
    "SchedulePipeDream": "mpiring.parallel.pipeline",
    "init_process_group": "mpiring.comm.default",
    "destroy_process_group": "mpiring.comm.default",
    "is_initialized": "mpiring.comm.default",
    "get_rank": "mpiring.comm.default",
    "get_world_size": "mpiring.comm.default",
    "checkpoint": "mpiring.parallel",
    # torch.distributed's functions, for a script that imports mpiring as dist.
    "Backend": "mpiring.comm.functional",
    "P2POp": "mpiring.comm.functional",
    "Work": "mpiring.comm.functional",
    "ReduceOp": "mpiring.comm.functional",
    "all_gather": "mpiring.comm.functional",
    "all_gather_into_tensor": "mpiring.comm.functional",
    "all_gather_object": "mpiring.comm.functional",
    "all_gather_single": "mpiring.comm.functional",
    "all_reduce": "mpiring.comm.functional",
    "all_to_all": "mpiring.comm.functional",
    "all_to_all_single": "mpiring.comm.functional",
    "barrier": "mpiring.comm.functional",
    "batch_isend_irecv": "mpiring.comm.functional",
    "broadcast": "mpiring.comm.functional",
    "broadcast_object_list": "mpiring.comm.functional",
    "gather": "mpiring.comm.functional",
    "gather_object": "mpiring.comm.functional",
    "get_backend": "mpiring.comm.functional",
    "get_global_rank": "mpiring.comm.functional",
    "get_group_rank": "mpiring.comm.functional",
    "get_process_group_ranks": "mpiring.comm.functional",
    "irecv": "mpiring.comm.functional",
    "is_available": "mpiring.comm.functional",
    "isend": "mpiring.comm.functional",
    "monitored_barrier": "mpiring.comm.functional",
    "new_group": "mpiring.comm.functional",
    "recv": "mpiring.comm.functional",
    "reduce": "mpiring.comm.functional",
    "reduce_scatter": "mpiring.comm.functional",
    "reduce_scatter_single": "mpiring.comm.functional",
    "reduce_scatter_tensor": "mpiring.comm.functional",
    "scatter": "mpiring.comm.functional",
    "scatter_object_list": "mpiring.comm.functional",
    "send": "mpiring.comm.functional",
    "get_node_local_rank": "mpiring.comm.functional",
    "is_backend_available": "mpiring.comm.functional",
    "is_gloo_available": "mpiring.comm.functional",
    "is_mpi_available": "mpiring.comm.functional",
    "is_nccl_available": "mpiring.comm.functional",
    "is_torchelastic_launched": "mpiring.comm.functional",
    "is_ucc_available": "mpiring.comm.functional",
    "new_subgroups": "mpiring.comm.functional",
    "new_subgroups_by_enumeration": "mpiring.comm.functional",
    "recv_object_list": "mpiring.comm.functional",
    "send_object_list": "mpiring.comm.functional",
    "GroupMember": "mpiring.comm.default",
    "group": "mpiring.comm.default",
}

__all__ = ["BACKENDS", "BackendUnavailable", "Communicator", "ConfigError", "MismatchError",
           "MpiringTimeout", "init", "pages", *_LAZY]


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'mpiring' has no attribute {name!r}")
    from importlib import import_module

    module = import_module(where)
    value = getattr(module, name, None) or import_module(f"{where}.{name}")  # a name or a module
    globals()[name] = value  # later lookups skip this function
    return value
