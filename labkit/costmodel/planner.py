"""``plan(shape, cluster, global_batch)``: every 3D configuration that fits, ranked by predicted step time.

The choice a team makes before a large run (lesson 11): how many ways of tensor parallelism ``t``, pipeline
stages ``p`` and data-parallel replicas ``d = N / (t p)``; ZeRO's stage over ``d``; the micro-batch ``b``;
activation recomputation; and the schedule.  Narayanan et al. 2021 (section 3.3) give rules of thumb: ``t`` up
to the GPUs of one node, ``p`` as large as the model needs to fit, then ``d`` for the rest, ``b`` small when
``m`` must stay large.  The planner checks them by its own numbers instead:

1. **enumerate** every ``(t, p, zero, b, recompute, schedule)`` whose degrees divide what they split: ``t`` the
   heads (and key/value heads), ``p`` (times ``v``) the layers, ``d`` the global batch, ``b`` a replica's
   share; FSDP only with GPipe or 1F1B (as :func:`labkit.parallel.parallelize.check_3d` refuses otherwise);
2. **fit**: the memory per GPU (:func:`labkit.costmodel.memory.memory_per_rank` with these degrees, plus the
   activations the first stage holds: ``min(m, p)`` micro-batches of its ``L / p`` layers under 1F1B and ZB-H1,
   ``m`` under GPipe, ``p + (p - 1) / v``-ish under interleaving, counted as ``min(m, p) + 1``; sequence
   parallelism with TP; Korthikanti et al. 2022) must not exceed the device's memory;
3. **rank** by :func:`labkit.costmodel.step.predict_step`.  Placing every candidate's schedule in time would
   take minutes at thousands of GPUs, so each is first bounded from below by its closed-form makespan
   (:func:`~labkit.costmodel.step.closed_form_makespan`: free sends), and only candidates whose bound beats the
   ``top``-th best exact time so far are simulated: the top of the ranking is exact, not estimated.

``efficiency`` is the fraction of the device's peak its matrix multiplications reach: the one calibration
constant (``labkit doctor`` measures it on this machine; for published runs lesson 11 fits it once).
When nothing fits, :class:`PlanResult` says why: the smallest memory per GPU any candidate needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.costmodel import hardware
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPU, mfu, model_flops_per_step
from labkit.costmodel.memory import TransformerShape, activation_bytes, memory_per_rank, num_parameters
from labkit.costmodel.step import Hardware, Layout, StepTime, closed_form_makespan, predict_step, stage_times

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1")


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` GPUs of one kind: its peak and links (:data:`labkit.costmodel.compute.GPUS`), the fraction
    ``efficiency`` of the peak its matrices reach, and each link's latency."""

    gpu: GPU
    num_gpus: int
    efficiency: float = 0.5
    intra_latency_s: float = hardware.NVLINK_LATENCY_S
    inter_latency_s: float = hardware.INFINIBAND_LATENCY_S

    def __post_init__(self) -> None:
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"num_gpus must be an integer >= 1, got {self.num_gpus!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        if self.gpu.nvlink_bandwidth <= 0 or self.gpu.network_bandwidth <= 0:
            raise ValueError(f"{self.gpu.name} has no link bandwidths: give nvlink_bandwidth and network_bandwidth")

    def hardware(self) -> Hardware:
        return Hardware(self.efficiency * self.gpu.peak_bf16_flops,
                        LinkModel(self.intra_latency_s, 1 / self.gpu.nvlink_bandwidth),
                        LinkModel(self.inter_latency_s, 1 / self.gpu.network_bandwidth), self.gpu.gpus_per_node)


@dataclass(frozen=True)
class Candidate:
    """One ranked configuration: its layout, predicted step (each term apart), memory per GPU and MFU."""

    layout: Layout
    step: StepTime
    memory: dict[str, float]
    mfu: float
    tokens_per_s: float


