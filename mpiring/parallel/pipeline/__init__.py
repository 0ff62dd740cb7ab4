"""Pipeline parallelism: stages, schedules as data (GPipe, 1F1B, ZB-H1, PipeDream, interleaved
1F1B and zero bubble, ZB-V), runtime.

    actions      the instruction set (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)
    schedules    one pure generator per schedule, and the pass that adds communication
    validate     order and matching checks, and the simulation that finds deadlocks
    diagram      the lecture's per-device timeline
    stage        PipelineStage: one rank's layers, F / B / W
    runtime      executes a program; ScheduleGPipe, Schedule1F1B, ScheduleZeroBubble,
                 ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
    transport    the sends and receives: shapes agreed once, then bare tensors
    data_parallel  pp x dp: stage_grid, each stage's replicas reduced by DDP
    pipedream    SchedulePipeDream (asynchronous 1F1B, weight stashing)
"""

from mpiring.parallel.pipeline.actions import Action, parse, parse_schedule
from mpiring.parallel.pipeline.diagram import draw, draw_schedule
from mpiring.parallel.pipeline.pipedream import SchedulePipeDream
from mpiring.parallel.pipeline.runtime import (
    PipelineError,
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    ScheduleZeroBubble,
)
from mpiring.parallel.pipeline.schedules import build, dump_csv, load_csv
from mpiring.parallel.pipeline.stage import PipelineStage
from mpiring.parallel.pipeline.validate import ScheduleError, check, simulate

__all__ = ["Action", "PipelineError", "PipelineSchedule", "PipelineStage", "Schedule1F1B",
           "ScheduleError", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleInterleavedZeroBubble", "SchedulePipeDream",
           "ScheduleZBVZeroBubble", "ScheduleZeroBubble", "build",
           "check", "draw", "draw_schedule", "dump_csv", "load_csv", "parse", "parse_schedule",
           "simulate"]
