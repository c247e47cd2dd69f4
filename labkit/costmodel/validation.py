"""The step model held to published runs it was not fitted to: its few constants fitted on one set, tested on others.

:func:`labkit.costmodel.step.predict_step` prices each layer kernel by kernel (:mod:`labkit.costmodel.kernels`)
with three constants no datasheet gives: the fractions of the peak that large matrix products and a flash
attention kernel reach, and the fraction of the HBM bandwidth that the memory-bound operations reach
(:data:`EFFICIENCIES`).  Everything else comes from sources: the GPUs' peaks, bandwidths and SMs, the links,
NCCL's latencies, the slowdown of overlapped compute (:mod:`labkit.costmodel.hardware`), how each run was run
(:mod:`labkit.costmodel.published`, :mod:`~labkit.costmodel.published_fsdp`,
:mod:`~labkit.costmodel.published_recent`).  Constants fitted to the runs they are checked on say little, so
they are fitted on one set and scored on the others, beside the simplest rivals.

- *Fit set*: the Megatron-LM README's H100 model table (:data:`FIT_SET`, 9 rows).  :data:`EFFICIENCIES` is
  the least-squares fit of the predicted MFU to the measured one there (:func:`fit_kernels`; attention at
  most :data:`ATTENTION_CEILING`, FlashAttention-3's best), and nothing else is fitted.  Leave-one-out: each
  row predicted with the three fitted on the other 8 (:func:`leave_one_out`).
- *Held out but looked at* (:data:`HELD_OUT`): Narayanan et al. 2021's Table 1 (10 rows on A100s,
  recomputation, no flash attention), Llama 3's Table 4 (the 2 rows without context parallelism) and
  MosaicML's MPT table (20 FSDP rows on H100s).  None was fitted, but all were looked at: each was predicted by
  the earlier model (every FLOP at one efficiency, :data:`FLOP_EFFICIENCY`) before the kernel model was
  written, and MosaicML's was tried as a fit set while it was.
- *Unseen* (:data:`UNSEEN`): 25 rows of five sources published 2022-2024
  (:data:`~labkit.costmodel.published_recent.RECENT_RUNS`: torchtitan's bf16 tables on H100s and A100s,
  Korthikanti et al. 2022's full and selective recomputation, MT-NLG 530B, BLOOM 176B), transcribed by a
  rule fixed in advance and committed before any of them was predicted, after the kernel model, its three
  constants and how a published recomputation maps onto a layout were fixed.  The first prediction of them is
  the one the tests and lesson 11 print; nothing was changed after it.

For every set, the same scores:

- *Measured MFU*: the model's FLOPs (no recomputation, the causal mask not exploited: Megatron's count) per
  second over the GPUs' peak, from each row's printed throughput
  (:attr:`~labkit.costmodel.published.PublishedRun.model_mfu`).
- *Baselines*: (1) the **constant**: the fit set's mean measured MFU, predicting every run (for leave-one-out,
  the mean of the other 8); (2) the **constant hardware-FLOPs utilisation**: the same mean times each run's
  model FLOPs over the FLOPs it executes (3/4 of a layer's work under full recomputation), a constant that
  knows what recomputation costs and nothing else.
- *Scores*: root-mean-square error in MFU points; the share of rows within :data:`WITHIN_POINTS` (5) points;
  Spearman's rank correlation of predicted against measured MFU, compared with its one-sided 5 % critical
  value for the set's size (:data:`SPEARMAN_CRITICAL`; none for 2 rows).
- *The planner's choices* (:func:`planner_agreement`): Narayanan et al.'s rows planned with the options that
  study had (A100 nodes of 8, the interleaved schedule or 1F1B, recomputation, no ZeRO, micro-batches of one);
  a choice agrees when it is the published ``(t, p)`` or when the published ``(t, p)``'s best layout is
  predicted within :data:`AGREEMENT_MARGIN` (5 %) of it: a tie the model cannot resolve.
- *Scaling*: the README's strong-scaling figure (:func:`strong_scaling`) beside a flat line, and MPT's change of
  MFU with the GPUs (:func:`scaling_changes`) beside no change.

Lesson 11 claims exactly what passes, and says plainly what does not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from labkit.costmodel.calibration import rank_correlation
from labkit.costmodel.compute import GPUS, mfu, model_flops_per_step
from labkit.costmodel.experts import ep_all_to_all_s
from labkit.costmodel.kernels import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, MEMORY_EFFICIENCY
from labkit.costmodel.planner import Cluster, PlanResult, plan
from labkit.costmodel.published import (
    LLAMA3_405B,
    MEGATRON_STRONG_SCALING,
    MEGATRON_WEAK_SCALING,
    NARAYANAN_2021,
    PublishedRun,
    strong_scaling_run,
)
from labkit.costmodel.published_fsdp import MOSAIC_FSDP
from labkit.costmodel.published_recent import DEEPSEEK_V3, RECENT_RUNS
from labkit.costmodel.stages import Layout, weighted_stage_layers
from labkit.costmodel.step import StepTime, predict_step

FIT_SET = MEGATRON_WEAK_SCALING
# Llama 3's 131k row (cp = 16) stays out of the held-out scores: lesson 13 predicts it on its own.
HELD_OUT = {"Narayanan et al. 2021 (A100)": NARAYANAN_2021,
            "Llama 3 405B (H100)": tuple(run for run in LLAMA3_405B if run.cp == 1),
            "MosaicML MPT, FSDP (H100)": MOSAIC_FSDP}
UNSEEN = {"published 2022-2024 (unseen)": RECENT_RUNS}
Efficiencies = tuple[float, float, float]  # (matrices, attention, memory): labkit.costmodel.kernels.Kernels
# fit_kernels(FIT_SET) to 0.01 (tests/test_costmodel_kernels.py refits them), kept in labkit.costmodel.kernels
EFFICIENCIES: Efficiencies = (GEMM_EFFICIENCY, ATTENTION_EFFICIENCY, MEMORY_EFFICIENCY)
# The earlier model's one constant, every FLOP at one efficiency: fit_efficiency(FIT_SET) to 0.001
FLOP_EFFICIENCY = 0.530
# The most of the peak a flash-attention kernel is allowed: FlashAttention-3's best on an H100, "up to 740 TFLOPs/s
# (75% utilization)" (Shah et al. 2024, arXiv 2407.08608, abstract)
ATTENTION_CEILING = 0.75
# One-sided 5 % critical values of Spearman's rho (Zar 1972, "Significance testing of the Spearman rank
# correlation coefficient", JASA 67, table 1: exact for n <= 10)
SPEARMAN_CRITICAL = {9: 0.600, 10: 0.564, 20: 0.380, 25: 0.337}
AGREEMENT_MARGIN = 0.05
WITHIN_POINTS = 5.0  # a prediction "within 5 points" of the measured MFU (issue 41's target: 70 % of the rows)


def predict(run: PublishedRun, efficiency: float | Efficiencies = EFFICIENCIES
            ) -> tuple[StepTime, float]:
    """labkit's predicted step of ``run`` at its published layout, run as it was run, and the MFU it implies."""
    step = predict_step(run.shape(), run.layout(), run.global_batch, run.cluster(efficiency).hardware(),
                        overlap_dp=run.overlap_dp, stage_layers=run.stage_layers, **run.step_options())
    return step, mfu(run.model_flops(), step.step_s, run.gpus, GPUS[run.gpu].peak_bf16_flops)


