"""A layer's time on a GPU from its kernels' shapes: matrix products on a roofline, attention by the tiles a
causal kernel computes, and everything else as bytes over the memory's bandwidth (lesson 11).

A fixed fraction of the peak for every FLOP prices a 1B model on 8 GPUs like a 175B model on 1,024.  They are
not alike: a narrow model's matrix products are small (some do not fill the GPU), its norms, activations and
residual adds move as many bytes per FLOP as a wide model's move per hundred, and its logits (``V`` wide
whatever ``h``) weigh more.  So each kernel of a layer is priced by its own shape (:class:`Kernels`):

- **Matrix products** (:meth:`Kernels.gemm_s`): ``2 m n k`` FLOPs at ``gemm_efficiency`` of the peak, or the
  bytes of the three matrices over the memory bandwidth if that is longer (the *roofline*: Williams,
  Waterman and Patterson 2009, "Roofline: an insightful visual performance model for multicore
  architectures", CACM 52(4)).  A product is cut into output tiles of ``128 x 128`` (cuBLAS's and CUTLASS's
  usual tile for 16-bit inputs), one streaming multiprocessor (SM) each at a time: with fewer tiles than
  SMs the rest of the GPU idles, so a product of ``tiles < SMs`` runs at ``tiles / SMs`` of the rate.  Past
  one wave, libraries split the remainder (stream-K, split-K) and the rate is taken as full.  Backward runs
  two products of the same FLOPs (the input's gradient ``m x k`` and the weight's ``k x n``).
- **Attention**, a fused (flash) kernel (:meth:`Kernels.flash_attention_s`): the two products ``Q K^T`` and
  ``P V`` over the ``128 x 128`` tiles of the score matrix that the causal mask does not blank entirely —
  ``n (n + 1) / 2`` of ``n^2`` for ``n = s / 128``, the diagonal tiles in full (FlashAttention-2, Dao 2023,
  arXiv 2307.08691, section 3.1: "we skip the computation of blocks ... for which all entries are masked") —
  at ``attention_efficiency`` of the peak; backward does 2.5 times the forward's FLOPs (the scores
  recomputed, then four products: FlashAttention-2's own count, ``benchmarks/benchmark_flash_attention.py``
  of Dao-AILab/flash-attention).  One thread block a ``128``-row block of queries and a head: fewer blocks
  than SMs leave the rest idle, as for products.  Without a fused kernel (Megatron-LM in 2021) the scores
  are a batched product of the full ``s x s`` matrix (masked after, nothing skipped), and softmax and dropout
  read and write the ``b a s^2`` scores through memory.
- **Memory-bound operations** (:func:`elementwise_bytes`): the norms, the activation function, dropout, the
  bias and residual adds, rotary embeddings, the loss's softmax over the vocabulary and the optimizer's
  update move bytes, not FLOPs: their bytes over ``memory_efficiency`` of the HBM bandwidth.

**The MFU count is not the time.**  ``labkit.costmodel.compute.model_flops_per_step`` counts attention
without the causal mask, as Megatron-LM and every MFU in the published tables do; the time here follows the
work the kernel does, half of that at long sequences.

:data:`GEMM_TILE` and the FLOPs counts are sourced above; the three efficiencies are not on any datasheet:
:mod:`labkit.costmodel.validation` fits them on one set of published runs and tests them on the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GEMM_TILE = 128  # rows and columns of one output tile (module docstring)
ATTENTION_BLOCK = 128  # queries and keys per tile of a flash-attention kernel
FLASH_BACKWARD_RATIO = 2.5  # a flash kernel's backward FLOPs over its forward's (module docstring)
# The three efficiencies, fitted on Megatron-LM's H100 table (labkit.costmodel.validation.fit_kernels; refitted
# in tests/test_costmodel_published.py)
GEMM_EFFICIENCY = 0.57
ATTENTION_EFFICIENCY = 0.75
MEMORY_EFFICIENCY = 0.46
# The cross-entropy over the vocabulary, as Megatron-LM's vocab-parallel loss runs it
# (megatron/core/tensor_parallel/cross_entropy.py, on logits cast to fp32): forward, the cast (read 2, write 4),
# the max (read 4), the shift (read and write 4), the exponential (read and write 4), the sum (read 4) and the
# division into probabilities kept for backward (read and write 4): 38 bytes a logit; backward, the
# probabilities times the loss's gradient (read and write 4) and the cast back (read 4, write 2): 14.
LOSS_FORWARD_BYTES = 38
LOSS_BACKWARD_BYTES = 14
ADAM_BYTES_PER_PARAMETER = 30  # read fp32 master, m, v (12) and write them (12), write the 16-bit weight (2) ...
# ... and read the gradient (gradient_bytes more): the optimizer's step on each parameter a rank updates


@dataclass(frozen=True)
class Kernels:
    """One GPU's rates for each kind of kernel (module docstring): its datasheet ``peak_flops`` (dense 16-bit)
    and ``memory_bandwidth`` (HBM, bytes/s), its ``multiprocessors`` (SMs), and the fractions of each that its
    matrix products, attention kernels and memory-bound kernels reach."""

    peak_flops: float
    memory_bandwidth: float
    multiprocessors: int
    gemm_efficiency: float
    attention_efficiency: float
    memory_efficiency: float

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if isinstance(self.multiprocessors, bool) or not isinstance(self.multiprocessors, int) \
                or self.multiprocessors < 1:
            raise ValueError(f"multiprocessors must be an integer >= 1, got {self.multiprocessors!r}")
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")

    def fill(self, blocks: float) -> float:
        """The share of the SMs ``blocks`` independent tiles keep busy: ``blocks / SMs`` below one wave, else 1."""
        return min(1.0, blocks / self.multiprocessors)

    def memory_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` through HBM at ``memory_efficiency`` of its bandwidth."""
        return nbytes / (self.memory_efficiency * self.memory_bandwidth)

    def gemm_s(self, m: float, n: float, k: float, batch: float = 1, value_bytes: int = 2) -> float:
        """One product of an ``m x k`` by a ``k x n`` matrix (``batch`` of them at once): the longer of its FLOPs
        at ``gemm_efficiency`` of the peak, scaled by how much of the GPU its tiles fill, and its bytes."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        tiles = batch * math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
        compute = 2 * m * n * k * batch / (self.gemm_efficiency * self.peak_flops * self.fill(tiles))
        return max(compute, self.memory_s(value_bytes * batch * (m * k + k * n + m * n)))

    def gemm_pass_s(self, m: float, n: float, k: float, backward: bool = False, batch: float = 1,
                    value_bytes: int = 2) -> float:
        """A weight's product forward (``m`` tokens, ``k`` in, ``n`` out), or its two backward: the input's
        gradient (``m x n`` by ``n x k``) and the weight's (``k x m`` by ``m x n``)."""
        if not backward:
            return self.gemm_s(m, n, k, batch, value_bytes)
        return self.gemm_s(m, k, n, batch, value_bytes) + self.gemm_s(k, n, m, batch, value_bytes)

    def flash_attention_s(self, sequences_heads: float, seq_len: float, qk_dim: float, v_dim: float,
                          causal: bool = True, backward: bool = False, kv_len: float | None = None) -> float:
        """A flash kernel over ``sequences_heads`` (sequences x heads on this GPU) of ``seq_len`` queries against
        ``kv_len`` keys (default the same), forward or backward (module docstring)."""
        flops = flash_attention_flops(seq_len, qk_dim, v_dim, causal, kv_len) * sequences_heads
        if backward:
            flops *= FLASH_BACKWARD_RATIO
        blocks = sequences_heads * math.ceil(seq_len / ATTENTION_BLOCK)
        return flops / (self.attention_efficiency * self.peak_flops * self.fill(blocks))


