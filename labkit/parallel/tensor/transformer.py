"""``parallelize_tensor(model, mesh)``: TinyGPT split over the tensor-parallel ranks, Megatron-LM's way.

Every matrix of the model is split over the ``t`` ranks of the mesh's ``tp`` dimension (Shoeybi et al. 2019):

- **attention** by heads: query, key and value column-parallel (rank ``r`` computes heads ``r a/t ..
  (r+1) a/t``, whole, with no communication), the output projection row-parallel;
- **the MLP**: the first matrix column-parallel, the second row-parallel;
- **the vocabulary**: the embedding table and the LM head (one weight when tied) split by rows, and the loss
  computed on the split logits (:func:`labkit.parallel.tensor.layers.vocab_parallel_cross_entropy`).

Norms and the position embedding stay whole on every rank.  Each half-layer has one ``f`` at its entry and one
``g`` at its exit, so a layer all-reduces ``b s h`` values twice forward and twice backward.  With
``sequence_parallel=True`` (Korthikanti et al. 2022) what lies between the halves (norms, dropout, the residual
stream) is split along the sequence instead of repeated: ``g`` becomes a reduce-scatter, ``f`` an all-gather,
and the activations of a whole layer are divided by ``t``; the replicated parameters then see only their
rank's tokens, and their gradients are summed over the group at the end of backward (like DDP's, and skipped
likewise with ``set_requires_gradient_sync(False)``).

The split model is built from the dense one's weights (each rank keeps its slices), so it starts identical to
its dense twin, and :meth:`TensorParallel.full_state_dict` gives the dense weights back.  The model is
modified in place, like ``torch.distributed.tensor.parallel.parallelize_module``: its layers are replaced,
under the same names, by the split ones.  **Dropout**: replicated activations draw their masks from the
default generator, which must be in the same state on every rank of the group (checked here; seed every rank
alike with ``torch.manual_seed``), and split ones (attention's heads; with sequence parallelism everything
between the halves) from a generator per rank (:class:`labkit.parallel.tensor.ops.ParallelRNG`).
Activation checkpointing would replay the default generator only, so it is not combined with dropout here.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.costmodel.tensor_parallel import (
    Collective,
    tensor_parallel_collectives,
    tensor_parallel_size_problem,
    total_bytes,
)
from labkit.mesh import Mesh
from labkit.models import TinyGPT
from labkit.parallel.base import ParallelWrapper, Piece, queue_end_of_backward
from labkit.parallel.tensor import state as tensor_state
from labkit.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    enter_columns,
    padded_size,
    vocab_parallel_cross_entropy,
)
from labkit.parallel.tensor.ops import ParallelRNG, RegionDropout, TensorParallelGroup


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's ``n_head / t`` heads (query, key, value column-parallel, the
    output projection row-parallel); the attention dropout draws from the rank's own generator."""

    def __init__(self, dense: nn.Module, tp: TensorParallelGroup, sequence_parallel: bool, rng: ParallelRNG,
                 where: str):
        super().__init__()
        self.head_dim, self.dropout, self.rng = dense.head_dim, dense.dropout, rng
        self.core = dense.core  # the attention itself, on this rank's heads (context parallelism replaces it)
        self.tp, self.sequence_parallel, self.where = tp, sequence_parallel, where
        self.query, self.key, self.value = (ColumnParallelLinear.from_dense(linear, tp, sequence_parallel, where)
                                            for linear in (dense.query, dense.key, dense.value))
        self.proj = RowParallelLinear.from_dense(dense.proj, tp, sequence_parallel, where)
        self.resid_dropout = RegionDropout(dense.resid_dropout.p, rng if sequence_parallel else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = enter_columns(x, [self.query, self.key, self.value], self.tp, self.sequence_parallel, self.where)
        batch, time = q.shape[:2]

        def heads(projected: torch.Tensor) -> torch.Tensor:
            return projected.view(batch, time, -1, self.head_dim).transpose(1, 2)

        dropout = self.dropout if self.training else 0.0
        with self.rng.fork() if dropout else contextlib.nullcontext():
            attended = self.core(heads(q), heads(k), heads(v))
        return self.resid_dropout(self.proj(attended.transpose(1, 2).reshape(batch, time, -1)))


class ParallelMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with ``fc`` column-parallel and ``proj`` row-parallel: ``4h / t`` hidden units."""

    def __init__(self, dense: nn.Module, tp: TensorParallelGroup, sequence_parallel: bool, rng: ParallelRNG,
                 where: str):
        super().__init__()
        self.fc = ColumnParallelLinear.from_dense(dense.fc, tp, sequence_parallel, where)
        self.proj = RowParallelLinear.from_dense(dense.proj, tp, sequence_parallel, where)
        self.dropout = RegionDropout(dense.dropout.p, rng if sequence_parallel else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


def check_tensor_parallel_sizes(n_embd: int, n_head: int, tp_degree: int, n_kv_head: int | None = None) -> None:
    """``ValueError`` naming the numbers unless ``tp_degree`` divides the hidden size and the heads (and, under
    grouped-query attention, the ``n_kv_head`` key/value heads: ``tensor_parallel_size_problem``)."""
    problem = tensor_parallel_size_problem(n_embd, n_head, tp_degree, n_kv_head)
    if problem:
        raise ValueError(problem)


class TensorParallel(ParallelWrapper):
    """A ``TinyGPT`` (or a pipeline stage of one) split over a tensor-parallel group; see the module docstring.

    ``forward(idx, targets=None) -> (logits, loss)``: ``logits`` are this rank's vocabulary slice
    ``[b, s, V_padded / t]`` (never gathered), ``loss`` the mean cross-entropy over the whole vocabulary.  A
    stage without the head returns its hidden state (this rank's sequence shard with sequence parallelism).
    ``dense_alone``: on a group of one rank (no sequence parallelism, dropout or vocabulary padding) keep the
    dense layers: the same numbers, fewer operations (:func:`labkit.parallel.parallelize` asks for it).
    """

    def __init__(self, module: TinyGPT, group: Any = None, sequence_parallel: bool = False, seed: int | None = None,
                 vocab_divisible_by: int = 1, dense_alone: bool = False):
        if not isinstance(module, TinyGPT):
            raise TypeError(f"parallelize_tensor splits a labkit.models.TinyGPT, got {type(module).__name__}")
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
        super().__init__(module, group)
        config = module.config
        check_tensor_parallel_sizes(config.n_embd, config.n_head, self.world_size)
        if config.n_experts and sequence_parallel and self.world_size > 1:
            raise ValueError("sequence parallelism with MoE blocks is not built here: the tp ranks would route "
                             "different tokens; use sequence_parallel=False (the MoE layer then runs whole on "
                             "every tp rank)")
        self.config, self.sequence_parallel = config, sequence_parallel
        self.vocab_divisible_by = vocab_divisible_by
        self.padded_vocab_size = padded_size(config.vocab_size, self.world_size, vocab_divisible_by)
        self.tp = TensorParallelGroup(self.group, on_collective=self._on_collective)
        self._log: list[Collective] = []
        self._forwards, self._shape = 0, (0, 0)
        device = next(module.parameters()).device
        if config.dropout > 0 and self.world_size > 1:
            _check_same_random_state(self.group, device)
        self.rng = ParallelRNG(torch.initial_seed() if seed is None else seed, self.rank, device)
        self._split: dict[str, tuple[int, int]] = {}  # name -> (split dimension, its dense size)
        # dense_alone (parallelize's, for tp = 1): one rank with nothing to pad, shard or draw dropout masks for
        # keeps the dense layers, which compute the same without the split layers' extra operations and a Python
        # hook per gradient, so a 3D layout with tp = 1 runs at the dense model's pace.
        self.dense = dense_alone and self.world_size == 1 and not sequence_parallel and config.dropout == 0 \
            and self.padded_vocab_size == config.vocab_size
        if not self.dense:
            self._parallelize(module)
        self._replicated = [p for name, p in module.named_parameters() if name not in self._split]
        self._queued = False
        # With sequence parallelism each rank's new gradient of a replicated parameter covers its tokens only:
        # keep those contributions apart (whatever .grad already held is whole) until they are summed.
        self._partial: list[torch.Tensor | None] = [None] * len(self._replicated)
        if sequence_parallel and self.world_size > 1:
            for index, parameter in enumerate(self._replicated):
                parameter.register_hook(self._keeper(index))
        for parameter in [] if self.dense else module.parameters():
            parameter.register_post_accumulate_grad_hook(self._on_gradient)

    @torch.no_grad()
    def _parallelize(self, model: TinyGPT) -> None:
        tp, sp, config = self.tp, self.sequence_parallel, self.config
        vocab = self.padded_vocab_size
        if model.token_embedding is not None:
            model.token_embedding = VocabParallelEmbedding.from_dense(model.token_embedding, tp, sp,
                                                                      divisible_by=self.vocab_divisible_by)
            model.dropout = RegionDropout(model.dropout.p, self.rng if sp else None)
            self._split["token_embedding.weight"] = (0, config.vocab_size)
        for index in model.block_indices:
            block, where = model.blocks[index], f"blocks.{index}"
            block.attn = ParallelSelfAttention(block.attn, tp, sp, self.rng, f"{where}.attn")
            # An MoE layer is left whole on every tp rank (its experts are split over ep instead; Megatron-Core
            # would split the tokens over tp with sequence parallelism and let the tp x ep ranks share experts).
            moe = config.n_experts > 0
            if not moe:
                block.mlp = ParallelMLP(block.mlp, tp, sp, self.rng, f"{where}.mlp")
            for name, layer in (("attn.query", block.attn.query), ("attn.key", block.attn.key),
                                ("attn.value", block.attn.value), *(() if moe else (("mlp.fc", block.mlp.fc),))):
                self._split[f"{where}.{name}.weight"] = (0, layer.out_features)
                if layer.bias is not None:
                    self._split[f"{where}.{name}.bias"] = (0, layer.out_features)
            for name, layer in (("attn.proj", block.attn.proj), *(() if moe else (("mlp.proj", block.mlp.proj),))):
                self._split[f"{where}.{name}.weight"] = (1, layer.in_features)
        if model.lm_head is not None:
            dense = model.lm_head
            model.lm_head = ColumnParallelLinear(config.n_embd, vocab, tp, bias=False, sequence_parallel=sp,
                                                 where="head")
            if config.tie_weights:
                model.lm_head.weight = model.token_embedding.weight
            else:
                model.lm_head.to(dense.weight.device, dense.weight.dtype)
                model.lm_head.weight.zero_()
                mine = dense.weight[tp.rank * (vocab // tp.size):(tp.rank + 1) * (vocab // tp.size)]
                model.lm_head.weight[:mine.shape[0]].copy_(mine)
            self._split["lm_head.weight"] = (0, config.vocab_size)

    # -- the forward pass --------------------------------------------------------------------------------

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        self._start_forward()
        model, t = self.module, self.world_size
        time = idx.shape[1] * (t if self.sequence_parallel and model.token_embedding is None else 1)
        if self.sequence_parallel and time % t:
            raise ValueError(f"sequence parallelism splits the sequence over the {t} tensor-parallel ranks: the "
                             f"sequence length {time} must be divisible by {t}")
        self._forwards, self._shape = self._forwards + 1, (idx.shape[0], time)
        if self.dense:
            return model(idx, targets)
        x = idx if model.token_embedding is None else self._embed(idx)
        for block in model.blocks:
            if block is not None:
                x = block(x)
        if model.lm_head is None:
            if targets is not None:
                raise ValueError("targets were given to a stage without the head: the loss belongs to the stage "
                                 "that holds the head")
            return x, None
        logits = model.lm_head(model.final_norm(x))
        if targets is None:
            return logits, None
        return logits, vocab_parallel_cross_entropy(logits, targets, self.tp, self.config.vocab_size)

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        model, time = self.module, idx.shape[1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size={self.config.block_size}")
        if self.sequence_parallel:  # this rank's shard of the positions
            shard = time // self.world_size
            positions = torch.arange(self.rank * shard, (self.rank + 1) * shard, device=idx.device)
        else:
            positions = torch.arange(time, device=idx.device)
        return model.dropout(model.token_embedding(idx) + model.position_embedding(positions))

    # -- gradients -----------------------------------------------------------------------------------------

    def _on_gradient(self, _parameter: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        if self.require_gradient_sync:
            self.reduce_gradients()

    def _keeper(self, index: int) -> Any:
        def keep(grad: torch.Tensor) -> torch.Tensor:
            partial = self._partial[index]
            self._partial[index] = grad.detach().clone() if partial is None else partial.add_(grad)
            return grad
        return keep

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """With sequence parallelism, sum over the group the replicated parameters' gradient contributions of
        the backward passes since the last reduction (each rank's covers its tokens only), in one all-reduce;
        without, they are already whole and equal."""
        if self.sequence_parallel and self.world_size > 1 and self._replicated:
            partials = [torch.zeros_like(p) if part is None else part
                        for p, part in zip(self._replicated, self._partial, strict=True)]
            flat = torch.cat([partial.reshape(-1) for partial in partials])
            self._on_collective("step", "all_reduce", "gradients", flat)
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for parameter, partial in zip(self._replicated, partials, strict=True):
                total = flat[offset:offset + partial.numel()].view_as(partial)
                offset += partial.numel()
                if parameter.grad is None:
                    parameter.grad = total.clone()
                else:  # .grad holds this rank's part of the new contributions: swap it for their sum
                    parameter.grad.add_(total - partial)
            self._partial = [None] * len(self._replicated)
        self._reduction_done()

    def split_parameters(self) -> dict[str, tuple[int, int]]:
        """``{name: (dimension, dense size)}`` of the parameters split over the ranks; the others are whole."""
        return dict(self._split)

    def _gradient_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        split = [p.grad for name, p in self.module.named_parameters() if name in self._split]
        whole = [p.grad for p in self._replicated]
        return ([g for g in split if g is not None], [g for g in whole if g is not None], self.world_size > 1)

    # -- communication ---------------------------------------------------------------------------------------

    def _on_collective(self, phase: str, kind: str, where: str, tensor: torch.Tensor) -> None:
        if self._step_reduced:  # a step's first collective outside a forward (its forward resets on its own)
            self._log.clear()
        self._count(kind, tensor)
        self._log.append(Collective(phase, kind, where, tensor.numel() * tensor.element_size()))

    def _start_forward(self) -> None:
        if self._step_reduced:
            self._log.clear()
            self._forwards = 0
        super()._start_forward()

    def communication_log(self) -> list[Collective]:
        """Every collective of the last step, in the order issued: ``(phase, kind, where, nbytes)``."""
        return list(self._log)

    def predicted_collectives(self) -> list[Collective]:
        """What ``labkit.costmodel.tensor_parallel`` predicts for the last step's shapes and micro-batches."""
        model = self.module
        batch, time = self._shape
        return tensor_parallel_collectives(self.config, batch, time, self.world_size, self.sequence_parallel,
                                           max(self._forwards, 1), blocks=len(model.block_indices),
                                           embedding=model.token_embedding is not None,
                                           head=model.lm_head is not None)

    def predicted_communication(self) -> dict[str, int]:
        return total_bytes(self.predicted_collectives()) if self._forwards else {}

    # -- checkpoints -----------------------------------------------------------------------------------------

    def _gather(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The dense tensor of a split parameter (or of its gradient) named ``name``: collective."""
        dim, size = self._split[name]
        pieces = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=self.group)
        return torch.cat(pieces, dim=dim).narrow(dim, 0, size).clone()

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the dense ``TinyGPT``'s ``state_dict()`` (shards gathered, vocabulary padding dropped)."""
        return {name: self._gather(name, tensor) if name in self._split else tensor.clone()
                for name, tensor in self.module.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        tensor_state.load_full_state_dict(self, state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return tensor_state.full_optimizer_state_dict(self, optimizer)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        tensor_state.load_full_optimizer_state_dict(self, optimizer, state)

    def sharded_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
        return tensor_state.sharded_state(self, optimizer)

    def random_states(self) -> dict[str, torch.Tensor]:
        """The split regions' dropout generator (one per rank), for a checkpoint."""
        return {"tensor_parallel_dropout": self.rng.state.clone()}

    def load_random_states(self, states: dict[str, torch.Tensor]) -> None:
        self.rng.state = states["tensor_parallel_dropout"].clone()

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Collective: ``{name: gradient}`` as the dense model would hold them (``None`` where there is none on
        any rank; a split parameter's gradient must exist on every rank or on none)."""
        return {name: None if p.grad is None else self._gather(name, p.grad) if name in self._split
                else p.grad.clone() for name, p in self.module.named_parameters()}


def _check_same_random_state(group: Any, device: torch.device) -> None:
    """Replicated activations draw the same dropout mask on every rank only from the same generator state."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    mine = torch.tensor([zlib.crc32(state.numpy().tobytes())], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    differ = [rank for rank, value in enumerate(everyone) if not torch.equal(value, everyone[0])]
    if differ:
        raise ValueError(f"ranks {differ} of the tensor-parallel group have a different random state from rank "
                         "0's: with dropout, activations every rank holds whole must drop the same elements on "
                         "every rank; call torch.manual_seed(seed) with the same seed on every rank first")


def parallelize_tensor(model: TinyGPT, mesh: Mesh | Any = None, sequence_parallel: bool = False,
                       seed: int | None = None, vocab_divisible_by: int = 1) -> TensorParallel:
    """Split ``model`` over the ``tp`` dimension of ``mesh`` (a :class:`labkit.mesh.Mesh`; or a process group,
    ``None`` for every rank); see the module docstring.  ``seed``: the split regions' dropout generator is
    seeded ``seed + 2718 + tp rank`` (default: ``torch.initial_seed()``).  ``vocab_divisible_by``: the
    vocabulary is padded to a multiple of ``vocab_divisible_by * t`` (1: labkit's least padding; 128:
    Megatron-LM's ``--make-vocab-size-divisible-by`` default).  A collective."""
    group = mesh.group("tp") if isinstance(mesh, Mesh) else mesh
    return TensorParallel(model, group, sequence_parallel=sequence_parallel, seed=seed,
                          vocab_divisible_by=vocab_divisible_by)

