"""Pipeline parallelism.  ``schedule``: schedules as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1), their
validation and torch's CSV form; ``simulate``: their timing, bubble and activations held, without any process
group."""

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

__all__ = ["Action", "Schedule", "Timeline", "from_csv", "gpipe", "interleaved_1f1b", "one_f_one_b", "simulate",
           "to_csv", "validate", "zb_h1"]