@dataclass
class PlanResult:
    """The ranked candidates that fit (fastest first), how many were considered, and when none fits, why."""

    candidates: list[Candidate]
    considered: int
    fitting: int
    smallest_memory: float | None = None  # bytes per GPU the least hungry candidate needed
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def reason(self) -> str:
        if self.candidates:
            return f"{self.fitting} of {self.considered} configurations fit"
        if self.smallest_memory is None:
            return "no configuration divides this model, batch and number of GPUs: " + "; ".join(self.notes)
        return (f"nothing fits: the least memory any of the {self.considered} configurations needs is "
                f"{self.smallest_memory / 1e9:.1f} GB per GPU")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layout_memory(shape: TransformerShape, layout: Layout, global_batch: int, sequence_parallel: bool = True,
                  flash_attention: bool = False, dropout: bool = True) -> dict[str, float]:
    """Bytes per GPU of ``layout`` (mixed precision and Adam): model states, and the first stage's activations
    (``flash_attention``, ``dropout``: as :func:`labkit.costmodel.memory.activation_bytes`).  With
    recomputation each held micro-batch keeps its layers' inputs, and only the one layer being rebuilt holds
    its whole activations."""
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m = global_batch // (d * b)
    held = {"gpipe": m, "interleaved": min(m, p) + 1}.get(layout.schedule, min(m, p))
    options = {"tp_degree": t, "sequence_parallel": sequence_parallel and t > 1, "dropout": dropout,
               "flash_attention": flash_attention}
    whole = activation_bytes(shape, b, checkpointing=layout.recompute, layers=shape.num_layers // p, **options)
    if layout.recompute:  # the rebuilt layer once, not once per micro-batch held
        rebuilt = activation_bytes(shape, b, layers=1, **options)
        activations = held * (whole - rebuilt) + rebuilt
    else:
        activations = held * whole
    return memory_per_rank(num_parameters(shape), "mixed", "adam", layout.zero, d, t, p, activations)


def candidates(shape: TransformerShape, num_gpus: int, global_batch: int, micro_batches=(1, 2, 4, 8),
               schedules=SCHEDULES, zero_stages=(0, 1, 2, 3), recompute=(False, True),
               virtual_stages: int | tuple[int, ...] = 2) -> list[Layout]:
    """Every layout whose degrees divide what they split (see the module docstring); ``virtual_stages``: the
    interleaved schedule's stages per rank to try (one or several)."""
    interleavings = (virtual_stages,) if isinstance(virtual_stages, int) else tuple(virtual_stages)
    found = []
    for t in _divisors(num_gpus):
        if shape.num_heads % t or shape.num_kv_heads % t:
            continue
        for p in _divisors(num_gpus // t):
            d = num_gpus // (t * p)
            if shape.num_layers % p or global_batch % d:
                continue
            for b in micro_batches:
                if (global_batch // d) % b:
                    continue
                m = global_batch // (d * b)
                for schedule in schedules:
                    if schedule != "1f1b" and p == 1:
                        continue  # one stage: every schedule is the same gradient accumulation
                    for v in interleavings if schedule == "interleaved" else (1,):
                        if schedule == "interleaved" and (shape.num_layers % (p * v) or m % p):
                            continue
                        for zero in zero_stages:
                            if zero == 3 and schedule in ("interleaved", "zb-h1"):
                                continue
                            found += [Layout(d, t, p, zero, b, r, schedule, v) for r in recompute]
    return found


def plan(shape: TransformerShape, cluster: Cluster, global_batch: int, top: int = 10, flash_attention: bool = False,
         dropout: bool = True, gradient_bytes: int | None = None, overlap_gather: bool = False, **choices
         ) -> PlanResult:
    """The ``top`` fastest configurations of ``shape`` on ``cluster`` for a step of ``global_batch`` sequences
    that fit in the device's memory, exactly ranked by :func:`~labkit.costmodel.step.predict_step`
    (``choices``: :func:`candidates`' keyword arguments; ``flash_attention`` and ``dropout`` go to the memory
    model, :func:`layout_memory`; ``gradient_bytes`` (4: gradients reduced in fp32, as Megatron does under
    bf16) and ``overlap_gather`` to the step model)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    layouts = candidates(shape, cluster.num_gpus, global_batch, **choices)
    hardware = cluster.hardware()
    fitting, smallest = [], math.inf
    for layout in layouts:
        memory = layout_memory(shape, layout, global_batch, flash_attention=flash_attention, dropout=dropout)
        smallest = min(smallest, memory["total"])
        if memory["total"] <= cluster.gpu.memory_bytes:
            fitting.append((layout, memory))
    notes = [] if layouts else [f"{cluster.num_gpus} GPUs, {shape.num_heads} heads, {shape.num_layers} layers, "
                                f"global batch {global_batch}"]
    # A lower bound for each (free sends, no exposed DP): the exact model runs only where the bound could win.
    bounded = [(_lower_bound(shape, layout, global_batch, hardware), layout, memory) for layout, memory in fitting]
    bounded.sort(key=lambda entry: entry[0])
    flops = model_flops_per_step(shape, global_batch)
    ranked: list[Candidate] = []
    for bound, layout, memory in bounded:
        if len(ranked) >= top and bound >= ranked[top - 1].step.step_s:
            break
        step = predict_step(shape, layout, global_batch, hardware, gradient_bytes=gradient_bytes,
                            overlap_gather=overlap_gather)
        ranked.append(Candidate(layout, step, memory, mfu(flops, step.step_s, cluster.num_gpus,
                                                          cluster.gpu.peak_bf16_flops),
                                global_batch * shape.seq_len / step.step_s))
        ranked.sort(key=lambda candidate: candidate.step.step_s)
    return PlanResult(ranked[:top], len(layouts), len(fitting), None if fitting or not layouts else smallest, notes)


def _lower_bound(shape: TransformerShape, layout: Layout, global_batch: int, hardware: Hardware) -> float:
    """The step without sends, DP or ZeRO: each stage's compute and TP in the closed-form pipeline."""
    m, v, forward, backward, tp_forward, tp_backward = stage_times(shape, layout, global_batch, hardware)
    return closed_form_makespan(layout.schedule if layout.pp > 1 else "1f1b", layout.pp, m, forward + tp_forward,
                                backward + tp_backward, v)
