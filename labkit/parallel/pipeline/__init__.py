"""Pipeline parallelism.  ``schedule``: schedules as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their
validation and torch's CSV form; ``zero_bubble``: the schedules of 2024-25 (ZB-V, interleaved zero bubble,
DualPipeV), equal to torch's; ``simulate``: their timing, bubble and activations held, without any process
group (``replay``: a timeline's own durations placed again); ``stage``: TinyGPT split into stages, each rank's
stages with their forward, backward (whole or split into I and W) and the point-to-point messages between
neighbours (shapes agreed once); ``runtime``: a schedule run on real ranks and timed into the simulator's
``Timeline``; ``timed``: stages that wait instead of compute, to measure a schedule's bubble free of CPU
contention."""

from labkit.parallel.pipeline.runtime import PipelineRun, build_pipeline, run_schedule
from labkit.parallel.pipeline.schedule import (
    Action,
    Schedule,
    from_csv,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    stage_rank,
    to_csv,
    validate,
    zb_h1,
)
from labkit.parallel.pipeline.simulate import Timeline, replay, simulate
from labkit.parallel.pipeline.stage import PipelineStage, build_stage, split_stages
from labkit.parallel.pipeline.timed import TimedStage, timed_pipeline
from labkit.parallel.pipeline.zero_bubble import closed_form_idle, dualpipe_v, interleaved_zb, zb_v

__all__ = ["Action", "PipelineRun", "PipelineStage", "Schedule", "TimedStage", "Timeline", "build_pipeline",
           "build_stage", "closed_form_idle", "dualpipe_v", "from_csv", "gpipe", "interleaved_1f1b", "interleaved_zb", "one_f_one_b",
           "replay", "run_schedule", "simulate", "split_stages", "stage_rank", "timed_pipeline", "to_csv",
           "validate", "zb_h1", "zb_v"]
