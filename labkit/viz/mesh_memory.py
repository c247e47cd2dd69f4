"""Lesson 10's memory figures: does a 3D layout of one model fit one GPU, and with how large a micro-batch?

:func:`memory_choices` prices layouts ``(dp, tp, pp, zero_stage)`` of one model on one GPU count with the
analytical model of :mod:`labkit.costmodel.memory`; :func:`largest_micro_batch` finds the largest micro-batch
that fits (a divisor of the replica's share of the global batch, never above it); :func:`plot_memory_choices`
stacks the bytes against the device's memory, and :func:`plot_layout` puts the mesh of
:func:`labkit.viz.mesh_plots.plot_mesh` above them (the lesson's explorer).

**The model the lesson prices, and why.**  Llama 2 70B (Touvron et al. 2023, "Llama 2: Open Foundation and
Fine-Tuned Chat Models", Table 1: 4k-token context, grouped-query attention, trained "with a global batch-size
of 4M tokens", so :data:`LLAMA_2_GLOBAL_BATCH` = 1024 sequences of 4096; section 2.2.1: on A100 80GB GPUs).
Its 69.0B parameters hold 1.1 TB of mixed-precision Adam states, and one sequence's activations over its 80
layers are about 100 GiB without recomputation: no single GPU holds either, which is what model parallelism is
for.  :data:`LLAMA_2_ACTIVATIONS` assumes no dropout (Meta's released model code, ``llama/model.py`` of
meta-llama/llama, has no dropout layer, and neither paper mentions one) and an attention kernel that stores no
attention matrix: Llama 1's (Touvron et al. 2023a, "LLaMA", section 2.4: xformers' causal attention), which
Llama 2 says nothing about beyond adopting "most of the pretraining setting" of Llama 1 (section 2.2).  The
same section 2.4 says Llama 1 saved activations selectively (the linear layers' outputs) and used model and
sequence parallelism (Korthikanti et al. 2022) to make room: recomputation is an option here
(``recompute=True``), off by default.

**What a rank holds.**  Model states from :func:`~labkit.costmodel.memory.memory_per_rank` (Adam, parameters
split evenly over ``tp * pp`` ranks, ZeRO over the ``dp`` replicas), activations those of the *first pipeline
stage*, the rank that holds the most:

- **1F1B** (Narayanan et al. 2021, section 2.2.1): the first of ``p`` stages holds ``min(p, m)`` micro-batches
  of its ``ceil(L / p)`` layers before its first backward pass, so about one micro-batch of the *whole* model
  however deep the pipeline;
- **tensor parallelism** divides the activations inside its split regions by ``t`` on its own (the ``24/t`` and
  attention terms of Korthikanti et al. 2022, lesson 06); **sequence parallelism** (on by default here) divides
  the rest, the norms' and dropouts' ``10 s b h``, so that together they divide every layer by ``t``;
- no activation recomputation by default; with ``recompute=True``, full recomputation (Korthikanti et al.'s
  "full"): each layer keeps only its input, ``s b h`` 16-bit values (split by sequence parallelism), for each
  micro-batch held, and one layer's activations are rebuilt at a time during the backward pass;
- the embedding's and the loss's activations left out.

**Gradients under accumulation: two ways to reduce.**  A step of ``m = B / (d b)`` micro-batches either
accumulates gradients over all of them and reduces them once, after the last (labkit's ``parallelize``,
Megatron-LM's distributed optimizer, ``torch.distributed.pipelining`` with FSDP, which syncs only the last
micro-batch's backward): then ZeRO-2 and FSDP partition gradients only with that reduce-scatter, each rank holds
its whole gradients through the schedule, and ZeRO-2 saves nothing on them over ZeRO-1
(``memory_per_rank(accumulating=True)``; with ``m = 1`` they are sharded).  Or it reduce-scatters after every
micro-batch's backward and accumulates its own shard (FSDP's default outside ``no_sync``, DeepSpeed ZeRO-2/3
without a pipeline): ``reduce_each_micro_batch=True``, gradients sharded over ``d``, at ``m`` reduce-scatters a
step instead of one.

**16-bit: bf16 or fp16.**  Mixed precision stores 2-byte weights, gradients and activations either way; which
format a GPU can compute in is :func:`half_precision`'s: the V100's tensor cores have no bf16 (Volta: fp16
only; bf16 came with the A100), so a V100 trains in fp16 with a loss scale (lesson 04).

Memory is drawn in GiB (2^30 bytes); device memory is quoted as vendors quote it, in GB (1e9 bytes), so an
"80 GB" GPU is a line at 74.5 GiB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from labkit.costmodel.memory import activation_bytes, memory_per_rank
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.degrees import check_degrees
from labkit.viz.mesh_plots import MEMORY_PARTS, plot_mesh

LLAMA_2_70B = TransformerShape.preset("llama-2-70b")
LLAMA_2_GLOBAL_BATCH = 4 * 2**20 // LLAMA_2_70B.seq_len  # "a global batch-size of 4M tokens": 1024 sequences
LLAMA_2_ACTIVATIONS = {"dropout": False, "flash_attention": True}
# GPUs whose tensor cores compute no bf16 (NVIDIA V100 datasheet: fp16 tensor cores; bf16 from Ampere on).
NO_BF16 = ("V100 32GB",)
GIB = 2**30


def half_precision(gpu_name: str) -> str:
    """The 16-bit format mixed precision uses on ``gpu_name``: ``"fp16"`` on a GPU without bf16 (the V100),
    else ``"bf16"``.  Both are 2 bytes, so the memory model is the same; fp16 needs a loss scale (lesson 04)."""
    return "fp16" if gpu_name in NO_BF16 else "bf16"


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def memory_choices(shape: TransformerShape, num_gpus: int, choices: Sequence[Sequence[int]],
                   micro_batch: int = 1, global_batch: int | None = None, precision: str = "mixed",
                   dropout: bool = True, flash_attention: bool = False,
                   sequence_parallel: bool = True, recompute: bool = False, reduce_each_micro_batch: bool = False,
                   gradient_bytes: float | None = None) -> list[dict]:
    """The bytes per GPU of each ``(dp, tp, pp, zero_stage)`` layout of ``shape`` on ``num_gpus`` GPUs, with
    micro-batches of ``micro_batch`` sequences (the module docstring says what is counted).

    ``global_batch`` (sequences a step): each replica runs ``m = global_batch / (dp * micro_batch)``
    micro-batches, which must be a whole number >= 1; ``m > 1`` accumulates, so ZeRO-2 and FSDP hold whole
    gradients.  Without it, a layout accumulates when it has a pipeline (``pp > 1`` runs ``m >= p``) and holds
    ``p`` micro-batches on its first stage.

    ``recompute``: full activation recomputation; ``reduce_each_micro_batch``: gradients reduce-scattered after
    every micro-batch, so ZeRO-2 and FSDP hold them sharded even while accumulating; ``gradient_bytes``: bytes
    a gradient (default 2; 4 for Megatron-LM's fp32 ``main_grad``).

    Each row: ``{"dp", "tp", "pp", "zero", "microbatches" (m, or None), "accumulating", "weights",
    "gradients", "optimizer_states", "activations", "total", "label"}``, bytes as floats, ``label`` like
    ``"dp=8 tp=1 pp=1 ZeRO-0"`` (``", recompute"`` and ``", RS/micro-batch"`` appended when those options
    are on and change something).  A choice whose ``dp * tp * pp`` is not ``num_gpus``, a ``tp`` that does not
    divide the heads and the key/value heads, a ``pp`` above the number of layers, or a global batch the
    replicas' micro-batches do not divide raises ``ValueError`` naming the choice.
    """
    _count("num_gpus", num_gpus)
    _count("micro_batch", micro_batch)
    if global_batch is not None:
        _count("global_batch", global_batch)
    if not choices:
        raise ValueError("choices is empty: give (dp, tp, pp, zero_stage) tuples to compare")
    parameters = num_parameters(shape)
    rows = []
    for choice in choices:
        if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or len(choice) != 4:
            raise ValueError(f"a choice is a (dp, tp, pp, zero_stage) tuple, got {choice!r}")
        dp, tp, pp, zero = choice
        name = f"choice {tuple(choice)!r}"
        try:
            check_degrees(dp, tp, pp)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        if dp * tp * pp != num_gpus:
            raise ValueError(f"{name} (dp={dp}, tp={tp}, pp={pp}, ZeRO-{zero}): dp * tp * pp = {dp * tp * pp}, "
                             f"but num_gpus is {num_gpus}")
        if pp > shape.num_layers:
            raise ValueError(f"{name}: pp={pp} stages for {shape.num_layers} layers leaves some stage without a "
                             "layer")
        microbatches, held = None, pp
        if global_batch is not None:
            if global_batch % (dp * micro_batch):
                raise ValueError(f"{name}: the global batch of {global_batch} sequences does not split into dp={dp} "
                                 f"replicas of micro-batches of {micro_batch} (m = {global_batch / dp / micro_batch:g})")
            microbatches = global_batch // (dp * micro_batch)
            held = min(pp, microbatches)
        accumulating = microbatches > 1 if microbatches is not None else pp > 1
        try:
            stage_layers = math.ceil(shape.num_layers / pp)
            options = {"precision": precision, "dropout": dropout, "flash_attention": flash_attention,
                       "tp_degree": tp, "sequence_parallel": sequence_parallel}
            whole = activation_bytes(shape, micro_batch, layers=stage_layers, **options)
            if recompute:  # each micro-batch held keeps its layers' inputs; one layer is rebuilt at a time
                inputs = activation_bytes(shape, micro_batch, checkpointing=True, layers=stage_layers, **options) \
                    - whole / stage_layers
                activations = held * inputs + whole / stage_layers
            else:
                activations = held * whole
            memory = memory_per_rank(parameters, precision=precision, zero_stage=zero, dp_degree=dp,
                                     tp_degree=tp, pp_degree=pp, activation_bytes=activations,
                                     accumulating=accumulating and not reduce_each_micro_batch,
                                     gradient_bytes=gradient_bytes)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        label = f"dp={dp} tp={tp} pp={pp} ZeRO-{zero}" + (", recompute" if recompute else "") \
            + (", RS/micro-batch" if reduce_each_micro_batch and accumulating and zero >= 2 else "")
        rows.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero, "microbatches": microbatches,
                     "accumulating": accumulating, **memory, "label": label})
    return rows


def largest_micro_batch(shape: TransformerShape, num_gpus: int, choice: Sequence[int], device_memory_bytes: float,
                        global_batch: int, **options) -> int:
    """The largest micro-batch ``b`` for which ``choice`` fits in ``device_memory_bytes``: a divisor of the
    replica's ``global_batch / dp`` sequences (so ``b`` never exceeds them, and the step splits into whole
    micro-batches), 0 when not even ``b = 1`` fits.  ``options`` go to :func:`memory_choices`.  A larger ``b``
    means fewer micro-batches, which can end the accumulation (``m = 1``) and shard ZeRO-2's gradients, so
    each candidate is priced whole rather than extrapolated."""
    _count("global_batch", global_batch)
    dp = choice[0]
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1 or global_batch % dp:
        raise ValueError(f"choice {tuple(choice)!r}: the global batch of {global_batch} sequences does not split "
                         f"over dp={dp!r} replicas")
    share = global_batch // dp
    for b in sorted((b for b in range(1, share + 1) if share % b == 0), reverse=True):
        (row,) = memory_choices(shape, num_gpus, [choice], micro_batch=b, global_batch=global_batch, **options)
        if row["total"] <= device_memory_bytes:
            return b
    return 0


def plot_memory_choices(rows: Sequence[Mapping], device_memory_bytes: float | None = None,
                        title: str = "Memory per GPU, by layout") -> Figure:
    """One horizontal bar per row of :func:`memory_choices` (first row on top), stacked in GiB: weights,
    gradients, optimizer states, activations; each bar's total written at its end.  With
    ``device_memory_bytes`` (e.g. ``compute.GPUS["A100 80GB"].memory_bytes``, 80e9), a vertical line at the
    device's memory, and the totals that exceed it marked "does not fit"; the axis then ends at four times the
    device's memory at most, and a longer bar is cut there, its total written inside with "(off scale)"."""
    if not rows:
        raise ValueError("rows is empty: give memory_choices' rows to draw")
    needed = {"label", "total", *MEMORY_PARTS}
    for row in rows:
        missing = needed - set(row)
        if missing:
            raise ValueError(f"a row needs {sorted(needed)}; {sorted(missing)} missing from {dict(row)!r}")
    if device_memory_bytes is not None and (isinstance(device_memory_bytes, bool)
                                            or not isinstance(device_memory_bytes, (int, float))
                                            or not 0 < device_memory_bytes < math.inf):
        raise ValueError(f"device_memory_bytes must be None or a positive number of bytes, "
                         f"got {device_memory_bytes!r}")
    figure = Figure(figsize=(11, 1.8 + 0.45 * len(rows)))
    axis = figure.subplots()
    positions = list(range(len(rows)))
    left = [0.0] * len(rows)
    for key, (name, color) in MEMORY_PARTS.items():
        values = [row[key] / GIB for row in rows]
        axis.barh(positions, values, left=left, height=0.62, color=color, edgecolor="white", linewidth=0.5,
                  label=name)
        left = [start + value for start, value in zip(left, values, strict=True)]
    device_gib = None if device_memory_bytes is None else device_memory_bytes / GIB
    longest = max(row["total"] for row in rows) / GIB
    right = 1.3 * longest if device_gib is None else min(1.3 * max(device_gib, longest), 4 * device_gib)
    axis.set_xlim(0, right)
    for position, row in zip(positions, rows, strict=True):
        total = row["total"] / GIB
        over = device_gib is not None and total > device_gib
        inside = total > 0.7 * right  # written inside the bar's end, so that it stays on the axis
        text = f" {total:,.1f} GiB" + (" (does not fit)" if over else "") + (" (off scale)" if total > right else "")
        axis.text(min(total, right) - (0.005 * right if inside else 0), position, text + (" " if inside else ""),
                  va="center", ha="right" if inside else "left", fontsize=8, color="#B00000" if over else "black",
                  fontweight="bold" if over else "normal",
                  bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 0.6})  # over the line
    if device_gib is not None:
        axis.axvline(device_gib, color="black", linestyle="--", linewidth=1.3, gid="device memory",
                     label=f"device memory: {device_memory_bytes / 1e9:g} GB = {device_gib:.1f} GiB")
        axis.text(device_gib, 1.0, f"{device_memory_bytes / 1e9:g} GB", ha="center", va="bottom", fontsize=8,
                  transform=axis.get_xaxis_transform())  # above the plot, clear of the first bar's total
    axis.set_yticks(positions, [row["label"] for row in rows], fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("memory per GPU (GiB)")
    axis.set_title(title, fontsize=9, pad=14 if device_gib is not None else 6)  # above the device's label
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return figure


def stack_figures(figures: Sequence[Figure], dpi: int = 90) -> Figure:
    """``figures`` one above the other, each drawn at ``dpi`` and placed pixel for pixel, centred (save the
    result at the same ``dpi``): the explorer shows one image."""
    if not figures:
        raise ValueError("figures is empty: give the figures to stack")
    pictures = []
    for part in figures:
        part.set_dpi(dpi)
        canvas = FigureCanvasAgg(part)
        canvas.draw()
        pictures.append(numpy.asarray(canvas.buffer_rgba()))
    width, height = max(p.shape[1] for p in pictures), sum(p.shape[0] for p in pictures)
    figure = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, facecolor="white")
    top = height
    for picture in pictures:
        top -= picture.shape[0]
        figure.figimage(picture, xo=(width - picture.shape[1]) // 2, yo=top, origin="upper", gid="part")
    return figure


def plot_layout(dp: int, tp: int, pp: int, rows: Sequence[Mapping], gpus_per_node: int = 8,
                highlight_rank: int | None = 0, device_memory_bytes: float | None = None,
                title: str = "Memory per GPU, by layout", dpi: int = 90) -> Figure:
    """:func:`~labkit.viz.mesh_plots.plot_mesh` above :func:`plot_memory_choices`, in one figure
    (:func:`stack_figures`)."""
    return stack_figures([plot_mesh(dp, tp, pp, gpus_per_node, highlight_rank),
                          plot_memory_choices(rows, device_memory_bytes, title)], dpi)
