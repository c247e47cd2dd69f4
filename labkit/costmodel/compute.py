"""Back-of-the-envelope models of training cost: how much compute and memory a model needs.

Lesson 00 starts here, with the two reasons training is distributed at all:

- **Memory.** Training with Adam in mixed precision keeps, per parameter, 2 bytes of bf16/fp16 weights, 2 bytes
  of gradients and 12 bytes of optimizer state (fp32 master weights, momentum, variance): **16 bytes per
  parameter** before a single activation.  A 7B-parameter model needs 112 GB; the largest GPUs hold 80-141 GB.
- **Time.** A transformer's forward and backward pass cost about **6 FLOPs per parameter per token** (2 for the
  forward multiply-add, 4 for the backward), so training on D tokens costs ``6 N D`` FLOPs.  A GPU delivers
  its peak only in part: the *model FLOPs utilisation* (MFU) of good large-scale runs is 38-49 %
  (:data:`MFU_OF_LARGE_RUNS`, with its sources).

So ``time = 6 N D / (GPUs x peak x MFU)`` — and the rest of the course is about keeping MFU high while the
GPUs count grows.  (``labkit.costmodel.memory`` has the full memory model, ``labkit.costmodel.step`` the
time of one step.)
"""

from __future__ import annotations

from typing import Any

from labkit.costmodel import hardware

SECONDS_PER_DAY = 86_400.0
BYTES_PER_PARAMETER_MIXED_ADAM = 16  # 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master, m, v)


# The MFU that published large runs report, lowest and highest, the range every lesson quotes: Llama 3 405B's
# pre-training at 38-43 % of the H100's bf16 peak (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4) and
# Megatron-LM's H100 model table at 41-49 % (README "Performance Benchmarking", Megatron-Core r0.8.0; 49 % for its
# 16B on 192 GPUs).  Narayanan et al. 2021's "52 % of peak" for a 1T GPT on A100s (Table 1: 163 of 312 TFLOP/s)
# counts the recomputed forward (their equation 3): hardware FLOPs, 39 % as MFU (labkit.costmodel.published).
MFU_OF_LARGE_RUNS = (0.38, 0.49)

# The GPUs' presets live in labkit.costmodel.hardware (one source for every lesson); they are re-exported here.
GPU, GPUS = hardware.GPU, hardware.GPUS


def training_flops(parameters: float, tokens: float) -> float:
    """FLOPs to train a dense transformer with ``parameters`` on ``tokens``: about 6 N D."""
    if parameters <= 0 or tokens <= 0:
        raise ValueError(f"parameters and tokens must be positive, got {parameters!r} and {tokens!r}")
    return 6.0 * parameters * tokens


def training_time_seconds(parameters: float, tokens: float, gpus: int, peak_flops_per_gpu: float,
                          utilization: float = 0.4) -> float:
    """Wall-clock seconds for ``training_flops`` on ``gpus`` GPUs running at ``utilization`` of their peak.

    This is the ideal: it assumes communication is perfectly hidden, which later lessons show is the hard part.
    """
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return training_flops(parameters, tokens) / (gpus * peak_flops_per_gpu * utilization)


def model_state_bytes(parameters: float, bytes_per_parameter: float = BYTES_PER_PARAMETER_MIXED_ADAM) -> float:
    """Bytes of weights + gradients + optimizer state, before activations (16 B/param for mixed-precision Adam)."""
    if parameters <= 0:
        raise ValueError(f"parameters must be positive, got {parameters!r}")
    return parameters * bytes_per_parameter


# --------------------------------------------------------------------------------------------------------
# FLOPs of a transformer step (lesson 11)