def squared_error(efficiency: float | Efficiencies, runs: Iterable[PublishedRun]) -> float:
    """The sum over ``runs`` of (predicted MFU - measured MFU)^2."""
    return sum((predict(run, efficiency)[1] - run.model_mfu) ** 2 for run in runs)


def fit_efficiency(runs: Iterable[PublishedRun], low: float = 0.3, high: float = 1.0, tolerance: float = 1e-4
                   ) -> float:
    """The least-squares efficiency over ``runs``, by golden-section search on ``[low, high]`` (the error is
    unimodal in it: a faster matrix only shortens a step)."""
    runs = list(runs)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    error_a, error_b = squared_error(a, runs), squared_error(b, runs)
    while high - low > tolerance:
        if error_a < error_b:
            high, b, error_b = b, a, error_a
            a = high - ratio * (high - low)
            error_a = squared_error(a, runs)
        else:
            low, a, error_a = a, b, error_b
            b = low + ratio * (high - low)
            error_b = squared_error(b, runs)
    return (low + high) / 2


def fit_kernels(runs: Iterable[PublishedRun], start: Efficiencies = (0.6, 0.5, 0.5), step: float = 0.1,
                tolerance: float = 0.002) -> Efficiencies:
    """The least-squares ``(matrices, attention, memory)`` efficiencies over ``runs``: a pattern search from
    ``start``, each efficiency moved by ``step`` up and down while that lowers the error, ``step`` halved when
    none does, until it is under ``tolerance``.  Each stays in ``(0, 1]``, attention's at most
    :data:`ATTENTION_CEILING`."""
    runs = list(runs)
    ceilings = (1.0, ATTENTION_CEILING, 1.0)
    best = tuple(start)
    error = squared_error(best, runs)
    while step >= tolerance:
        moved = False
        for index in range(3):
            for sign in (1, -1):
                trial = list(best)
                trial[index] = min(ceilings[index], max(tolerance, trial[index] + sign * step))
                candidate = squared_error(tuple(trial), runs)
                if candidate < error:
                    best, error, moved = tuple(trial), candidate, True
        if not moved:
            step /= 2
    return best  # type: ignore[return-value]


