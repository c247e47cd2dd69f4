"""Pipeline parallelism.  ``schedule``: schedules as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their
validation and torch's CSV form; ``simulate``: their timing, bubble and activations held, without any process
group; ``stage``: TinyGPT split into stages, each rank's stages with their forward, backward and the
point-to-point messages between neighbours (shapes agreed once)."""

from labkit.parallel.pipeline.schedule import (
    Action,
    Schedule,
    from_csv,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    to_csv,
    validate,
    zb_h1,
)
from labkit.parallel.pipeline.simulate import Timeline, simulate
from labkit.parallel.pipeline.stage import PipelineStage, build_stage, split_stages

__all__ = ["Action", "PipelineStage", "Schedule", "Timeline", "build_stage", "from_csv", "gpipe", "interleaved_1f1b",
           "one_f_one_b", "simulate", "split_stages", "to_csv", "validate", "zb_h1"]
