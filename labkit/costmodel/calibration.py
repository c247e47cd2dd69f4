"""This machine's constants for the cost model: what ``labkit doctor`` measures, saved for the predictions.

A GPU's preset (:data:`labkit.costmodel.compute.GPUS`) gives its datasheet peak and links; a laptop has none,
and a tiny model on a CPU is far from any peak anyway.  So lesson 11 predicts its CPU runs from constants
measured here, by :func:`labkit.calibrate.calibrate`:

- **compute**: one rank's forward and backward of a :class:`~labkit.models.TinyGPT` on one thread, timed at
  several micro-batch sizes and two depths, fitted as ``seconds = FLOPs / flops + layers * layer_overhead_s +
  pass_overhead_s`` (times 1 for a forward, 2 for a backward): the FLOP rate of the matrices, the fixed cost of
  each layer's operations and that of a pass;
- **links**: the alpha-beta of one ring step over gloo with ``ranks`` ranks sending at once
  (:func:`labkit.measure.measure_alpha_beta`), the way the ring collectives load the loopback, and of an
  all-reduce between two ranks amid compute; each below ``copy_bytes_per_s``, the rate at which one thread
  copies the largest message timed (:func:`labkit.measure.measure_copy_bandwidth`): a loopback send copies each
  byte at least twice, so a link fitted faster than one copy is noise read as a bandwidth, and is refused here
  as in the fit;
- **optimizer**: AdamW's step, seconds per parameter;
- **cores**: the processor cores the ranks share (the simulator's processor sharing), the compute ``n`` busy
  ranks get from them together (``throughput``), and how much longer than their mean the slowest of ``g`` of
  them takes for the same forward and backward (``straggle``: what a synchronisation of ``g`` ranks waits for).

:meth:`Calibration.hardware` turns them into the :class:`~labkit.costmodel.step.Hardware` that
:func:`~labkit.costmodel.step.predict_step` and :func:`~labkit.costmodel.simulator.simulate_step` take.  They
are saved as JSON in ``~/.cache/labkit/calibration.json`` (or ``$LABKIT_CALIBRATION``).
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.costmodel.simulator import SimulatedStep, simulate_step
from labkit.costmodel.step import Hardware, Layout


@dataclass(frozen=True)
class Calibration:
    """Constants measured on one machine (see the module docstring); times in seconds."""

    flops: float  # FLOP/s of one rank's passes on one thread
    layer_overhead_s: float  # fixed seconds per layer and forward (twice per backward)
    alpha_s: float  # one ring step's latency over gloo
    beta_s_per_byte: float  # ... and its seconds per byte
    optimizer_s_per_parameter: float  # AdamW's step
    cores: int  # processor cores the ranks share
    ranks: int  # how many ranks sent at once when the links were measured
    machine: str = ""
    loaded_alpha_s: float = 0.0  # an all-reduce between 2 ranks while every rank computes around it
    loaded_beta_s_per_byte: float = 0.0
    throughput: tuple[float, ...] = ()  # [n - 1]: the cores' worth of compute n busy ranks get together
    straggle: tuple[float, ...] = ()  # [g - 1]: the slowest of g of the busy ranks over their mean
    pass_overhead_s: float = 0.0  # fixed seconds per forward pass whatever its layers (twice per backward)
    copy_bytes_per_s: float = 0.0  # one thread's copy of the largest message timed: no link is faster (0: unmeasured)

    def __post_init__(self) -> None:
        object.__setattr__(self, "throughput", tuple(self.throughput))  # JSON gives a list
        object.__setattr__(self, "straggle", tuple(self.straggle))
        if self.flops <= 0 or self.cores < 1 or self.ranks < 2:
            raise ValueError(f"a calibration needs flops > 0, cores >= 1 and ranks >= 2, got {self.flops!r}, "
                             f"{self.cores!r} and {self.ranks!r}")
        if min(self.layer_overhead_s, self.pass_overhead_s, self.alpha_s, self.loaded_alpha_s,
               self.loaded_beta_s_per_byte, self.optimizer_s_per_parameter, self.copy_bytes_per_s) < 0:
            raise ValueError(f"measured times and rates must be >= 0, got {self}")
        loaded = self.loaded_alpha_s or self.loaded_beta_s_per_byte  # 0 and 0: not measured
        if self.beta_s_per_byte <= 0 or (loaded and self.loaded_beta_s_per_byte <= 0):
            raise ValueError(f"a link's seconds per byte must be > 0 (an infinite bandwidth is a flat fit, not a "
                             f"link), got {self.beta_s_per_byte!r} and, amid compute, {self.loaded_beta_s_per_byte!r}")
        for name, link in (("the gloo ring step", self.link), ("the all-reduce amid compute", self.loaded_link)):
            if self.copy_bytes_per_s and link.bandwidth_bytes_per_s > self.copy_bytes_per_s:
                raise ValueError(f"{name} at {link.bandwidth_bytes_per_s / 1e9:.1f} GB/s (beta "
                                 f"{link.beta_s_per_byte:.3g} s/B) is faster than this machine copies memory "
                                 f"({self.copy_bytes_per_s / 1e9:.1f} GB/s, one thread), which a loopback send "
                                 "cannot be; run `labkit doctor` to measure it again")

    @property
    def link(self) -> LinkModel:
        return LinkModel(self.alpha_s, self.beta_s_per_byte)

    @property
    def loaded_link(self) -> LinkModel:
        """The collective as the runs see it: between ranks that compute around it (and a peer that may not be
        running when it arrives); the plain ring step where it was not measured."""
        if not self.loaded_alpha_s and not self.loaded_beta_s_per_byte:
            return self.link
        return LinkModel(self.loaded_alpha_s, self.loaded_beta_s_per_byte)

    def hardware(self) -> Hardware:
        """One host: every rank on these cores (their measured curve when there is one), and the loaded link
        for every group (all of them cross the same loopback, amid the same compute)."""
        return Hardware(self.flops, self.loaded_link, self.loaded_link, gpus_per_node=1 << 20,
                        cores=self.throughput or self.cores, layer_overhead_s=self.layer_overhead_s,
                        straggle=self.straggle, pass_overhead_s=self.pass_overhead_s)

    def optimizer_s(self, parameters: float) -> float:
        return self.optimizer_s_per_parameter * parameters

    def simulate(self, shape: TransformerShape, layout: Layout, global_batch: int, value_bytes: int = 4,
                 overlap_dp: bool = False) -> SimulatedStep:
        """One step of ``layout`` on this machine's ranks, as ``labkit.train`` runs it by default (fp32, the DP
        reduction after the schedule, AdamW over each rank's weights)."""
        optimizer = self.optimizer_s(num_parameters(shape) / (layout.tp * layout.pp))
        return simulate_step(shape, layout, global_batch, self.hardware(), value_bytes=value_bytes,
                             overlap_dp=overlap_dp, optimizer_s=optimizer)

    def describe(self) -> str:
        shared = f" ({self.ranks} busy ranks get {self.throughput[-1]:.2f})" if self.throughput else ""
        if self.straggle:
            shared += f", the slowest of {len(self.straggle)} {self.straggle[-1]:.2f}x their mean"
        loaded = self.loaded_link
        copy = (f", both below one thread's memory copy at {self.copy_bytes_per_s / 1e9:.1f} GB/s (no loopback "
                "send can beat it)" if self.copy_bytes_per_s else ", memory copy not measured (an older labkit's)")
        return (f"{self.flops / 1e9:.1f} GFLOP/s per rank (one thread) + {1e6 * self.layer_overhead_s:.0f} us per "
                f"layer and {1e6 * self.pass_overhead_s:.0f} us per pass, forward; {self.cores} cores{shared}; "
                f"gloo ring step alpha {1e6 * self.alpha_s:.0f} us, "
                f"{1 / self.beta_s_per_byte / 1e9:.2f} GB/s ({self.ranks} ranks at once), amid compute alpha "
                f"{1e6 * loaded.alpha_s:.0f} us, {1 / loaded.beta_s_per_byte / 1e9:.2f} GB/s{copy}; AdamW "
                f"{1e9 * self.optimizer_s_per_parameter:.1f} ns per parameter")


