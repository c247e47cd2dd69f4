"""What each pipeline stage of a 3D layout computes and holds: the inputs of lesson 11's step model.

:func:`labkit.costmodel.step.predict_step` prices a step from these; :func:`labkit.costmodel.rank_memory.layout_memory`
counts memory from them.  A layout (:class:`Layout`) cuts a model of ``L`` layers into ``p v`` *chunks* (``v``
per rank under the interleaved schedule, chunk ``c`` on rank ``c mod p``), ``L / (p v)`` layers each unless the
caller gives each chunk's count (``stage_layers``, e.g. Llama 3's pipeline, which leaves its first and last
stage a layer short to make room for the embedding and the loss: Dubey et al. 2024, section 3.3.2).

**The stages are not equal.**  The token embedding is a lookup (no matrix FLOPs) on the first chunk, and the
output layer (the logits, ``2 h V`` FLOPs a token forward, twice that backward) and the loss on the last
(lesson 07's uneven-stage pitfall).  For GPT-3 175B the output layer costs a third of a layer; for a 1.7B GPT with a
131k vocabulary, 4 layers.  :func:`chunk_costs` prices each chunk's forward and backward on one micro-batch
(``head_on_last_stage=False`` spreads the whole model's FLOPs evenly instead, an idealised balanced pipeline:
exercise 11 computes that one by hand), and :func:`rank_parameters` counts each rank's parameters: the
embedding (and learned positions) on rank 0, the output layer and the final norm on rank ``p - 1`` (a tied
output layer is a copy of the embedding there when ``p > 1``, as Megatron-LM keeps it).

:func:`stage_times` is the uniform-stage summary the event simulator (:mod:`labkit.costmodel.simulator`) uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.costmodel.collectives import LinkModel, ring_all_reduce_cost
from labkit.costmodel.compute import head_flops, layer_flops, model_flops_per_step
from labkit.costmodel.context import cp_layer_seconds
from labkit.costmodel.experts import ep_all_to_all_s
from labkit.costmodel.hardware import link_of
from labkit.costmodel.kernels import Kernels, LayerTime, head_time, layer_time
from labkit.costmodel.shapes import expert_parameters, layer_parameters, num_parameters
from labkit.degrees import check_degree, check_degrees
from labkit.parallel.pipeline.catalog import V_SHAPED
from labkit.parallel.pipeline.schedule import stage_rank


def _runs(counts: tuple[int, ...]) -> str:
    """``(0, 1, 1, 1, 0)`` as ``"0/1x3/0"``: each run of equal counts once, with its length."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return "/".join(f"{count}x{length}" if length > 1 else str(count) for count, length in runs)


SELECTIVE = ("", "attention", "op", "layer")  # Layout.selective: what a selective recomputation reruns


