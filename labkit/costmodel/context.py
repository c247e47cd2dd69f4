"""What long sequences cost: attention's FLOPs and memory, and context parallelism's bytes, work and time.

Pure arithmetic (no process group); ``labkit.parallel.context`` is held to it: the kernel's saved bytes, the
ring's, all-gather's and Ulysses' messages byte for byte, each rank's causal work.  Notation: ``b`` sequences
of ``s`` tokens, ``a`` heads of ``d`` (so ``h = a d``), ``cp`` ranks per sequence, ``e`` bytes per element.

**Attention.**  Scores and the weighted sum are two ``s x s x d`` matrix products per head:
``4 b s^2 h`` FLOPs forward (:func:`attention_flops`), half of it under the causal mask when the kernel skips
the masked half (blockwise attention does, tile by tile), and twice that backward plus one recomputation of the
scores (FlashAttention-2's backward: ``2.5x`` the forward).  Memory: a kernel that forms the score matrix keeps
``b a s^2`` probabilities for backward; blockwise attention keeps ``q, k, v, out`` and one log-sum-exp per row
(:func:`attention_saved_bytes`), and a ``block x block`` tile per head while it runs.

**Attention's memory traffic** (:func:`attention_hbm_bytes`), the point of FlashAttention (Dao et al. 2022): a
kernel per operation writes the ``s x s`` scores to the GPU's memory (HBM), reads them back for the softmax,
writes the probabilities and reads them for ``P V``: ``4 s^2`` values beside ``4 s d`` for ``q, k, v, out``
(the paper's Algorithm 0).  A fused kernel keeps each tile in the SM's on-chip memory and writes only ``out``
and, for backward, one or two numbers a row: FlashAttention-1 its running maximum ``m`` and sum ``l`` (its
outer loop ran over the keys, writing each query block's ``out``, ``m`` and ``l`` back at every block of keys),
FlashAttention-2 (Dao 2023) their log-sum-exp alone, its outer loop over the queries writing each output once.
FlashAttention-2 reads its blocks of ``K, V`` once per block of queries; a head's ``K, V`` (4 MiB at 8k tokens
of 128 in 16 bits) stay in the H100's 50 MB L2 cache meanwhile, so the count takes HBM to see them once (an
assumption, which the FLOPs do not need).

**Context parallelism's messages** per attention call and rank (:func:`cp_messages`; ``N = b (s / cp) h``),
counted as labkit counts every message: the bytes that *leave* the rank (:mod:`labkit.costmodel.collectives`);
the collective's whole size, what enters a reduce-scatter or an all-to-all or leaves an all-gather, is
:func:`collective_size` of it:

==========  =================================================  ===================================================
strategy    forward                                            backward
==========  =================================================  ===================================================
ring        ``cp - 1`` sends of one K/V block (``2 N e``)      ``cp - 1`` K/V sends, ``cp - 1`` dK/dV
all-gather  all-gather of K/V (``2 N e (cp - 1)`` out; of      all-gather again, reduce-scatter dK/dV (``2 N e
            ``2 N e cp``)                                      (cp - 1)`` out of ``2 N e cp``)
Ulysses     all-to-all of q, k, v (``3 N e (cp - 1) / cp``),   all-to-all of dout, of dq, dk, dv
            of out (``N e (cp - 1) / cp``)
==========  =================================================  ===================================================

**In a step** (:func:`cp_layer_seconds`, which :func:`labkit.costmodel.stages.chunk_costs` adds to every layer):
the ring sends each of its ``cp - 1`` K/V blocks (with grouped-query attention, ``2 b (s / cp) h_kv / t``
values) while the attention of the block in hand runs (``1 / cp`` of the rank's causal attention FLOPs, the
masked half skipped), so only what
outlasts it is exposed, plus the slowdown of the compute it hides behind; backward sends K/V and dK/dV per step
beside twice the compute.  All-gather's gather (and backward its gather and reduce-scatter) and Ulysses'
all-to-alls sit on the critical path.

**Memory per GPU at long sequences** (:func:`playbook_memory`): the Ultra-Scale Playbook's figure of an 8B model
("Memory Usage for 8B Model", section Context Parallelism; Tazi et al. 2025, https://huggingface.co/spaces/
nanotron/ultrascale-playbook; its data read from the figure's HTML in the mirror ``lzx1413/ultra-scale-book``,
``docs/fragments/cp_8Bmemoryusage.html``) counts bf16 weights and gradients (2 bytes each), Adam's two fp32
moments (8 bytes, no fp32 master copy), all split by TP only, and Korthikanti et al.'s activations without the
score matrix, ``s b h (10 + 24 / t)`` per layer without sequence parallelism, of the ``s / cp`` tokens a rank
holds.  At 131,072 tokens an 8B model needs 544 GiB of activations on one GPU, 352 GiB with ``t = 2`` and 88
GiB with ``t = 2, cp = 4``; ``tests/test_costmodel_context.py`` checks every bar of the figure.

Through each rank's link (:func:`cp_link_bytes`) ring and all-gather move the same K/V bytes forward, ``2 N e
(cp - 1)``; the ring's go in ``cp - 1`` steps that hide behind the attention of the block in hand when a block's
compute outlasts its transfer (:func:`ring_exposed_seconds`).  Ulysses moves ``4 N e (cp - 1)/cp`` forward,
which does not grow with ``cp`` at a fixed ``s / cp``.

**Which link** (:func:`cp_layer_seconds` without a ``link``; :mod:`labkit.costmodel.hardware`): the cp group's
ranks are ``t`` apart.  Inside a node every message goes over NVLink.  Across nodes the all-gather and the
reduce-scatter are ring collectives on NCCL's channels (:func:`labkit.costmodel.hardware.link_of`), but the ring's
point-to-point sends step together and wait for the slowest, a hop between nodes through one GPU's adapter, and
Ulysses' all-to-alls send each rank's share for other nodes through its own adapter beside the NVLink share
(:func:`labkit.costmodel.collectives.all_to_all_cost`).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from labkit.costmodel.collectives import (
    LinkModel,
    all_to_all_cost,
    ring_all_gather_cost,
    ring_reduce_scatter_cost,
)
from labkit.costmodel.hardware import link_of, node_members
from labkit.costmodel.kernels import attention_time
from labkit.costmodel.memory import korthikanti_layer_activation_bytes
from labkit.costmodel.shapes import num_parameters
from labkit.parallel.context.sequence import chunk_positions, padded_length, ulysses_problem

KINDS = ("send", "all_gather", "reduce_scatter", "all_to_all")
CP_STRATEGIES = ("ring", "all_gather", "ulysses")


def attention_flops(batch: int, seq_len: int, hidden: int, *, causal: bool = True, backward: bool = False) -> float:
    """FLOPs of one layer's attention products (``Q K^T`` and ``P V``) over ``batch`` sequences, forward
    (``backward=True``: FlashAttention-2's backward, 2.5x: the two products' gradients and the recomputed
    scores).  Causal: the half on or below the diagonal, ``s (s + 1) / 2`` query-key pairs."""
    pairs = seq_len * (seq_len + 1) / 2 if causal else seq_len * seq_len
    forward = 4.0 * batch * pairs * hidden
    return 2.5 * forward if backward else forward


def causal_pairs_per_rank(seq_len: int, cp: int, layout: str = "zigzag") -> list[int]:
    """Per rank, the query-key pairs its queries attend to under the causal mask (all of its work, whichever
    rank's keys they are): contiguous rank ``r`` gets ``c (r c) + c (c + 1) / 2`` for chunks of ``c``; zig-zag
    evens them out."""
    seq_len = padded_length(seq_len, cp, layout)
    pairs = []
    for rank in range(cp):
        positions = chunk_positions(seq_len, cp, rank, layout)
        pairs.append(int((positions + 1).sum()))  # query at position p sees keys 0 .. p
    return pairs


def imbalance(work: list[float]) -> float:
    """The busiest rank's work over the mean: how long a step waits for it (1.0: balanced)."""
    return max(work) / (sum(work) / len(work))


def attention_saved_bytes(batch: int, heads: int, seq_len: int, head_dim: int, element_size: int = 4, *,
                          kernel: str = "blockwise", causal: bool = True) -> int:
    """Bytes attention keeps for its backward pass.  ``"blockwise"``: ``q, k, v, out`` and the log-sum-exp
    (``4 b a s d + b a s`` elements); ``"scores"`` (``softmax(q k^T / sqrt(d)) v`` as written,
    :func:`labkit.parallel.context.textbook_attention`): ``q, k, v`` and the ``b a s^2`` probabilities, plus the
    causal mask's ``s^2`` bytes (the ``5 a s / h`` term of Korthikanti et al.'s count, at 16 bits, comes from
    these probabilities, their dropout mask and the scores)."""
    if kernel not in ("blockwise", "scores"):
        raise ValueError(f"kernel must be 'blockwise' or 'scores', got {kernel!r}")
    if kernel == "blockwise":
        return (4 * batch * heads * seq_len * head_dim + batch * heads * seq_len) * element_size
    values = 3 * batch * heads * seq_len * head_dim + batch * heads * seq_len * seq_len
    return values * element_size + (seq_len * seq_len if causal else 0)


def tile_bytes(batch: int, heads: int, block_size: int, element_size: int = 4) -> int:
    """One ``block x block`` tile of scores for every (sequence, head): what blockwise attention forms at once."""
    return batch * heads * block_size * block_size * element_size


def attention_hbm_bytes(seq_len: int, head_dim: int, kernel: str = "flash", element_size: int = 2) -> int:
    """Bytes one head of one sequence moves through the GPU's memory in attention's forward pass (module
    docstring): ``"unfused"``, a kernel per operation, ``(4 s d + 4 s^2) e`` (the scores and probabilities
    written and read); ``"flash"``, FlashAttention-2's, ``4 s d e`` for ``q, k, v, out`` and the fp32
    log-sum-exp of each row, kept for backward."""
    if kernel not in ("unfused", "flash"):
        raise ValueError(f"kernel must be 'unfused' or 'flash', got {kernel!r}")
    if kernel == "unfused":
        return (4 * seq_len * head_dim + 4 * seq_len * seq_len) * element_size
    return 4 * seq_len * head_dim * element_size + 4 * seq_len


def cp_messages(strategy: str, cp: int, batch: int, heads: int, local_len: int, head_dim: int,
                element_size: int = 4) -> list[tuple[str, str, int]]:
    """``(phase, kind, bytes)`` of every message one attention call's forward and backward passes make on one
    rank, bytes that leave the rank: what ``ContextParallelGroup.log`` records (``local_len = s / cp`` tokens
    per rank).  A collective's whole size: :func:`collective_size`."""
    if strategy not in CP_STRATEGIES:
        raise ValueError(f"strategy must be 'ring', 'all_gather' or 'ulysses', got {strategy!r}")
    if cp == 1:
        return []
    block = batch * heads * local_len * head_dim * element_size  # one of q, k, v or out, this rank's tokens
    if strategy == "ring":
        return [("forward", "send", 2 * block)] * (cp - 1) + [("backward", "send", 2 * block)] * (2 * (cp - 1))
    if strategy == "all_gather":
        out = 2 * block * (cp - 1)  # its K/V to each other rank (a ring forwards others' instead: as many bytes)
        return [("forward", "all_gather", out), ("backward", "all_gather", out), ("backward", "reduce_scatter", out)]
    away = (cp - 1) * block // cp  # the heads of the other ranks; cp divides the heads
    return [("forward", "all_to_all", 3 * away), ("forward", "all_to_all", away),
            ("backward", "all_to_all", away), ("backward", "all_to_all", 3 * away)]


def collective_size(kind: str, nbytes: float, cp: int) -> float:
    """The whole size of a collective of ``kind`` of which ``nbytes`` left the rank: a send's own size; an
    all-gather's output, a reduce-scatter's or an all-to-all's input, ``cp / (cp - 1)`` times what left (the
    rank's own share stays)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return float(nbytes) if kind == "send" else nbytes * cp / (cp - 1)


def cp_link_bytes(strategy: str, cp: int, batch: int, heads: int, local_len: int, head_dim: int,
                  element_size: int = 4) -> dict[str, float]:
    """``{"forward": bytes, "backward": bytes}`` that leave each rank in one attention call."""
    total = {"forward": 0.0, "backward": 0.0}
    for phase, _, nbytes in cp_messages(strategy, cp, batch, heads, local_len, head_dim, element_size):
        total[phase] += nbytes
    return total


def cp_saved_extra_bytes(strategy: str, layers: int, batch: int, local_len: int, hidden: int,
                         element_size: int = 4) -> int:
    """Bytes a rank keeps for backward beyond one process's activations at ``s / cp`` tokens: none for the ring
    and all-gather (their saved ``q, k, v, out, lse`` are what torch's kernel saves), and for Ulysses one output
    per layer, ``b (s / cp) h``: the kernel keeps its head-sharded output, the projection the sequence-sharded
    one the second all-to-all returns (``tests/test_context_parallel.py`` measures all three)."""
    return layers * batch * local_len * hidden * element_size if strategy == "ulysses" else 0


def cp_buffer_bytes(strategy: str, cp: int, batch: int, heads: int, local_len: int, head_dim: int,
                    element_size: int = 4) -> int:
    """Bytes of other ranks' data a rank holds while one attention call's forward pass runs: the ring one K/V
    block in flight (plus the one in hand, received last step), all-gather the whole sequence's K/V, Ulysses
    q, k, v of the whole sequence for its ``heads / cp`` heads (the same size as its own)."""
    block = batch * heads * local_len * head_dim * element_size
    if cp == 1:
        return 0
    return {"ring": 2 * 2 * block, "all_gather": 2 * block * cp, "ulysses": 3 * block}[strategy]


def ring_exposed_seconds(compute_s: float, transfer_s: float, cp: int) -> float:
    """The ring's communication left on the critical path in one pass: ``cp - 1`` steps, each hiding the next
    block's transfer behind the current block's compute (``transfer_s``, ``compute_s`` per step)."""
    return (cp - 1) * max(0.0, transfer_s - compute_s)


def _widths(shape: Any, layout: Any, value_bytes: int) -> tuple[float, int, int, int]:
    """``(tokens a rank, one rank's K and V, its q, k, v, its out)`` in bytes, for one layer and micro-batch:
    a rank's ``s / cp`` tokens, ``h / t`` query values and, under grouped-query attention, ``h_kv / t`` K/V."""
    cp, t, b = layout.cp, layout.tp, layout.micro_batch
    if layout.cp_strategy == "ulysses":
        problem = ulysses_problem(shape.num_heads, cp, shape.num_kv_heads, t)
        if problem:
            raise ValueError(problem)
    local_len = shape.seq_len / cp
    kv_width = shape.hidden_size * shape.num_kv_heads / shape.num_heads / t
    q_width = shape.hidden_size // t
    kv = int(2 * b * local_len * kv_width) * value_bytes
    return local_len, kv, int(b * local_len * (q_width + 2 * kv_width)) * value_bytes, \
        int(b * local_len * q_width) * value_bytes


def cp_layer_bytes(shape: Any, layout: Any, value_bytes: int = 2) -> tuple[float, float]:
    """``(forward, backward)`` bytes that leave one rank in one layer's attention for one micro-batch: the same
    messages as :func:`cp_messages` (which the runtime's log matches), here with grouped-query attention's
    narrower K/V and ``tp``.  Ulysses under GQA needs whole K/V heads on every rank (``ValueError`` otherwise)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    _, kv, qkv, out = _widths(shape, layout, value_bytes)
    if layout.cp_strategy == "ring":
        return (cp - 1) * kv, 2 * (cp - 1) * kv
    if layout.cp_strategy == "all_gather":
        return (cp - 1) * kv, 2 * (cp - 1) * kv
    if layout.cp_strategy == "ulysses":
        away = (cp - 1) / cp
        return away * (qkv + out), away * (out + qkv)
    raise ValueError(f"cp_strategy must be 'ring', 'all_gather' or 'ulysses', got {layout.cp_strategy!r}")


def cp_layer_seconds(shape: Any, layout: Any, hardware: Any, link: LinkModel | None = None,
                     value_bytes: int = 2) -> tuple[float, float]:
    """``(forward, backward)`` seconds context parallelism adds to one layer of one micro-batch on the critical
    path (module docstring): ``shape`` a ``TransformerShape``, ``layout`` a ``Layout`` (``cp``, ``cp_strategy``,
    ``tp``, ``micro_batch``), ``hardware`` its ``flops``, ``overlap_slowdown``, ``call_latency_s`` and links.
    ``link``: every message of the cp group on that one link (a what-if); ``None``: the links the group's place
    on the nodes gives each kind of message (module docstring, "Which link").  Ulysses under GQA needs whole K/V
    heads on every rank (``ValueError`` otherwise)."""
    cp, t, b = layout.cp, layout.tp, layout.micro_batch
    if cp == 1:
        return 0.0, 0.0
    if link is None:
        local = node_members(hardware.gpus_per_node, t, cp)
        near, far, ring = hardware.intra_node, hardware.inter_node, link_of(hardware, t, cp)
        hop = near if local == cp else far  # a ring of sends waits for its hop between nodes
    else:
        local, near, far, ring, hop = cp, link, link, link, link
    local_len, block, qkv, out = _widths(shape, layout, value_bytes)
    latency, slowdown = hardware.call_latency_s, hardware.overlap_slowdown
    if layout.cp_strategy == "ring":
        # one step's attention products: 1 / cp of the rank's causal work (zig-zag: half of its queries' pairs);
        # with the GPU's kernels (labkit.costmodel.kernels), a causal flash kernel's, backward 2.5x the forward
        step = 2 * b * local_len * shape.seq_len * shape.hidden_size / t / hardware.flops / cp
        back = 2 * step
        if getattr(hardware, "kernels", None) is not None:
            step, back = (part / cp for part in attention_time(hardware.kernels, shape, b, shape.seq_len, t, cp,
                                                               True, False, value_bytes))
        send = hop.alpha_s + block * hop.beta_s_per_byte + latency

        def exposed(transfer: float, compute: float) -> float:
            return max(0.0, transfer - compute) + slowdown * min(transfer, compute)

        return (cp - 1) * exposed(send, step), (cp - 1) * exposed(2 * send, back)
    if layout.cp_strategy == "all_gather":
        gather = ring_all_gather_cost(block * cp, cp, ring, element_size=value_bytes).time_s + latency
        scatter = ring_reduce_scatter_cost(block * cp, cp, ring, element_size=value_bytes).time_s + latency
        return gather, gather + scatter
    if layout.cp_strategy == "ulysses":

        def all_to_all(nbytes: int) -> float:
            return all_to_all_cost(nbytes, cp, near, value_bytes, local, far).time_s + latency

        return all_to_all(qkv) + all_to_all(out), all_to_all(out) + all_to_all(qkv)
    raise ValueError(f"cp_strategy must be 'ring', 'all_gather' or 'ulysses', got {layout.cp_strategy!r}")


def rank_attention_seconds(shape: Any, cp: int, tp: int, hardware: Any, value_bytes: int = 2) -> float:
    """One rank's share of one layer's causal flash attention, forward and backward, for one sequence: the
    kernel model's (:func:`labkit.costmodel.kernels.attention_time`), what the ring hides its sends behind; on
    hardware without kernels, its FLOPs at ``hardware.flops`` (backward twice the forward, as in
    :func:`cp_layer_seconds`)."""
    if getattr(hardware, "kernels", None) is None:
        return 3 * 2 * shape.seq_len / cp * shape.seq_len * shape.hidden_size / tp / hardware.flops
    return sum(attention_time(hardware.kernels, shape, 1, shape.seq_len, tp, cp, True, False, value_bytes))


def cp_strategy_costs(shape: Any, seq_lens: list[int], cp: int, tp: int, hardware: Any,
                      link: LinkModel | None = None, value_bytes: int = 2) -> dict[str, Any]:
    """What lesson 13's figure and table show, one source for both: at each of ``seq_lens``, one layer's
    ``"attention"`` on one rank (:func:`rank_attention_seconds`) and per strategy (``"exposed"``, seconds of
    forward and backward, :func:`cp_layer_seconds`; ``"left"``, bytes that leave a rank, :func:`cp_layer_bytes`).
    A strategy the heads rule out (Ulysses under GQA, :func:`~labkit.parallel.context.sequence.ulysses_problem`)
    is left out and named in ``"refused"``."""
    costs: dict[str, Any] = {"seq_lens": list(seq_lens), "exposed": {}, "left": {}, "refused": {},
                             "attention": [rank_attention_seconds(replace(shape, seq_len=s), cp, tp, hardware,
                                                                  value_bytes) for s in seq_lens]}
    for strategy in CP_STRATEGIES:
        problem = ulysses_problem(shape.num_heads, cp, shape.num_kv_heads, tp) if strategy == "ulysses" else None
        if problem:
            costs["refused"][strategy] = problem
            continue
        layout = SimpleNamespace(cp=cp, tp=tp, micro_batch=1, cp_strategy=strategy)  # what the two read of a Layout
        layouts = [(replace(shape, seq_len=s), layout) for s in seq_lens]
        costs["exposed"][strategy] = [sum(cp_layer_seconds(one, layout, hardware, link, value_bytes))
                                      for one, layout in layouts]
        costs["left"][strategy] = [sum(cp_layer_bytes(one, layout, value_bytes)) for one, layout in layouts]
    return costs


def playbook_memory(shape: Any, seq_len: int, tp: int = 1, cp: int = 1, micro_batch: int = 1) -> dict[str, float]:
    """GiB per GPU the Ultra-Scale Playbook's 8B figure counts (module docstring): ``{"parameters",
    "gradients", "optimizer_states", "activations", "total"}`` for ``shape`` at ``seq_len`` tokens."""
    gib = 2 ** 30
    weights = num_parameters(shape) / tp
    per_layer = korthikanti_layer_activation_bytes(seq_len // cp, micro_batch, shape.hidden_size,
                                                   shape.num_heads, tp, attention_matrix=False)
    parts = {"parameters": 2 * weights / gib, "gradients": 2 * weights / gib, "optimizer_states": 8 * weights / gib,
             "activations": shape.num_layers * per_layer / gib}
    return {**parts, "total": sum(parts.values())}
