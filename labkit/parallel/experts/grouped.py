"""Every expert in one product: the padded batch, MegaBlocks' block-sparse form and the grouped GEMM.

After the permutation (:mod:`labkit.parallel.experts.permute`) expert ``e`` has ``n_e`` rows, and the ``n_e``
differ from batch to batch.  :func:`labkit.parallel.experts.permute.run_experts` runs the experts one after the
other, a loop of ``E`` small products: right on a CPU, but on a GPU ``E`` kernel launches, each too small to fill
the device.  Three ways to do it in one product, computing the same outputs (:func:`expert_forward`):

- **padded**: a batched product over ``[E, capacity, h]``, every expert's rows padded with zeros to one size.
  A capacity (GShard, Switch) chose that size and drops what is past it; to drop nothing, the size must be the
  largest load, so a skewed router makes every expert compute the busiest one's rows;
- **block-sparse** (MegaBlocks, Gale et al. 2023, section 5): the layer as one block-sparse matrix product whose
  nonzero blocks are each expert's rows against its own weights, rows padded only to the block size ``B`` (128
  there), so at most ``B - 1`` rows of padding an expert, whatever the loads: "dropless" MoE at the speed of one
  kernel.  Here each row block is one ``B x h`` by ``h x f`` product of a batched product (the nonzero blocks);
  MegaBlocks' kernels read each block's weights in place, where this version copies them per block;
- **grouped**: a grouped GEMM (CUTLASS's, ``torch.nn.functional.grouped_mm``: Megatron-Core's and torchtitan's
  default) takes every expert's row count and computes exactly the ``sum n_e`` rows: no padding at all.

:func:`computed_rows` counts the rows each form computes, padding included: what it costs beside the ``sum n_e``
the router asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

FORMS = ("loop", "padded", "block-sparse", "grouped")


def computed_rows(counts: Sequence[int], form: str, block: int = 128) -> int:
    """Rows an expert layer computes for ``counts[e]`` rows of each expert, padding included."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if form == "padded":
        return len(counts) * max(counts, default=0)
    if form == "block-sparse":
        return sum(math.ceil(n / block) * block for n in counts)
    return sum(counts)


def stacked_weights(experts: nn.ModuleList) -> tuple[torch.Tensor, ...]:
    """``(w1 [E, h, f], b1 [E, f], w2 [E, f, h], b2 [E, h])`` of experts built as
    :class:`~labkit.parallel.experts.layer.Expert` (with biases), differentiable."""
    w1 = torch.stack([expert.fc.weight.t() for expert in experts])
    w2 = torch.stack([expert.proj.weight.t() for expert in experts])
    return w1, torch.stack([e.fc.bias for e in experts]), w2, torch.stack([e.proj.bias for e in experts])


def _padded(rows: torch.Tensor, counts: list[int], weights: tuple[torch.Tensor, ...], size: int,
            block_of: torch.Tensor | None = None) -> torch.Tensor:
    """Rows into zero-padded slots of ``size`` (one per expert, or with ``block_of`` one per block), a batched
    product with each slot's expert's weights, the real rows back."""
    w1, b1, w2, b2 = weights
    starts = torch.tensor([0] + counts[:-1], device=rows.device).cumsum(0)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                    torch.tensor(counts, device=rows.device))
    place = torch.arange(rows.shape[0], device=rows.device) - starts[owner]  # a row's place among its expert's
    if block_of is None:
        slot, index = owner, place
    else:  # the expert's first block, then the block within it
        first = torch.tensor([0] + [math.ceil(n / size) for n in counts[:-1]], device=rows.device).cumsum(0)
        slot, index = first[owner] + place // size, place % size
    slots = len(counts) if block_of is None else block_of.numel()
    batch = rows.new_zeros(slots, size, rows.shape[1]).index_put((slot, index), rows)
    expert = torch.arange(len(counts), device=rows.device) if block_of is None else block_of
    hidden = F.gelu(torch.bmm(batch, w1[expert]) + b1[expert].unsqueeze(1))
    return (torch.bmm(hidden, w2[expert]) + b2[expert].unsqueeze(1))[slot, index]


def expert_forward(rows: torch.Tensor, counts: Sequence[int], experts: nn.ModuleList, form: str = "grouped",
                   block: int = 128) -> torch.Tensor:
    """The experts on ``rows`` grouped by expert, ``counts[e]`` of them for expert ``e``, in one of
    :data:`FORMS`; the same outputs as :func:`~labkit.parallel.experts.permute.run_experts` (the loop)."""
    counts = [int(n) for n in counts]
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if len(counts) != len(experts) or sum(counts) != rows.shape[0]:
        raise ValueError(f"counts must give each of the {len(experts)} experts its rows, summing to the "
                         f"{rows.shape[0]} rows, got {counts}")
    if form == "loop":
        return torch.cat([expert(chunk) for expert, chunk in zip(experts, rows.split(counts), strict=True)])
    weights = stacked_weights(experts)
    if form == "padded":
        return _padded(rows, counts, weights, max(counts))
    if form == "block-sparse":
        blocks = [math.ceil(n / block) for n in counts]
        block_of = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                           torch.tensor(blocks, device=rows.device))
        return _padded(rows, counts, weights, block, block_of)
    w1, b1, w2, b2 = weights
    ends = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                    torch.tensor(counts, device=rows.device))
    hidden = F.gelu(F.grouped_mm(rows, w1, offs=ends) + b1[owner])
    return F.grouped_mm(hidden, w2, offs=ends) + b2[owner]
