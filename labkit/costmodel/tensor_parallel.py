"""What tensor parallelism sends: every collective of one training step, and the time it takes.

Megatron-LM's tensor parallelism (Shoeybi et al. 2019) over ``t`` ranks puts two conjugate operators around
each half of a transformer layer: ``f`` where the replicated activation enters the split matrices (identity
forward, all-reduce of the gradient backward) and ``g`` where the partial results leave them (all-reduce
forward, identity backward).  Attention and the MLP each have one of each, so one layer costs, per
micro-batch of ``b`` sequences of ``s`` tokens and hidden size ``h`` (``A = b s h`` values):

==========================  ================================================  ======================================
                            forward                                           backward
==========================  ================================================  ======================================
tensor parallel             2 all-reduces of ``A`` (``g``)                    2 all-reduces of ``A`` (``f``)
+ sequence parallel         2 all-gathers (output ``A``), 2 reduce-scatters   2 reduce-scatters, 2 all-gathers (the
                            (input ``A``)                                     conjugates), 2 all-gathers more
==========================  ================================================  ======================================

*Sequence parallelism* (Korthikanti et al. 2022) keeps the activations between the halves (norms, dropout,
residual) split along the sequence: ``g`` becomes a reduce-scatter and ``f`` an all-gather.  A ring all-reduce
is a reduce-scatter followed by an all-gather, so the same bytes cross the links.  The two extra all-gathers in
backward are Korthikanti's memory trade: the column-parallel layer saves only its sequence shard of the input
and gathers it again to compute its weight gradient (their section 4.2.2, overlapped with compute on GPUs).
The vocabulary-parallel embedding ends in one ``g`` (a reduce-scatter with sequence parallelism), the head
starts with one ``f`` (an all-gather, re-gathered in backward), and the vocabulary-parallel cross-entropy
all-reduces three ``b s`` vectors in forward: the maximum logit, the sum of exponentials and the target's
logit.  With sequence parallelism the replicated parameters (norms, the row-parallel biases, the position
embedding) see only their shard of the tokens, so their gradients are summed over the group once per step.

Sizes are counted as everywhere in labkit (``labkit.parallel.base``): an all-reduce's message, an all-gather's
output, a reduce-scatter's input.  :func:`tensor_parallel_collectives` lists every call, as
``labkit.parallel.tensor`` logs them; :func:`tensor_parallel_step_time` turns them into seconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from labkit.costmodel.collectives import (
    LinkModel,
    ring_all_gather_cost,
    ring_all_reduce_cost,
    ring_reduce_scatter_cost,
)
from labkit.models import GPTConfig


@dataclass(frozen=True)
class Collective:
    """One collective call: in which pass, which kind, where in the model, and its size in bytes."""

    phase: str  # "forward" or "backward" (or "step": once per step, after the backward passes)
    kind: str  # "all_reduce", "all_gather" or "reduce_scatter"
    where: str  # "embedding", "blocks.3.attn", "blocks.3.mlp", "head", "loss", "gradients"
    nbytes: int


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def layer_collectives(where: str, micro_batch: int, seq_len: int, hidden_size: int, tp_degree: int,
                      sequence_parallel: bool = False, value_bytes: int = 4) -> list[Collective]:
    """The collectives of one half-layer (attention or MLP) for one micro-batch: its entry and its exit."""
    if tp_degree == 1:
        return []
    size = micro_batch * seq_len * hidden_size * value_bytes
    if not sequence_parallel:
        return [Collective("forward", "all_reduce", where, size), Collective("backward", "all_reduce", where, size)]
    return [Collective("forward", "all_gather", where, size), Collective("forward", "reduce_scatter", where, size),
            Collective("backward", "all_gather", where, size),  # the conjugate of the exit's reduce-scatter
            Collective("backward", "reduce_scatter", where, size),  # the conjugate of the entry's all-gather
            Collective("backward", "all_gather", where, size)]  # the saved input shard, gathered again


def replicated_parameters(config: GPTConfig, sequence_parallel: bool, blocks: int | None = None,
                          embedding: bool = True, head: bool = True) -> int:
    """Elements of the parameters every tensor-parallel rank holds whole and, with sequence parallelism, sees
    only a shard of the tokens for: the norms, the row-parallel biases, and the position embedding."""
    h = config.n_embd
    blocks = config.n_layer if blocks is None else blocks
    norm = 2 * h if config.bias else h
    per_block = 2 * norm + (2 * h if config.bias else 0)
    total = blocks * per_block + (norm if head else 0)
    return total + (config.block_size * h if embedding and sequence_parallel else 0)


def tensor_parallel_collectives(config: GPTConfig, micro_batch: int, seq_len: int, tp_degree: int,
                                sequence_parallel: bool = False, micro_batches: int = 1,
                                blocks: int | None = None, embedding: bool = True, head: bool = True,
                                value_bytes: int = 4) -> list[Collective]:
    """Every collective a tensor-parallel rank of ``TinyGPT(config)`` issues in one step of ``micro_batches``
    forward and backward passes (``blocks`` layers, default all; a pipeline stage may lack the embedding or
    the head), in the order the forward passes issue them, each backward's after its forward's."""
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("tp_degree", tp_degree),
                        ("micro_batches", micro_batches)):
        _check_count(name, value)
    if tp_degree == 1:
        return []
    blocks = config.n_layer if blocks is None else blocks
    size = micro_batch * seq_len * config.n_embd * value_bytes
    one: list[Collective] = []
    if embedding:
        kind = "reduce_scatter" if sequence_parallel else "all_reduce"
        one.append(Collective("forward", kind, "embedding", size))
        if sequence_parallel:
            one.append(Collective("backward", "all_gather", "embedding", size))
    for index in range(blocks):
        for half in ("attn", "mlp"):
            one += layer_collectives(f"blocks.{index}.{half}", micro_batch, seq_len, config.n_embd, tp_degree,
                                     sequence_parallel, value_bytes)
    if head:
        if sequence_parallel:
            one += [Collective("forward", "all_gather", "head", size),
                    Collective("backward", "reduce_scatter", "head", size),
                    Collective("backward", "all_gather", "head", size)]
        else:
            one.append(Collective("backward", "all_reduce", "head", size))
        one += [Collective("forward", "all_reduce", "loss", micro_batch * seq_len * 4)] * 3
    step = one * micro_batches
    if sequence_parallel:
        elements = replicated_parameters(config, True, blocks, embedding, head)
        step.append(Collective("step", "all_reduce", "gradients", elements * 4))
    return step


def total_bytes(collectives: list[Collective]) -> dict[str, int]:
    """Bytes per kind of collective: ``{"all_reduce": ..., "all_gather": ..., "reduce_scatter": ...}``."""
    totals: Counter = Counter()
    for collective in collectives:
        totals[collective.kind] += collective.nbytes
    return dict(totals)


_COSTS = {"all_reduce": ring_all_reduce_cost, "all_gather": ring_all_gather_cost,
          "reduce_scatter": ring_reduce_scatter_cost}


@dataclass(frozen=True)
class TensorParallelStep:
    """Predicted time of one tensor-parallel step (seconds): compute split ``t`` ways, then communication."""

    compute_s: float
    communication_s: float
    collectives: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s


def tensor_parallel_step_time(config: GPTConfig, micro_batch: int, seq_len: int, tp_degree: int,
                              dense_compute_s: float, link: LinkModel, sequence_parallel: bool = False,
                              micro_batches: int = 1) -> TensorParallelStep:
    """``dense_compute_s / t`` (the matrices split evenly; the replicated norms and the loss are small) plus
    every collective's ring cost over ``link``, none hidden: on the critical path, as in Megatron without
    overlap.  ``dense_compute_s``: one process's step time for the same micro-batches."""
    if not dense_compute_s >= 0:
        raise ValueError(f"dense_compute_s must be a number >= 0, got {dense_compute_s!r}")
    calls = tensor_parallel_collectives(config, micro_batch, seq_len, tp_degree, sequence_parallel, micro_batches)
    seconds = sum(_COSTS[call.kind](call.nbytes, tp_degree, link).time_s for call in calls)
    return TensorParallelStep(dense_compute_s / tp_degree, seconds, len(calls))


