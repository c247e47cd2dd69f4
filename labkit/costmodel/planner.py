"""``plan(shape, cluster, global_batch)``: every 3D configuration that fits, ranked by predicted step time.

The choice a team makes before a large run (lesson 11): how many ways of tensor parallelism ``t``, pipeline
stages ``p`` and data-parallel replicas ``d = N / (t p)``; ZeRO's stage over ``d``; the micro-batch ``b``;
activation recomputation; and the schedule (interleaving with any ``v`` that divides a stage's layers).
Narayanan et al. 2021 (section 3.3) give rules of thumb: ``t`` up to the GPUs of one node, ``p`` as large as
the model needs to fit, then ``d`` for the rest, ``b`` small when ``m`` must stay large.  The planner checks
them by its own numbers instead:

1. **enumerate** every ``(t, p, zero, b, recompute, schedule, v)`` whose degrees divide what they split: ``t``
   the heads (and key/value heads), ``p v`` the layers, ``d`` the global batch, ``b`` a replica's share;
   FSDP only with GPipe or 1F1B (as :func:`labkit.parallel.parallelize.check_3d` refuses otherwise);
2. **fit**: the memory of the fullest GPU (:func:`~labkit.costmodel.rank_memory.layout_memory`: the first pipeline rank holds the embedding
   and the most micro-batches in flight, the last the output layer and the logits) must stay under the
   device's memory less :data:`MEMORY_MARGIN`;
3. **rank** by :func:`labkit.costmodel.step.predict_step`.  Placing every candidate's schedule in time would
   take minutes at thousands of GPUs, so each is first bounded from below (free sends, no DP or ZeRO, each
   stage's work and the schedule's closed form at the lightest stage's pace), and only candidates whose bound
   beats the ``top``-th best exact time so far are simulated: the top of the ranking is exact, not estimated.

**What a plan counts at the peak of memory.**  Lesson 04 measures a mixed-precision step's model states at
their peak: 20 bytes a parameter, the 16 held between steps and the optimizer's fp32 copy of the gradients
(:func:`~labkit.costmodel.memory.memory_per_rank` with ``peak=True``; ``gradient_bytes=4`` for frameworks
that accumulate in fp32 and step those directly, 18).  A step accumulates every micro-batch's gradients before
its one reduction, so under ZeRO-2 and FSDP each rank holds them whole through the schedule
(``accumulating``).  This is Megatron-LM's and DeepSpeed's mixed precision; PyTorch's FSDP2 keeps its fp32 shard
as the master and steps fp32 gradients, 16 bytes a parameter (``labkit.fake_world`` builds rank 0 of 1,024 GPUs
under FSDP2 and under ZeRO-1 and sets each term beside this one).  Beyond what the model counts, a real run
needs the CUDA context, NCCL's buffers (a few MiB per channel and peer, for every group a rank joins), cuBLAS's
workspaces and the caching allocator's rounding and fragmentation: not measured here (the course's lessons run
on CPUs), so the planner keeps a margin, :data:`MEMORY_MARGIN`, 10 % of the device (8 GB of an 80 GB GPU),
rather than plan to the last byte.

Each layer is priced kernel by kernel (:mod:`labkit.costmodel.kernels`) at three fitted efficiencies: the shares
of the peak that large matrix products and a flash kernel reach, and of the HBM bandwidth the memory-bound
operations reach (:class:`Cluster`; :mod:`labkit.costmodel.validation` fits them to published runs and tests them
on others; ``labkit doctor`` measures this machine's own constants for its CPU runs).  When nothing fits, :class:`PlanResult` says why: the least memory per GPU any
candidate needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.costmodel import hardware
from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import GPU, mfu, model_flops_per_step
from labkit.costmodel.kernels import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, MEMORY_EFFICIENCY, Kernels
from labkit.costmodel.rank_memory import layout_memory
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.stages import (
    weighted_stage_layers,
)
from labkit.costmodel.step import Hardware, Layout, StepTime, lower_bound, predict_step
from labkit.parallel.context.sequence import padded_length, ulysses_problem

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1")  # tried by default
ALL_SCHEDULES = SCHEDULES + ("interleaved-zb", "zb-v", "dualpipev")  # those of 2024-25 on request (schedules=)
# From this many tokens a sequence, the planner tries context parallelism even when a layout fits without it: the
# lengths published runs split (torchtitan's context-parallel table starts at 32k tokens, Llama 3's at 131k)
LONG_CONTEXT = 32_768
MEMORY_MARGIN = 0.10  # of the device kept free for what the memory model does not count (module docstring)
# Megatron-Core's gradient buckets: DistributedDataParallelConfig.bucket_size, "max(40000000, 1000000 * dp_size)
# parameters (larger DP sizes need larger buckets to ensure collectives do not become latency-bound)".
DP_BUCKET_ELEMENTS = 40_000_000


@dataclass(frozen=True)
class Cluster:
    """``num_gpus`` GPUs of one kind: its peak, memory and links (:data:`labkit.costmodel.compute.GPUS`), the
    fraction ``efficiency`` of the peak its matrices reach, each link's latency, and the share of each GPU's
    memory a plan leaves free (``memory_margin``, :data:`MEMORY_MARGIN`).  Each layer is priced kernel by kernel
    (:meth:`kernels`): ``efficiency`` is the fraction of the peak large matrix products reach,
    ``attention_efficiency`` a flash kernel's, ``memory_efficiency`` the fraction of the HBM bandwidth the
    memory-bound operations reach (defaults: the three fitted to published runs,
    :data:`labkit.costmodel.validation.EFFICIENCIES`).  With ``attention_efficiency=None,
    memory_efficiency=None``, the earlier model: every FLOP of the Megatron count at ``efficiency``."""

    gpu: GPU
    num_gpus: int
    efficiency: float = GEMM_EFFICIENCY
    attention_efficiency: float | None = ATTENTION_EFFICIENCY
    memory_efficiency: float | None = MEMORY_EFFICIENCY
    intra_latency_s: float = hardware.NVLINK_LATENCY_S
    inter_latency_s: float = hardware.INFINIBAND_LATENCY_S
    memory_margin: float = MEMORY_MARGIN

    def __post_init__(self) -> None:
        if isinstance(self.num_gpus, bool) or not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ValueError(f"num_gpus must be an integer >= 1, got {self.num_gpus!r}")
        for name in ("efficiency", "attention_efficiency", "memory_efficiency"):
            value = getattr(self, name)
            if (value is not None or name == "efficiency") and not (isinstance(value, (int, float))
                                                                   and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if (self.attention_efficiency is None) != (self.memory_efficiency is None):
            raise ValueError("give attention_efficiency and memory_efficiency together (the kernel model), or "
                             "neither (every FLOP at efficiency)")
        if not 0 <= self.memory_margin < 1:
            raise ValueError(f"memory_margin must be in [0, 1), got {self.memory_margin!r}")
        if self.gpu.nvlink_bandwidth <= 0 or self.gpu.network_bandwidth <= 0:
            raise ValueError(f"{self.gpu.name} has no link bandwidths: give nvlink_bandwidth and network_bandwidth")

    @property
    def usable_bytes(self) -> float:
        """What a plan may fill of each GPU: its memory less the margin."""
        return (1 - self.memory_margin) * self.gpu.memory_bytes

    def hardware(self) -> Hardware:
        """The step model's view of the cluster: NCCL's latencies (per ring step and per call), the slowdown of
        compute beside hidden communication (:mod:`labkit.costmodel.hardware`), Megatron-Core's gradient
        buckets (:data:`DP_BUCKET_ELEMENTS`), and a network adapter per GPU (``rails``: DGX nodes)."""
        return Hardware(self.efficiency * self.gpu.peak_bf16_flops,
                        LinkModel(self.intra_latency_s, 1 / self.gpu.nvlink_bandwidth),
                        LinkModel(self.inter_latency_s, 1 / self.gpu.network_bandwidth), self.gpu.gpus_per_node,
                        call_latency_s=hardware.NCCL_CALL_LATENCY_S, overlap_slowdown=hardware.OVERLAP_SLOWDOWN,
                        dp_bucket_elements=DP_BUCKET_ELEMENTS, rails=True, kernels=self.kernels())

    def kernels(self) -> Kernels | None:
        """The GPU's rates by kernel (:mod:`labkit.costmodel.kernels`): its peak, HBM bandwidth and SMs at the
        cluster's three efficiencies; ``None`` (every FLOP at ``efficiency``) without ``attention_efficiency``
        and ``memory_efficiency``."""
        if self.attention_efficiency is None or self.memory_efficiency is None:
            return None
        if not self.gpu.memory_bandwidth or not self.gpu.multiprocessors:
            raise ValueError(f"{self.gpu.name} has no memory_bandwidth or multiprocessors: the kernel model needs both")
        return Kernels(self.gpu.peak_bf16_flops, self.gpu.memory_bandwidth, self.gpu.multiprocessors,
                       self.efficiency, self.attention_efficiency, self.memory_efficiency)


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
    usable_bytes: float | None = None  # what a plan could fill of each GPU
    # Nothing fits, and context parallelism, tried for it, cannot cut the sequence into 2 cp zig-zag chunks for
    # any cp: the length labkit.train would pad it to for the largest cp tried (a length to plan instead).
    padded_seq_len: int | None = None

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def reason(self) -> str:
        if self.candidates:
            return f"{self.fitting} of {self.considered} configurations fit"
        if self.smallest_memory is None:
            return "no configuration divides this model, batch and number of GPUs: " + "; ".join(self.notes)
        room = "" if self.usable_bytes is None else f", {self.usable_bytes / 1e9:.1f} GB usable"
        unsplit = "" if self.padded_seq_len is None else (
            f"; context parallelism, which would spread each sequence's activations, cannot split this sequence "
            f"length: no cp tried cuts it into 2 cp equal zig-zag chunks (labkit.train pads a sequence to "
            f"{self.padded_seq_len} tokens, a length to plan instead)")
        return (f"nothing fits: the least memory any of the {self.considered} configurations needs is "
                f"{self.smallest_memory / 1e9:.1f} GB per GPU{room}{unsplit}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def cp_problem(shape: TransformerShape, ranks: int, cp: int, cp_strategy: str = "ring", tp: int = 1) -> str | None:
    """Why ``cp`` ranks cannot split ``shape``'s sequences on ``ranks`` GPUs at tensor-parallel degree ``tp``, or
    None: cp must divide the ``ranks / tp`` ranks left, cut each sequence into ``2 cp`` equal zig-zag chunks (one
    from each end a rank, for causal balance), and under Ulysses divide each TP rank's heads, its key/value heads
    included (:func:`~labkit.parallel.context.sequence.ulysses_problem`).  The one rule
    :func:`candidates` filters by and ``labkit plan --cp`` explains a refusal with."""
    problems = []
    if (ranks // tp) % cp:
        problems.append(f"does not divide the {ranks // tp} GPUs")
    if cp > 1 and padded_length(shape.seq_len, cp) != shape.seq_len:
        problems.append(f"does not cut the sequence's {shape.seq_len} tokens into {2 * cp} equal zig-zag chunks "
                        "(two a cp rank)")
    if cp > 1 and cp_strategy == "ulysses" and ulysses_problem(shape.num_heads, cp, shape.num_kv_heads, tp):
        problems.append(f"does not divide the {shape.num_heads // tp} query and {shape.num_kv_heads // tp} K/V heads "
                        "a TP rank holds, which Ulysses spreads whole over the cp ranks")
    return ", and ".join(problems) or None


def ep_problem(shape: TransformerShape, ranks: int, ep: int) -> str | None:
    """Why ``ep`` ranks cannot hold ``shape``'s experts, or None: ep must divide the experts (each rank holds
    ``E / ep``) and the ``dp x cp`` replicas it is folded over, so ``ranks``, their number (or the GPUs, which
    every ``dp x cp`` divides).  The one rule :func:`candidates` filters by and ``labkit plan --ep`` explains a
    refusal with."""
    problems = []
    if shape.num_experts % ep:
        problems.append(f"does not divide the {shape.num_experts} experts")
    if ranks % ep:
        problems.append(f"does not divide dp x cp (a divisor of {ranks})")
    return ", and ".join(problems) or None


def _ep_degrees(shape: TransformerShape, replicas: int, asked: tuple[int, ...] | None) -> list[int]:
    """The ep degrees a layout of ``replicas`` (``dp x cp``) ranks may fold over them (module docstring)."""
    if not shape.moe_layers:
        return [1]
    tried = asked or tuple(2 ** k for k in range(shape.num_experts.bit_length()))
    return [ep for ep in tried if ep_problem(shape, replicas, ep) is None]


def _stages_per_rank(schedule: str, per_stage: int, p: int, m: int, asked: tuple[int, ...] | None
                     ) -> tuple[int, ...]:
    """The ``v`` to try for ``schedule`` on ``p`` ranks of ``per_stage`` layers and ``m`` micro-batches (none when
    the schedule cannot run them)."""
    if schedule in ("zb-v", "dualpipev"):  # two chunks a rank; DualPipeV needs m >= 2p
        return (2,) if per_stage % 2 == 0 and (schedule == "zb-v" or m >= 2 * p) else ()
    if schedule.startswith("interleaved"):  # Megatron's groups of p; interleaved ZB's rounds
        runs = m % p == 0 if schedule == "interleaved" else m % max(1, m // p) == 0
        return tuple(v for v in (asked or _divisors(per_stage)[1:]) if v > 1 and per_stage % v == 0) if runs else ()
    return (1,)


def uneven_layers(shape: TransformerShape, p: int, schedule: str, v: int) -> tuple[int, ...] | None | bool:
    """The chunks' layers of a pipeline of ``p`` ranks (``v`` chunks each, two in a V) whose chunks do not divide
    the layers: torchtitan's split, the embedding and the output each weighing a layer
    (:func:`~labkit.costmodel.stages.weighted_stage_layers`); ``None`` where they divide (``L / (p v)`` each),
    ``False`` where no chunk count can hold them."""
    chunks = p * (v if schedule.startswith("interleaved") else 2 if schedule in ("zb-v", "dualpipev") else 1)
    if shape.num_layers % chunks == 0:
        return None
    try:
        return weighted_stage_layers(shape.num_layers, chunks)
    except ValueError:
        return False


def candidates(shape: TransformerShape, num_gpus: int, global_batch: int, micro_batches=(1, 2, 4, 8),
               schedules=SCHEDULES, zero_stages=(0, 1, 2, 3), recompute=(False, "selective", True),
               virtual_stages: int | tuple[int, ...] | None = None, tensor_parallel: tuple[int, ...] | None = None,
               pipeline_parallel: tuple[int, ...] | None = None, context_parallel: tuple[int, ...] = (1,),
               cp_strategy: str = "ring", expert_parallel: tuple[int, ...] | None = None,
               uneven_stages: bool = True) -> list[Layout]:
    """Every layout whose degrees divide what they split (see the module docstring), a ZeRO stage only where
    there are replicas to partition over (``d = 1``: the lowest stage asked for), and ZeRO-2 only where it differs
    from ZeRO-1 (``m = 1``: under accumulation it holds whole gradients and sends what ZeRO-1 sends).
    ``schedules``: names of :data:`ALL_SCHEDULES` (the four of :data:`SCHEDULES` by default);
    ``virtual_stages``: the interleaved schedules' stages per rank to try (default: every ``v >= 2`` that divides a
    stage's layers); ``tensor_parallel`` and ``pipeline_parallel``: the degrees to try (default: every divisor);
    ``context_parallel``: the cp degrees to try (default none; each must cut the sequence into ``2 cp`` zig-zag
    chunks, and with ``cp_strategy="ulysses"`` divide each TP rank's heads); ``expert_parallel``: the ep degrees
    to try for an MoE shape (default: every power of two dividing the experts and ``d cp``; a dense shape: 1);
    ``uneven_stages``: also pipelines whose chunks do not divide the layers, split as torchtitan splits them
    (:func:`uneven_layers`).  ``recompute``: among ``False``, ``True`` (full) and ``"selective"``."""
    interleavings = (virtual_stages,) if isinstance(virtual_stages, int) else virtual_stages
    unknown = [name for name in schedules if name not in ALL_SCHEDULES]
    if unknown:
        raise ValueError(f"schedules must be among {ALL_SCHEDULES}, got {unknown[0]!r}")
    found = []
    for t, cp in ((t, cp) for t in _divisors(num_gpus) for cp in context_parallel):
        if shape.num_heads % t or shape.num_kv_heads % t or (tensor_parallel and t not in tensor_parallel):
            continue
        if cp_problem(shape, num_gpus, cp, cp_strategy, t) is not None:
            continue
        for p in _divisors(num_gpus // (t * cp)):
            d = num_gpus // (t * cp * p)
            if (p > shape.num_layers or global_batch % d or (pipeline_parallel and p not in pipeline_parallel)
                    or (shape.num_layers % p and not uneven_stages)):
                continue
            for b in micro_batches:
                if (global_batch // d) % b:
                    continue
                m = global_batch // (d * b)
                for schedule in schedules:
                    if schedule != "1f1b" and p == 1:
                        continue  # one stage: every schedule is the same gradient accumulation
                    even = shape.num_layers % p == 0  # else torchtitan's weighted split (uneven_layers)
                    per_stage = shape.num_layers // p if even else (shape.num_layers + 2) // p \
                        if (shape.num_layers + 2) % p == 0 else 1
                    tried = _stages_per_rank(schedule, per_stage, p, m, interleavings)
                    for v, uneven in ((v, uneven_layers(shape, p, schedule, v)) for v in tried):
                        if uneven is False or (uneven is not None and not uneven_stages):
                            continue
                        for zero in zero_stages:
                            if zero == 3 and schedule != "1f1b" and schedule != "gpipe":
                                continue  # FSDP wraps one stage a rank and cannot follow W passes
                            if d * cp == 1 and zero != min(zero_stages):
                                continue  # one replica: every ZeRO stage is the same layout
                            if zero == 2 and m > 1 and 1 in zero_stages:
                                continue  # accumulating, ZeRO-2 holds and sends what ZeRO-1 does: the same layout
                            found += [Layout(d, t, p, zero, b, r is True, schedule, v, cp, cp_strategy, ep,
                                             "attention" if r == "selective" else "", uneven)
                                      for r in recompute for ep in _ep_degrees(shape, d * cp, expert_parallel)]
    return found


def plan(shape: TransformerShape, cluster: Cluster, global_batch: int, top: int = 10, flash_attention: bool = True,
         dropout: bool = True, gradient_bytes: int | None = None, overlap_gather: bool = False,
         overlap_tp: bool = False, overlap_dp: bool = True, **choices) -> PlanResult:
    """The ``top`` fastest configurations of ``shape`` on ``cluster`` for a step of ``global_batch`` sequences
    that fit in each device's memory less the cluster's margin, exactly ranked by
    :func:`~labkit.costmodel.step.predict_step` (``choices``: :func:`candidates`' keyword arguments;
    ``flash_attention`` and ``dropout`` go to the memory model, :func:`~labkit.costmodel.rank_memory.layout_memory`; ``gradient_bytes`` (4:
    gradients accumulated and reduced in fp32, as Megatron-LM does under bf16) to both; ``overlap_gather``,
    ``overlap_tp`` and ``overlap_dp`` to the step model)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    layouts = candidates(shape, cluster.num_gpus, global_batch, **choices)
    def fits(layout: Layout) -> bool:
        return layout_memory(shape, layout, global_batch, flash_attention=flash_attention, dropout=dropout,
                             gradient_bytes=gradient_bytes)["total"] <= cluster.usable_bytes

    tried_cp = choices.get("context_parallel", (1,))
    if "context_parallel" not in choices and (shape.seq_len >= LONG_CONTEXT
                                              or not any(fits(layout) for layout in layouts)):
        # Nothing fits without context parallelism, or the sequences are long: try it (powers of two that cut the
        # sequence into 2 cp chunks), and keep what it adds only if something then fits (else the answer, and its
        # reason, stay without it).
        degrees = tuple(cp for cp in (1, 2, 4, 8, 16, 32, 64) if cp <= cluster.num_gpus)
        with_cp = candidates(shape, cluster.num_gpus, global_batch, context_parallel=degrees, **choices)
        layouts = with_cp if any(fits(layout) for layout in with_cp if layout.cp > 1) else layouts
        tried_cp = degrees
    if flash_attention:  # a flash kernel keeps no scores and recomputes them anyway: selective is no recomputation
        layouts = [layout for layout in layouts if layout.selective != "attention"]
    hardware = cluster.hardware()
    fitting, smallest = [], math.inf
    memory_options = {"flash_attention": flash_attention, "dropout": dropout, "gradient_bytes": gradient_bytes}
    for layout in layouts:
        memory = layout_memory(shape, layout, global_batch, **memory_options)
        smallest = min(smallest, memory["total"])
        if memory["total"] <= cluster.usable_bytes:
            fitting.append((layout, memory))
    notes = [] if layouts else [f"{cluster.num_gpus} GPUs, {shape.num_heads} heads, {shape.num_layers} layers, "
                                f"global batch {global_batch}"]
    # A lower bound for each (free sends, no DP or ZeRO): the exact model runs only where the bound could win.
    step_options = {"gradient_bytes": gradient_bytes, "overlap_gather": overlap_gather, "overlap_tp": overlap_tp,
                    "overlap_dp": overlap_dp, "flash_attention": flash_attention, "dropout": dropout}
    bounded = [(lower_bound(shape, layout, global_batch, hardware, **step_options), layout, memory)
               for layout, memory in fitting]
    bounded.sort(key=lambda entry: entry[0])
    flops = model_flops_per_step(shape, global_batch)
    ranked: list[Candidate] = []
    for bound, layout, memory in bounded:
        if len(ranked) >= top and bound >= ranked[top - 1].step.step_s:
            break
        step = predict_step(shape, layout, global_batch, hardware, **step_options)
        ranked.append(Candidate(layout, step, memory, mfu(flops, step.step_s, cluster.num_gpus,
                                                          cluster.gpu.peak_bf16_flops),
                                global_batch * shape.seq_len / step.step_s))
        ranked.sort(key=lambda candidate: candidate.step.step_s)
    split = [cp for cp in tried_cp if cp > 1]  # when none cuts the sequence, its length is why nothing fits
    unsplit = split and not fitting and layouts and all(padded_length(shape.seq_len, cp) > shape.seq_len
                                                        for cp in split)
    return PlanResult(ranked[:top], len(layouts), len(fitting), None if fitting or not layouts else smallest, notes,
                      cluster.usable_bytes, padded_length(shape.seq_len, max(split)) if unsplit else None)