def matmul_parameters_per_layer(shape: Any) -> float:
    """The weights one layer multiplies each token by (``labkit.costmodel.shapes.TransformerShape``): the four
    attention projections (key and value narrower under grouped-query attention; a multi-head latent attention's
    own count) and the MLP's two (GELU) or three (SwiGLU) matrices.  Biases and norms are left out: their FLOPs
    are ``O(h)`` per token.  In a mixture of experts a token meets its ``top_k`` routed experts, the shared
    ones and the router (``h E``): the *active* weights, averaged here over the dense and the MoE layers."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    kv_width = shape.num_kv_heads * (h // shape.num_heads)
    attention = 2 * h * h + 2 * h * kv_width if shape.attention_parameters is None else shape.attention_parameters
    matrices = 2 if shape.mlp == "gelu" else 3
    if not getattr(shape, "moe_layers", 0):
        return attention + matrices * h * f
    active = (shape.top_k + shape.shared_experts) * matrices * h * shape.expert_ffn_hidden_size + h * shape.num_experts
    dense = shape.num_layers - shape.moe_layers
    return attention + (dense * matrices * h * f + shape.moe_layers * active) / shape.num_layers


def model_flops_per_step(shape: Any, global_batch: int, seq_len: int | None = None,
                         recompute: bool = False, causal: bool = False) -> float:
    """FLOPs of one training step over ``global_batch`` sequences of ``seq_len`` tokens (default: the shape's).

    Counted as Narayanan et al. 2021 (section 5.1, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM") count them: per layer and token, ``2`` FLOPs per multiplied weight and ``4 s h``
    for the attention scores and their weighted sum (``Q K^T`` and ``A V``, the causal mask not exploited); the
    logits ``2 h V`` per token; backward twice the forward, and with full activation ``recompute`` the layers'
    forward once more.  For GPT's shape (``f = 4h``, no grouped-query attention) this is their
    ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` with recomputation and ``72 B s l h^2 (1 + s / 6h + V / 12 l h)``
    without (:func:`narayanan_flops`).  MFU counts the step without recomputation (the model's FLOPs), whatever
    the run recomputed; the FLOPs a GPU actually executed (HFU) include it.  ``causal``: attention counted over the
    ``s (s + 1) / 2`` query-key pairs the causal mask leaves, the work a causal kernel does (about half of
    Megatron's count's at long sequences): not the MFU's count, but what the time follows.
    """
    layer_forward = layer_flops(shape, global_batch, seq_len, causal)
    logits_forward = head_flops(shape, global_batch, seq_len)
    return shape.num_layers * layer_forward * (4 if recompute else 3) + 3 * logits_forward


def _tokens(global_batch: int, seq_len: int) -> int:
    if global_batch < 1 or seq_len < 1:
        raise ValueError(f"global_batch and seq_len must be >= 1, got {global_batch!r} and {seq_len!r}")
    return global_batch * seq_len


def layer_flops(shape: Any, global_batch: int, seq_len: int | None = None, causal: bool = False) -> float:
    """One layer's forward FLOPs over ``global_batch`` sequences (:func:`model_flops_per_step`'s count; with
    ``causal``, each query's attention over the ``(s + 1) / 2`` keys it sees on average, not all ``s``)."""
    s = shape.seq_len if seq_len is None else seq_len
    keys = (s + 1) / 2 if causal else s
    return _tokens(global_batch, s) * (2 * matmul_parameters_per_layer(shape) + 2 * keys * attention_width(shape))


def attention_width(shape: Any) -> int:
    """The widths a token's attention scores and weighted sum run over, ``heads x (qk_dim + v_dim)``: ``2 h``
    for standard heads, wider for DeepSeek's latent attention (``128 x (192 + 128)`` against ``2 x 7168``)."""
    head = shape.hidden_size // shape.num_heads
    qk, v = getattr(shape, "qk_head_dim", None) or head, getattr(shape, "v_head_dim", None) or head
    return shape.num_heads * (qk + v)


def head_flops(shape: Any, global_batch: int, seq_len: int | None = None) -> float:
    """The output layer's forward FLOPs (the logits, ``2 h V`` a token); its backward costs twice that."""
    s = shape.seq_len if seq_len is None else seq_len
    return _tokens(global_batch, s) * 2 * shape.hidden_size * shape.vocab_size


def narayanan_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int, recompute: bool = True
                    ) -> float:
    """Narayanan et al. 2021's closed form (their equation 3 with recomputation; 72 and 12 without)."""
    if recompute:
        return 96 * batch * seq_len * layers * hidden ** 2 * (1 + seq_len / (6 * hidden)
                                                              + vocab / (16 * layers * hidden))
    return 72 * batch * seq_len * layers * hidden ** 2 * (1 + seq_len / (6 * hidden) + vocab / (12 * layers * hidden))


def mfu(flops_per_step: float, step_s: float, gpus: int, peak_flops_per_gpu: float) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second over the GPUs' peak (PaLM, Chowdhery et al. 2022)."""
    if step_s <= 0 or gpus < 1 or peak_flops_per_gpu <= 0:
        raise ValueError(f"step_s, gpus and peak_flops_per_gpu must be positive, got {step_s!r}, {gpus!r}, "
                         f"{peak_flops_per_gpu!r}")
    return flops_per_step / step_s / (gpus * peak_flops_per_gpu)


def tokens_per_second(global_batch: int, seq_len: int, step_s: float) -> float:
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s!r}")
    return global_batch * seq_len / step_s
