"""Pipeline parallelism: stages, schedules as data (GPipe, 1F1B, ZB-H1, PipeDream, interleaved
1F1B and zero bubble, ZB-V, DualPipeV, looped BFS), runtime.

    actions      the instruction set (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)
    schedules    one pure generator per schedule, and the pass that adds communication
    validate     order and matching checks, and the simulation that finds deadlocks
    diagram      the lecture's per-device timeline
    stage        PipelineStage: one rank's layers, F / B / W
    runtime      executes a program; ScheduleGPipe, Schedule1F1B, ScheduleZeroBubble,
                 ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
                 ScheduleDualPipeV, ScheduleLoopedBFS
    transport    the sends and receives: shapes agreed once, then bare tensors
    data_parallel  pp x dp: stage_grid, each stage's replicas reduced by DDP
    pipedream    SchedulePipeDream (asynchronous 1F1B, weight stashing)

``get_schedule_class(name)`` maps torch.distributed.pipelining's schedule names to these.
"""

from mpiring.parallel.pipeline.actions import Action, parse, parse_schedule
from mpiring.parallel.pipeline.diagram import draw, draw_schedule
from mpiring.parallel.pipeline.pipedream import SchedulePipeDream
from mpiring.parallel.pipeline.runtime import (
    PipelineError,
    PipelineSchedule,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
)
from mpiring.parallel.pipeline.schedules import build, dump_csv, load_csv
from mpiring.parallel.pipeline.stage import PipelineStage
from mpiring.parallel.pipeline.validate import ScheduleError, check, simulate

__all__ = ["Action", "PipelineError", "PipelineSchedule", "PipelineStage", "Schedule1F1B",
           "ScheduleDualPipeV", "ScheduleError", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "SchedulePipeDream",
           "ScheduleZBVZeroBubble", "ScheduleZeroBubble", "build", "check", "draw",
           "draw_schedule", "dump_csv", "get_schedule_class", "load_csv", "parse",
           "parse_schedule", "simulate"]

#: torch.distributed.pipelining's schedule names (``get_schedule_class``)...
TORCH_NAMES = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
               "GPipe": ScheduleGPipe, "LoopedBFS": ScheduleLoopedBFS,
               "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
               "PipelineScheduleSingle": PipelineSchedule, "PipelineScheduleMulti": PipelineSchedule,
               "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
#: ... and in the same style the two of mpiring's that torch lacks.
SCHEDULE_CLASSES = {**TORCH_NAMES, "ZeroBubble": ScheduleZeroBubble,
                    "PipeDream": SchedulePipeDream}


def get_schedule_class(schedule_name: str) -> type[PipelineSchedule]:
    """The schedule class named ``schedule_name``, in any case (torch's function of the
    same name, for a script that takes its schedule from a flag): torch's names, then
    "ZeroBubble" (ZB-H1) and "PipeDream", then each class's own ``name`` ("1f1b", "zb",
    "zbv", "dualpipev", ..., as ``train --schedule`` spells them). torch's two base
    classes map to ``PipelineSchedule``, which runs a program given as ``actions``.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    own = {c.name: c for c in SCHEDULE_CLASSES.values() if c is not PipelineSchedule}
    by_lower = {k.lower(): cls for k, cls in (*SCHEDULE_CLASSES.items(), *own.items())}
    cls = by_lower.get(str(schedule_name).lower())
    if cls is None:
        raise ValueError(f"unknown schedule name {schedule_name!r}: use one of "
                         f"{', '.join(TORCH_NAMES)} (torch's), ZeroBubble, PipeDream, or "
                         f"{', '.join(own)}")
    return cls
