"""The course's workloads: a small classifier MLP and a small decoder-only transformer (GPT).

Every distributed technique in labkit is checked by training one of these two models and comparing with
single-process training, so both are plain ``nn.Module``s that know nothing about parallelism (torchtitan's
rule: parallelisms are applied *to* a model, from outside).  Four properties matter to the lessons:

- **Deterministic initialisation.**  ``TinyGPT(config, seed=s)`` is bit-identical on every rank and every run,
  whatever the global random state, and does not consume it: the modules are first built on the *meta* device
  (shapes only: no memory, no random numbers), then materialised and every tensor is initialised from one
  ``torch.Generator(seed)``.  Data-parallel ranks can thus start from the same weights without a broadcast, and a
  test can build the single-process reference model from the same seed.  (Building on ``meta`` is also how
  models too large for one device are created before ZeRO-3/FSDP shards them.)
- **Tied weights.**  With ``tie_weights=True`` the LM head *is* the token embedding (one ``Parameter`` used
  twice, GPT-2's choice: it saves ``vocab_size * n_embd`` parameters).  Its gradient is the sum of two
  contributions, and anything that walks over parameters — DDP buckets, ZeRO shards, checkpoints — must count
  it once.  ``num_parameters()`` does.
- **Pipeline stages.**  Pipeline parallelism gives each stage some of the blocks.  Following torchtitan, a stage
  is *the same class with the pieces it does not own set to None*:
  ``TinyGPT(config, seed, blocks=range(2, 4), embedding=False, head=False)`` holds blocks 2 and 3 only.
  ``TinyGPT.blocks`` is an ``nn.ModuleList`` of ``n_layer`` slots indexed by the *global* block number (the
  unit that pipeline stages own, FSDP wraps and activation checkpointing recomputes), a slot being ``None`` where
  the block lives on another stage, so a stage's parameters keep the whole model's names
  (``blocks.2.attn.query.weight``) and checkpoints, optimizers and tests can match them by name;
  ``block_indices`` lists the slots held, and code that walks a stage's ``blocks`` skips the ``None`` slots.
  The values are the whole model's too: a stage builds the whole model on ``meta``, then draws every random
  number the whole model would draw, in the same order, and keeps only its own (the cost: the random draws of the
  whole model, into one scratch tensor at a time).  The pieces are callable apart: ``embed(idx) -> x``, each
  block ``x -> x``, ``head(x) -> logits`` (final norm and LM head) and ``loss(logits, targets)``; ``forward``
  composes whatever the model holds.  A tied weight cannot be split between two stages, so a model holding only
  one of the embedding and the head needs ``tie_weights=False``.
- **Tensor-parallel heads.**  Inside a block, query, key and value are three separate ``nn.Linear`` layers (not
  one fused ``3 * n_embd`` projection): a few percent slower, but tensor parallelism can split each one by heads
  along its output dimension without untangling a fused weight.  Attention counts its heads from the width it
  is given (``head_dim = n_embd // n_head`` is fixed), so a column-sharded query with ``n_embd / t`` outputs
  runs ``n_head / t`` heads with the code unchanged.

The GPT is GPT-2's design at toy size: token + position embeddings; ``n_layer`` pre-LayerNorm blocks, each
``x + attention(norm(x))`` then ``x + mlp(norm(x))``, with causal self-attention through
``scaled_dot_product_attention(is_causal=True)`` and an MLP of width ``4 * n_embd`` with GELU; a final LayerNorm;
and a linear head to vocabulary logits.  Weights start from ``N(0, 0.02)``, the two residual projections of each
block from ``N(0, 0.02 / sqrt(2 n_layer))`` so the residual stream's variance does not grow with depth.

Parameters per block: ``12 d^2 + 13 d`` with biases (``d = n_embd``: 4 d^2 attention, 8 d^2 MLP), plus
``(vocab_size + block_size) d`` for the embeddings and ``2 d`` for the final norm.  The presets
(``GPTConfig.preset(name)``, character vocabulary of 32) have exactly:

=========  ========  =======  =======  ==========  ============
name       n_layer   n_head   n_embd   block_size  parameters
=========  ========  =======  =======  ==========  ============
``100k``   4         4        48       64             117,792
``1m``     4         4        144      128          1,026,144
``10m``    8         8        320      256          9,956,480
``50m``    16        8        512      512         50,717,696
=========  ========  =======  =======  ==========  ============

Layer counts divide by 2 and 4 and head counts by 2 and 4, so every preset splits evenly over 2 or 4 pipeline
stages or tensor-parallel ranks.  At float32 the weights alone take 4 bytes per parameter (the 50m preset:
203 MB) and AdamW adds 8 more; ``labkit.costmodel.memory`` accounts for the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.data import VOCAB_SIZE
from labkit.parallel.experts.layer import MoE
from labkit.parallel.experts.router import check_moe

IGNORE_INDEX = -100  # a target the loss leaves out (F.cross_entropy's ignore_index): a padded sequence's end


# --------------------------------------------------------------------------------------------------------
# A classifier MLP


@dataclass
class MLPConfig:
    in_features: int = 32
    hidden_sizes: tuple[int, ...] = (64, 64)
    num_classes: int = 4

    def __post_init__(self) -> None:
        self.hidden_sizes = tuple(self.hidden_sizes)
        for name, value in (("in_features", self.in_features), ("num_classes", self.num_classes),
                            *((f"hidden_sizes[{i}]", size) for i, size in enumerate(self.hidden_sizes))):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class TinyMLP(nn.Module):
    """``Linear -> ReLU`` for each hidden size, then a ``Linear`` to class logits.  ``forward(x) -> logits``."""

    def __init__(self, config: MLPConfig, seed: int = 0):
        super().__init__()
        self.config = config
        sizes = (config.in_features, *config.hidden_sizes, config.num_classes)
        with torch.device("meta"):
            self.layers = nn.ModuleList(nn.Linear(fan_in, fan_out) for fan_in, fan_out in itertools.pairwise(sizes))
        self.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            # PyTorch's default for nn.Linear (uniform, bound 1/sqrt(fan_in)), drawn from our generator.
            bound = 1.0 / math.sqrt(layer.in_features)
            with torch.no_grad():
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)

    def num_parameters(self) -> int:
        return sum(parameter.numel() for parameter in self.parameters())


# --------------------------------------------------------------------------------------------------------
# A small GPT


@dataclass
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    block_size: int = 64  # longest sequence the model accepts (number of position embeddings)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 48
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms
    tie_weights: bool = True  # LM head shares the token embedding's weight
    # Mixture of experts (labkit.parallel.experts): n_experts > 0 makes every block's MLP an MoE layer.
    n_experts: int = 0
    top_k: int = 2  # experts per token
    expert_hidden: int | None = None  # each expert's hidden width (None: 4 n_embd, the dense MLP's)
    n_shared_experts: int = 0  # experts every token goes through (DeepSeek-V3)
    router: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    capacity_factor: float | None = None  # None: drop nothing
    aux_loss_weight: float = 0.0  # Switch's load-balancing loss (0.01 in the paper)
    bias_update_rate: float = 0.0  # DeepSeek-V3's bias balancing (gamma; 0.001 in the paper); 0: off
    z_loss_weight: float = 0.0  # ST-MoE's router z-loss (0.001 in the paper)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"n_experts must be an integer >= 0 (0: a dense MLP), got {self.n_experts!r}")
        if self.n_experts:
            check_moe(self.n_experts, self.top_k, score=self.router, capacity_factor=self.capacity_factor,
                      n_shared_experts=self.n_shared_experts, expert_hidden=self.expert_hidden,
                      aux_loss_weight=self.aux_loss_weight, bias_update_rate=self.bias_update_rate,
                      z_loss_weight=self.z_loss_weight)

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named size (``"100k"``, ``"1m"``, ``"10m"``, ``"50m"``; see the module docstring for exact counts).

        ``overrides`` replace fields, e.g. ``GPTConfig.preset("1m", dropout=0.1)``.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS = {
    "100k": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=48),
    "1m": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=144),
    "10m": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=320),
    "50m": GPTConfig(block_size=512, n_layer=16, n_head=8, n_embd=512),
}


class Attention(nn.Module):
    """The attention core, ``softmax(q k^T / sqrt(d)) v`` under the causal mask (torch's fused kernel), apart from
    the projections around it so that a parallelism can replace it whole: context parallelism puts its ring,
    all-gather or all-to-all attention here (``labkit.parallel.context``).  No parameters."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q, k, v`` ``[batch, heads, seq, head_dim]`` -> the attended values, same shape as ``q``."""
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                              is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.core = Attention(config.dropout)
        self.query = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.key = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.value = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape

        # [batch, heads, time, head_dim], as many heads as the projection's width holds: all n_head of them, or
        # a tensor-parallel rank's share when the projection is column-sharded.
        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(batch, time, -1, self.head_dim).transpose(1, 2)

        attended = self.core(heads(self.query), heads(self.key), heads(self.value))
        merged = attended.transpose(1, 2).reshape(batch, time, -1)  # the local width, heads side by side
        return self.resid_dropout(self.proj(merged))


class MLP(nn.Module):
    """The dense block's MLP, ``4 n_embd`` wide (an MoE layer's experts, ``labkit.parallel.experts.Expert``, are
    the same at their own width; kept apart so that a dense model runs no code of ``labkit.parallel``)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


def feed_forward(config: GPTConfig) -> nn.Module:
    """A block's second half: the MLP, or with ``n_experts > 0`` a mixture of experts."""
    if not config.n_experts:
        return MLP(config)
    return MoE(config.n_embd, config.n_experts, config.top_k, expert_hidden=config.expert_hidden,
               score=config.router, capacity_factor=config.capacity_factor, n_shared_experts=config.n_shared_experts,
               aux_loss_weight=config.aux_loss_weight, z_loss_weight=config.z_loss_weight, bias=config.bias)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = feed_forward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer, or the part of one that a pipeline stage holds; see the module docstring.

    ``forward(idx, targets=None) -> (logits, loss)``.  ``blocks`` (global indices; default: all), ``embedding``
    (token and position embeddings) and ``head`` (final norm and LM head) choose the pieces this model holds;
    the others are ``None``.  Whatever it holds has the values, and the names, of the whole
    ``TinyGPT(config, seed)``.
    """

    def __init__(self, config: GPTConfig, seed: int = 0, blocks: Iterable[int] | None = None,
                 embedding: bool = True, head: bool = True):
        super().__init__()
        self.config = config
        held = _check_blocks(blocks, config.n_layer)
        if config.tie_weights and not (embedding and head):
            raise ValueError(f"tie_weights=True makes the head and the embedding one weight, so a model holding "
                             f"only one of them (embedding={embedding}, head={head}) cannot tie it: build the "
                             f"pieces from a config with tie_weights=False")
        if not (held or embedding or head):
            raise ValueError("blocks is empty and embedding=False, head=False: the model would hold nothing")
        with torch.device("meta"):
            self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
            self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
            self.dropout = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.final_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        draws = self._random_weights()  # the whole model's, before any piece is dropped
        for index in range(config.n_layer):
            if index not in held:
                self.blocks[index] = None
        if not embedding:
            self.token_embedding = self.position_embedding = self.dropout = None
        if not head:
            self.final_norm = self.lm_head = None
        self.to_empty(device="cpu")
        # Tie after materialising: moving off "meta" creates a new tensor per module and would untie them.
        if config.tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        self._initialise(draws, torch.Generator().manual_seed(seed))

    def _random_weights(self) -> list[tuple[str, torch.Size, float]]:
        """``(module name, weight shape, std)`` of each weight drawn at random, in the order they are drawn."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        draws = []
        for name, module in self.named_modules():
            if module is self.lm_head and self.config.tie_weights:
                continue  # it is the token embedding
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(".proj")  # attention's, the MLP's, every expert's
                draws.append((name, module.weight.shape, residual_std if is_residual else 0.02))
        return draws

    @torch.no_grad()
    def _initialise(self, draws: list[tuple[str, torch.Size, float]], generator: torch.Generator) -> None:
        held = dict(self.named_modules())
        for name, shape, std in draws:
            # A weight this model does not hold is drawn all the same, into scratch, so that the generator
            # reaches each held weight in the state the whole model's would: same seed, same values.
            weight = held[name].weight if name in held else torch.empty(shape)
            weight.normal_(0.0, std, generator=generator)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()
        for buffer in self.buffers():  # an MoE router's balancing bias and load count start at zero
            buffer.zero_()

    @property
    def block_indices(self) -> tuple[int, ...]:
        """The global indices of the blocks this model holds, in order (``0 .. n_layer - 1`` when whole)."""
        return tuple(index for index, block in enumerate(self.blocks) if block is not None)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``[batch, time]`` -> the residual stream ``[batch, time, n_embd]``."""
        if self.token_embedding is None:
            raise ValueError("this model does not hold the embedding (built with embedding=False)")
        time = idx.shape[-1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size={self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        return self.dropout(self.token_embedding(idx) + self.position_embedding(positions))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream ``[batch, time, n_embd]`` -> logits ``[batch, time, vocab_size]``."""
        if self.lm_head is None:
            raise ValueError("this model does not hold the head (built with head=False)")
        return self.lm_head(self.final_norm(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``logits`` ``[batch, time, vocab_size]`` against ``targets`` ``[batch, time]``."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx`` ``[batch, time]`` token ids -> logits ``[batch, time, vocab_size]`` and the mean cross-entropy
        against ``targets`` (same shape as ``idx``), or ``None`` without targets.

        A model without the embedding takes the previous stage's output ``[batch, time, n_embd]`` as ``idx``; one
        without the head returns its last block's output in place of the logits (and takes no targets).
        """
        x = idx if self.token_embedding is None else self.embed(idx)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        if self.lm_head is None:
            if targets is not None:
                raise ValueError("targets were given to a model without the head: the loss belongs to the "
                                 "stage that holds the head")
            return x, None
        logits = self.head(x)
        return logits, None if targets is None else self.loss(logits, targets)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[batch, time]`` (context cut to ``block_size``)."""
        if self.token_embedding is None or self.lm_head is None or len(self.block_indices) < self.config.n_layer:
            raise ValueError("generate needs the whole model: this one lacks the embedding, the head or blocks "
                             f"(holds blocks {list(self.block_indices)})")
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            probabilities = F.softmax(logits[:, -1] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
        return idx

    def num_parameters(self) -> int:
        """Number of distinct parameters this model holds (a tied weight counts once)."""
        return sum(parameter.numel() for parameter in self.parameters())


def _check_blocks(blocks: Iterable[int] | None, n_layer: int) -> tuple[int, ...]:
    """The sorted global block indices a model holds: ``blocks``, or all ``n_layer`` of them when ``None``."""
    if blocks is None:
        return tuple(range(n_layer))
    held = list(blocks)
    for index in held:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_layer:
            raise ValueError(f"blocks must be indices in [0, {n_layer}) (n_layer={n_layer}), got {index!r}")
    if len(set(held)) != len(held):
        raise ValueError(f"blocks lists an index twice: {held}")
    return tuple(sorted(held))
