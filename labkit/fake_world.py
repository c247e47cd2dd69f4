"""One rank of a thousand-GPU run, built by PyTorch on one CPU: its memory term by term, beside labkit's model.

:mod:`labkit.costmodel.memory` and :func:`labkit.costmodel.planner.layout_memory` predict the bytes of each term
(parameters, gradients, optimizer states, activations) on the fullest GPU of a layout.  At 1,024 GPUs what a
rank holds also depends on rules the formulas do not see: how PyTorch pads a shard, which tensors tensor
parallelism leaves whole, how an optimizer is partitioned.  Here PyTorch builds the model on *one rank of a fake
world*, one training step runs, and each term is set beside labkit's with every difference named and computed
from the shape and PyTorch's rules, never fitted (:class:`Term`; the tests hold what is left to 0 bytes).

**The fake world** (:func:`fake_world`).  PyTorch's fake process group (``FakeProcessGroup`` and ``FakeStore``,
registered by ``torch.testing._internal.distributed.fake_pg``) lets one process join as rank ``r`` of ``N``: every
collective returns at once and moves nothing (garbage values, the right shapes), so ``fully_shard``,
``parallelize_module``, DDP and ``ZeroRedundancyOptimizer`` allocate what they would on rank ``r`` of a real job,
and the step computes only that rank's share.  Rank 0 is the fullest rank of both layouts below (FSDP2's chunks
are largest on it; ZeRO-1 gives it the largest tensor, alone when there are more ranks than tensors).

**Who counts.**  PyTorch's trackers work on CPU: ``FSDPMemTracker`` sorts an FSDP2 rank's storages into sharded
and unsharded parameters, gradients, optimizer states, activations, all-gather and reduce-scatter buffers;
``MemTracker`` does the same for a plain module (it files DDP's gradient buckets as activations or temporaries).
Both snapshot each module before and after its forward: the layers' activations are read off those.  Model
states are also counted from the storages, each once (:func:`labkit.measure.storage_bytes`, a DTensor's local
tensor), and the tests hold the two counts equal where the tracker sorts them right.

**FSDP2 (ZeRO-3) over dp x tensor parallelism** (:func:`check_fsdp_tp`): TinyGPT split by Megatron's plan
(:func:`tensor_parallel_plan`) on a ``(dp, tp)`` ``DeviceMesh``, then ``fully_shard`` on each block and the root
with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, AdamW.  FSDP2 keeps the fp32 shard itself as
the master weights and reduce-scatters and steps fp32 gradients: ``4 + 4 + 8 = 16`` bytes a parameter, which is
:func:`~labkit.costmodel.memory.memory_per_rank`'s ``"fp32"``.  The planner counts a mixed-precision step as
Megatron-LM and DeepSpeed keep it, bf16 weights and gradients beside an fp32 master and, at the peak, the
optimizer's fp32 copy of the gradients: 20 bytes, 4 more than FSDP2 holds.  The bf16 weights FSDP2 gathers (a
layer's while it runs, the root's embedding and head through the whole step) are in neither model.

**ZeRO-1 over data parallelism** (:func:`check_zero1`): DDP (``gradient_as_bucket_view=True``) and
``ZeroRedundancyOptimizer`` in fp32.  It gives *whole tensors* to ranks, the largest first, each to the least
loaded rank (:func:`zero_redundancy_partition`; ``labkit.parallel.zero``'s stage 1 does the same): with more
ranks than tensors, the fullest rank holds the largest tensor's states, where the model divides all of them
evenly, as DeepSpeed's and Megatron's distributed optimizers split one flat buffer.  DDP's default keeps its
buckets beside the gradients, a second copy (:func:`ddp_bucket_bytes`).  PyTorch has no ZeRO-1 of DTensors:
DDP refuses a module mixing DTensors and tensors, and ``ZeroRedundancyOptimizer``'s broadcast has no DTensor rule.

**The other differences**: parameters tensor parallelism leaves whole (LayerNorms, learned positions, row-parallel
biases), which the model divides by ``t``; FSDP2's ``ceil(rows / dp)`` rows a shard; Adam's 4-byte ``step`` per
tensor; the LayerNorms' mean and inverse standard deviation (``4 s b`` values a layer, in the activations' dtype on
CPU, fp32 on CUDA), which the activation model leaves out as ``h`` times smaller.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from labkit.costmodel.memory import activation_bytes, memory_per_rank
from labkit.costmodel.planner import layout_memory
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.costmodel.stages import Layout
from labkit.measure import storage_bytes
from labkit.models import GPTConfig, TinyGPT

# --------------------------------------------------------------------------------------------------------
# The fake world and the model


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` in a fake process group (no communication); the group and
    every subgroup made inside are destroyed on leaving, also on error."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if torch_dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: a fake world needs its own")
    torch_dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def gpt_config(shape: TransformerShape) -> GPTConfig:
    """The :class:`GPTConfig` whose TinyGPT has ``shape`` exactly (``seq_len`` its ``block_size``); ``ValueError``
    for a shape TinyGPT cannot build (SwiGLU, RMSNorm, rotary positions, grouped-query attention, experts, an MLP
    other than ``4h``) or a tied head (one weight cannot be both a row- and a column-parallel DTensor)."""
    config = GPTConfig(vocab_size=shape.vocab_size, block_size=shape.seq_len, n_layer=shape.num_layers,
                       n_head=shape.num_heads, n_embd=shape.hidden_size, bias=shape.bias,
                       tie_weights=shape.tied_embeddings)
    if TransformerShape.from_gpt_config(config) != shape or shape.tied_embeddings:
        raise ValueError(f"TinyGPT builds GELU, LayerNorm, learned-position shapes without experts, and here an "
                         f"untied head: {shape} is not one")
    return config


def parameter_tensors(shape: TransformerShape) -> list[tuple[str, tuple[int, ...], int | None]]:
    """TinyGPT's parameters as ``(name, global shape, the dimension tensor parallelism splits or None)``, in
    the order ``named_parameters`` gives them (:func:`tensor_parallel_plan`: a column-parallel linear splits its
    weight's rows and its bias, a row-parallel one its weight's columns and not its bias)."""
    h, v = shape.hidden_size, shape.vocab_size

    def linear(name: str, out: int, into: int, column: bool) -> list:
        bias = [(f"{name}.bias", (out,), 0 if column else None)] if shape.bias else []
        return [(f"{name}.weight", (out, into), 0 if column else 1)] + bias

    def norm(name: str) -> list:
        return [(f"{name}.weight", (h,), None)] + ([(f"{name}.bias", (h,), None)] if shape.bias else [])

    tensors = [("token_embedding.weight", (v, h), 0), ("position_embedding.weight", (shape.seq_len, h), None)]
    for i in range(shape.num_layers):
        tensors += norm(f"blocks.{i}.attn_norm")
        for name in ("query", "key", "value"):
            tensors += linear(f"blocks.{i}.attn.{name}", h, h, column=True)
        tensors += linear(f"blocks.{i}.attn.proj", h, h, column=False) + norm(f"blocks.{i}.mlp_norm")
        tensors += linear(f"blocks.{i}.mlp.fc", 4 * h, h, True) + linear(f"blocks.{i}.mlp.proj", h, 4 * h, False)
    return tensors + norm("final_norm") + [("lm_head.weight", (v, h), 0)]


def tensor_parallel_plan(num_layers: int) -> dict:
    """Megatron's split for ``parallelize_module``: Q, K, V and the MLP's first matrix column-parallel, the two
    projections row-parallel, a vocabulary-parallel embedding, and the head's logits left sharded by vocabulary
    for ``loss_parallel`` (as torchtitan's Llama plan, without sequence parallelism)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"attn.query": ColwiseParallel, "attn.key": ColwiseParallel, "attn.value": ColwiseParallel,
              "attn.proj": RowwiseParallel, "mlp.fc": ColwiseParallel, "mlp.proj": RowwiseParallel}
    plan = {f"blocks.{i}.{name}": style() for i in range(num_layers) for name, style in styles.items()}
    return {"token_embedding": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(use_local_output=False), **plan}


