"""Transformers counted for memory: their shapes, parameters and the activations a layer saves.

The model states per parameter and per rank are :mod:`labkit.costmodel.memory`'s, which re-exports every
public name here (``from labkit.costmodel.memory import TransformerShape`` keeps working).

**Activations of a standard transformer** (:class:`TransformerShape`, :func:`layer_activation_bytes`).  Per
layer and micro-batch, Korthikanti et al. count, in 16-bit values with 1-byte dropout masks and the
``a s^2 b`` attention matrix stored (softmax output, its dropout mask, the dropout output):

- attention: LayerNorm input, QKV input, Q, K, V, output-projection input: ``2 sbh`` each;
  ``5 a s^2 b``; dropout mask ``sbh``;
- MLP (``4h`` wide, GELU): LayerNorm input and MLP input ``2 sbh`` each, GELU input and output ``8 sbh`` each,
  dropout mask ``sbh``;

``s b h (34 + 5 a s / h)`` bytes in all.  Under tensor parallelism of degree ``t`` everything but ``10 sbh``
(the LayerNorm and projection inputs, the two dropout masks) is split: ``sbh (10 + 24/t + 5as/(ht))``;
*sequence parallelism* splits the remaining ``10 sbh`` too, so the whole layer is divided by ``t``.
:func:`layer_activation_bytes` itemises the same tensors for any shape: fp32 (4-byte values: ``sbh (66 +
9as/h)``), no dropout, *flash attention* (no ``s^2`` term, only a 4-byte log-sum-exp per row, ``4 a s b``), a
SwiGLU MLP (gate and up outputs, ``silu(gate)`` and the product: ``4 s b f`` values, where GELU's ``4h`` MLP
stores ``2 s b f``), and grouped-query attention (K and V at ``kv_heads / heads`` of the width, as kernels
with native GQA store them; code that repeats K and V to every head stores them at full width).  Llama-2-7B's
SwiGLU (``f = 2.6875 h``) thus stores about ``37.5 sbh`` bytes per layer at 16 bits without dropout and with
flash attention, where GPT's ``4h`` GELU stores ``32 sbh``: the 34 belongs to GPT's MLP.  (A fused SwiGLU
kernel that recomputes ``silu(gate)`` keeps less.)  It omits, as the paper does, what is ``h`` times smaller:
the norms' per-token statistics, rotary tables.  With *full activation checkpointing* only each layer's input
is kept, ``2 sbh`` per layer at 16 bits (divided by ``t`` with sequence parallelism), plus one layer's
activations rebuilt during its backward pass (:func:`activation_bytes`).  Pipeline parallelism changes the
count of layers whose activations a rank holds (``layers=``), not the per-layer bytes: with 1F1B, the first of
``p`` stages keeps ``p`` micro-batches of ``L / p`` layers, as many as without pipelining.

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
one shared expert and 256 routed ones, 8 a token, and multi-head latent attention (:func:`mla_parameters`).
An MoE layer's activations add each token's ``k`` dispatched copies and its experts' hidden tensors
(``k + shared`` experts' worth) in place of the dense MLP's.

For example GPT-3 175B (``s = 2048``, ``b = 1``) stores 2.87 GB per layer, 275 GB for 96 layers; ``t = 8``
with sequence parallelism makes that 34.4 GB per rank, and full checkpointing 7.7 GB on one rank.

**TinyGPT, to the byte** (:func:`tinygpt_activation_bytes`).  On CPU in fp32 a TinyGPT block saves ``64 sbh``
bytes (Korthikanti's tensors less the dropout masks, 16 values per ``s b h``, at 4 bytes) plus ``16 sb`` (two
LayerNorms' mean and inverse standard deviation) plus the attention core.  ``scaled_dot_product_attention``
takes the CPU flash kernel when there is no dropout: ``4 a s b`` of log-sum-exp, no matrix.  With dropout in
training it falls back to the math path, which stores the softmax output, its dropout mask and the dropout
output, ``12 a s^2 b``, and CPU dropout keeps a 4-byte float mask (``4 sbh`` twice per block; CUDA's fused
dropout keeps a 1-byte mask).  The embedding and the loss add token and position ids (int64), the final norm's
input and statistics, the head's input and, with targets, the log-softmax output ``4 s b V``, the targets and
one scalar.  The prediction equals what ``labkit.measure.ActivationMeter`` measures exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from labkit.models import GPTConfig

PRECISIONS = ("fp32", "mixed")


def _check_count(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_amount(name: str, value: Any, minimum_exclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (minimum_exclusive and value == 0):
        bound = "> 0" if minimum_exclusive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


# --------------------------------------------------------------------------------------------------------
# Transformer shapes and their activations


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
        for name in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "ffn_hidden_size",
                     "num_kv_heads"):
            _check_count(name, getattr(self, name))
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
    # routed experts of width 2048, 8 a token; MLA; 4K tokens in pre-training): "671B total parameters with 37B
    # activated for each token" (the multi-token prediction module, 14B more, is left out, as the 671B does)
    "deepseek-v3": TransformerShape(61, 7168, 128, 4096, 129280, ffn_hidden_size=18432, num_experts=256, top_k=8,
                                    expert_ffn_hidden_size=2048, shared_experts=1, dense_layers=3,
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


def korthikanti_layer_activation_bytes(seq_len: int, micro_batch: int, hidden_size: int, num_heads: int,
                                       tp_degree: int = 1, sequence_parallel: bool = False,
                                       attention_matrix: bool = True) -> float:
    """Korthikanti et al.'s ``s b h (34 + 5 a s / h)`` bytes per layer (16-bit, dropout, attention matrix
    stored), as ``s b h (10 + 24 / t + 5 a s / (h t))`` under tensor parallelism and divided by ``t`` whole
    with sequence parallelism; ``attention_matrix=False`` leaves out the ``5 a s / h`` term (a fused kernel
    that keeps no score matrix, as the Ultra-Scale Playbook's memory figures do)."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden_size", hidden_size),
                        ("num_heads", num_heads), ("tp_degree", tp_degree)):
        _check_count(name, value)
    s, b, h, a, t = seq_len, micro_batch, hidden_size, num_heads, tp_degree
    replicated = 10 / t if sequence_parallel else 10
    return s * b * h * (replicated + 24 / t + (5 * a * s / (h * t) if attention_matrix else 0.0))


