"""Tensor parallelism (Megatron-LM) and sequence parallelism, from ``torch.distributed`` collectives.

- ``ops``: the conjugate operators ``f`` and ``g`` and their sequence-parallel forms, as autograd Functions;
  the dropout generator of the split regions;
- ``layers``: column- and row-parallel linear layers, the vocabulary-parallel embedding and cross-entropy;
- ``transformer``: :func:`parallelize_tensor`, TinyGPT split over a mesh's ``tp`` ranks, keeping the wrapper
  contract of ``labkit.parallel.base``;
- ``timing``: where a split step's time goes on CPU cores (the kernels the split divides, ranks sharing a
  machine, a collective's cost between bursts of compute), the inputs of lesson 06's step-time model.
"""

from labkit.parallel.tensor.layers import (
                                           ColumnParallelLinear,
                                           RowParallelLinear,
                                           VocabParallelEmbedding,
                                           vocab_parallel_cross_entropy,
)
from labkit.parallel.tensor.ops import (
                                           ParallelRNG,
                                           TensorParallelGroup,
                                           copy_to_tensor_parallel,
                                           f,
                                           g,
                                           gather_from_sequence_parallel,
                                           reduce_from_tensor_parallel,
                                           reduce_scatter_to_sequence_parallel,
)
from labkit.parallel.tensor.transformer import TensorParallel, parallelize_tensor

__all__ = ["ColumnParallelLinear", "ParallelRNG", "RowParallelLinear", "TensorParallel", "TensorParallelGroup",
           "VocabParallelEmbedding", "copy_to_tensor_parallel", "f", "g", "gather_from_sequence_parallel",
           "parallelize_tensor", "reduce_from_tensor_parallel", "reduce_scatter_to_sequence_parallel",
           "vocab_parallel_cross_entropy"]
