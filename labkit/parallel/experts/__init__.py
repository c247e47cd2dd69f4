"""Mixture of experts and expert parallelism.

- ``router``: scores, top-k, capacity and dropped tokens, the auxiliary balancing loss, DeepSeek-V3's bias;
- ``permute``: the permutation that groups a batch's assignments by expert (and by destination rank), its
  inverse, the weighted sum back into the tokens;
- ``layer``: the MoE layer (TinyGPT's MLP when ``GPTConfig.n_experts > 0``) and its dense reference;
- ``dispatch``: expert parallelism's all-to-alls;
- ``model``: expert parallelism applied to a model, the experts' gradients, bias balancing, the 3D layout;
- ``grouped``: every expert in one product (padded batch, MegaBlocks' block-sparse form, grouped GEMM), and the
  rows each computes;
- ``placement``: redundant experts and their placement on GPUs (DeepSeek's EPLB);
- ``timing``: what lesson 14 measures (EP on launched ranks, balancing runs, the capacity factor, the forms).
"""

from labkit.parallel.experts.dispatch import ExpertParallelGroup, check_expert_parallel
from labkit.parallel.experts.layer import (
    Expert,
    MoE,
    aux_loss_scale,
    is_expert_parallel,
    moe_layers,
    moe_reference,
)
from labkit.parallel.experts.model import apply_expert_parallel, balance_experts, reduce_expert_gradients
from labkit.parallel.experts.permute import (
    dispatch_order,
    inverse_permutation,
    owner_of,
    route_to_experts,
    send_counts,
)
from labkit.parallel.experts.router import (
    SCORES,
    Router,
    Routing,
    check_moe,
    drop_over_capacity,
    expert_capacity,
)

__all__ = ["SCORES", "Expert", "ExpertParallelGroup", "MoE", "Router", "Routing", "apply_expert_parallel",
           "aux_loss_scale", "balance_experts", "check_expert_parallel", "check_moe", "dispatch_order",
           "drop_over_capacity", "expert_capacity", "inverse_permutation", "is_expert_parallel", "moe_layers",
           "moe_reference", "owner_of", "reduce_expert_gradients", "route_to_experts", "send_counts"]