def _rms(errors: Sequence[float]) -> float:
    return math.sqrt(sum(error ** 2 for error in errors) / len(errors))


def executed_ratio(run: PublishedRun) -> float:
    """The model's FLOPs over the FLOPs the run executes (recomputation reruns every layer's forward)."""
    shape = run.shape()
    return model_flops_per_step(shape, run.global_batch) / model_flops_per_step(shape, run.global_batch,
                                                                                 recompute=run.recompute)


@dataclass(frozen=True)
class Score:
    """One set's predictions beside its measurements and the two baselines (MFU as fractions)."""

    name: str
    runs: tuple[PublishedRun, ...]
    predicted: tuple[float, ...]
    measured: tuple[float, ...]
    constant: tuple[float, ...]  # baseline 1
    hardware_constant: tuple[float, ...]  # baseline 2

    @property
    def rms(self) -> float:
        return _rms([p - m for p, m in zip(self.predicted, self.measured, strict=True)])

    @property
    def constant_rms(self) -> float:
        return _rms([c - m for c, m in zip(self.constant, self.measured, strict=True)])

    @property
    def hardware_constant_rms(self) -> float:
        return _rms([c - m for c, m in zip(self.hardware_constant, self.measured, strict=True)])

    @property
    def rank_correlation(self) -> float | None:
        return rank_correlation(list(self.predicted), list(self.measured)) if len(self.runs) > 2 else None

    @property
    def critical(self) -> float | None:
        return SPEARMAN_CRITICAL.get(len(self.runs))

    @property
    def orders_the_runs(self) -> bool:
        rho, critical = self.rank_correlation, self.critical
        return rho is not None and critical is not None and rho >= critical

    def within(self, points: float = WITHIN_POINTS) -> float:
        """The share of the rows predicted within ``points`` MFU points of their measurement."""
        return sum(abs(p - m) <= points / 100 for p, m in zip(self.predicted, self.measured, strict=True)) \
            / len(self.runs)

    @property
    def beats_constant(self) -> bool:
        return self.rms < self.constant_rms

    @property
    def beats_hardware_constant(self) -> bool:
        return self.rms < self.hardware_constant_rms


def score(name: str, runs: Sequence[PublishedRun], efficiency: float | Efficiencies = EFFICIENCIES,
          fit_mean: float | None = None) -> Score:
    """``runs`` predicted at ``efficiency``, beside the baselines built on ``fit_mean`` (default the fit set's
    mean measured MFU)."""
    mean = sum(run.model_mfu for run in FIT_SET) / len(FIT_SET) if fit_mean is None else fit_mean
    return Score(name, tuple(runs), tuple(predict(run, efficiency)[1] for run in runs),
                 tuple(run.model_mfu for run in runs), tuple(mean for _ in runs),
                 tuple(mean * executed_ratio(run) for run in runs))