def flash_attention_flops(seq_len: int, qk_dim: int, v_dim: int, causal: bool = True, kv_len: int | None = None,
                          block: int = ATTENTION_BLOCK) -> float:
    """Forward FLOPs of a flash kernel for one sequence and head: ``2 x block x block x (d_qk + d_v)`` per tile
    computed (a tile at the sequence's end as long as what is left), every tile of ``ceil(s / block) x
    ceil(kv / block)`` without the mask, those on or below the diagonal with it (queries and keys aligned at the
    start: the same sequence, ``n (n + 1) / 2`` tiles for ``n`` blocks)."""
    if not causal or kv_len is not None:
        return 2 * seq_len * (seq_len if kv_len is None else kv_len) * (qk_dim + v_dim)
    whole, rest = divmod(seq_len, block)  # n whole blocks, and a last one of what is left
    pairs = block * block * whole * (whole + 1) / 2 + rest * seq_len  # block i sees blocks 0 .. i, whole
    return 2 * pairs * (qk_dim + v_dim)


def elementwise_bytes(shape: Any, tokens: float, tp: int, sequence_parallel: bool, dropout: bool,
                      value_bytes: int = 2, moe: bool = False) -> float:
    """Bytes one layer's memory-bound operations move forward, on one of ``tp`` ranks, for ``tokens`` tokens,
    with the fused kernels Megatron-LM and Transformer Engine use: each norm reads and writes ``h`` a token;
    the biased activation reads ``f / t`` (SwiGLU: ``2 f / t``, its gate and its input) and writes ``f / t``;
    each of the two bias-dropout-residual adds reads the branch and the residual and writes their sum, ``3 h``
    (and a 1-byte mask with ``dropout``); rotary embeddings (a shape without learned positions) read and
    write the queries and keys.  Norms and residual adds run on ``tokens / t`` of them with sequence
    parallelism, on all of them (repeated on every rank) without.  In an MoE layer (``moe``) a token's
    activation runs in each of its ``k`` routed and its shared experts."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    if moe:  # a token's experts each run the activation on their own width
        f = (shape.top_k + shape.shared_experts) * shape.expert_ffn_hidden_size
    per_rank_tokens = tokens / tp if sequence_parallel else tokens
    mask = 1 / value_bytes if dropout else 0.0
    sequence_side = (2 * h) * 2 + 2 * (3 * h + h * mask)  # two norms, two bias-dropout-residual adds
    activation = (3 if shape.mlp == "swiglu" else 2) * f / tp
    rotary = 0.0
    if not shape.learned_positions:
        kv_width = shape.num_kv_heads * (h // shape.num_heads)
        rotary = 2 * (h + kv_width) / tp
    return value_bytes * (per_rank_tokens * sequence_side + tokens * (activation + rotary))


@dataclass(frozen=True)
class LayerTime:
    """One layer's seconds on one GPU for one micro-batch: ``forward``, ``backward`` (without recomputation),
    and the parts of the forward that a selective recomputation may rerun in the backward:
    ``attention_forward``, the unfused attention core (0 with a flash kernel, which recomputes its scores
    anyway), ``products_forward`` the matrix products and ``elementwise_forward`` the memory-bound operations
    (which move twice those bytes backward); ``products_backward``, the products' gradients."""

    forward: float
    backward: float
    attention_forward: float = 0.0
    products_forward: float = 0.0
    elementwise_forward: float = 0.0
    products_backward: float = 0.0


