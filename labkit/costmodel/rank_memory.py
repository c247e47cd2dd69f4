"""Bytes on the fullest GPU of a 3D layout (lesson 11): the memory model (:mod:`labkit.costmodel.memory`) applied
to each pipeline rank's chunks, micro-batches in flight, logits and context-parallel buffers; what
:func:`labkit.costmodel.planner.plan` fits each layout against."""

from __future__ import annotations

import dataclasses

from labkit.costmodel.context import cp_buffer_bytes, cp_saved_extra_bytes
from labkit.costmodel.memory import activation_bytes, memory_per_rank
from labkit.costmodel.shapes import TransformerShape
from labkit.costmodel.stages import Layout, chunk_layers, rank_expert_parameters, rank_parameters


def held_microbatches(layout: Layout, m: int, rank: int) -> float:
    """How many micro-batches of its stage's activations pipeline rank ``rank`` holds at its peak: all ``m``
    under GPipe, ``p - rank`` under 1F1B and ZB-H1 (at most ``m``), and under interleaving Megatron's warm-up,
    ``(v - 1) p + 2 (p - 1 - rank) + 1`` chunk passes of ``1 / v`` of a stage each; interleaved ZB one fewer a
    hop, ``(v - 1) g + p - rank`` (``g``: its round of ``m // max(1, m // p)`` micro-batches); ZB-V
    ``min(2p, m + rank + 1, 2m)`` and DualPipeV ``2p + 1`` passes of half a stage (``p`` and ``p + 1/2`` stages
    once ``m >= 2p``; tested against the simulator's count)."""
    p = layout.pp
    if layout.schedule == "gpipe":
        return m
    if layout.schedule.startswith("interleaved"):
        v = layout.virtual_stages
        if layout.schedule == "interleaved-zb":
            return min(m * v, (v - 1) * (m // max(1, m // p)) + p - rank) / v
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1) / v
    if layout.schedule == "zb-v":
        return min(2 * p, m + rank + 1, 2 * m) / 2
    if layout.schedule == "dualpipev":
        return p + 0.5
    return min(m, p - rank)


def layout_memory(shape: TransformerShape, layout: Layout, global_batch: int, sequence_parallel: bool = True,
                  flash_attention: bool = True, dropout: bool = True, gradient_bytes: int | None = None,
                  stage_layers: tuple[int, ...] | None = None, peak: bool = True) -> dict[str, float]:
    """Bytes on the fullest GPU of ``layout`` (mixed precision and Adam): the larger of the first pipeline
    rank (the embedding, the most micro-batches in flight: :func:`held_microbatches`) and the last (the
    output layer, and one micro-batch's logits, in bf16 and in fp32 for the loss).  Model states at the step's
    peak (``peak``: lesson 04's fp32 copy of the gradients; ``gradient_bytes``: as
    :func:`~labkit.costmodel.memory.memory_per_rank`), whole gradients under ZeRO-2/FSDP when the step
    accumulates ``m > 1`` micro-batches; activations per :func:`~labkit.costmodel.memory.activation_bytes`
    (``flash_attention``, ``dropout``; sequence parallelism with TP).  With recomputation each held micro-batch
    keeps its layers' inputs, and only the one layer being rebuilt holds its whole activations.  With context
    parallelism each rank holds the activations of ``s / cp`` tokens of each sequence, the K/V it gathers or
    receives for the one layer whose attention runs (:func:`~labkit.costmodel.context.cp_buffer_bytes`), and
    its model states sharded by ZeRO over the ``dp x cp`` replicas.  In a mixture of experts the routed experts
    are counted apart: ``1 / ep`` of them a GPU (not split by tp), their states sharded over the ``dp cp / ep``
    ranks that hold the same experts; the rest as in a dense model (:mod:`labkit.costmodel.experts`)."""
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m = global_batch // (d * b)
    full = shape
    shape = dataclasses.replace(shape, seq_len=shape.seq_len // layout.cp)  # this rank's tokens of a sequence
    options = {"tp_degree": t, "sequence_parallel": sequence_parallel and t > 1, "dropout": dropout,
               "flash_attention": flash_attention or layout.selective == "attention"}  # no score matrix kept
    layers = chunk_layers(shape, layout, stage_layers)
    stage = max(sum(layers[c] for c in layout.chunks_of(r)) for r in range(p))  # a rank's layers, its chunks together
    last = layout.rank_of(layout.chunks - 1)  # the output layer's rank: p - 1, or 0 in a V
    whole = activation_bytes(shape, b, checkpointing=layout.recompute, layers=max(stage, 1), **options)
    rebuilt = activation_bytes(shape, b, layers=1, **options)
    per_stage = (whole - rebuilt) if layout.recompute else whole
    if layout.selective == "layer":  # every second layer keeps only its input ("op": counted whole, an upper bound)
        per_stage = (whole + activation_bytes(shape, b, checkpointing=True, layers=max(stage, 1), **options)
                     - rebuilt) / 2
    if layout.cp_strategy == "ulysses" and layout.cp > 1 and not layout.recompute:  # its second output a layer
        per_stage += cp_saved_extra_bytes("ulysses", stage, b, shape.seq_len, shape.hidden_size // t, 2)
    logits = b * shape.seq_len * -(-shape.vocab_size // t) * (2 + 4)
    parameters = rank_parameters(full, layout, stage_layers)
    experts = rank_expert_parameters(full, layout, stage_layers)
    if layout.cp > 1:  # one layer's K/V from the other cp ranks, in bf16 (and their gradients, backward)
        kv_heads = max(shape.num_kv_heads / t, 1)  # Megatron replicates K/V heads that t does not divide
        per_rank_heads = shape.num_heads / t if layout.cp_strategy == "ulysses" else kv_heads
        transient = 2 * cp_buffer_bytes(layout.cp_strategy, layout.cp, b, per_rank_heads, shape.seq_len,
                                        shape.hidden_size // shape.num_heads, 2)
    else:
        transient = 0.0
    worst: dict[str, float] = {}
    for rank in sorted({0, p - 1, last}):
        activations = held_microbatches(layout, m, rank) * per_stage + (rebuilt if layout.recompute else 0.0)
        activations += (logits if rank == last else 0.0) + transient
        memory = memory_per_rank(parameters[rank] - experts[rank], "mixed", "adam", layout.zero, layout.replicas, t,
                                 1, activations, accumulating=m > 1, gradient_bytes=gradient_bytes, peak=peak)
        if experts[rank]:  # the routed experts: 1/ep of them, sharded over the replicas of the same experts
            held = memory_per_rank(experts[rank], "mixed", "adam", layout.zero, layout.replicas // layout.ep,
                                   layout.ep, 1, accumulating=m > 1, gradient_bytes=gradient_bytes, peak=peak)
            memory = {name: memory[name] + held[name] for name in memory}
        if memory["total"] > worst.get("total", -1.0):
            worst = memory
    return worst