def average(calibrations: list[Calibration]) -> Calibration:
    """One machine's calibrations, measured around a run (before it and after), as one: each time constant's
    mean (the FLOP rate's harmonic mean: it is a time per FLOP that adds up; the copy rate's mean over those
    that measured it), the curves point by point.  A machine whose speed drifts while the run is timed is then
    predicted at the speed of the whole window.  Each link stays below the copy rate: the mean of betas each
    at least ``1/copy`` is at least the mean of ``1/copy``, which is at least ``1/mean(copy)``."""
    if not calibrations:
        raise ValueError("average needs at least one calibration")
    values = {}
    for item in fields(Calibration):
        measured = [getattr(calibration, item.name) for calibration in calibrations]
        if item.name == "flops":
            values[item.name] = statistics.harmonic_mean(measured)
        elif item.name == "copy_bytes_per_s":
            values[item.name] = statistics.fmean([rate for rate in measured if rate] or [0.0])
        elif isinstance(measured[0], float):
            values[item.name] = statistics.fmean(measured)
        elif isinstance(measured[0], tuple) and all(len(m) == len(measured[0]) for m in measured):
            values[item.name] = tuple(map(statistics.fmean, zip(*measured, strict=True)))
        else:  # the machine, its cores and ranks; curves of different lengths: the first calibration's
            values[item.name] = measured[0]
    return Calibration(**values)


def default_path() -> Path:
    """Where ``labkit doctor`` saves the calibration: ``$LABKIT_CALIBRATION``, else ``~/.cache/labkit/``."""
    configured = os.environ.get("LABKIT_CALIBRATION")
    return Path(configured) if configured else Path.home() / ".cache" / "labkit" / "calibration.json"


def save(calibration: Calibration, path: Path | str | None = None) -> Path:
    target = Path(path) if path is not None else default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(calibration), indent=2) + "\n")
    return target


def load(path: Path | str | None = None) -> Calibration | None:
    """The saved calibration, or ``None`` when there is none (run ``labkit doctor``).  A file that does not
    parse as one raises ``ValueError`` naming it."""
    source = Path(path) if path is not None else default_path()
    if not source.exists():
        return None
    try:
        return Calibration(**json.loads(source.read_text()))
    except (TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{source} is not a labkit calibration ({error}); run `labkit doctor` to redo it") from error


def rank_correlation(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties get their mean rank): 1 when both order
    the items alike, -1 when one reverses the other."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"rank_correlation needs two lists of the same length >= 2, got {len(xs)} and {len(ys)}")

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
                end += 1
            for position in range(start, end + 1):
                result[order[position]] = (start + end) / 2
            start = end + 1
        return result

    a, b = ranks(xs), ranks(ys)
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    covariance = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b, strict=True))
    spread = (sum((x - mean_a) ** 2 for x in a) * sum((y - mean_b) ** 2 for y in b)) ** 0.5
    return covariance / spread if spread else 0.0
