"""The course's workloads: a small classifier MLP and a small decoder-only transformer (GPT).

Every distributed technique in labkit is checked by training one of these two models and comparing with
single-process training, so both are plain ``nn.Module``s that know nothing about parallelism (torchtitan's
rule: parallelisms are applied *to* a model, from outside).  Three properties matter to the lessons:

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
- **Per-block structure.**  ``TinyGPT.blocks`` is an ``nn.ModuleList`` of identical transformer blocks: the unit
  that pipeline parallelism assigns to stages, FSDP wraps, and activation checkpointing recomputes.  Inside a
  block, query, key and value are three separate ``nn.Linear`` layers (not one fused ``3 * n_embd`` projection):
  a few percent slower, but tensor parallelism can split each one by heads along its output dimension without
  untangling a fused weight.

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
203 MB) and AdamW adds 8 more; ``labkit.memory`` accounts for the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.data import VOCAB_SIZE

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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

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


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.query = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.key = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.value = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:  # [batch, n_head, time, head_size]
            return projection(x).view(batch, time, self.n_head, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.query), heads(self.key), heads(self.value),
                                                  dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        merged = attended.transpose(1, 2).reshape(batch, time, channels)
        return self.resid_dropout(self.proj(merged))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer.  ``forward(idx, targets=None) -> (logits, loss)``; see the module docstring."""

    def __init__(self, config: GPTConfig, seed: int = 0):
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
            self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
            self.dropout = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.final_norm = nn.LayerNorm(config.n_embd, bias=config.bias)
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.to_empty(device="cpu")
        # Tie after materialising: moving off "meta" creates a new tensor per module and would untie them.
        if config.tie_weights:
            self.lm_head.weight = self.token_embedding.weight
        self._initialise(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def _initialise(self, generator: torch.Generator) -> None:
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for module in self.modules():
            if module is self.lm_head and self.config.tie_weights:
                continue  # already initialised as the token embedding
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = any(module is block.attn.proj or module is block.mlp.proj for block in self.blocks)
                module.weight.normal_(0.0, residual_std if is_residual else 0.02, generator=generator)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx`` ``[batch, time]`` token ids -> logits ``[batch, time, vocab_size]`` and the mean cross-entropy
        against ``targets`` (same shape as ``idx``), or ``None`` without targets."""
        time = idx.shape[-1]
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size={self.config.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None = None,
                 temperature: float = 1.0) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` ``[batch, time]`` (context cut to ``block_size``)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            probabilities = F.softmax(logits[:, -1] / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
        return idx

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied weight counts once)."""
        return sum(parameter.numel() for parameter in self.parameters())

