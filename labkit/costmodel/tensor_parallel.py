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
from collections.abc import Callable
from dataclasses import dataclass

from labkit.costmodel.collectives import (
    LinkModel,
    ring_all_gather_cost,
    ring_all_reduce_cost,
    ring_reduce_scatter_cost,
)
from labkit.degrees import check_degree
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
        for half in ("attn",) if config.n_experts else ("attn", "mlp"):  # an MoE layer runs whole on each rank
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
    """Predicted time of one tensor-parallel step on one rank (seconds): its compute, then its collectives, none
    of them overlapped.  ``whole_s`` is the part of ``compute_s`` that every rank repeats whole."""

    compute_s: float
    communication_s: float
    collectives: int
    whole_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s


def tensor_parallel_step_time(config: GPTConfig, micro_batch: int, seq_len: int, tp_degree: int,
                              dense_compute_s: float, link: LinkModel | None = None, sequence_parallel: bool = False,
                              micro_batches: int = 1, *, whole_s: float = 0.0, slowdown: float = 1.0,
                              collective_s: Callable[[Collective], float] | None = None) -> TensorParallelStep:
    """One step of ``tp_degree`` ranks, from ``dense_compute_s``, one process's step on the same micro-batches::

        compute       = (whole_s + (dense_compute_s - whole_s) / t) * slowdown
        communication = the cost of every collective (:func:`tensor_parallel_collectives`)

    - ``whole_s``: the part of one process's step that the split does not divide, which every rank runs whole:
      the norms, residual additions, embedding lookup, the loss's softmax, the optimizer's arithmetic, and the
      framework's fixed cost per operation (split or not).  0 (the default) for large layers on GPUs, where
      the matrices are nearly all of it; a large share of a tiny model's step on a CPU
      (``labkit.parallel.tensor.timing.SplitKernels`` measures it).
    - ``slowdown``: how many times slower each rank computes when all ``t`` compute at once than one process
      alone: 1 on a device per rank; on shared CPU cores at least ``t / cores``, and more for the shared caches
      (``labkit.parallel.tensor.timing.shared_machine_costs`` measures it).
    - each collective costs its ring time over ``link`` (``labkit.costmodel.collectives``), or
      ``collective_s(call)`` seconds, a cost measured on the machine itself.

    Nothing is hidden: every collective sits on the critical path, as labkit runs them.  (Megatron-LM's
    ``--tp-comm-overlap`` and PyTorch's async tensor parallelism hide part of them behind the matrix products,
    by cutting each product into chunks and sending one chunk while the next is computed.)"""
    if not dense_compute_s >= 0:
        raise ValueError(f"dense_compute_s must be a number >= 0, got {dense_compute_s!r}")
    if not 0 <= whole_s <= dense_compute_s:
        raise ValueError(f"whole_s must lie between 0 and dense_compute_s={dense_compute_s!r}, got {whole_s!r}")
    if not slowdown > 0:
        raise ValueError(f"slowdown must be a number > 0, got {slowdown!r}")
    calls = tensor_parallel_collectives(config, micro_batch, seq_len, tp_degree, sequence_parallel, micro_batches)
    if calls and link is None and collective_s is None:
        raise ValueError("give the link the collectives cross (link=...) or their measured cost (collective_s=...)")
    if collective_s is not None:
        seconds = sum(collective_s(call) for call in calls)
    else:
        seconds = sum(_COSTS[call.kind](call.nbytes, tp_degree, link).time_s for call in calls)
    compute = (whole_s + (dense_compute_s - whole_s) / tp_degree) * slowdown
    return TensorParallelStep(compute, seconds, len(calls), whole_s * slowdown)


# --------------------------------------------------------------------------------------------------------
# Per rank and per layer: what a rank holds, and why tensor parallelism stays inside a node


