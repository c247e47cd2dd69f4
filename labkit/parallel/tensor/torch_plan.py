"""The same split written with PyTorch's own tensor parallelism, the reference labkit's is proven against.

``parallelize_module(TinyGPT(config), device_mesh, torch_plan(config, sequence_parallel))`` splits the model as
:func:`labkit.parallel.tensor.parallelize_tensor` does (Megatron's plan, as torchtitan writes it for its Llama),
with DTensor layouts in place of labkit's explicit ``f`` and ``g``:

- the vocabulary: ``token_embedding`` ``RowwiseParallel`` (rows of the table; the partial look-ups summed, or
  reduce-scattered along the sequence, ``Shard(1)``); ``lm_head`` ``ColwiseParallel`` with vocabulary-split
  output (``Shard(-1)``), for a cross-entropy under ``torch.distributed.tensor.parallel.loss_parallel()``;
- each block: query, key, value and ``mlp.fc`` ``ColwiseParallel``, ``attn.proj`` and ``mlp.proj``
  ``RowwiseParallel``; TinyGPT's attention counts its heads from the local width, so it runs unchanged;
- sequence parallelism: the norms ``SequenceParallel``, ``attn`` and ``mlp`` enter with an all-gather
  (``PrepareModuleInput`` from ``Shard(1)`` to ``Replicate()``), the row-parallel layers leave ``Shard(1)``,
  and each rank adds its own positions (``position_embedding``'s output redistributed to ``Shard(0)``).

torch's TP cannot tie an embedding and a head it parallelises separately: use ``tie_weights=False``.  With
sequence parallelism it leaves the norms' gradients ``Partial`` (summed by ``full_tensor()`` or in the
optimizer step), where labkit all-reduces them at the end of backward.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from labkit.models import GPTConfig


def torch_plan(config: GPTConfig, sequence_parallel: bool = False) -> dict:
    """``parallelize_module``'s plan for ``TinyGPT(config)`` (module docstring)."""
    if sequence_parallel:
        plan = {"token_embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "position_embedding": PrepareModuleOutput(output_layouts=Replicate(),
                                                          desired_output_layouts=Shard(0)),
                "final_norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                           use_local_output=False)}
    else:
        plan = {"token_embedding": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    exit_layout = Shard(1) if sequence_parallel else Replicate()
    for index in range(config.n_layer):
        block = f"blocks.{index}"
        for name in ("attn.query", "attn.key", "attn.value", "mlp.fc"):
            plan[f"{block}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"{block}.{name}"] = RowwiseParallel(output_layouts=exit_layout)
        if sequence_parallel:
            for half in ("attn", "mlp"):
                plan[f"{block}.{half}_norm"] = SequenceParallel()
                plan[f"{block}.{half}"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                             desired_input_layouts=(Replicate(),))
    return plan