def held_out(efficiency: float | Efficiencies = EFFICIENCIES) -> list[Score]:
    """Each held-out set, scored (module docstring)."""
    return [score(name, runs, efficiency) for name, runs in HELD_OUT.items()]


def unseen(efficiency: float | Efficiencies = EFFICIENCIES) -> Score:
    """The unseen set, scored (module docstring)."""
    (name, runs), = UNSEEN.items()
    return score(name, runs, efficiency)


def scaling_changes(scored: Score) -> list[tuple[str, float, float]]:
    """For each model size of ``scored`` timed on more than one GPU count: ``(size, predicted change, measured
    change)`` of MFU from its fewest GPUs to its most (module docstring)."""
    sizes: dict[str, list[int]] = {}
    for index, run in enumerate(scored.runs):
        sizes.setdefault(run.parameters, []).append(index)
    changes = []
    for size, rows in sizes.items():
        if len({scored.runs[k].gpus for k in rows}) < 2:
            continue
        fewest = min(rows, key=lambda k: scored.runs[k].gpus)
        most = max(rows, key=lambda k: scored.runs[k].gpus)
        changes.append((size, scored.predicted[most] - scored.predicted[fewest],
                        scored.measured[most] - scored.measured[fewest]))
    return changes


@dataclass(frozen=True)
class StrongScaling:
    """The README's strong-scaling figure beside the model and the constant (MFU as fractions, by GPUs)."""

    gpus: tuple[int, ...]
    steps: tuple[StepTime, ...]
    predicted: tuple[float, ...]
    measured: tuple[float, ...]
    constant: float

    @property
    def rms(self) -> float:
        return _rms([p - m for p, m in zip(self.predicted, self.measured, strict=True)])

    @property
    def constant_rms(self) -> float:
        return _rms([self.constant - m for m in self.measured])

    @property
    def predicted_drop(self) -> float:
        return self.predicted[0] - self.predicted[-1]

    @property
    def measured_drop(self) -> float:
        return self.measured[0] - self.measured[-1]


def strong_scaling(efficiency: float | Efficiencies = EFFICIENCIES) -> StrongScaling:
    """Each point of the README's strong-scaling figure predicted at the model table's 177B layout
    (:func:`~labkit.costmodel.published.strong_scaling_run`), beside the fit set's mean MFU."""
    predicted = [predict(strong_scaling_run(point), efficiency) for point in MEGATRON_STRONG_SCALING]
    mean = sum(run.model_mfu for run in FIT_SET) / len(FIT_SET)
    return StrongScaling(tuple(point.gpus for point in MEGATRON_STRONG_SCALING), tuple(s for s, _ in predicted),
                         tuple(value for _, value in predicted),
                         tuple(point.mfu for point in MEGATRON_STRONG_SCALING), mean)


def leave_one_out(runs: Sequence[PublishedRun] = FIT_SET) -> Score:
    """Each of ``runs`` predicted with the efficiencies fitted on the others (:func:`fit_kernels`, started from
    the whole set's fit), beside the others' mean."""
    predicted, constant = [], []
    for index, run in enumerate(runs):
        others = [other for k, other in enumerate(runs) if k != index]
        predicted.append(predict(run, fit_kernels(others, EFFICIENCIES, step=0.02))[1])
        constant.append(sum(other.model_mfu for other in others) / len(others))
    return Score("leave-one-out on the fit set", tuple(runs), tuple(predicted),
                 tuple(run.model_mfu for run in runs), tuple(constant),
                 tuple(c * executed_ratio(run) for c, run in zip(constant, runs, strict=True)))


# --------------------------------------------------------------------------------------------------------
# The planner beside the held-out study's choices


NARAYANAN_OPTIONS = {"micro_batches": (1,), "schedules": ("interleaved", "1f1b"), "zero_stages": (0,),
                     "recompute": (True,)}