# --------------------------------------------------------------------------------------------------------
# Per rank and per layer: what a rank holds, and why tensor parallelism stays inside a node


def parameters_per_rank(config: GPTConfig, tp_degree: int) -> dict[str, int]:
    """Elements of ``TinyGPT(config)``'s parameters one of ``tp_degree`` ranks holds: ``"split"``, its ``1/t``
    of every matrix (query, key, value, the projections, the MLP, and the vocabulary padded to a multiple of
    ``t``, as ``labkit.parallel.tensor`` pads it) with the column-parallel biases; ``"replicated"``, what every
    rank holds whole (the norms, the row-parallel biases, the position embedding).  Times 4 bytes for fp32
    weights, 4 more for their gradients and 8 for AdamW's two moments."""
    _check_count("tp_degree", tp_degree)
    h, t = config.n_embd, tp_degree
    vocab = -(-config.vocab_size // t) * t
    columns = 3 * h * h + 4 * h * h + ((3 * h + 4 * h) if config.bias else 0)  # query, key, value, MLP fc
    rows = h * h + 4 * h * h  # the attention and MLP output projections
    split = config.n_layer * (columns + rows) + vocab * h * (1 if config.tie_weights else 2)
    whole = replicated_parameters(config, sequence_parallel=True)  # with the position embedding
    return {"split": split // t, "replicated": whole}


def layer_training_flops(micro_batch: int, seq_len: int, hidden_size: int) -> float:
    """FLOPs of one GPT layer's forward and backward pass over a micro-batch: ``72 b s h^2 (1 + s / (6 h))``.

    Forward, ``24 b s h^2`` in the matrices (query, key, value and the output projection ``8 b s h^2``, the
    ``4h`` MLP ``16 b s h^2``) and ``4 b s^2 h`` in attention's two products; backward twice that.  Narayanan
    et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") count
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration: 96 because their activation recomputation runs
    each forward twice, and the last term is the LM head.  Tensor parallelism splits all of it ``t`` ways."""
    for name, value in (("micro_batch", micro_batch), ("seq_len", seq_len), ("hidden_size", hidden_size)):
        _check_count(name, value)
    b, s, h = micro_batch, seq_len, hidden_size
    return 72.0 * b * s * h * h * (1.0 + s / (6.0 * h))


@dataclass(frozen=True)
class TensorParallelLayerTime:
    """Predicted seconds of one layer's forward and backward pass on one tensor-parallel rank."""

    compute_s: float
    communication_s: float
    collectives: int

    @property
    def communication_fraction(self) -> float:
        """The share of the layer's time spent communicating (none of it overlapped)."""
        total = self.compute_s + self.communication_s
        return self.communication_s / total if total else 0.0


def tensor_parallel_layer_time(micro_batch: int, seq_len: int, hidden_size: int, tp_degree: int,
                               peak_flops: float, link: LinkModel, sequence_parallel: bool = False,
                               value_bytes: int = 2) -> TensorParallelLayerTime:
    """One layer on a GPU: :func:`layer_training_flops` split ``t`` ways at ``peak_flops`` (the best case: no
    kernel runs at its peak), against the ring cost over ``link`` of the layer's collectives
    (:func:`layer_collectives` for attention and the MLP, ``value_bytes`` per value: 2 for bf16), none hidden.

    Why tensor parallelism stays inside a node: compute falls as ``1/t`` while each all-reduce still moves
    ``2 (t-1)/t`` of the ``b s h`` activation per rank, which grows towards twice it.  The compute per byte
    sent grows with ``h`` (``72 b s h^2`` against ``b s h``), so a wide layer keeps the communication a
    fraction of the compute over NVLink (hundreds of GB/s per GPU, inside a node), while InfiniBand (about a
    ninth of that per GPU) makes it most of the layer's time."""
    _check_count("tp_degree", tp_degree)
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be a number > 0, got {peak_flops!r}")
    compute_s = layer_training_flops(micro_batch, seq_len, hidden_size) / (tp_degree * peak_flops)
    calls = [call for half in ("attn", "mlp") for call in layer_collectives(
        half, micro_batch, seq_len, hidden_size, tp_degree, sequence_parallel, value_bytes)]
    seconds = sum(_COSTS[call.kind](call.nbytes, tp_degree, link, element_size=value_bytes).time_s
                  for call in calls)
    return TensorParallelLayerTime(compute_s, seconds, len(calls))
