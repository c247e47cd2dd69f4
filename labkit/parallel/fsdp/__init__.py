"""Fully sharded data parallelism (ZeRO-3; Zhao et al., "PyTorch FSDP", VLDB 2023).

- ``model``: :class:`FullyShardedDataParallel` — every model state sharded over the group, a unit's parameters
  gathered before its forward and its backward and freed after, gradients reduce-scattered;
- ``units``: how the model is cut into units, each unit's flat parameter (``fully_shard``'s shards), the
  argument checks and the memory the model predicts;
- ``state``: the full state for checkpoints — shards gathered into whole tensors, and whole tensors cut back.
"""

from labkit.parallel.fsdp.model import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]