# --------------------------------------------------------------------------------------------------------
# PyTorch's sharding rules, predicted


def fsdp_shard_elements(shape: TransformerShape, dp: int, tp: int, root_only: bool = False) -> tuple[int, float]:
    """``(rank 0's elements, the even share)`` under tensor parallelism over ``tp`` (:func:`parameter_tensors`),
    then FSDP2 over ``dp``: each piece's rows cut into chunks of ``ceil(rows / dp)`` (``torch.chunk``; rank 0's is
    always full), against ``numel / dp`` of each piece.  ``root_only``: the tensors outside the blocks."""
    held, even = 0, 0.0
    for name, size, dim in parameter_tensors(shape):
        if root_only and name.startswith("blocks."):
            continue
        local = [extent // tp if d == dim else extent for d, extent in enumerate(size)]
        rest = math.prod(local[1:])
        held += math.ceil(local[0] / dp) * rest
        even += local[0] * rest / dp
    return held, even


def zero_redundancy_partition(numels: list[int], world_size: int) -> list[list[int]]:
    """``ZeroRedundancyOptimizer``'s partition: the tensors' sizes, largest first (a stable sort), each given
    whole to the rank holding the fewest elements so far (the lowest such rank); each rank's sizes."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for numel in sorted(numels, reverse=True):
        min(ranks, key=sum).append(numel)  # the first of the least loaded
    return ranks


# --------------------------------------------------------------------------------------------------------
# Measured


@dataclass
class RankMemory:
    """Bytes one rank holds, by term: model states after one step, activations when the forward pass ends."""

    parameters: int  # the parameters' storages (FSDP2: this rank's fp32 shards)
    gradients: int  # the .grad storages (DDP with bucket views: its buckets)
    optimizer_states: int  # Adam's exp_avg and exp_avg_sq
    optimizer_steps: int  # Adam's step counters: one 4-byte tensor per parameter tensor this rank steps
    activations: int  # created by the transformer layers and alive when the forward ends
    outside_activations: int  # the embedding's, the head's and the loss's (and the inputs' views)
    gathered: int = 0  # FSDP2's unsharded bf16 parameters alive when the forward ends (the root's)
    peak: int = 0  # the tracker's peak over the step, every category
    tracker: dict[str, int] = field(default_factory=dict)  # the tracker's categories after the step


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    seen: set[int] = set()
    parameters = list(model.parameters())
    held = {"parameters": storage_bytes([_local(p) for p in parameters], seen),
            "gradients": storage_bytes([_local(p.grad) for p in parameters if p.grad is not None], seen),
            "optimizer_states": 0, "optimizer_steps": 0}
    for state in optimizer.state.values():
        for name, value in state.items():
            held["optimizer_steps" if name == "step" else "optimizer_states"] += storage_bytes([_local(value)], seen)
    return held


def _category(snapshot: dict, name: str) -> int:
    return sum(per_device.get(name, 0) for per_device in snapshot.values())


def _rank_memory(model, optimizer, tracker, forward_end: dict, after: dict, states: tuple[str, str]) -> RankMemory:
    """Model states counted from the storages; the layers' activations from the tracker's snapshots of the first
    block before its forward and the last after it (``states``: torch's ``_ModState`` or ``_FSDPModState`` names);
    the rest of the forward's activations, the gathered parameters and the peak from its other snapshots."""
    first, last = (tracker.memory_tracking[model.blocks[i]].snapshots for i in (0, -1))
    layers = _category(last[states[1]][0], "Activation") - _category(first[states[0]][0], "Activation")
    categories = {getattr(name, "value", name): value for per_device in after.values()
                  for name, value in per_device.items() if value}
    return RankMemory(**_held(model, optimizer), activations=layers,
                      outside_activations=_category(forward_end, "Activation") - layers,
                      gathered=_category(forward_end, "Unsharded Param"),
                      peak=_category(tracker.get_tracker_snapshot("peak"), "Total"), tracker=categories)


def _batch(config: GPTConfig, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, config.vocab_size, (micro_batch, config.block_size), generator=generator)
                 for _ in range(2))  # type: ignore[return-value]


def _step(tracker, model, optimizer, batch, context=contextlib.nullcontext) -> tuple[dict, dict]:
    """Forward (``model(idx, targets)[1]`` is the loss), backward and the optimizer's step inside ``tracker``:
    its snapshots when the forward ends and after the step."""
    with tracker:
        with context():
            loss = model(*batch)[1]
            forward_end = tracker.get_tracker_snapshot()
            loss.backward()
        optimizer.step()
        return forward_end, tracker.get_tracker_snapshot()


def measure_fsdp_tp(shape: TransformerShape, dp: int, tp: int, micro_batch: int = 1) -> RankMemory:
    """Rank 0 of ``dp x tp`` ranks: TinyGPT(shape) split by :func:`tensor_parallel_plan` over ``tp``, then
    ``fully_shard`` (each block, then the root) over ``dp`` with ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)``, AdamW; one step on ``micro_batch`` sequences under ``FSDPMemTracker``."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    config = gpt_config(shape)
    if shape.num_heads % tp or shape.vocab_size % tp:
        raise ValueError(f"tp={tp} must divide the {shape.num_heads} heads and the vocabulary of {shape.vocab_size}")
    with fake_world(dp * tp), warnings.catch_warnings():
        # TinyGPT returns its logits as a view; nothing here changes them in place, which is what FSDP2 warns of.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = TinyGPT(config)
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(config.n_layer))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = _batch(config, micro_batch)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(batch)
        snapshots = _step(tracker, model, optimizer, batch, loss_parallel)
        return _rank_memory(model, optimizer, tracker, *snapshots, ("Before Pre-Forward", "After Post-Forward"))


def _ddp(model: torch.nn.Module, gradient_as_bucket_view: bool) -> torch.nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=gradient_as_bucket_view)
    # The fake group's all-reduce hands DDP's reducer no tensor back; a hook that returns the bucket as it is
    # stands in for the reduction (it moves nothing, as the fake group would not).
    ddp.register_comm_hook(None, noop_hook)
    return ddp


def ddp_bucket_bytes(shape: TransformerShape, dp: int, gradient_as_bucket_view: bool = False) -> tuple[int, int]:
    """``(DDP's gradient buckets, the gradients held beside them after a backward)`` on rank 0 of ``dp``, as
    ``MemTracker`` counts them: what building ``DistributedDataParallel`` leaves allocated, and the gradients
    allocated apart from it (all of them by default; none with ``gradient_as_bucket_view``, which makes each
    gradient a view into its bucket)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config = gpt_config(shape)
    with fake_world(dp):
        model = TinyGPT(config)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            ddp = _ddp(model, gradient_as_bucket_view)
            built = tracker.get_tracker_snapshot()
            ddp(*_batch(config, 1))[1].backward()
            after = tracker.get_tracker_snapshot()
        return _category(built, "Total") - _category(built, "Parameter"), _category(after, "Gradient")


def measure_zero1(shape: TransformerShape, dp: int, micro_batch: int = 1) -> RankMemory:
    """Rank 0 of ``dp`` ranks: TinyGPT(shape) in fp32 under ``DistributedDataParallel`` (gradients as views into
    its buckets) with ``ZeroRedundancyOptimizer(AdamW)``; one step under ``MemTracker``."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.optim import ZeroRedundancyOptimizer

    config = gpt_config(shape)
    with fake_world(dp):
        model = TinyGPT(config)
        ddp = _ddp(model, gradient_as_bucket_view=True)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        tracker = MemTracker()
        tracker.track_external(model, optimizer.optim)
        snapshots = _step(tracker, ddp, optimizer, _batch(config, micro_batch))
        return _rank_memory(model, optimizer.optim, tracker, *snapshots, ("Pre-Forward", "Post-Forward"))


# --------------------------------------------------------------------------------------------------------
# Beside labkit's model


@dataclass
class Term:
    """One term of a rank's memory: PyTorch's bytes, labkit's, and the named parts of the difference (each
    computed from the shape and PyTorch's rules, never fitted): :attr:`unexplained` is what they leave."""

    name: str
    torch: float
    labkit: float
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def unexplained(self) -> float:
        return self.torch - self.labkit - sum(self.parts.values())


@dataclass
class MemoryCheck:
    """A layout's rank measured (:class:`RankMemory`), beside :func:`~labkit.costmodel.memory.memory_per_rank`
    and :func:`~labkit.costmodel.memory.activation_bytes` (``terms``) and the planner's
    :func:`~labkit.costmodel.planner.layout_memory` (``planner_terms``)."""

    label: str
    layout: Layout
    measured: RankMemory
    terms: list[Term]
    planner_terms: list[Term]

    def table(self) -> str:
        """The terms as a table: PyTorch's bytes, labkit's, the difference and its parts; the tracker's peak."""
        rows = [f"{self.label}: rank 0 of {self.layout.gpus}",
                f"{'term':<24}{'PyTorch':>14}{'labkit':>14}{'difference':>14}  explained by"]
        for title, terms in (("memory_per_rank, activation_bytes", self.terms), ("layout_memory", self.planner_terms)):
            rows.append(f"-- beside {title}")
            rows += [f"{term.name:<24}{term.torch:>14,.0f}{term.labkit:>14,.0f}{term.torch - term.labkit:>+14,.0f}  "
                     + "; ".join(f"{name} {value:+,.0f}" for name, value in term.parts.items() if value)
                     for term in terms]
        return "\n".join(rows + [f"peak over the step (PyTorch's tracker, every category): {self.measured.peak:,} bytes"])


def _norm_statistics(shape: TransformerShape, micro_batch: int, value_bytes: int) -> int:
    """Two LayerNorms a layer, each keeping a mean and an inverse standard deviation per token."""
    return shape.num_layers * 2 * 2 * shape.seq_len * micro_batch * value_bytes


def _outside(shape: TransformerShape, micro_batch: int, tp: int, value_bytes: int, targets: bool) -> dict[str, float]:
    """What the embedding, the head and the loss keep beside the planner's logits (``6 b s V / t``: bf16 and an
    fp32 copy): the embedding's output (the first layer's input), the final norm's output and statistics, the
    loss's log-softmax of this rank's ``V / t`` columns in the activations' dtype (the logits are freed), the
    position ids (int64), the loss and its total weight, and (``targets``: the tracker was not told they are
    inputs) the targets' flat view, int64."""
    sb = shape.seq_len * micro_batch
    sbh = sb * shape.hidden_size * value_bytes
    return {"embedding output": sbh, "final norm output and statistics": sbh + 2 * sb * value_bytes,
            "log-softmax kept once (planner: bf16 + fp32 logits)": (value_bytes - 6) * sb * (shape.vocab_size // tp),
            "position ids, targets, loss scalars": 8 * shape.seq_len + 2 * value_bytes + (8 * sb if targets else 0)}


def check_fsdp_tp(shape: TransformerShape, dp: int = 128, tp: int = 8, micro_batch: int = 1) -> MemoryCheck:
    """FSDP2 over ``dp`` x tensor parallelism over ``tp`` (:func:`measure_fsdp_tp`) beside labkit's ZeRO-3."""
    measured = measure_fsdp_tp(shape, dp, tp, micro_batch)
    psi, b = num_parameters(shape), micro_batch
    even = psi / (dp * tp)
    held, share = fsdp_shard_elements(shape, dp, tp)
    whole, padding = share - even, held - share
    steps = 4 * len(parameter_tensors(shape))
    model = memory_per_rank(psi, "fp32", "adam", zero_stage=3, dp_degree=dp, tp_degree=tp)
    layers = activation_bytes(shape, b, "mixed", dropout=False, flash_attention=True, tp_degree=tp)
    norms = {"LayerNorm statistics (bf16 on CPU)": _norm_statistics(shape, b, 2)}

    def split(size: int) -> dict[str, float]:
        return {"left whole by tensor parallelism": size * whole, "FSDP2's padding to ceil(rows / dp)": size * padding}

    terms = [Term("parameters", measured.parameters, model["weights"], split(4)),
             Term("gradients", measured.gradients, model["gradients"], split(4)),
             Term("optimizer states", measured.optimizer_states + measured.optimizer_steps, model["optimizer_states"],
                  {**split(8), "Adam's step counters": steps}),
             Term("activations (layers)", measured.activations, layers, norms)]
    layout = Layout(dp=dp, tp=tp, pp=1, zero=3, micro_batch=b)
    planner = layout_memory(shape, layout, dp * b, sequence_parallel=False, flash_attention=True, dropout=False)
    logits = b * shape.seq_len * (shape.vocab_size // tp) * (2 + 4)
    root = 2 * dp * fsdp_shard_elements(shape, dp, tp, root_only=True)[0]  # bf16, padded rows gathered too
    planner_terms = [
        Term("parameters", measured.parameters, planner["weights"],
             {**split(4), "the fp32 shard is the master (planner: bf16 here)": 2 * even}),
        Term("gradients", measured.gradients, planner["gradients"],
             {**split(4), "fp32 gradients stepped as they are (planner: bf16 + fp32 copy)": -2 * even}),
        Term("optimizer states", measured.optimizer_states + measured.optimizer_steps, planner["optimizer_states"],
             {**split(8), "Adam's step counters": steps, "no separate master": -4 * even}),
        Term("activations (layers)", measured.activations, planner["activations"] - logits, norms),
        Term("activations (outside)", measured.outside_activations, logits, _outside(shape, b, tp, 2, targets=False)),
        Term("gathered parameters", measured.gathered, 0, {"the root's, bf16, for the whole step": root})]
    return MemoryCheck(f"FSDP2 (ZeRO-3) dp={dp} x TP {tp}, bf16 compute", layout, measured, terms, planner_terms)


def check_zero1(shape: TransformerShape, dp: int = 1024, micro_batch: int = 1) -> MemoryCheck:
    """DDP + ``ZeroRedundancyOptimizer`` over ``dp`` ranks in fp32 (:func:`measure_zero1`) beside labkit's ZeRO-1."""
    measured = measure_zero1(shape, dp, micro_batch)
    psi, b = num_parameters(shape), micro_batch
    even = psi / dp
    mine = zero_redundancy_partition([math.prod(size) for _, size, _ in parameter_tensors(shape)], dp)[0]
    partition = {"whole tensors, largest first": 8 * (sum(mine) - even), "Adam's step counters": 4 * len(mine)}
    model = memory_per_rank(psi, "fp32", "adam", zero_stage=1, dp_degree=dp)
    layers = activation_bytes(shape, b, "fp32", dropout=False, flash_attention=True)
    norms = {"LayerNorm statistics (fp32)": _norm_statistics(shape, b, 4)}
    terms = [Term("parameters", measured.parameters, model["weights"]),
             Term("gradients", measured.gradients, model["gradients"]),
             Term("optimizer states", measured.optimizer_states + measured.optimizer_steps, model["optimizer_states"],
                  partition),
             Term("activations (layers)", measured.activations, layers, norms)]
    layout = Layout(dp=dp, tp=1, pp=1, zero=1, micro_batch=b)
    planner = layout_memory(shape, layout, dp * b, sequence_parallel=False, flash_attention=True, dropout=False)
    logits = b * shape.seq_len * shape.vocab_size * (2 + 4)
    in_bf16 = activation_bytes(shape, b, "mixed", dropout=False, flash_attention=True)
    planner_terms = [
        Term("parameters", measured.parameters, planner["weights"], {"fp32 weights (planner: bf16)": 2 * psi}),
        Term("gradients", measured.gradients, planner["gradients"],
             {"fp32 gradients stepped as they are (planner: bf16 + fp32 copy)": 2 * psi - 4 * even}),
        Term("optimizer states", measured.optimizer_states + measured.optimizer_steps, planner["optimizer_states"],
             {**partition, "no separate master": -4 * even}),
        Term("activations (layers)", measured.activations, planner["activations"] - logits,
             {**norms, "fp32 activations (planner: bf16)": layers - in_bf16}),
        Term("activations (outside)", measured.outside_activations, logits, _outside(shape, b, 1, 4, targets=True))]
    return MemoryCheck(f"DDP + ZeroRedundancyOptimizer (ZeRO-1) dp={dp}, fp32", layout, measured, terms, planner_terms)
