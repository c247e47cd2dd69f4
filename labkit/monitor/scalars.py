"""Every rank's scalars in TensorBoard: one run per rank, or, past tens of ranks, one summary of all of them.

**One run per rank** (:class:`RankLog`).  Each rank writes its own TensorBoard run, ``DIR/rank-R``, under the same
tags (:data:`TAGS`; on a GPU also :data:`GPU_TAGS`).  TensorBoard takes every sub-folder of the folder it is given
for a run and draws one curve per run on each tag's chart, so ``tensorboard --logdir DIR`` overlays every rank's
loss on one chart.  :func:`read_scalars` reads the event files back with TensorBoard's own reader.  Writing is
asynchronous (the writer's thread), a few microseconds per scalar.

**A summary, for many ranks** (:class:`SummaryLog`).  A chart of 1,024 curves shows nothing, and 1,024 writers
fill a file system with event files.  Large runs log on one rank the statistics across ranks instead: torchtitan
logs the mean and the maximum of the loss over the data-parallel ranks (``loss_metrics/global_avg_loss`` and
``global_max_loss``, all-reduced), Megatron-LM its timers' minimum and maximum over the ranks
(``--timing-log-option minmax``) and the slowest and fastest ranks by name (``--log-straggler``).  Here every rank
hands its scalars to one all-gather (:func:`gather_scalars`, ``8 x tags`` bytes a rank) and rank 0 writes three runs,
``DIR/min``, ``DIR/mean`` and ``DIR/max``, so each chart holds three curves at any scale, and the ``max`` run also
holds, per tag, the rank that had the maximum (``rank_of_max/<tag>``): a straggler, or the rank whose loss left.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
import torch.distributed as torch_dist

from labkit import dist

# Every device: the loss, learning rate, gradient norm, throughput, the step's wall-clock time and this rank's own
# work in it (its training thread's CPU time: a wait in a collective adds nothing), the data wait, the bytes sent
# and the model FLOP/s it achieved (TFLOP/s: the step's model FLOPs over its wall-clock time).
TAGS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "busy_ms", "data_wait_ms", "comm_bytes", "tflops")
# A GPU only: the allocator's peak and what it holds from the driver (reserved: the peak plus its cache), and the
# model FLOPs utilisation against the GPU's dense bf16 peak (labkit.costmodel.hardware), where the GPU is known.
GPU_TAGS = ("peak_memory_bytes", "memory_reserved_bytes", "mfu")
SUMMARY_RUNS = ("min", "mean", "max")


def rank_directory(directory: str | Path, rank: int) -> Path:
    """The TensorBoard run of ``rank`` inside ``directory``: one sub-folder per rank, so their curves overlay."""
    return Path(directory) / f"rank-{rank}"


def _writer(path: Path, flush_secs: float):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:  # tensorboard is a dependency of labkit; a stripped environment may lack it
        raise ImportError("--tensorboard needs the tensorboard package: pip install tensorboard") from error
    return SummaryWriter(log_dir=str(path), flush_secs=flush_secs)


def _check_tags(values: dict[str, float]) -> None:
    unknown = set(values) - set(TAGS) - set(GPU_TAGS)
    if unknown:
        raise ValueError(f"unknown scalar tag(s) {sorted(unknown)}; the tags are {TAGS + GPU_TAGS}")


class RankLog:
    """This rank's TensorBoard run: :meth:`scalars` writes the step's values under ``train/<tag>``, :meth:`alarm`
    a divergence alarm as text under ``alarm`` (and as the scalar ``alarm/<kind>`` = 1, a mark on the charts)."""

    def __init__(self, directory: str | Path, rank: int | None = None, flush_secs: float = 5.0):
        self.rank = dist.rank() if rank is None else rank
        self.path = rank_directory(directory, self.rank)
        self.writer = _writer(self.path, flush_secs)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        _check_tags(values)
        for tag, value in values.items():
            self.writer.add_scalar(f"train/{tag}", float(value), step)

    def alarm(self, alarm) -> None:
        self.writer.add_text("alarm", alarm.message, alarm.step)
        self.writer.add_scalar(f"alarm/{alarm.kind}", 1.0, alarm.step)

    def close(self) -> None:
        self.writer.close()


def gather_scalars(values: dict[str, float], group=None) -> dict[int, dict[str, float]]:
    """Every rank's ``values`` (the same tags on every rank), by rank: one all-gather of a float64 per tag
    (collective over ``group``)."""
    tags = sorted(values)
    mine = torch.tensor([float(values[tag]) for tag in tags], dtype=torch.float64, device=dist.device())
    size = torch_dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    torch_dist.all_gather(gathered, mine, group=group)
    return {dist.global_rank(group, index): dict(zip(tags, row.tolist(), strict=True))
            for index, row in enumerate(gathered)}


def summarize(by_rank: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """``{"min": {tag: ...}, "mean": ..., "max": ..., "rank_of_max": {tag: rank}}`` over the ranks of ``by_rank``
    (a NaN on any rank makes that tag's statistics NaN: a broken rank is not averaged away)."""
    if not by_rank:
        raise ValueError("need the scalars of at least one rank, got none")
    tags = sorted(next(iter(by_rank.values())))
    summary: dict[str, dict[str, float]] = {name: {} for name in (*SUMMARY_RUNS, "rank_of_max")}
    for tag in tags:
        values = {rank: by_rank[rank][tag] for rank in sorted(by_rank)}
        if any(math.isnan(value) for value in values.values()):
            for name in summary:
                summary[name][tag] = math.nan
            continue
        summary["min"][tag], summary["max"][tag] = min(values.values()), max(values.values())
        summary["mean"][tag] = statistics.fmean(values.values())
        summary["rank_of_max"][tag] = max(values, key=lambda rank: values[rank])
    return summary


class SummaryLog:
    """Rank 0's summary of every rank (see the module docstring): three runs, ``DIR/min``, ``DIR/mean`` and
    ``DIR/max``, the tags under ``train/<tag>`` as :class:`RankLog` writes them, and in ``DIR/max`` the rank of the
    maximum under ``rank_of_max/<tag>``.  :meth:`scalars` is collective over ``group``; only rank 0 writes."""

    def __init__(self, directory: str | Path, group=None, flush_secs: float = 5.0):
        self.group = group
        self.writers = ({name: _writer(Path(directory) / name, flush_secs) for name in SUMMARY_RUNS}
                        if dist.rank() == 0 else {})

    def scalars(self, step: int, values: dict[str, float]) -> None:
        _check_tags(values)
        summary = summarize(gather_scalars(values, self.group))
        for name, writer in self.writers.items():
            for tag, value in summary[name].items():
                writer.add_scalar(f"train/{tag}", float(value), step)
        if self.writers:
            for tag, rank in summary["rank_of_max"].items():
                self.writers["max"].add_scalar(f"rank_of_max/{tag}", float(rank), step)

    def alarm(self, alarm) -> None:
        if self.writers:
            self.writers["max"].add_text("alarm", alarm.message, alarm.step)
            self.writers["max"].add_scalar(f"alarm/{alarm.kind}", 1.0, alarm.step)

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def read_scalars(directory: str | Path, runs: str = "rank-*") -> dict:
    """The scalars under ``directory`` as the logs wrote them, read with TensorBoard's own event reader: every
    rank's, ``{rank: {tag: [(step, value), ...]}}`` (tags without their ``train/`` prefix), or with
    ``runs="summary"`` the summary's, ``{"min" | "mean" | "max": {tag: [(step, value), ...]}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = [Path(directory) / name for name in SUMMARY_RUNS] if runs == "summary" else \
        sorted(Path(directory).glob(runs))
    found: dict = {}
    for run in folders:
        events = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        key = run.name if runs == "summary" else int(run.name.removeprefix("rank-"))
        found[key] = {tag.removeprefix("train/"): [(event.step, event.value) for event in events.Scalars(tag)]
                      for tag in events.Tags()["scalars"]}
    return found
