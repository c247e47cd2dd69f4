"""``parallelize(model, mesh, ...)``: TinyGPT under all three parallelisms at once (3D; Narayanan et al. 2021).

The three are applied in the order torchtitan applies them, each inside the group of its dimension of the
:class:`labkit.mesh.Mesh`:

1. **pipeline** (pp): the model is cut into ``p v`` stages (:func:`~labkit.parallel.pipeline.split_stages`), and
   this rank keeps its own, ``r, r + p, ...`` for pp-rank ``r``;
2. **tensor** (tp): each of those stages is split over the ``t`` ranks of the tp group
   (:class:`~labkit.parallel.tensor.TensorParallel`: heads, MLP columns and rows, the vocabulary);
3. **context** (cp, when the mesh has ``cp > 1``): every stage's attention runs over the cp group, each rank
   holding ``s / cp`` of every sequence (:mod:`labkit.parallel.context.model`: ring, all-gather or Ulysses,
   ``cp_strategy``; contiguous or zig-zag, ``cp_split``); **experts** (ep, when ``ep > 1``): every MoE layer
   keeps ``E / ep`` experts and routes over the ep group (:mod:`labkit.parallel.experts.model`);
4. **data** (dp): the ranks that hold the same piece of the same stages are replicas: DDP (``zero=0``),
   ZeRO-1 or ZeRO-2 around this rank's stages, or FSDP (``zero=3``) around its one stage, over the dp group,
   or with cp the ``dp x cp`` group (``Mesh.group("dp_cp")``: the cp ranks of a sequence hold the same weights).

One training step is a pipeline schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, interleaved ZB, ZB-V or DualPipeV:
:data:`~labkit.parallel.pipeline.catalog.SCHEDULES`) over ``m`` micro-batches of
the data-parallel rank's batch, run by :func:`~labkit.parallel.pipeline.run_schedule`.  Every wrapper runs with
gradient sync off during the schedule, so that the ``m`` backward passes only accumulate; then the data-parallel
reduction runs **once per step**, not once per micro-batch (``reduce_gradients()``: DDP's all-reduce, ZeRO-2's
and FSDP's reduce-scatter).  Tensor parallelism's all-reduces of activations, in contrast, sit inside every
micro-batch's forward and backward, on the critical path; and the pipeline sends one activation per micro-batch
and boundary forward, one gradient back.  What each dimension puts on the wire, per step and per rank:

=========  ====================================================================  ==========================
dimension  what                                                                  when
=========  ====================================================================  ==========================
tp         ``b s h`` activations, all-reduced 2x forward and 2x backward a layer  every micro-batch, blocking
pp         ``b s h`` activations to the next stage, their gradients back          every micro-batch, p2p
cp         K/V blocks round the ring (or all-gathered, or all-to-all'd)           every attention, overlapped
dp         this rank's gradients (``Psi / (t p)``), all-reduced or scattered      once a step, after the last B
=========  ====================================================================  ==========================

which is why the mesh puts tp innermost (one node's fast links) and pp outermost (:mod:`labkit.mesh`).

**The result keeps the wrapper contract** (:mod:`labkit.parallel.base`), so the trainer and the checkpointer
treat it like any other: :meth:`Parallel3D.forward_backward` runs a step's schedule and returns the loss (on
every rank: the last stage's, broadcast over the pp group), ``make_optimizer`` builds the data-parallel
wrapper's optimizer over this rank's pieces, ``clip_grad_norm_`` clips by the norm over the whole model,
``full_state_dict()`` gathers the dense TinyGPT (FSDP's shards over dp, TP's slices over tp, the stages over pp)
and ``full_optimizer_state_dict`` does the same for Adam's moments, so a full checkpoint of a 3D run loads into
one process, or into another layout.

**What is refused, before any process starts** (:func:`check_3d`): a product ``d t p`` that is not the world
size, ``t`` that does not divide the heads and the hidden size, ``p v`` stages that do not divide the layers,
a batch that the micro-batches do not divide, a schedule that does not fit ``p`` and ``m``, tied embeddings
with more than one stage, and FSDP with a schedule it cannot run: interleaving (FSDP here wraps one stage per
rank) and the split schedules (their ``W`` passes bypass FSDP's per-unit backward hooks).  ZeRO-1/2 shard one optimizer over
all of this rank's stages, so they run with every schedule.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.costmodel.context import cp_messages
from labkit.degrees import check_degrees
from labkit.dist import global_rank
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.base import ParallelWrapper, Piece
from labkit.parallel.context.attention import ContextParallelGroup
from labkit.parallel.context.model import apply_context_parallel, check_context_parallel, shard_batch
from labkit.parallel.context.sequence import check_sequence
from labkit.parallel.ddp import DistributedDataParallel
from labkit.parallel.experts.layer import is_expert_parallel
from labkit.parallel.experts.model import ExpertsIn3D, balance_experts, check_expert_layout
from labkit.parallel.fsdp import FullyShardedDataParallel
from labkit.parallel.parallelize import state as threed_state
from labkit.parallel.pipeline.catalog import SCHEDULES, SPLIT_BACKWARD, stages_per_rank
from labkit.parallel.pipeline.runtime import run_schedule
from labkit.parallel.pipeline.schedule import Schedule
from labkit.parallel.pipeline.simulate import Timeline
from labkit.parallel.pipeline.stage import PipelineStage, split_stages
from labkit.parallel.tensor.transformer import TensorParallel, check_tensor_parallel_sizes
from labkit.parallel.zero import ZeroDataParallel

ZERO_STAGES = (0, 1, 2, 3)
DP_WRAPPERS = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}


def check_3d(config: GPTConfig, dp: int, tp: int, pp: int, *, zero: int = 0, schedule: str = "1f1b",
             microbatches: int = 1, virtual_stages: int = 1, batch_size: int | None = None,
             seq_len: int | None = None, world_size: int | None = None, cp: int = 1, cp_strategy: str = "ring",
             cp_split: str = "zigzag", ep: int = 1) -> Schedule:
    """Every check of a 3D (or, with ``cp > 1``, 4D) layout that needs no process group; returns the step's
    schedule.

    ``batch_size`` is one data-parallel replica's batch (cut into ``microbatches``); ``virtual_stages`` (``v``)
    is the number of stages per pp-rank, used by ``"interleaved"`` and ``"interleaved-zb"`` only.  Raises ``ValueError`` naming the value.
    """
    degrees = check_degrees(dp, tp, pp, cp)
    if world_size is not None and dp * cp * tp * pp != world_size:
        named = "dp * tp * pp" if cp == 1 else "dp * cp * tp * pp"
        values = " * ".join(str(degrees[d]) for d in ("dp", "cp", "tp", "pp") if d != "cp" or cp > 1)
        raise ValueError(f"{named} must equal the number of ranks: {values} = {dp * cp * tp * pp}, "
                         f"but there are {world_size} (choose degrees whose product is {world_size})")
    check_context_parallel(config, cp, tp, cp_strategy, cp_split, seq_len)
    check_expert_layout(config, ep, dp, cp, zero)
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES} (0: DDP, 1/2: ZeRO-1/2, 3: FSDP), got {zero!r}")
    for name, value in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    v = stages_per_rank(schedule, virtual_stages)
    check_tensor_parallel_sizes(config.n_embd, config.n_head, degrees["tp"])
    split_stages(config, pp * v)  # raises when p v stages do not divide n_layer
    if pp * v > 1 and config.tie_weights:
        raise ValueError(f"{pp * v} pipeline stages put the embedding and the head on different ranks, so they "
                         "cannot share one weight: use a config with tie_weights=False")
    if zero == 3 and (schedule in SPLIT_BACKWARD or v > 1):
        raise ValueError(f"FSDP (zero=3) cannot run the {schedule} schedule here: "
                         + ("its W passes compute weight gradients outside the backward pass that FSDP's "
                            "per-unit hooks re-gather and reduce" if schedule in SPLIT_BACKWARD else
                            "FSDP wraps one stage per rank, and interleaving puts several on each")
                         + "; use gpipe or 1f1b with FSDP, or ZeRO-1/2 (zero=1 or 2) with this schedule")
    if batch_size is not None and (batch_size < 1 or batch_size % microbatches):
        raise ValueError(f"the batch of {batch_size} sequences per data-parallel rank must split into "
                         f"{microbatches} equal micro-batches (batch_size % microbatches == 0)")
    if seq_len is not None and not 1 <= seq_len <= config.block_size:
        raise ValueError(f"seq_len must be in [1, block_size={config.block_size}], got {seq_len}")
    return SCHEDULES[schedule](pp, microbatches, v)


def _stage_module(model: TinyGPT, stage: int, num_stages: int) -> TinyGPT:
    """Stage ``stage`` of ``model``: a TinyGPT with only that stage's pieces, holding ``model``'s values."""
    blocks = split_stages(model.config, num_stages)[stage]
    piece = TinyGPT(model.config, seed=0, blocks=blocks, embedding=stage == 0, head=stage == num_stages - 1)
    mine = piece.state_dict()
    piece.load_state_dict({name: model.state_dict()[name] for name in mine})
    return piece.to(next(model.parameters()).device)


class Parallel3D(ParallelWrapper):
    """This rank's share of a TinyGPT trained with data, tensor and pipeline parallelism; see the module
    docstring.  Build it with :func:`parallelize`."""

    def __init__(self, model: TinyGPT, mesh: Mesh, *, zero: int = 0, schedule: str = "1f1b",
                 microbatches: int = 1, virtual_stages: int = 2, micro_batch_size: int, seq_len: int,
                 bucket_cap_mb: float = 25.0, seed: int | None = None, overlap_dp: bool = False,
                 cp_strategy: str = "ring", cp_split: str = "zigzag"):
        if not isinstance(model, TinyGPT):
            raise TypeError(f"parallelize splits a labkit.models.TinyGPT, got {type(model).__name__}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a labkit.mesh.Mesh, got {type(mesh).__name__}")
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
        config = model.config
        table = check_3d(config, mesh.dp, mesh.tp, mesh.pp, zero=zero, schedule=schedule, microbatches=microbatches,
                        virtual_stages=virtual_stages, batch_size=micro_batch_size * microbatches, seq_len=seq_len,
                        world_size=dist.get_world_size(), cp=mesh.cp, cp_strategy=cp_strategy,
                        cp_split=cp_split, ep=mesh.ep)
        stage_indices = table.stages_of(mesh.rank("pp"))
        # 1. the pipeline's cut, 2. tensor parallelism inside each stage, 3. context parallelism of attention
        tensor_parallel = [TensorParallel(_stage_module(model, s, table.stages), mesh.group("tp"), seed=seed,
                                          dense_alone=True) for s in stage_indices]
        self.context_parallel = ContextParallelGroup(mesh.group("cp"), cp_split) if mesh.cp > 1 else None
        self.cp_strategy = cp_strategy
        for tp in tensor_parallel if self.context_parallel else []:
            apply_context_parallel(tp.module, self.context_parallel, seq_len, cp_strategy)
        # 3b. expert parallelism of the MoE layers, folded over dp x cp (see labkit.parallel.experts.model)
        self.experts = ExpertsIn3D(mesh, [tp.module for tp in tensor_parallel]) if mesh.ep > 1 else None
        super().__init__(nn.ModuleList(tensor_parallel), None)
        # ``schedule`` is the schedule's name; ``self.table`` its table (which rank runs what, when)
        self.table, self.stage_indices, self.tensor_parallel = table, stage_indices, tensor_parallel
        self.mesh, self.zero, self.config, self.overlap_dp = mesh, zero, config, bool(overlap_dp)
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        local_len = check_sequence(seq_len, mesh.cp, cp_split) // mesh.cp  # this rank's tokens of a sequence
        # 4. data parallelism around them, over the ranks that hold the same weights: dp x cp (FSDP: one stage)
        dp_group = mesh.group("dp_cp")
        if zero == 3:
            self.data_parallel: ParallelWrapper = FullyShardedDataParallel(self.tensor_parallel[0], group=dp_group)
            runs = [self.data_parallel]
        else:  # DDP: buffers (an MoE router's bias) stay alike by construction, no broadcast before a forward
            options = {"broadcast_buffers": False} if zero == 0 else {"stage": zero}
            wrapper = DistributedDataParallel if zero == 0 else ZeroDataParallel
            self.data_parallel = wrapper(self.module, bucket_cap_mb=bucket_cap_mb, group=dp_group, **options)
            runs = self.tensor_parallel
        self.stages = [PipelineStage(run, s, self.table.stages, mesh, micro_batch_size=micro_batch_size,
                                     seq_len=local_len, num_microbatches=self.table.m, hidden_size=config.n_embd,
                                     placement=table.placement)
                       for run, s in zip(runs, self.stage_indices, strict=True)]
        self.split = {name: spec for tp in self.tensor_parallel for name, spec in tp.split_parameters().items()}
        self.expert_names = {threed_state.plain_name(name) for name, p in self.module.named_parameters()
                             if is_expert_parallel(p)}
        self.timeline: Timeline | None = None  # the last step's, when forward_backward(timeline=True)
        self._p2p: Counter = Counter()

    def __repr__(self) -> str:
        return (f"Parallel3D({self.mesh!r}, {DP_WRAPPERS[self.zero]} over dp, {self.table.name} with "
                f"m={self.table.m}, stages {self.stage_indices} of {self.table.stages} on this rank)")

    # -- a step ------------------------------------------------------------------------------------------------

    def _wrappers(self) -> list[ParallelWrapper]:
        return [*self.tensor_parallel, self.data_parallel]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipelined model has no single forward pass: call forward_backward(inputs, targets), "
                           "which runs a step's schedule")

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, *, loss_scale: float = 1.0,
                         timeline: bool = False) -> torch.Tensor:
        """One step's forward and backward passes over this data-parallel rank's batch ``[m b, s]``: the
        schedule, then the data-parallel reduction.  Returns the batch's mean loss on every rank (the last
        stage's, broadcast over the pp group).  ``loss_scale``: the gradients are those of ``loss * loss_scale``
        (a loss scaler's, for fp16).  With ``timeline``, :attr:`timeline` is the step as it ran."""
        expected = (self.table.m * self.micro_batch_size, self.seq_len)
        if tuple(inputs.shape) != expected or tuple(targets.shape) != expected:
            raise ValueError(f"inputs and targets must have shape (microbatches * micro_batch_size, seq_len) = "
                             f"{expected}, got {tuple(inputs.shape)} and {tuple(targets.shape)}")
        weight = 1.0
        if self.context_parallel is not None:  # this rank's chunks of every sequence (see context.model)
            inputs, targets, weight = shard_batch(inputs, targets, self.mesh.cp, self.mesh.rank("cp"),
                                                  self.context_parallel.split)
            self.context_parallel.log.clear()
        if self.experts is not None:
            self.experts.start_step()
        for stage in self.stages:
            stage.loss_scale = float(loss_scale) * weight
        for wrapper in self._wrappers():
            wrapper.set_requires_gradient_sync(False)
        # overlap_dp, with one stage per rank and no split backward: the data-parallel reduction starts during the
        # last backward (the wrapper's own overlap; Megatron's overlap_grad_reduce); else it follows the schedule.
        overlapped = self.overlap_dp and len(self.stages) == 1 and \
            not any(a.kind == "W" for a in self.table.orders()[0])
        try:
            run = run_schedule(self.table, self.stages, inputs, targets, timeline=timeline,
                               before_last_backward=(lambda: self.data_parallel.set_requires_gradient_sync(True))
                               if overlapped else None)
        finally:
            for wrapper in self._wrappers():
                wrapper.set_requires_gradient_sync(True)
        for tp in self.tensor_parallel:
            tp.reduce_gradients()
        if not overlapped:
            with trace.span(f"dp {'all-reduce' if self.zero < 2 else 'reduce-scatter'} gradients", "comm"):
                self.data_parallel.reduce_gradients()
        if self.experts is not None:  # the experts' replicas, which the data-parallel wrapper left alone
            self.experts.reduce_gradients(self.module)
        self._count_p2p()
        self.timeline = run.timeline
        pp = self.mesh.group("pp")
        loss = torch.tensor(run.loss if run.loss is not None else 0.0, device=self.stages[0].device)
        if self.context_parallel is not None:  # the sequences' mean: every cp rank's share of it
            loss *= weight / self.mesh.cp
            dist.all_reduce(loss, group=self.mesh.group("cp"))
        if self.mesh.pp > 1:
            last = self.table.rank_of(self.table.stages - 1)  # pp - 1, or 0 in a V
            dist.broadcast(loss, src=global_rank(pp, last), group=pp)
        return loss

    def _count_p2p(self) -> None:
        """The pipeline's point-to-point bytes of the step just run, sent by this rank."""
        one = math.prod(self.stages[0].activation_shape) * self.stages[0].dtype.itemsize
        me = dist.get_rank()  # in a V, rank p - 1 hands stage p - 1's output to stage p without a message
        sends = sum((stage.next_rank not in (None, me)) + (stage.prev_rank not in (None, me)) for stage in self.stages)
        self._p2p = Counter({"pp send": one * self.table.m * sends} if sends else {})

    # -- the contract ----------------------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Nothing left to do: :meth:`forward_backward` reduces once a step, after its schedule."""

    def make_optimizer(self, optimizer_cls: type[torch.optim.Optimizer], params: Any = None,
                       **kwargs: Any) -> torch.optim.Optimizer:
        """The data-parallel wrapper's optimizer over this rank's pieces (ZeRO: a ``ShardedOptimizer``)."""
        if params is not None:
            raise ValueError("a 3D model builds its optimizer over all of this rank's pieces; parameter groups "
                             "are not supported here (params must be None)")
        self.optimizer = self.data_parallel.make_optimizer(optimizer_cls, **kwargs)
        return self.optimizer

    def communication_per_step(self) -> dict[str, int]:
        """This rank's bytes of the last step, by dimension: into each collective for ``"tp all_reduce"``,
        ``"dp all_reduce"`` (or ZeRO's and FSDP's kinds), as the wrappers count them; what left the rank for
        ``"pp send"``, cp's messages and ep's all-to-alls (:mod:`labkit.costmodel.collectives`)."""
        found = Counter(self._p2p)
        for tp in self.tensor_parallel:
            found.update({f"tp {kind}": n for kind, n in tp.communication_per_step().items()})
        found.update({f"dp {kind}": n for kind, n in self.data_parallel.communication_per_step().items()})
        for _, kind, n in self.context_parallel.log if self.context_parallel else []:
            found[f"cp {kind}"] += n
        found.update(self.experts.communication() if self.experts else {})
        return dict(found)

    def predicted_communication(self) -> dict[str, int]:
        found = Counter(self._p2p)
        for tp in self.tensor_parallel:
            found.update({f"tp {kind}": n for kind, n in tp.predicted_communication().items()})
        if self.zero == 3:  # FSDP gathers its units again for every micro-batch's forward and backward
            predicted = self.data_parallel.predicted_communication(self.table.m, self._root_gathers())
        else:
            predicted = self.data_parallel.predicted_communication()
        found.update({f"dp {kind}": n for kind, n in predicted.items()})
        if self.context_parallel is not None:  # one attention call per block held, per micro-batch
            blocks = sum(len(tp.module.block_indices) for tp in self.tensor_parallel)
            heads = self.config.n_head // self.mesh.tp
            local = self.stages[0].activation_shape[1]
            for _, kind, n in cp_messages(self.cp_strategy, self.mesh.cp, self.micro_batch_size, heads, local,
                                          self.config.n_embd // self.config.n_head,
                                          self.stages[0].dtype.itemsize):
                found[f"cp {kind}"] += n * blocks * self.table.m
        if self.experts is not None:  # from the splits the router made: the model takes the routing as given
            found.update(self.experts.predicted(self.config.n_embd * self.stages[0].dtype.itemsize,
                                                self.config.n_experts))
        return dict(found)

    def _root_gathers(self) -> int:
        """How often this rank's schedule finds no forward awaiting its backward when a forward starts: each
        time, FSDP gathers the root unit again (it keeps it while any backward is pending)."""
        pending = gathers = 0
        for action in self.table.orders()[self.mesh.rank("pp")]:
            if action.kind == "F":
                gathers += pending == 0
                pending += 1
            elif action.kind in ("B", "I"):
                pending -= 1
        return gathers

    def memory_breakdown(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        return self.data_parallel.memory_breakdown(optimizer if optimizer is not None else self.optimizer)

    def gradients(self) -> dict[str, torch.Tensor | None]:
        """``{name: this rank's gradient}`` under the dense model's names: its slice of every split parameter
        (ZeRO-2 and FSDP: this rank's piece of that slice), and the replicated ones whole."""
        return {threed_state.plain_name(name): grad for name, grad in self.data_parallel.gradients().items()}

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over the whole model, as one process would compute it: every rank's share of
        ``|g|^p`` weighted so that a tensor replicated over the tp or dp ranks counts once, summed over all ranks
        (maxima for ``inf``)."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        norm_type = float(norm_type)
        if not (norm_type == math.inf or norm_type > 0):
            raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
        grads = {name: g for name, g in self.gradients().items() if g is not None}
        device = self.stages[0].device
        dp_copies = 1 if self.zero >= 2 else self.mesh.dp * self.mesh.cp  # ZeRO-2, FSDP: disjoint over dp x cp
        local = torch.zeros((), device=device)
        for name, g in grads.items():
            if norm_type == math.inf:
                local = torch.maximum(local, g.detach().abs().max().float()) if g.numel() else local
            else:
                copies = self.experts.copies() if name in self.expert_names else \
                    dp_copies * (1 if name in self.split else self.mesh.tp)
                local += g.detach().float().norm(norm_type) ** norm_type / copies
        dist.all_reduce(local, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
        total = local if norm_type == math.inf else local ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads.values():
            g.mul_(coefficient.to(g.dtype))
        return total

    def balance_experts(self, rate: float | None = None) -> None:
        """DeepSeek-V3's bias update of the MoE layers held (``rate``: default the config's) from the step's load
        summed over dp x cp; call after the optimizer step."""
        balance_experts(self.module, self.config.bias_update_rate if rate is None else rate, self.mesh.group("dp_cp"))

    # -- dense states: gathered over dp (FSDP), tp (the slices) and pp (the stages) ----------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective (every rank): the dense TinyGPT's ``state_dict()``."""
        return threed_state.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        threed_state.load_full_state_dict(self, state)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Collective: the optimizer's state as one process over the dense TinyGPT would hold it."""
        return threed_state.full_optimizer_state_dict(self, optimizer)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        threed_state.load_full_optimizer_state_dict(self, optimizer, state)

    def sharded_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Piece]:
        raise NotImplementedError("a 3D model saves the full layout only (checkpoint layout='full'): its pieces "
                                  "are cut over dp, tp and pp at once")

    def random_states(self) -> dict[str, torch.Tensor]:
        """Each of this rank's stages' tensor-parallel dropout generator."""
        return {f"tensor_parallel_dropout/{s}": tp.rng.state.clone()
                for s, tp in zip(self.stage_indices, self.tensor_parallel, strict=True)}

    def load_random_states(self, states: dict[str, torch.Tensor]) -> None:
        for s, tp in zip(self.stage_indices, self.tensor_parallel, strict=True):
            tp.rng.state = states[f"tensor_parallel_dropout/{s}"].clone()


def parallelize(model: TinyGPT, mesh: Mesh, *, zero: int = 0, schedule: str = "1f1b", microbatches: int = 1,
                virtual_stages: int = 2, micro_batch_size: int, seq_len: int, bucket_cap_mb: float = 25.0,
                seed: int | None = None, overlap_dp: bool = False, cp_strategy: str = "ring",
                cp_split: str = "zigzag") -> Parallel3D:
    """``model`` split over ``mesh``: pipeline stages over pp, tensor parallelism over tp, then DDP (``zero=0``),
    ZeRO-1/2 or FSDP (``zero=3``) over dp; see the module docstring.  A collective: every rank calls it with
    the same model (the same weights) and arguments.  ``schedule``: one of :data:`SCHEDULES`, over
    ``microbatches`` micro-batches of ``micro_batch_size`` sequences of ``seq_len`` tokens; ``virtual_stages``:
    stages per rank of the interleaved schedules (ZB-V and DualPipeV hold two, in a V).  ``seed``: tensor parallelism's dropout generator (see
    :func:`~labkit.parallel.tensor.parallelize_tensor`).  ``overlap_dp``: with one stage per rank and no split
    backward, start the data-parallel reduction during the last backward instead of after the schedule."""
    return Parallel3D(model, mesh, zero=zero, schedule=schedule, microbatches=microbatches,
                      virtual_stages=virtual_stages, micro_batch_size=micro_batch_size, seq_len=seq_len,
                      bucket_cap_mb=bucket_cap_mb, seed=seed, overlap_dp=overlap_dp, cp_strategy=cp_strategy,
                      cp_split=cp_split)
