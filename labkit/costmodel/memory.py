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
top.  Activations are added as the caller computes them for one rank (below).

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
"""

from __future__ import annotations

from labkit.costmodel import shapes as _shapes

# Re-exported (lessons and the library import them from here): the transformers' shapes and activations.
PRECISIONS, MODEL_SHAPES, TransformerShape = _shapes.PRECISIONS, _shapes.MODEL_SHAPES, _shapes.TransformerShape
num_parameters, activation_bytes = _shapes.num_parameters, _shapes.activation_bytes
layer_activation_bytes = _shapes.layer_activation_bytes
korthikanti_layer_activation_bytes = _shapes.korthikanti_layer_activation_bytes
tinygpt_activation_bytes = _shapes.tinygpt_activation_bytes
_check_count, _check_amount = _shapes._check_count, _shapes._check_amount

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
    _check_amount("num_parameters", num_parameters)
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    for name, degree in (("dp_degree", dp_degree), ("tp_degree", tp_degree), ("pp_degree", pp_degree)):
        _check_count(name, degree)
    _check_amount("activation_bytes", activation_bytes, minimum_exclusive=False)
    per_parameter: dict[str, float] = dict(bytes_per_parameter(precision, optimizer))
    if gradient_bytes is not None:
        _check_amount("gradient_bytes", gradient_bytes)
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
