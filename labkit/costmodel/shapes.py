"""Transformers described for the cost model: their shapes and how many parameters they hold.

The bytes they need (model states per parameter and per rank, activations per layer) are
:mod:`labkit.costmodel.memory`'s; the FLOPs, :mod:`labkit.costmodel.compute`'s.

**Well-known shapes** (:meth:`TransformerShape.preset`; :func:`num_parameters` counts them as built, so the
published counts are met exactly, except GPT-3, which the paper rounds; the Llama shapes are built with
RMSNorm, SwiGLU, rotary positions, no biases and an untied head):

================  ======  =====  =====  ========  ==========  ======  ===============  ====================
name              layers  h      heads  kv heads  ffn         vocab   parameters       published
================  ======  =====  =====  ========  ==========  ======  ===============  ====================
``gpt2``          12      768    12     12        3072        50257   124,439,808      124M
``gpt2-xl``       48      1600   25     25        6400        50257   1,557,611,200    1.56B
``gpt3-175b``     96      12288  96     96        49152       50257   174.60e9         175.0B (-0.23 %)
``llama-2-7b``    32      4096   32     32        11008       32000   6,738,415,616    6.74B
``llama-2-70b``   80      8192   64     8         28672       32000   68,976,648,192   68.98B
``mixtral-8x7b``  32      4096   32     8         8 x 14336   32000   46,702,792,704   46.7B (12.9B active)
``deepseek-v3``   61      7168   128    MLA       256 x 2048  129280  671,026,404,352  671B (37B active)
================  ======  =====  =====  ========  ==========  ======  ===============  ====================

The two mixtures of experts count their active parameters too (``num_parameters(shape, active=True)``:
12,879,925,248 and 37,552,282,624); DeepSeek-V3's first 3 layers are dense (``ffn`` 18432), each later one has
one shared expert and 256 routed ones, 8 a token on at most 4 nodes (node-limited routing, section 2.1.2:
``max_nodes``), and multi-head latent attention (:func:`mla_parameters`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from labkit.models import GPTConfig

PRECISIONS = ("fp32", "mixed")


def check_count(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_amount(name: str, value: Any, minimum_exclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (minimum_exclusive and value == 0):
        bound = "> 0" if minimum_exclusive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


# --------------------------------------------------------------------------------------------------------
# Transformer shapes and their parameters


@dataclass
class TransformerShape:
    """A decoder-only transformer's published shape: enough to count its parameters and activations.

    ``ffn_hidden_size`` defaults to ``4 * hidden_size`` and ``num_kv_heads`` to ``num_heads`` (fewer:
    grouped-query attention).  ``mlp``: ``"gelu"`` (two matrices, ``h -> f -> h``) or ``"swiglu"``
    (three: gate, up, down); ``norm``: ``"layernorm"`` (weight, and a bias if ``bias``) or ``"rmsnorm"``
    (weight only); ``learned_positions``: a ``seq_len x hidden_size`` position table (GPT) rather than rotary
    embeddings (Llama, no parameters); ``tied_embeddings``: the output head is the token embedding.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_kv_heads: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = True
    # A mixture of experts (labkit.costmodel.experts): every layer after the first dense_layers has num_experts
    # routed MLPs of expert_ffn_hidden_size (default ffn_hidden_size), a token going through top_k of them and
    # through the shared experts (one MLP shared_experts times as wide), and a router (h x E).
    num_experts: int = 0
    top_k: int = 1
    expert_ffn_hidden_size: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    # Node-limited routing (DeepSeek-V3: 4): a token's experts lie on at most max_nodes of the nodes expert
    # parallelism spans, and its dispatch crosses the network once per node (labkit.costmodel.experts).
    max_nodes: int | None = None
    # Attention other than multi-head or grouped-query (DeepSeek's multi-head latent attention): its parameters
    # per layer, and the widths of a head's queries-keys and values (default hidden_size / num_heads each).
    attention_parameters: int | None = None
    qk_head_dim: int | None = None
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.expert_ffn_hidden_size is None:
            self.expert_ffn_hidden_size = self.ffn_hidden_size
        if self.num_experts and not (1 <= self.top_k <= self.num_experts and 0 <= self.dense_layers < self.num_layers):
            raise ValueError(f"an MoE shape needs 1 <= top_k <= num_experts and 0 <= dense_layers < num_layers, got "
                             f"top_k={self.top_k}, num_experts={self.num_experts}, dense_layers={self.dense_layers}")
        if self.max_nodes is not None:
            check_count("max_nodes", self.max_nodes)
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "ffn_hidden_size",
                     "num_kv_heads"):
            check_count(name, getattr(self, name))
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by "
                             f"num_heads={self.num_heads}, and num_heads by num_kv_heads={self.num_kv_heads}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")

    @property
    def ffn_multiplier(self) -> float:
        return self.ffn_hidden_size / self.hidden_size

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts (0 for a dense model)."""
        return self.num_layers - self.dense_layers if self.num_experts else 0

    @classmethod
    def preset(cls, name: str) -> TransformerShape:
        """A published shape: ``"gpt2"``, ``"gpt2-xl"``, ``"gpt3-175b"``, ``"llama-2-7b"``, ``"llama-2-70b"``,
        ``"llama-3-8b"``, ``"llama-3-405b"``, ``"mixtral-8x7b"`` or ``"deepseek-v3"`` (see the module docstring)."""
        if name not in MODEL_SHAPES:
            raise ValueError(f"unknown model shape {name!r}; choose one of {sorted(MODEL_SHAPES)}")
        return dataclasses.replace(MODEL_SHAPES[name])

    @classmethod
    def from_gpt_config(cls, config: GPTConfig) -> TransformerShape:
        """The shape of ``TinyGPT(config)`` (``seq_len`` is its ``block_size``), its MoE blocks included."""
        moe = {"num_experts": config.n_experts, "top_k": config.top_k, "shared_experts": config.n_shared_experts,
               "expert_ffn_hidden_size": config.expert_hidden or 4 * config.n_embd} if config.n_experts else {}
        return cls(config.n_layer, config.n_embd, config.n_head, config.block_size, config.vocab_size,
                   bias=config.bias, tied_embeddings=config.tie_weights, **moe)


def mla_parameters(hidden: int, heads: int, q_rank: int, kv_rank: int, qk_nope: int, qk_rope: int,
                   v_dim: int) -> int:
    """Multi-head latent attention's weights (DeepSeek-V2/V3): queries through a rank-``q_rank`` bottleneck
    (down, its RMSNorm, up to ``heads x (qk_nope + qk_rope)``), keys and values through a shared
    ``kv_rank`` latent plus one rotary key of ``qk_rope`` (down, its RMSNorm, up to ``heads x (qk_nope + v)``),
    and the output projection from ``heads x v``."""
    queries = hidden * q_rank + q_rank + q_rank * heads * (qk_nope + qk_rope)
    keys_values = hidden * (kv_rank + qk_rope) + kv_rank + kv_rank * heads * (qk_nope + v_dim)
    return queries + keys_values + heads * v_dim * hidden


_LLAMA = {"mlp": "swiglu", "norm": "rmsnorm", "bias": False, "learned_positions": False,
          "tied_embeddings": False}
MODEL_SHAPES = {
    "gpt2": TransformerShape(12, 768, 12, 1024, 50257),
    "gpt2-xl": TransformerShape(48, 1600, 25, 1024, 50257),
    "gpt3-175b": TransformerShape(96, 12288, 96, 2048, 50257),
    "llama-2-7b": TransformerShape(32, 4096, 32, 4096, 32000, ffn_hidden_size=11008, **_LLAMA),
    "llama-2-70b": TransformerShape(80, 8192, 64, 4096, 32000, ffn_hidden_size=28672, num_kv_heads=8,
                                    **_LLAMA),
    # Llama 3 (Dubey et al. 2024, Table 3): 8B and 405B at the 8,192 tokens of their main pre-training stage
    "llama-3-8b": TransformerShape(32, 4096, 32, 8192, 128256, ffn_hidden_size=14336, num_kv_heads=8, **_LLAMA),
    "llama-3-405b": TransformerShape(126, 16384, 128, 8192, 128256, ffn_hidden_size=53248, num_kv_heads=8,
                                     **_LLAMA),
    # Mixtral 8x7B (Jiang et al. 2024, Table 1: 8 experts, top-2, "47B" of which "13B active"; Mistral AI's
    # announcement: 46.7B and 12.9B), at 4,096 training tokens (the paper gives the 32k context only)
    "mixtral-8x7b": TransformerShape(32, 4096, 32, 4096, 32000, ffn_hidden_size=14336, num_kv_heads=8, num_experts=8,
                                     top_k=2, **_LLAMA),
    # DeepSeek-V3 (DeepSeek-AI 2024, sections 2.1 and 4.2: 61 layers, the first 3 dense, then 1 shared and 256
    # routed experts of width 2048, 8 a token on at most 4 nodes; MLA; 4K tokens in pre-training): "671B total
    # parameters with 37B activated for each token" (the multi-token prediction module, 14B more, is left out, as
    # the 671B does)
    "deepseek-v3": TransformerShape(61, 7168, 128, 4096, 129280, ffn_hidden_size=18432, num_experts=256, top_k=8,
                                    expert_ffn_hidden_size=2048, shared_experts=1, dense_layers=3, max_nodes=4,
                                    attention_parameters=mla_parameters(7168, 128, 1536, 512, 128, 64, 128),
                                    qk_head_dim=192, v_head_dim=128, **_LLAMA),
}


def mlp_parameters(shape: TransformerShape, width: int) -> int:
    """One MLP of hidden width ``width``: two matrices (GELU) or three (SwiGLU), and their biases."""
    h = shape.hidden_size
    if shape.mlp == "gelu":
        return 2 * h * width + (width + h if shape.bias else 0)
    return 3 * h * width + (2 * width + h if shape.bias else 0)


def attention_parameters(shape: TransformerShape) -> int:
    """One layer's attention weights: ``q, o`` (``h x h``) and ``k, v`` (narrower under grouped-query attention),
    or the shape's own count (multi-head latent attention)."""
    if shape.attention_parameters is not None:
        return shape.attention_parameters
    h = shape.hidden_size
    kv_width = shape.num_kv_heads * (h // shape.num_heads)
    return 2 * h * h + 2 * h * kv_width + (2 * h + 2 * kv_width if shape.bias else 0)


def expert_parameters(shape: TransformerShape) -> int:
    """The routed experts' parameters over all layers: what expert parallelism splits (0 for a dense model)."""
    return shape.moe_layers * shape.num_experts * mlp_parameters(shape, shape.expert_ffn_hidden_size)


def num_parameters(shape: TransformerShape, active: bool = False) -> int:
    """Parameters of ``shape`` as built: attention, MLP (or the router and experts) and two norms per layer, a
    final norm, embeddings.  ``active``: those one token uses, its ``top_k`` routed experts of ``num_experts``."""
    h = shape.hidden_size
    norm = h * (2 if shape.norm == "layernorm" and shape.bias else 1)
    embeddings = shape.vocab_size * h * (1 if shape.tied_embeddings else 2)
    embeddings += shape.seq_len * h if shape.learned_positions else 0
    dense_layers = shape.num_layers - shape.moe_layers
    return (dense_layers * layer_parameters(shape) + shape.moe_layers * layer_parameters(shape, True, active)
            + norm + embeddings)


def layer_parameters(shape: TransformerShape, moe: bool = False, active: bool = False) -> int:
    """One layer's parameters: attention, two norms, and its MLP, or (``moe``) its router and experts (``active``:
    a token's ``top_k`` routed ones of ``num_experts``)."""
    h = shape.hidden_size
    norms = 2 * h * (2 if shape.norm == "layernorm" and shape.bias else 1)
    if not moe:
        return attention_parameters(shape) + mlp_parameters(shape, shape.ffn_hidden_size) + norms
    routed = (shape.top_k if active else shape.num_experts) * mlp_parameters(shape, shape.expert_ffn_hidden_size)
    shared = mlp_parameters(shape, shape.shared_experts * shape.expert_ffn_hidden_size) if shape.shared_experts else 0
    return attention_parameters(shape) + h * shape.num_experts + routed + shared + norms