def parameters_per_rank(config: GPTConfig, tp_degree: int, vocab_divisible_by: int = 1) -> dict[str, int]:
    """Elements of ``TinyGPT(config)``'s parameters one of ``tp_degree`` ranks holds: ``"split"``, its ``1/t``
    of every matrix (query, key, value, the projections, the MLP, and the vocabulary padded to a multiple of
    ``vocab_divisible_by * t``, as ``labkit.parallel.tensor`` pads it: 1 by default, Megatron-LM's 128 as an
    option) with the column-parallel biases; ``"replicated"``, what every rank holds whole (the norms, the
    row-parallel biases, the position embedding).  Times 4 bytes for fp32 weights, 4 more for their gradients
    and 8 for AdamW's two moments."""
    check_degree("tp_degree", tp_degree)
    _check_count("vocab_divisible_by", vocab_divisible_by)
    h, t = config.n_embd, tp_degree
    multiple = vocab_divisible_by * t
    vocab = -(-config.vocab_size // multiple) * multiple
    columns = 3 * h * h + 4 * h * h + ((3 * h + 4 * h) if config.bias else 0)  # query, key, value, MLP fc
    rows = h * h + 4 * h * h  # the attention and MLP output projections
    split = config.n_layer * (columns + rows) + vocab * h * (1 if config.tie_weights else 2)
    whole = replicated_parameters(config, sequence_parallel=True)  # with the position embedding
    return {"split": split // t, "replicated": whole}


def tensor_parallel_size_problem(hidden_size: int, heads: int, tp_degree: int,
                                 kv_heads: int | None = None) -> str | None:
    """Why ``tp_degree`` ranks cannot split a layer of ``hidden_size`` with ``heads`` query heads and
    ``kv_heads`` key/value heads (``None``: as many as query heads), or ``None`` when they can.

    Heads are split whole, so ``t`` must divide the heads and the hidden size.  Under grouped-query attention
    (Ainslie et al. 2023, "GQA"; Llama-2-70B: 64 query heads sharing 8 key/value heads) each rank must also hold
    whole key/value heads with their groups of query heads: Megatron-LM refuses a ``t`` that does not divide
    ``num_query_groups`` (``TransformerConfig``: "num_query_groups must be a multiple of
    tensor_model_parallel_size"), so Llama-2-70B's tensor parallelism stops at 8.  (Inference engines such as
    vLLM replicate key/value heads past that instead, each rank computing a copy.)"""
    for name, value in (("hidden_size", hidden_size), ("heads", heads), ("tp_degree", tp_degree)):
        _check_count(name, value)
    if kv_heads is not None:
        _check_count("kv_heads", kv_heads)
        if heads % kv_heads:
            return f"{heads} query heads cannot be shared evenly by {kv_heads} key/value heads"
    if heads % tp_degree or hidden_size % tp_degree:
        return (f"tensor parallelism over {tp_degree} ranks splits the heads and the hidden size evenly: "
                f"n_head={heads} and n_embd={hidden_size} must both be divisible by {tp_degree}")
    if kv_heads is not None and kv_heads % tp_degree:
        return (f"under grouped-query attention each of the {tp_degree} ranks must hold whole key/value heads: "
                f"the {kv_heads} key/value heads must be divisible by {tp_degree} (Megatron-LM refuses it)")
    return None


def valid_tp_degrees(hidden_size: int, heads: int, kv_heads: int | None = None, limit: int = 64) -> list[int]:
    """Every ``t`` from 1 to ``limit`` that :func:`tensor_parallel_size_problem` accepts."""
    _check_count("limit", limit)
    return [t for t in range(1, limit + 1) if tensor_parallel_size_problem(hidden_size, heads, t, kv_heads) is None]


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
    check_degree("tp_degree", tp_degree)
    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be a number > 0, got {peak_flops!r}")
    compute_s = layer_training_flops(micro_batch, seq_len, hidden_size) / (tp_degree * peak_flops)
    calls = [call for half in ("attn", "mlp") for call in layer_collectives(
        half, micro_batch, seq_len, hidden_size, tp_degree, sequence_parallel, value_bytes)]
    seconds = sum(_COSTS[call.kind](call.nbytes, tp_degree, link, element_size=value_bytes).time_s
                  for call in calls)
    return TensorParallelLayerTime(compute_s, seconds, len(calls))