def attention_time(kernels: Kernels, shape: Any, batch: int, seq_len: int, tp: int, cp: int, flash: bool,
               dropout: bool, value_bytes: int) -> tuple[float, float]:
    """``(forward, backward)`` seconds of one layer's attention core (scores, softmax, weighted sum) on one GPU:
    ``batch`` sequences of ``seq_len`` tokens, ``heads / tp`` heads, ``1 / cp`` of the causal work (zig-zag
    balances it; each rank's blocks are ``s / cp`` queries long)."""
    heads = shape.num_heads / tp
    head = shape.hidden_size // shape.num_heads
    qk, v = getattr(shape, "qk_head_dim", None) or head, getattr(shape, "v_head_dim", None) or head
    if flash:
        flops = flash_attention_flops(seq_len, qk, v) * batch * heads / cp
        rate = kernels.attention_efficiency * kernels.peak_flops * kernels.fill(
            batch * heads * math.ceil(seq_len / cp / ATTENTION_BLOCK))
        return flops / rate, FLASH_BACKWARD_RATIO * flops / rate
    # unfused: two batched products over the whole score matrix, softmax and dropout through memory
    s, pairs = seq_len / cp, batch * heads * seq_len * seq_len / cp  # a rank's queries; its scores
    mask = 1 if dropout else 0
    forward = (kernels.gemm_s(s, seq_len, qk, batch * heads, value_bytes)
               + kernels.gemm_s(s, v, seq_len, batch * heads, value_bytes)
               + kernels.memory_s(pairs * (2 * value_bytes + (2 * value_bytes + mask if dropout else 0))))
    backward = (kernels.gemm_s(s, qk, seq_len, batch * heads, value_bytes)  # dQ
                + kernels.gemm_s(seq_len, qk, s, batch * heads, value_bytes)  # dK
                + kernels.gemm_s(s, seq_len, v, batch * heads, value_bytes)  # dP
                + kernels.gemm_s(seq_len, v, s, batch * heads, value_bytes)  # dV
                + kernels.memory_s(pairs * (3 * value_bytes + (2 * value_bytes + mask if dropout else 0))))
    return forward, backward


