"""Where the memory of training goes: the analytical model (``labkit.measure`` measures what it predicts).

**Model states** are what lives for the whole run, per parameter (``Psi`` parameters in all):

- *weights*: 4 bytes each in fp32, 2 in fp16/bf16;
- *gradients*: the same size as the weights;
- *optimizer states*: Adam keeps two moments (``exp_avg``, ``exp_avg_sq``), SGD with momentum one, plain SGD
  none, each in fp32; mixed precision adds the fp32 master copy of every weight (``labkit.precision``).

So Adam in fp32 holds ``4 + 4 + 8 = 16`` bytes per parameter and mixed-precision Adam ``2 + 2 + 12 = 16``
(:func:`bytes_per_parameter`; ZeRO, Rajbhandari et al. 2020, writes ``2 Psi + 2 Psi + K Psi`` with
``K = 12``).  A 1.5B-parameter GPT-2 thus needs 24 GB before the first activation.  Adam also keeps a
one-element ``step`` counter per parameter *tensor* (4 bytes each): :func:`model_state_bytes` reports those
apart (``labkit.measure.model_state_bytes``), as ``optimizer_other``, because the per-parameter model ignores them.

**Activations** are the tensors the forward pass saves for the backward pass (inputs of matrix
multiplications, attention probabilities, normalisation statistics, ...).  They grow with batch size ``b``,
sequence length ``s`` and depth, not with ``Psi``: Korthikanti et al. ("Reducing Activation Recomputation in
Large Transformer Models", 2022) count ``s b h (34 + 5 a s / h)`` bytes per transformer layer at 16 bits
(``h`` hidden size, ``a`` heads; the ``5 a s / h`` term is the attention matrix, which fused attention kernels
do not store).  ``labkit.measure.ActivationMeter`` measures them instead of trusting a formula, and
``labkit.recompute`` trades them for a second forward pass.

**Per rank, under data, tensor and pipeline parallelism** (:func:`memory_per_rank`).  Tensor and pipeline
parallelism split the parameters themselves: each rank holds ``Psi / (t p)`` of them (evenly, the model
assumes; replicated LayerNorms and an embedding on one stage make it slightly uneven).  Plain data parallelism
(DP) replicates everything on its ``N_d`` ranks; ZeRO partitions over them, stage by stage:

=========  ===========================  ==================================  ====================
stage      the paper's name             bytes per rank (mixed-precision)    7.5B, ``N_d = 64``
=========  ===========================  ==================================  ====================
DP (0)     baseline                     ``(2 + 2 + K) Psi``                 120 GB
ZeRO-1     ``P_os`` (optimizer states)  ``(2 + 2) Psi + K Psi / N_d``       31.4 GB
ZeRO-2     ``P_os+g`` (+ gradients)     ``2 Psi + (2 + K) Psi / N_d``       16.6 GB
ZeRO-3     ``P_os+g+p`` (+ parameters)  ``(2 + 2 + K) Psi / N_d``           1.9 GB
=========  ===========================  ==================================  ====================

with ``K = 12`` and GB = 1e9 bytes: Figure 1 of Rajbhandari et al., exactly (31.40625, 16.640625 and 1.875 GB
before the paper's rounding).  Like the figure, the model counts steady-state model states only: ZeRO-3's
transient gather of one layer's full parameters, communication buckets, and the allocator's caching come on
top.  Activations are added as the caller computes them for one rank (below).  ``labkit.fake_world`` holds these
terms to what PyTorch allocates on rank 0 of 1,024 GPUs (FSDP2 over tensor parallelism, and ZeRO-1), each
difference named: parameters tensor parallelism leaves whole, FSDP2's padded rows, and ZeRO-1 in PyTorch (as in
``labkit.parallel.zero``) giving each rank whole tensors, so that past as many ranks as tensors the fullest holds
the largest tensor's optimizer states, not ``K Psi / N_d``.

**Transformers** (:class:`TransformerShape`, the well-known shapes, :func:`num_parameters`, the activations
of a layer and TinyGPT's to the byte) are counted in :mod:`labkit.costmodel.shapes` and importable from here.

**At the peak of a step, and under gradient accumulation** (:func:`memory_per_rank`'s ``peak``,
``accumulating`` and ``gradient_bytes``).  Lesson 04 measures what a mixed-precision step holds at its peak:
the 16 bytes above plus a 4-byte fp32 copy of each gradient for the optimizer, 20 bytes per parameter
(``peak=True``: the copy is of the gradients the optimizer steps, so it is partitioned from ZeRO-1 on, and
needed only where the gradients held are narrower than fp32).  Frameworks that accumulate gradients in fp32
(Megatron-LM's ``main_grad``, Llama 3) hold 4-byte gradients instead (``gradient_bytes=4``) and step them
directly.  And ZeRO-2 and FSDP partition gradients only once they are reduced: where a step accumulates them
over several micro-batches before its one reduction (a pipeline's ``m > 1``, or gradient accumulation; labkit's
``parallelize``, ``ZeroDataParallel`` and ``FullyShardedDataParallel`` with sync off, Megatron's distributed
optimizer), each rank holds whole gradients through the schedule (``accumulating=True``), and ZeRO-2 saves
nothing on them over ZeRO-1.

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

from labkit.costmodel.shapes import PRECISIONS, TransformerShape, check_amount, check_count
from labkit.degrees import check_degree
from labkit.models import GPTConfig

# Optimizer states (fp32 tensors the size of the parameter) per optimizer.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
# --------------------------------------------------------------------------------------------------------
# The analytical model


def bytes_per_parameter(precision: str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Model-state bytes per parameter, as ``{"weights", "gradients", "optimizer_states"}``.

    ``precision``: ``"fp32"``, or ``"mixed"`` (16-bit weights and gradients, fp32 master weights);
    ``optimizer``: ``"adam"`` (Adam/AdamW), ``"momentum"`` (SGD with momentum) or ``"sgd"`` (plain SGD).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZER_STATES)}, got {optimizer!r}")
    moments = 4 * OPTIMIZER_STATES[optimizer]
    if precision == "fp32":
        return {"weights": 4, "gradients": 4, "optimizer_states": moments}
    return {"weights": 2, "gradients": 2, "optimizer_states": 4 + moments}  # + the fp32 master copy


def predicted_model_state_bytes(num_parameters: int, precision: str = "fp32",
                                optimizer: str = "adam") -> dict[str, int]:
    """:func:`bytes_per_parameter` times ``num_parameters``."""
    return {name: num_parameters * size for name, size in bytes_per_parameter(precision, optimizer).items()}


ZERO_STAGES = (0, 1, 2, 3)


def memory_per_rank(num_parameters: float, precision: str = "mixed", optimizer: str = "adam",
                    zero_stage: int = 0, dp_degree: int = 1, tp_degree: int = 1, pp_degree: int = 1,
                    activation_bytes: float = 0.0, *, accumulating: bool = False,
                    gradient_bytes: float | None = None, peak: bool = False) -> dict[str, float]:
    """Bytes one rank holds: ``{"weights", "gradients", "optimizer_states", "activations", "total"}``.

    ``num_parameters`` of the whole model (``Psi``), split evenly over ``tp_degree * pp_degree``
    model-parallel ranks; ``zero_stage`` 0 (plain data parallelism), 1, 2 or 3 partitions optimizer states,
    then gradients, then weights over the ``dp_degree`` data-parallel ranks (see the module docstring).
    ``activation_bytes`` is added as given: what one rank holds depends on the micro-batch, checkpointing and
    schedule (:func:`activation_bytes`).

    ``accumulating``: the step accumulates gradients over several micro-batches before its one reduction, so
    ZeRO-2 and FSDP hold them whole through the schedule (their partition starts with the reduce-scatter).
    ``gradient_bytes``: bytes per parameter of the gradients held (default the precision's: 2 mixed, 4 fp32;
    4 for gradients accumulated in fp32, as Megatron-LM and Llama 3 keep them).  ``peak``: count the step's
    peak, as lesson 04 measures it: in mixed precision the optimizer steps a 4-byte fp32 copy of the gradients
    narrower than that (of its own partition from ZeRO-1 on), counted in ``"gradients"``: 20 bytes per
    parameter for plain data parallelism.
    """
    check_amount("num_parameters", num_parameters)
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    for name, degree in (("dp_degree", dp_degree), ("tp_degree", tp_degree), ("pp_degree", pp_degree)):
        check_count(name, degree)
    check_amount("activation_bytes", activation_bytes, minimum_exclusive=False)
    per_parameter: dict[str, float] = dict(bytes_per_parameter(precision, optimizer))
    if gradient_bytes is not None:
        check_amount("gradient_bytes", gradient_bytes)
        per_parameter["gradients"] = gradient_bytes
    local_parameters = num_parameters / (tp_degree * pp_degree)

    def held(name: str, partitioned_from_stage: int) -> float:
        shards = dp_degree if zero_stage >= partitioned_from_stage else 1
        return per_parameter[name] * local_parameters / shards

    gradients = held("gradients", 4 if accumulating else 2)
    if peak and precision == "mixed" and per_parameter["gradients"] < 4:
        gradients += 4 * local_parameters / (dp_degree if zero_stage >= 1 else 1)  # the optimizer's fp32 copy
    memory = {"weights": held("weights", 3), "gradients": gradients,
              "optimizer_states": held("optimizer_states", 1), "activations": float(activation_bytes)}
    memory["total"] = sum(memory.values())
    return memory


# --------------------------------------------------------------------------------------------------------
# Activations


def korthikanti_layer_activation_bytes(seq_len: int, micro_batch: int, hidden_size: int, num_heads: int,
                                       tp_degree: int = 1, sequence_parallel: bool = False,
                                       attention_matrix: bool = True) -> float:
    """Korthikanti et al.'s ``s b h (34 + 5 a s / h)`` bytes per layer (16-bit, dropout, attention matrix
    stored), as ``s b h (10 + 24 / t + 5 a s / (h t))`` under tensor parallelism and divided by ``t`` whole
    with sequence parallelism; ``attention_matrix=False`` leaves out the ``5 a s / h`` term (a fused kernel
    that keeps no score matrix, as the Ultra-Scale Playbook's memory figures do)."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden_size", hidden_size),
                        ("num_heads", num_heads), ("tp_degree", tp_degree)):
        check_count(name, value)
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
    check_count("micro_batch", micro_batch)
    check_degree("tp_degree", tp_degree)
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
    check_count("layers", layers)
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
    check_count("batch_size", batch_size)
    s = config.block_size if seq_len is None else seq_len
    check_count("seq_len", s)
    if s > config.block_size:
        raise ValueError(f"seq_len={s} exceeds block_size={config.block_size}")
    if isinstance(checkpointed, bool) or not isinstance(checkpointed, int) \
            or not 0 <= checkpointed <= config.n_layer:
        raise ValueError(f"checkpointed must be an integer in [0, {config.n_layer}], got {checkpointed!r}")
    t = 1 if tp_degree is None else tp_degree
    check_degree("tp_degree", t)
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