def _layer_activation_terms(shape: TransformerShape, micro_batch: int, value_bytes: int, mask_bytes: int,
                            attention_matrix: bool) -> tuple[int, int]:
    """One layer's saved bytes as ``(sequence region, tensor-parallel region)``.  ``mask_bytes`` 0: no
    dropout.  The first part is replicated on tensor-parallel ranks unless sequence parallelism splits it."""
    s, b, h, a = shape.seq_len, micro_batch, shape.hidden_size, shape.num_heads
    kv_width = shape.num_kv_heads * (h // a)
    # Two norms' inputs, QKV input, MLP input; the dropout masks after attention and after the MLP.
    sequence = s * b * h * (4 * value_bytes + 2 * mask_bytes)
    # Q, output-projection input; K, V; the MLP's hidden tensors.
    tensor = s * b * (2 * h + 2 * kv_width) * value_bytes
    tensor += s * b * shape.ffn_hidden_size * value_bytes * (2 if shape.mlp == "gelu" else 4)
    if shape.moe_layers:  # an MoE layer's MLP part, the layers averaged: k copies of each token's input row,
        # the hidden tensors of its k routed and the shared experts, the router's fp32 scores
        moe = s * b * (shape.top_k * h * value_bytes + 4 * shape.num_experts)
        moe += s * b * (shape.top_k + shape.shared_experts) * shape.expert_ffn_hidden_size * value_bytes * (
            2 if shape.mlp == "gelu" else 4)
        dense = s * b * shape.ffn_hidden_size * value_bytes * (2 if shape.mlp == "gelu" else 4)
        tensor += (moe - dense) * shape.moe_layers / shape.num_layers
    if attention_matrix:  # softmax output; with dropout also its mask and its output
        tensor += a * s * s * b * (value_bytes + (mask_bytes + value_bytes if mask_bytes else 0))
    else:  # flash attention: one fp32 log-sum-exp per head and row
        tensor += 4 * a * s * b
    return sequence, tensor


def _activation_value_bytes(precision: str) -> int:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return 4 if precision == "fp32" else 2


def layer_activation_bytes(shape: TransformerShape, micro_batch: int, precision: str = "mixed",
                           dropout: bool = True, flash_attention: bool = False, tp_degree: int = 1,
                           sequence_parallel: bool = False) -> float:
    """Bytes one layer saves for backward, per tensor-parallel rank (itemised in the module docstring).

    ``precision``: ``"mixed"`` (16-bit activations) or ``"fp32"``; ``dropout``: 1-byte masks, as CUDA's fused
    dropout keeps.  For a GPT-style shape with the defaults this is
    :func:`korthikanti_layer_activation_bytes`.
    """
    _check_count("micro_batch", micro_batch)
    _check_count("tp_degree", tp_degree)
    if shape.num_heads % tp_degree or shape.num_kv_heads % tp_degree:
        raise ValueError(f"tp_degree={tp_degree} must divide num_heads={shape.num_heads} "
                         f"and num_kv_heads={shape.num_kv_heads}")
    sequence, tensor = _layer_activation_terms(shape, micro_batch, _activation_value_bytes(precision),
                                               1 if dropout else 0, attention_matrix=not flash_attention)
    return sequence / (tp_degree if sequence_parallel else 1) + tensor / tp_degree


def activation_bytes(shape: TransformerShape, micro_batch: int, precision: str = "mixed",
                     dropout: bool = True, flash_attention: bool = False, checkpointing: bool = False,
                     tp_degree: int = 1, sequence_parallel: bool = False, layers: int | None = None) -> float:
    """Peak activation bytes on one rank for ``layers`` layers (default all) of one micro-batch.

    Without checkpointing: ``layers`` times :func:`layer_activation_bytes`, all held when the forward pass
    ends.
    With full checkpointing: each layer's input (``s b h`` values, split by sequence parallelism) plus one
    layer's activations, rebuilt during its backward pass.  Embeddings and the loss are left out.
    """
    layers = shape.num_layers if layers is None else layers
    _check_count("layers", layers)
    per_layer = layer_activation_bytes(shape, micro_batch, precision, dropout, flash_attention, tp_degree,
                                       sequence_parallel)
    if not checkpointing:
        return layers * per_layer
    layer_input = shape.seq_len * micro_batch * shape.hidden_size * _activation_value_bytes(precision)
    return layers * layer_input / (tp_degree if sequence_parallel else 1) + per_layer


def tinygpt_activation_bytes(config: GPTConfig, batch_size: int, seq_len: int | None = None,
                             checkpointed: int = 0, training: bool = True, with_loss: bool = True,
                             tp_degree: int | None = None, sequence_parallel: bool = False) -> int:
    """Bytes a fp32 ``TinyGPT(config)`` saves for backward on CPU: what :class:`ActivationMeter` measures
    around ``model(idx, targets)``, when the forward pass ends.

    ``seq_len`` defaults to ``config.block_size``; ``checkpointed``: how many blocks :func:`checkpoint_blocks`
    made recompute (each keeps only its input); ``training``: the model's mode (dropout acts only in
    training);
    ``with_loss``: targets were given.  ``idx`` and ``targets`` are assumed to be tensors of their own, not
    views into larger ones (the meter counts whole storages).

    ``tp_degree``: ``None`` for the plain model; ``t`` for one rank of the model split by
    ``labkit.parallel.tensor.parallelize_tensor`` over ``t`` ranks (with ``sequence_parallel`` or not), whose
    layers keep the dense ones' tensors at ``1/t`` of the width, and whose vocabulary-parallel embedding and
    loss keep their own: the embedding's local ids and a one-byte mask of the ids outside this rank's rows;
    the loss's softmax over this rank's ``V_padded / t`` columns, its local targets and their mask.
    """
    _check_count("batch_size", batch_size)
    s = config.block_size if seq_len is None else seq_len
    _check_count("seq_len", s)
    if s > config.block_size:
        raise ValueError(f"seq_len={s} exceeds block_size={config.block_size}")
    if isinstance(checkpointed, bool) or not isinstance(checkpointed, int) \
            or not 0 <= checkpointed <= config.n_layer:
        raise ValueError(f"checkpointed must be an integer in [0, {config.n_layer}], got {checkpointed!r}")
    t = 1 if tp_degree is None else tp_degree
    _check_count("tp_degree", t)
    if config.n_head % t or (sequence_parallel and s % t):
        raise ValueError(f"tp_degree={t} must divide n_head={config.n_head}"
                         + (f" and the sequence length {s}" if sequence_parallel else ""))
    b, h, v = batch_size, config.n_embd, config.vocab_size
    dropout = training and config.dropout > 0
    mask_bytes = 4 if dropout else 0  # CPU dropout saves a float mask
    shape = dataclasses.replace(TransformerShape.from_gpt_config(config), seq_len=s)
    sl = s // t if sequence_parallel else s  # the tokens of the regions between the split matrices, per rank
    # With dropout, CPU scaled_dot_product_attention takes the math path and stores the attention matrix.
    sequence, _ = _layer_activation_terms(dataclasses.replace(shape, seq_len=sl), b, 4, mask_bytes, dropout)
    local = dataclasses.replace(shape, hidden_size=h // t, num_heads=config.n_head // t,
                                num_kv_heads=config.n_head // t, ffn_hidden_size=4 * h // t)
    _, tensor = _layer_activation_terms(local, b, 4, mask_bytes, attention_matrix=dropout)
    block = sequence + tensor + 2 * 8 * sl * b  # + two LayerNorms' mean and rstd (fp32 per token)
    block_input = 4 * sl * b * h
    outside = 8 * sl + mask_bytes * sl * b * h  # position ids; the embedding dropout's mask
    outside += 4 * sl * b * h + 8 * sl * b  # the final norm's input and statistics
    outside += 4 * sl * b * h  # the head's input
    if tp_degree is None:
        outside += 8 * b * s  # token ids
        if with_loss:
            outside += 4 * s * b * v + 8 * b * s + 4  # log-softmax output, targets, total weight
    else:
        outside += 9 * b * s  # local token ids and the mask of those outside this rank's rows
        if with_loss:
            outside += 4 * s * b * (-(-v // t)) + 9 * b * s  # softmax of the local columns; local targets, mask
    return checkpointed * block_input + (config.n_layer - checkpointed) * block + outside