@dataclass(frozen=True)
class Agreement:
    """The planner's best layout for a published run, and the best with the published ``(t, p)``."""

    run: PublishedRun
    result: PlanResult
    published: StepTime | None  # the published (t, p)'s best layout, if it fits
    published_memory: float  # bytes on the fullest GPU of the published layout as run

    @property
    def picked(self) -> tuple[int, int] | None:
        best = self.result.best
        return None if best is None else (best.layout.tp, best.layout.pp)

    @property
    def same(self) -> bool:
        return self.picked == (self.run.tp, self.run.pp)

    @property
    def slower(self) -> float | None:
        """How much longer the published ``(t, p)``'s best step is than the planner's best (a fraction)."""
        if self.published is None or self.result.best is None:
            return None
        return self.published.step_s / self.result.best.step.step_s - 1

    @property
    def agrees(self) -> bool:
        return self.same or (self.slower is not None and self.slower <= AGREEMENT_MARGIN)


def planner_agreement(run: PublishedRun, efficiency: float | Efficiencies = EFFICIENCIES, **choices) -> Agreement:
    """Plan ``run``'s model, GPUs and batch with its study's options (:data:`NARAYANAN_OPTIONS` by default) and
    run as it was run; then the same search restricted to the published ``(t, p)``."""
    options = (NARAYANAN_OPTIONS | choices) if choices or run in NARAYANAN_2021 else choices
    cluster = run.cluster(efficiency)
    run_as = run.plan_options() | {"overlap_dp": run.overlap_dp}
    result = plan(run.shape(), cluster, run.global_batch, top=1, **run_as, **options)
    mine = plan(run.shape(), cluster, run.global_batch, top=1, tensor_parallel=(run.tp,),
                pipeline_parallel=(run.pp,), **run_as, **options)
    return Agreement(run, result, None if mine.best is None else mine.best.step, run.memory()["total"])


# --------------------------------------------------------------------------------------------------------
# A mixture of experts held out: DeepSeek-V3's pre-training throughput


def deepseek_v3(efficiency: Efficiencies = EFFICIENCIES, fp8_products: bool = False, micro_batch: int = 1
                ) -> tuple[StepTime, float]:
    """DeepSeek-V3's pre-training step at its published layout (:data:`~labkit.costmodel.published_recent.DEEPSEEK_V3`:
    2,048 H800s, 16 pipeline stages under DualPipe, here labkit's DualPipeV, 32 chunks split as torchtitan
    splits 61 layers; expert parallelism over 64 GPUs with node-limited routing, ZeRO-1 over the replicas, no TP;
    sequences of 4,096 tokens, the batch of 15,360 after its ramp, micro-batches of ``micro_batch``, not
    published), and the GPU hours per trillion tokens it implies.  labkit prices 16-bit products; DeepSeek-V3
    ran most of them in FP8 (``fp8_products``: the products' peak doubled, FP8's dense rate on Hopper, attention
    and everything else as before; and the dispatch all-to-alls, forward and backward, at one byte a value, the
    combines in bf16, as its section 3.3 "Low-Precision Storage and Communication" sends them), and DualPipe
    overlaps the all-to-alls with another micro-batch's compute where labkit's schedules leave them on the
    critical path: the two caveats go in opposite directions."""
    run = DEEPSEEK_V3
    shape = run.shape()
    cluster = Cluster(GPUS[run.gpu], run.gpus, *efficiency)
    hardware = cluster.hardware()
    if fp8_products:
        hardware = dataclasses.replace(hardware, kernels=dataclasses.replace(
            hardware.kernels, peak_flops=2 * hardware.kernels.peak_flops))
    chunks = 2 * run.pp
    layout = Layout(run.dp, run.tp, run.pp, run.zero, micro_batch, schedule="dualpipev", virtual_stages=2,
                    ep=run.ep, stage_layers=weighted_stage_layers(shape.num_layers, chunks))
    step = predict_step(shape, layout, run.global_batch, hardware, gradient_bytes=4)
    if fp8_products:  # two of each MoE layer's four all-to-alls at 1 byte a value, two at 2
        bf16 = ep_all_to_all_s(shape, layout, hardware, 2)
        fp8 = ep_all_to_all_s(shape, layout, hardware, 1)
        step = dataclasses.replace(step, ep_s=step.ep_s * (fp8 + bf16) / (2 * bf16))
    tokens = run.global_batch * run.seq_len
    return step, run.gpus * step.step_s / 3600 * 1e12 / tokens