def layer_time(kernels: Kernels, shape: Any, batch: int, tp: int = 1, cp: int = 1, ep: int = 1,
               moe: bool = False, flash_attention: bool = True, dropout: bool = False,
               sequence_parallel: bool = True, value_bytes: int = 2) -> LayerTime:
    """One layer of ``shape`` (a dense one, or with ``moe`` one of its MoE layers) on one GPU for ``batch``
    sequences, split ``tp`` ways by tensor parallelism and ``cp`` ways by context parallelism, its experts
    ``ep`` ways (module docstring): the products on the roofline, the attention core, the memory-bound
    operations (backward moving twice the forward's bytes: each reads the output's gradient and the saved
    input, and writes the input's gradient)."""
    h, t = shape.hidden_size, tp
    tokens = batch * shape.seq_len / cp
    head = h // shape.num_heads
    v_width = shape.num_heads * (getattr(shape, "v_head_dim", None) or head)
    kv_width = shape.num_kv_heads * head
    into = (h + 2 * kv_width) if shape.attention_parameters is None else (shape.attention_parameters / h - v_width)
    products = [(tokens, into / t, h), (tokens, h, v_width / t)]
    gated = 2 if shape.mlp == "swiglu" else 1
    if not moe:
        f = shape.ffn_hidden_size
        products += [(tokens, gated * f / t, h), (tokens, h, f / t)]
    else:
        f, experts = shape.expert_ffn_hidden_size, shape.num_experts
        rows = tokens / t * ep * shape.top_k / experts  # each of this rank's experts, from the whole ep group
        grouped = [(rows, gated * f, h, experts / ep), (rows, h, f, experts / ep)]
        products += [(tokens, experts, h)]  # the router
        if shape.shared_experts:
            width = shape.shared_experts * f
            products += [(tokens, gated * width / t, h), (tokens, h, width / t)]
    forward = sum(kernels.gemm_pass_s(m, n, k, value_bytes=value_bytes) for m, n, k in products)
    backward = sum(kernels.gemm_pass_s(m, n, k, backward=True, value_bytes=value_bytes) for m, n, k in products)
    if moe:
        forward += sum(kernels.gemm_pass_s(m, n, k, batch=e, value_bytes=value_bytes) for m, n, k, e in grouped)
        backward += sum(kernels.gemm_pass_s(m, n, k, True, e, value_bytes) for m, n, k, e in grouped)
    attention_forward, attention_backward = attention_time(kernels, shape, batch, shape.seq_len, t, cp,
                                                       flash_attention, dropout, value_bytes)
    elementwise = kernels.memory_s(elementwise_bytes(shape, tokens, t, sequence_parallel and t > 1, dropout,
                                                     value_bytes, moe))
    return LayerTime(forward + attention_forward + elementwise, backward + attention_backward + 2 * elementwise,
                     0.0 if flash_attention else attention_forward, forward, elementwise, backward)


def head_time(kernels: Kernels, shape: Any, batch: int, tp: int = 1, cp: int = 1, value_bytes: int = 2
              ) -> tuple[float, float]:
    """``(forward, backward)`` seconds of the output layer and the loss on one GPU: the logits' product
    (``V / t`` of them a token) and the cross-entropy's passes over the logits through memory
    (:data:`LOSS_FORWARD_BYTES`, :data:`LOSS_BACKWARD_BYTES` a logit)."""
    tokens = batch * shape.seq_len / cp
    width = shape.vocab_size / tp
    forward = kernels.gemm_pass_s(tokens, width, shape.hidden_size, value_bytes=value_bytes)
    backward = kernels.gemm_pass_s(tokens, width, shape.hidden_size, backward=True, value_bytes=value_bytes)
    return (forward + kernels.memory_s(tokens * width * LOSS_FORWARD_BYTES),
            backward + kernels.memory_s(tokens * width * LOSS_BACKWARD_BYTES))


def optimizer_time(kernels: Kernels, parameters: float, gradient_bytes: int = 2) -> float:
    """Adam's step over the ``parameters`` a GPU updates (its ZeRO shard): :data:`ADAM_BYTES_PER_PARAMETER`
    and the gradient's bytes, each, through memory."""
    return kernels.memory_s(parameters * (ADAM_BYTES_PER_PARAMETER + gradient_bytes))
