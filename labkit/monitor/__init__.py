"""Monitoring every rank: what each rank logged, an alarm when one trains apart, and where a hung job stopped.

"Use centralized logging (like Weights & Biases or TensorBoard) to monitor the loss curves of all ranks.  If one
rank shows a different loss behavior, it is a clear indicator of a configuration error."  Three tools for that,
one module each:

- :mod:`~labkit.monitor.scalars`: every rank's scalars in TensorBoard, one run per rank (:class:`RankLog`), or past
  tens of ranks rank 0's minimum, mean and maximum over all of them (:class:`SummaryLog`), read back with
  TensorBoard's own reader (:func:`read_scalars`);
- :mod:`~labkit.monitor.alarm`: the divergence alarm (:class:`DivergenceAlarm`), one all-gather of four numbers
  per rank every few steps, which names the rank, the step and the reason: a gradient norm or a replica's weights
  apart (to the bit), a loss beyond the ranks' spread, two ranks on the same batches, a straggler;
- :mod:`~labkit.monitor.hang`: a process group watched by torch's flight recorder (:func:`watched_group`), the
  recorder read on every rank, and the first collective at which the ranks of a hung job parted
  (:func:`hang_report`).

:mod:`~labkit.monitor.training` holds what ``labkit.train`` does with them each step (:class:`TrainingMonitor`)
and the faults it can inject on purpose (:data:`FAULTS`, ``LABKIT_TRAIN_FAULT=KIND:RANK``).
"""

from labkit.monitor.alarm import (
    Alarm,
    DivergenceAlarm,
    departed,
    deviations,
    loss_band,
    parameter_fingerprint,
    stragglers,
)
from labkit.monitor.hang import Hang, flight_record, hang_report, watched_group
from labkit.monitor.scalars import (
    GPU_TAGS,
    SUMMARY_RUNS,
    TAGS,
    RankLog,
    SummaryLog,
    gather_scalars,
    rank_directory,
    read_scalars,
    summarize,
)
from labkit.monitor.training import (
    FAULT_VARIABLE,
    FAULTS,
    LOG_RANKS,
    NAN_STEP,
    SLOW_S,
    TrainingMonitor,
    corrupt,
    fault_from_environment,
    gpu_peak_flops,
)

__all__ = ["FAULTS", "FAULT_VARIABLE", "GPU_TAGS", "LOG_RANKS", "NAN_STEP", "SLOW_S", "SUMMARY_RUNS", "TAGS", "Alarm",
           "DivergenceAlarm", "Hang", "RankLog", "SummaryLog", "TrainingMonitor", "corrupt", "departed", "deviations",
           "fault_from_environment", "flight_record", "gather_scalars", "gpu_peak_flops", "hang_report", "loss_band",
           "parameter_fingerprint", "rank_directory", "read_scalars", "stragglers", "summarize", "watched_group"]