@dataclass(frozen=True)
class Layout:
    """A 3D configuration: ``dp x tp x pp`` ranks, ZeRO stage over dp, micro-batch size, recomputation and the
    pipeline schedule (``virtual_stages``: the interleaved schedules' stages per rank; ZB-V and DualPipeV hold two,
    in a V: :meth:`rank_of`); with ``cp > 1`` a fourth
    dimension, context parallelism (``cp_strategy``: ``"ring"``, ``"all_gather"`` or ``"ulysses"``), each
    sequence split over ``cp`` ranks, whose gradients are reduced (and ZeRO's states sharded) over ``dp x cp``
    ranks, as :mod:`labkit.parallel.parallelize` builds it.  ``ep``: expert parallelism of an MoE shape, folded over
    ``dp x cp`` (:mod:`labkit.costmodel.experts`).  ``recompute``: full activation recomputation (each layer's
    forward rerun in its backward); ``selective``, a part of it (:data:`SELECTIVE`), never both:
    ``"attention"``, the attention core's (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.2: the scores, softmax, dropout and weighted sum, whose activations are the
    ``5 a s / h`` term; Megatron-LM's ``--recompute-activations``); ``"op"``, torchtitan's per-operation
    policy (every memory-bound operation and every second matrix product recomputed, the others' outputs
    kept: ``_get_selective_ac_policy`` in ``torchtitan/distributed/activation_checkpoint.py``); ``"layer"``,
    torchtitan's every second layer recomputed in full (``selective_ac_option = "2"``).  ``stage_layers``:
    each chunk's layers where they are not ``L / (p v)`` each (:func:`weighted_stage_layers`); a
    ``stage_layers`` argument of the functions below overrides it."""

    dp: int
    tp: int
    pp: int
    zero: int = 0
    micro_batch: int = 1
    recompute: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    cp_strategy: str = "ring"
    ep: int = 1
    selective: str = ""
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_degrees(self.dp, self.tp, self.pp, self.cp)
        check_degree("ep", self.ep)
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
            if len(self.stage_layers) != self.chunks or min(self.stage_layers) < 0:
                raise ValueError(f"stage_layers must give each of the {self.chunks} chunks its layers (>= 0), got "
                                 f"{self.stage_layers}")
        if self.selective not in SELECTIVE:
            raise ValueError(f"selective must be one of {SELECTIVE}, got {self.selective!r}")
        if self.recompute and self.selective:
            raise ValueError("recompute (full) and selective recomputation exclude each other: choose one")

    @property
    def gpus(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same weights and reduce their gradients together: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def chunks(self) -> int:
        """Pipeline chunks in all: ``p v`` under interleaving, ``2p`` in a V (ZB-V, DualPipeV), else ``p``."""
        return self.pp * (self.virtual_stages if self.schedule.startswith("interleaved") else
                          2 if self.schedule in V_SHAPED else 1)

    def rank_of(self, chunk: int) -> int:
        """The pipeline rank holding ``chunk``: ``chunk % p``, or in a V ``min(chunk, 2p - 1 - chunk)``."""
        return stage_rank(chunk, self.pp, "v" if self.schedule in V_SHAPED else "loop")

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks pipeline rank ``rank`` holds, in order: ``rank, rank + p, ...``, or in a V ``rank`` and
        ``2p - 1 - rank``."""
        if self.schedule in V_SHAPED:
            return [rank, 2 * self.pp - 1 - rank]
        return list(range(rank, self.chunks, self.pp))

    def label(self) -> str:
        extra = f" v={self.virtual_stages}" if self.schedule.startswith("interleaved") else ""
        context = f" cp={self.cp} ({self.cp_strategy})" if self.cp > 1 else ""
        context += f" ep={self.ep}" if self.ep > 1 else ""
        extra += "" if self.stage_layers is None else f" layers {_runs(self.stage_layers)}"
        return (f"dp={self.dp} tp={self.tp} pp={self.pp}{context} ZeRO-{self.zero} b={self.micro_batch}"
                f"{' recompute' if self.recompute else f' selective ({self.selective}) recompute' if self.selective else ''} "
                f"{self.schedule}{extra}")


@dataclass(frozen=True)
class Hardware:
    """What a step runs on: FLOP/s one GPU (or rank) achieves on the model's matrices, its links inside a node and
    across nodes, and how many GPUs a node holds (ranks are numbered node by node, as ``torchrun`` does).
    ``cores``: where ranks share a node's processor cores (gloo ranks on a CPU), how many — or, measured, a
    curve: ``cores[n - 1]`` the cores' worth of compute that ``n`` busy ranks get together (8 ranks on 2 cores
    may get less than 2, evicting each other's caches); ``None`` (GPUs): each rank computes on its own device.
    Only :mod:`labkit.costmodel.simulator` models the sharing.
    ``layer_overhead_s``: a fixed cost per layer and forward pass (twice that per backward) beside the FLOPs —
    the framework's own time per operation, which dominates tiny models on a CPU and is ~0 for large ones on
    GPUs (:class:`labkit.costmodel.calibration.Calibration` measures both on this machine);
    ``pass_overhead_s`` the same per pass whatever its layers (embedding, loss, the autograd engine's start).
    ``straggle``: where ranks share cores, ``straggle[g - 1]`` is how many times their mean the slowest of ``g``
    ranks takes for the same work started together (only the simulator models it:
    :func:`labkit.costmodel.simulator.straggle_factor`).  Empty: every rank keeps pace.

    Three more say how collectives behave on a GPU cluster (:class:`labkit.costmodel.planner.Cluster` sets them
    from :mod:`labkit.costmodel.hardware`; their defaults are an ideal machine, exercise 11's):
    ``call_latency_s``, a fixed cost per collective call beside the ring's per-step ``alpha`` (NCCL's base
    latency); ``overlap_slowdown``, the compute lost per second of communication hidden behind it; and
    ``dp_bucket_elements``: ``None``, gradients leave for the data-parallel reduction as a continuous stream
    while the last backward produces them, or the smallest bucket (in elements) they leave in, each bucket once
    its share of that backward is done (lesson 02's buckets; Megatron-LM's ``max(40M, 1M x d)``).  ``rails``:
    each GPU of a node has its own network adapter (``inter_node`` is one GPU's share), and a group that spans
    nodes with ``k`` members in each drives ``k`` of them at once, as NCCL's rings over several channels do
    on DGX nodes: ``k`` times one GPU's network bandwidth, at most the NVLink's (``False``: one GPU's, as if
    the group had one member a node).  Ring collectives only: an all-to-all or a send crosses nodes through its
    own GPU's adapter (:mod:`labkit.costmodel.hardware`).  ``kernels``: the GPU's rates by kernel
    (:class:`labkit.costmodel.kernels.Kernels`), which then price each layer by its products' shapes, its
    attention by a causal kernel's tiles and its memory-bound operations by their bytes, and the optimizer's
    step; ``None``: every FLOP of the Megatron count at ``flops`` (a CPU, calibrated; exercise 11)."""

    flops: float
    intra_node: LinkModel
    inter_node: LinkModel
    gpus_per_node: int = 8
    cores: float | tuple[float, ...] | None = None
    layer_overhead_s: float = 0.0
    straggle: tuple[float, ...] = ()
    pass_overhead_s: float = 0.0
    call_latency_s: float = 0.0
    overlap_slowdown: float = 0.0
    dp_bucket_elements: int | None = None
    rails: bool = False
    kernels: Kernels | None = None


def weighted_stage_layers(layers: int, chunks: int, input_weight: int = 1, output_weight: int = 1
                          ) -> tuple[int, ...]:
    """Each of ``chunks`` pipeline chunks' layers when the embedding counts as ``input_weight`` layers on the
    first and the output layer and loss as ``output_weight`` on the last, the ``layers + input_weight +
    output_weight`` units split evenly and the remainder one each to the first chunks: torchtitan's rule
    (``generate_llm_fqn_per_model_part``, ``torchtitan/distributed/pipeline_parallel.py`` of pytorch/torchtitan),
    Megatron-LM's ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split`` when the
    units divide evenly.  Llama 3 405B's 126 layers on 128 chunks: none on the first and the last, one on each
    other.  ``ValueError`` when a chunk would hold fewer units than the embedding's or the output's weight."""
    units = layers + input_weight + output_weight
    each, extra = divmod(units, chunks)
    if chunks < 1 or each < max(input_weight, output_weight, 1):
        raise ValueError(f"{layers} layers (+{input_weight} for the embedding, +{output_weight} for the output) "
                         f"cannot be split over {chunks} chunks of at least one unit each")
    counts = [each + (1 if chunk < extra else 0) for chunk in range(chunks)]
    counts[0] -= input_weight
    counts[-1] -= output_weight
    return tuple(counts)


def check_divides(shape: Any, layout: Layout, global_batch: int, stage_layers: tuple[int, ...] | None) -> None:
    """Raise ``ValueError`` naming the degree that does not divide what it cuts: the global batch, the experts,
    the sequence, the layers."""
    d, b = layout.dp, layout.micro_batch
    stage_layers = layout.stage_layers if stage_layers is None else stage_layers
    if global_batch % (d * b):
        raise ValueError(f"the global batch {global_batch} must split into dp={d} replicas of micro-batches of "
                         f"b={b} sequences (global_batch % (dp * b) == 0)")
    if layout.ep > 1 and ((layout.dp * layout.cp) % layout.ep or not getattr(shape, "moe_layers", 0)
                          or shape.num_experts % layout.ep):
        raise ValueError(f"ep={layout.ep} must divide dp x cp = {layout.dp * layout.cp} and the experts of an MoE shape "
                         f"({getattr(shape, 'num_experts', 0)})")
    if shape.seq_len % (2 * layout.cp) and layout.cp > 1:
        raise ValueError(f"cp={layout.cp} zig-zag chunks do not divide the sequence of {shape.seq_len} tokens "
                         f"(seq_len % (2 cp) == 0)")
    if stage_layers is None:
        if shape.num_layers % layout.chunks:
            raise ValueError(f"{layout.chunks} pipeline stages do not divide the {shape.num_layers} layers")
    elif len(stage_layers) != layout.chunks or sum(stage_layers) != shape.num_layers or min(stage_layers) < 0:
        raise ValueError(f"stage_layers must give each of the {layout.chunks} chunks its layers (>= 0), "
                         f"{shape.num_layers} in all; got {stage_layers}")


def chunk_layers(shape: Any, layout: Layout, stage_layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each chunk's layers (``stage_layers``, else the layout's, or ``L / (p v)`` each)."""
    stage_layers = layout.stage_layers if stage_layers is None else stage_layers
    if stage_layers is not None:
        return tuple(stage_layers)
    return (shape.num_layers // layout.chunks,) * layout.chunks


@dataclass(frozen=True)
class ChunkCosts:
    """One micro-batch on each chunk (index = chunk): compute and TP all-reduce seconds, forward and backward."""

    compute_forward: tuple[float, ...]
    compute_backward: tuple[float, ...]
    tp_forward: tuple[float, ...]
    tp_backward: tuple[float, ...]
    cp_forward: tuple[float, ...] = ()  # context parallelism's exposed communication (and its slowdown)
    cp_backward: tuple[float, ...] = ()
    ep_forward: tuple[float, ...] = ()  # expert parallelism's all-to-alls (on the critical path)
    ep_backward: tuple[float, ...] = ()

    def rank_totals(self, layout: Layout) -> list[tuple[float, float, float, float]]:
        """Per rank: ``(compute forward, compute backward, TP forward, TP backward)`` over its chunks."""
        totals = [[0.0] * 4 for _ in range(layout.pp)]
        for chunk, values in enumerate(zip(self.compute_forward, self.compute_backward, self.tp_forward,
                                           self.tp_backward, strict=True)):
            for k, value in enumerate(values):
                totals[layout.rank_of(chunk)][k] += value
        return [tuple(row) for row in totals]  # type: ignore[misc]


def tp_all_reduce_s(shape: Any, layout: Layout, hardware: Hardware, value_bytes: int = 2) -> float:
    """One TP all-reduce of a micro-batch's ``b s h`` values over the ``t`` ranks of a group (0 when ``t = 1``)."""
    t = layout.tp
    if t == 1:
        return 0.0
    nbytes = layout.micro_batch * shape.seq_len // layout.cp * shape.hidden_size * value_bytes
    return ring_all_reduce_cost(nbytes, t, link_of(hardware, 1, t)).time_s + hardware.call_latency_s


def chunk_costs(shape: Any, layout: Layout, hardware: Hardware, value_bytes: int = 2,
                stage_layers: tuple[int, ...] | None = None, head_on_last_stage: bool = True,
                flash_attention: bool = True, dropout: bool = False, sequence_parallel: bool = True) -> ChunkCosts:
    """Each chunk's seconds on one micro-batch (module docstring): its layers' FLOPs over the ``t`` ranks of
    its TP group at ``hardware.flops`` (the backward twice the forward, three times with recomputation, the
    forward rerun inside it), the output layer's on the last chunk (never recomputed), the per-layer and
    per-pass overheads, and two TP all-reduces per layer each way (two more backward when recomputing).  With
    context parallelism every rank computes ``1 / cp`` of each layer (zig-zag balances the causal work) and its
    attention adds what :func:`labkit.costmodel.context.cp_layer_seconds` leaves exposed; with expert parallelism
    each MoE layer adds two all-to-alls forward, two backward (two more when recomputing):
    :func:`labkit.costmodel.experts.ep_all_to_all_s`.  With ``hardware.kernels`` each layer is priced by its
    kernels instead (:func:`kernel_passes`; ``flash_attention``, ``dropout`` and ``sequence_parallel`` say
    which kernels run)."""
    b, t, chunks = layout.micro_batch, layout.tp * layout.cp, layout.chunks
    layers = chunk_layers(shape, layout, stage_layers)
    one = tp_all_reduce_s(shape, layout, hardware, value_bytes)
    backward_passes = 3 if layout.recompute else 2
    per_pass = hardware.pass_overhead_s * layout.pp / chunks  # a rank's per-pass cost, shared by its chunks
    if hardware.kernels is not None:
        forward, backward = kernel_passes(shape, layout, hardware.kernels, stage_layers, head_on_last_stage,
                                          flash_attention, dropout, sequence_parallel, value_bytes)
    elif head_on_last_stage:
        layer, head = layer_flops(shape, b) / (t * hardware.flops), head_flops(shape, b) / (t * hardware.flops)
        forward = [n * layer + (head if c == chunks - 1 else 0.0) for c, n in enumerate(layers)]
        backward = [backward_passes * n * layer + (2 * head if c == chunks - 1 else 0.0)
                    for c, n in enumerate(layers)]
    else:  # the whole model's FLOPs spread evenly over the chunks: a balanced pipeline
        flops = model_flops_per_step(shape, b, recompute=layout.recompute)
        even = flops / (t * chunks) / (backward_passes + 1) / hardware.flops
        forward, backward = [even] * chunks, [backward_passes * even] * chunks
    overhead = [hardware.layer_overhead_s * n + per_pass for n in layers]
    cp_forward, cp_backward = cp_layer_seconds(shape, layout, hardware, value_bytes=value_bytes)
    cp_backward += cp_forward if layout.recompute else 0.0  # the recomputed forward gathers or rotates again
    a2a = ep_all_to_all_s(shape, layout, hardware, value_bytes)
    moe = chunk_moe_layers(shape, layout, stage_layers)
    return ChunkCosts(tuple(f + o for f, o in zip(forward, overhead, strict=True)),
                      tuple(bw + backward_passes * o for bw, o in zip(backward, overhead, strict=True)),
                      tuple(2 * n * one for n in layers),
                      tuple((2 + 2 * layout.recompute) * n * one for n in layers),
                      tuple(n * cp_forward for n in layers), tuple(n * cp_backward for n in layers),
                      tuple(2 * n * a2a for n in moe), tuple((2 + 2 * layout.recompute) * n * a2a for n in moe))


def kernel_passes(shape: Any, layout: Layout, kernels: Kernels, stage_layers: tuple[int, ...] | None = None,
                  head_on_last_stage: bool = True, flash_attention: bool = True, dropout: bool = False,
                  sequence_parallel: bool = True, value_bytes: int = 2) -> tuple[list[float], list[float]]:
    """Each chunk's forward and backward seconds on one micro-batch from its kernels
    (:func:`labkit.costmodel.kernels.layer_time`): its dense and MoE layers, the output layer and the loss on
    the last chunk (:func:`~labkit.costmodel.kernels.head_time`), the backward rerunning each layer's forward
    under full recomputation and its attention core under selective recomputation; ``head_on_last_stage=False``:
    the whole model's seconds spread evenly over the chunks."""
    b, chunks = layout.micro_batch, layout.chunks
    options = {"tp": layout.tp, "cp": layout.cp, "ep": layout.ep, "flash_attention": flash_attention,
               "dropout": dropout, "sequence_parallel": sequence_parallel, "value_bytes": value_bytes}
    dense = layer_time(kernels, shape, b, **options)
    sparse = layer_time(kernels, shape, b, moe=True, **options) if getattr(shape, "moe_layers", 0) else dense

    def backward_of(layer: LayerTime) -> float:
        rerun = {"": 0.0, "attention": layer.attention_forward, "layer": layer.forward / 2,
                 "op": layer.elementwise_forward + layer.products_forward / 2}[layout.selective]
        return layer.backward + (layer.forward if layout.recompute else rerun)

    head_forward, head_backward = head_time(kernels, shape, b, layout.tp, layout.cp, value_bytes)
    moe = chunk_moe_layers(shape, layout, stage_layers)
    layers = chunk_layers(shape, layout, stage_layers)
    forward = [(n - k) * dense.forward + k * sparse.forward for n, k in zip(layers, moe, strict=True)]
    backward = [(n - k) * backward_of(dense) + k * backward_of(sparse) for n, k in zip(layers, moe, strict=True)]
    forward[-1] += head_forward
    backward[-1] += head_backward
    if not head_on_last_stage:
        forward, backward = [sum(forward) / chunks] * chunks, [sum(backward) / chunks] * chunks
    return forward, backward


def chunk_moe_layers(shape: Any, layout: Layout, stage_layers: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each chunk's MoE layers: its layers past the shape's first ``dense_layers`` (none for a dense model)."""
    counts, start = [], 0
    for n in chunk_layers(shape, layout, stage_layers):
        counts.append(0 if not getattr(shape, "moe_layers", 0) else
                      max(0, start + n - max(start, shape.dense_layers)))
        start += n
    return tuple(counts)


def rank_expert_parameters(shape: Any, layout: Layout, stage_layers: tuple[int, ...] | None = None) -> list[float]:
    """Each pipeline rank's routed-expert parameters, all ``E`` experts (expert parallelism then keeps ``1 / ep``
    of them): its chunks' MoE layers' share of :func:`labkit.costmodel.shapes.expert_parameters`."""
    counts = [0.0] * layout.pp
    per_layer = expert_parameters(shape) / shape.moe_layers if getattr(shape, "moe_layers", 0) else 0.0
    for chunk, n in enumerate(chunk_moe_layers(shape, layout, stage_layers)):
        counts[layout.rank_of(chunk)] += n * per_layer
    return counts


def chunk_parameters(shape: Any, layout: Layout, stage_layers: tuple[int, ...] | None = None) -> list[float]:
    """Each chunk's parameters before tensor parallelism splits them (module docstring): its layers', the
    embedding (and learned positions) on the first, the output layer and the final norm on the last (a tied
    output layer is a copy of the embedding there when the model has more than one chunk)."""
    layers = chunk_layers(shape, layout, stage_layers)
    moe = chunk_moe_layers(shape, layout, stage_layers)
    dense, sparse = layer_parameters(shape), layer_parameters(shape, moe=True) if moe and max(moe) else 0
    outside = num_parameters(shape) - (shape.num_layers - sum(moe)) * dense - sum(moe) * sparse  # embeddings, norm
    h, vocab = shape.hidden_size, shape.vocab_size
    embedding = vocab * h + (shape.seq_len * h if shape.learned_positions else 0)
    untied = 0 if shape.tied_embeddings else vocab * h
    head = untied if not shape.tied_embeddings else (vocab * h if len(layers) > 1 else 0)
    counts = [float((n - k) * dense + k * sparse) for n, k in zip(layers, moe, strict=True)]
    counts[0] += embedding
    counts[-1] += head + outside - embedding - untied  # and the final norm
    return counts


def rank_parameters(shape: Any, layout: Layout, stage_layers: tuple[int, ...] | None = None) -> list[float]:
    """Each pipeline rank's parameters (its chunks', :func:`chunk_parameters`)."""
    counts = [0.0] * layout.pp
    for chunk, count in enumerate(chunk_parameters(shape, layout, stage_layers)):
        counts[layout.rank_of(chunk)] += count
    return counts


def stage_times(shape: Any, layout: Layout, global_batch: int, hardware: Hardware, value_bytes: int = 2
                ) -> tuple[int, int, float, float, float, float]:
    """``(m, v, forward, backward, tp_forward, tp_backward)``: micro-batches per step, stages per rank, and one
    micro-batch's compute and TP all-reduce seconds on one rank's stages, the model's FLOPs spread evenly over
    the stages (the uniform stages the event simulator, :mod:`labkit.costmodel.simulator`, runs)."""
    extra = [f"{name}={degree}" for name, degree in (("cp", layout.cp), ("ep", layout.ep)) if degree > 1]
    if extra:
        raise ValueError(f"the event simulator runs dp x tp x pp layouts: {' and '.join(extra)} "
                         f"{'is' if len(extra) == 1 else 'are'} priced by predict_step")
    check_divides(shape, layout, global_batch, None)
    v = layout.chunks // layout.pp
    costs = chunk_costs(shape, layout, hardware, value_bytes, head_on_last_stage=False)
    forward, backward, tp_forward, tp_backward = costs.rank_totals(layout)[0]
    return global_batch // (layout.dp * layout.micro_batch), v, forward, backward, tp_forward, tp_backward
