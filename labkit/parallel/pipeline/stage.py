"""Pipeline stages: the model cut into contiguous pieces, one per stage, and the messages between them.

**The cut.**  :func:`split_stages` gives each of ``S`` stages ``n_layer / S`` consecutive blocks; the embedding
goes with the first stage, the final norm, the LM head and the loss with the last.  :func:`build_stage` builds
stage ``s`` as ``TinyGPT(config, seed, blocks=..., embedding=s == 0, head=s == S - 1)``: the whole model's
weights and parameter names (``blocks.2.attn.query.weight``), only its own pieces.  With interleaving
(Narayanan et al. 2021) there are ``S = p v`` stages on ``p`` ranks and rank ``r`` holds stages ``r, r + p,
...``; a stage index is always global, ``0 .. S - 1``, and stage ``s`` lives on pp-rank ``s % p`` (as in
:mod:`.schedule`).  The embedding and the head are then on different stages, so one weight cannot serve both:
more than one stage needs ``tie_weights=False``.

**What crosses a boundary.**  Between stage ``s`` and ``s + 1`` flows the residual stream of one micro-batch:
``[b, s, h]`` (micro-batch size, sequence length, ``n_embd``), ``b s h`` numbers, forward; and its gradient, the
same shape, backward.  For the 100k preset with ``b = 2, s = 16``: 1,536 floats, 6 KiB in fp32, each way, per
micro-batch and boundary: ``2 b s h (S - 1) m`` numbers per step in all, independent of the depth of a stage.
That is far less than data parallelism's all-reduce of every gradient, and point to point (``send``/``recv``
between two ranks), which is why pipeline stages tolerate the slow links between nodes (:mod:`labkit.mesh`).

**Why shapes are agreed once.**  ``recv`` writes into a buffer the receiver allocated beforehand, and the bytes
arrive without a header (NCCL moves raw memory): the receiver must know shape and dtype before the message
comes.  Sending them with every message would double the number of messages, each on the critical path.
``torch.distributed.pipelining`` therefore agrees them once, at set-up (shape inference: a first exchange).
Here they are *derived*, with no message at all: every boundary carries ``(micro_batch_size, seq_len,
n_embd)`` in the stage's parameter dtype (or the ``dtype`` given, e.g. under autocast), fixed when the
:class:`PipelineStage` is made.  The price is that every micro-batch of a run has that shape; a send of any
other shape is refused with ``ValueError`` rather than left to hang or to garble the receiver.

**What a stage keeps for backward.**  For each micro-batch between its forward and its backward: its input
(for a stage after the first, a leaf that requires grad: its ``.grad`` is what goes back to the previous stage)
and its output, whose autograd graph holds every intermediate activation of the stage's blocks (the memory that
pipeline schedules trade against the bubble: GPipe holds ``m`` micro-batches, 1F1B at most ``p - r``).
``backward`` frees them.

**A split backward** (zero-bubble schedules, Qi et al. 2023) runs ``B`` as two passes.  :meth:`backward_input`
(``I``) computes the gradient of the stage's input, which the previous stage waits for, and the gradient of the
output of every layer that holds weights (``Linear``, ``LayerNorm``, ``Embedding``): ``torch.autograd.grad``
asked only for those computes no weight gradient at all (each ``AddmmBackward`` skips the products no one asked
for).  :meth:`backward_weight` (``W``) then turns each layer's output gradient into its weights' gradients, one
small ``autograd.backward(output, grad, inputs=layer's parameters)`` per layer: ``dW = dYᵀ X`` for a linear
layer.  Between the two the stage keeps the graph (``retain_graph``), so here a deferred ``W`` holds all of a
micro-batch's activations, more than the layer inputs that Qi et al. count; the time is split as theirs is.

**Loss scaling.**  The last stage's ``forward`` returns the micro-batch's mean cross-entropy, unscaled (for
logging); its ``backward`` back-propagates ``loss / num_microbatches``, so that after all ``m`` backward passes
every stage's gradients are those of the mean loss over the batch (equal micro-batches): exactly what one
process with gradient accumulation over the same micro-batches computes.

**Messages.**  ``send_*`` are non-blocking (``isend``; the tensor is kept alive until :meth:`wait_sends`) and
``recv_*`` block (``irecv`` then ``wait``), on gloo and NCCL alike.  gloo matches messages by tag, and each
message has its own (boundary, direction, micro-batch), so receives may be posted in any order; NCCL ignores
tags and matches the messages between two ranks in the order they were posted, so a runtime on NCCL must post
them in the same order on both sides, as a valid schedule does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit import trace
from labkit.dist import global_rank, require_group
from labkit.mesh import Mesh
from labkit.models import GPTConfig, TinyGPT
from labkit.parallel.experts.layer import aux_loss_scale
from labkit.parallel.pipeline.schedule import stage_rank


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def split_stages(config: GPTConfig, num_stages: int) -> list[range]:
    """The global block indices of each of ``num_stages`` stages: contiguous, equal, in order.

    The embedding belongs to stage 0 and the head and loss to stage ``num_stages - 1`` (:func:`build_stage`).
    Raises ``ValueError`` naming both numbers when ``n_layer`` is not divisible by ``num_stages``: every stage
    gets the same number of blocks, since the slowest stage sets the pace of the whole pipeline.
    """
    _check_count("num_stages", num_stages)
    if config.n_layer % num_stages != 0:
        raise ValueError(f"n_layer={config.n_layer} is not divisible by num_stages={num_stages}: every stage "
                         f"gets the same number of blocks (n_layer / num_stages), so num_stages must divide "
                         f"n_layer")
    per_stage = config.n_layer // num_stages
    return [range(stage * per_stage, (stage + 1) * per_stage) for stage in range(num_stages)]


def build_stage(config: GPTConfig, seed: int, stage: int, num_stages: int) -> TinyGPT:
    """Stage ``stage`` (global, ``0 .. num_stages - 1``) of ``TinyGPT(config, seed)``: its blocks, plus the
    embedding on the first stage and the head on the last, with the whole model's values and names.

    More than one stage needs ``config.tie_weights=False`` (``ValueError`` otherwise): the tied weight would
    have to live on the first and the last stage at once.
    """
    ranges = split_stages(config, num_stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ValueError(f"stage must be a global stage index in [0, {num_stages}) (num_stages={num_stages}), "
                         f"got {stage!r}")
    if num_stages > 1 and config.tie_weights:
        raise ValueError(f"num_stages={num_stages} puts the embedding on stage 0 and the head on stage "
                         f"{num_stages - 1}, so they cannot share one weight: use a config with "
                         f"tie_weights=False (e.g. GPTConfig.preset(name, tie_weights=False))")
    return TinyGPT(config, seed, blocks=ranges[stage], embedding=stage == 0, head=stage == num_stages - 1)


class PipelineStage:
    """One stage of a pipeline on this rank: its module, its neighbours, and what it keeps between passes.

    ``group`` is a :class:`labkit.mesh.Mesh` (its ``"pp"`` group is used), a ``ProcessGroup`` or ``None`` (every
    rank); its ranks, in group order, are the pipeline's ``p`` ranks, and stage ``stage`` must live on this one
    (``stage % p`` is this rank's group rank; with ``placement="v"``, two stages a rank in a V, rank ``r``
    holds stages ``r`` and ``2p - 1 - r``).  ``num_stages = p v`` for ``v`` stages per rank.  Every message
    has shape ``activation_shape = (micro_batch_size, seq_len, n_embd)`` (see the module docstring), and the
    last stage's ``backward`` scales the loss by ``1 / num_microbatches``.

    ``hidden_size`` is ``n_embd``, read from ``module.config`` unless given (a module wrapped in FSDP has none).

    ``prev_rank`` and ``next_rank`` are the global ranks of the neighbouring stages (``None`` at either end).
    """

    def __init__(self, module: nn.Module, stage: int, num_stages: int, group: Any = None, *,
                 micro_batch_size: int, seq_len: int, num_microbatches: int, dtype: torch.dtype | None = None,
                 hidden_size: int | None = None, placement: str = "loop"):
        self.module = module
        self.num_stages = _check_count("num_stages", num_stages)
        self.num_microbatches = _check_count("num_microbatches", num_microbatches)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise ValueError(f"stage must be a global stage index in [0, {num_stages}), got {stage!r}")
        self.stage = stage
        self.group = require_group(group.group("pp") if isinstance(group, Mesh) else group)
        self.p = dist.get_world_size(self.group)
        if num_stages % self.p != 0:
            raise ValueError(f"num_stages={num_stages} must be a multiple of the pipeline's {self.p} ranks "
                             f"(v = num_stages / p stages per rank)")
        if self.p == 1 and num_stages > 1:
            raise ValueError(f"num_stages={num_stages} on a single rank would send to itself: use one stage "
                             "(the whole model) on one rank")
        if placement == "v" and num_stages != 2 * self.p:
            raise ValueError(f"the V placement puts two stages on each rank: num_stages must be 2p = {2 * self.p}, "
                             f"got {num_stages}")
        here = dist.get_rank(self.group)
        if stage_rank(stage, self.p, placement) != here:
            raise ValueError(f"stage {stage} lives on pp-rank {stage_rank(stage, self.p, placement)} ({placement} "
                             f"placement, p={self.p}), but this is pp-rank {here}")
        self.placement = placement
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.prev_rank = None if self.is_first else global_rank(self.group, stage_rank(stage - 1, self.p, placement))
        self.next_rank = None if self.is_last else global_rank(self.group, stage_rank(stage + 1, self.p, placement))
        parameter = next(module.parameters())
        self.device = parameter.device
        self.dtype = dtype or parameter.dtype
        self.activation_shape = torch.Size((_check_count("micro_batch_size", micro_batch_size),
                                            _check_count("seq_len", seq_len),
                                            module.config.n_embd if hidden_size is None else hidden_size))
        # micro-batch -> (input, output, [(layer, its output)] for a split backward, else None)
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor, list | None]] = {}
        self._weight_work: dict[int, list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = {}  # I done, W not
        self._capture: list[tuple[nn.Module, torch.Tensor]] | None = None
        self._hooked = False  # hooks on the weight-holding layers, added by the first split forward
        self._checked_capture = False
        self.loss_scale = 1.0  # the last stage back-propagates loss * loss_scale / num_microbatches (fp16)
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def __repr__(self) -> str:
        return (f"PipelineStage(stage {self.stage} of {self.num_stages}, blocks "
                f"{list(getattr(self.module, 'block_indices', ()))}, prev_rank={self.prev_rank}, "
                f"next_rank={self.next_rank}, activation_shape={tuple(self.activation_shape)})")

    # ------------------------------------------------------------------------------------------------
    # Compute

    def _check_microbatch(self, microbatch: int) -> None:
        if isinstance(microbatch, bool) or not isinstance(microbatch, int) \
                or not 0 <= microbatch < self.num_microbatches:
            raise ValueError(f"microbatch must be in [0, {self.num_microbatches}) "
                             f"(num_microbatches={self.num_microbatches}), got {microbatch!r}")

    def _capture_output(self, layer: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        if self._capture is not None:
            self._capture.append((layer, output))

    def forward(self, microbatch: int, input_or_ids: torch.Tensor, targets: torch.Tensor | None = None, *,
                split_backward: bool = False) -> torch.Tensor:
        """Run this stage on one micro-batch: token ids ``[b, s]`` on the first stage, the previous stage's
        output ``[b, s, h]`` on the others.  Returns the output ``[b, s, h]`` to send on, or on the last stage
        the micro-batch's mean loss (``targets`` required there, refused elsewhere), unscaled.

        Keeps the input and the output (with its autograd graph) until :meth:`backward` of the same micro-batch,
        or, with ``split_backward``, also each weight-holding layer's output, for :meth:`backward_input` and
        :meth:`backward_weight`.
        """
        self._check_microbatch(microbatch)
        if microbatch in self._saved:
            raise ValueError(f"stage {self.stage} already ran forward on micro-batch {microbatch} and has not "
                             "run its backward yet")
        if self.is_last != (targets is not None):
            raise ValueError(f"stage {self.stage} of {self.num_stages}: targets belong to the last stage, which "
                             f"computes the loss ({'missing' if self.is_last else 'given'} here)")
        inputs = None
        if not self.is_first:
            self._check_shape("input", input_or_ids)
            # A leaf of this stage's graph: backward stops here, and its .grad goes to the previous stage.
            inputs = input_or_ids.detach().requires_grad_(True)
        if split_backward and not self._hooked:
            for layer in self.module.modules():  # the layers that hold weights themselves: a split backward's W units
                if any(True for _ in layer.parameters(recurse=False)):
                    layer.register_forward_hook(self._capture_output)
            self._hooked = True
        self._capture = [] if split_backward else None
        try:  # an MoE layer's auxiliary loss gets the gradient scale this stage's loss will have
            with aux_loss_scale(self.loss_scale / self.num_microbatches):
                output, loss = self.module(input_or_ids if self.is_first else inputs, targets)
        finally:
            captured, self._capture = self._capture, None
        result = loss if self.is_last else output
        if split_backward and not self._checked_capture:
            self._check_capture(captured)
        self._saved[microbatch] = (inputs, result, captured)
        return result

    def _check_capture(self, captured: list[tuple[nn.Module, torch.Tensor]]) -> None:
        """A split backward finds each weight's gradient from its layer's output, seen by a forward hook: a layer
        whose weights were used without calling it (``F.linear(x, layer.weight)``) would silently get none."""
        seen = {id(p) for layer, _ in captured for p in layer.parameters(recurse=False)}
        missed = [name for name, p in self.module.named_parameters() if p.requires_grad and id(p) not in seen]
        if missed:
            raise ValueError(f"stage {self.stage}: a split backward (I then W) needs every weight-holding layer "
                             f"to be called as a module, but the weights {missed[:4]} were used without their "
                             "layer's forward, so W could not compute their gradients")
        self._checked_capture = True

    def _take(self, microbatch: int, grad_output: torch.Tensor | None, split: bool):
        self._check_microbatch(microbatch)
        if microbatch not in self._saved:
            raise ValueError(f"stage {self.stage} has no forward of micro-batch {microbatch} awaiting backward")
        if self.is_last != (grad_output is None):
            raise ValueError(f"stage {self.stage} of {self.num_stages}: the last stage starts backward from its "
                             "loss and takes no grad_output; every other stage needs the next stage's gradient")
        if split and self._saved[microbatch][2] is None:
            raise ValueError(f"stage {self.stage}: the forward of micro-batch {microbatch} ran without "
                             "split_backward=True, so its backward cannot be split into I and W")
        if not self.is_last:
            self._check_shape("grad_output", grad_output)
        inputs, output, captured = self._saved.pop(microbatch)
        # The root of this stage's backward: the last stage's share of the mean loss, or the output and its grad.
        if self.is_last:
            scaled = output if self.loss_scale == 1.0 else output * self.loss_scale
            root, grad = scaled / self.num_microbatches, None
        else:
            root, grad = output, grad_output
        return inputs, root, grad, captured

    def backward(self, microbatch: int, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """Back-propagate one micro-batch through this stage, accumulating into its parameters' ``.grad``.

        On the last stage from ``loss / num_microbatches`` (no ``grad_output``); elsewhere from ``grad_output``,
        the gradient of the output that the next stage sent back.  Returns the gradient of this stage's input,
        to send to the previous stage (``None`` on the first stage), and frees what :meth:`forward` kept.
        """
        inputs, root, grad, _ = self._take(microbatch, grad_output, split=False)
        torch.autograd.backward(root, grad)
        return None if inputs is None else inputs.grad

    def backward_input(self, microbatch: int, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """``I``: the first half of a split backward (forward ran with ``split_backward=True``).

        Returns the gradient of this stage's input, as :meth:`backward` does, and keeps the gradient of each
        weight-holding layer's output for :meth:`backward_weight`; no parameter's ``.grad`` changes yet.
        """
        inputs, root, grad, captured = self._take(microbatch, grad_output, split=True)
        wanted = ([] if inputs is None else [inputs]) + [output for _, output in captured]
        grads = torch.autograd.grad(root, wanted, grad, retain_graph=True, allow_unused=True)
        grad_input = None if inputs is None else grads[0]
        layer_grads = grads[len(wanted) - len(captured):]
        self._weight_work[microbatch] = [(layer, output, layer_grad) for (layer, output), layer_grad
                                         in zip(captured, layer_grads, strict=True) if layer_grad is not None]
        return grad_input

    def backward_weight(self, microbatch: int) -> None:
        """``W``: the weight gradients of ``microbatch`` from what :meth:`backward_input` kept, accumulated into
        ``.grad``; then the micro-batch's graph is released."""
        self._check_microbatch(microbatch)
        if microbatch not in self._weight_work:
            raise ValueError(f"stage {self.stage} has no input gradient (I) of micro-batch {microbatch} "
                             "awaiting its weight gradient (W)")
        for layer, output, layer_grad in self._weight_work.pop(microbatch):
            # Only this layer's own weights: its output's gradient must not flow on into earlier layers.
            torch.autograd.backward(output, layer_grad, inputs=list(layer.parameters(recurse=False)))

    @property
    def pending_microbatches(self) -> list[int]:
        """The micro-batches whose forward ran and whose backward (``B`` or ``I``) has not: their activations are
        what this stage holds in memory."""
        return sorted(self._saved)

    @property
    def pending_weights(self) -> list[int]:
        """The micro-batches whose ``I`` ran and whose ``W`` has not."""
        return sorted(self._weight_work)

    # ------------------------------------------------------------------------------------------------
    # Messages

    def _check_shape(self, what: str, tensor: torch.Tensor) -> None:
        if tensor.shape != self.activation_shape or tensor.dtype != self.dtype:
            raise ValueError(f"{what} of stage {self.stage} has shape {tuple(tensor.shape)} and dtype "
                             f"{tensor.dtype}, but this pipeline agreed on {tuple(self.activation_shape)} "
                             f"(micro_batch_size, seq_len, n_embd) and {self.dtype}")

    def _tag(self, boundary: int, backward: bool, microbatch: int) -> int:
        """One tag per message: boundary ``s`` is between stage ``s`` and ``s + 1`` (gloo matches by tag)."""
        return (microbatch * self.num_stages + boundary) * 2 + int(backward)

    def _send(self, tensor: torch.Tensor, peer: int | None, tag: int, what: str) -> dist.Work:
        if peer is None:
            raise ValueError(f"stage {self.stage} of {self.num_stages} has no stage to send its {what} to")
        self._check_shape(what, tensor)
        tensor = tensor.detach().contiguous()
        posted = trace.now()
        work = dist.isend(tensor, dst=peer, tag=tag)
        if trace.is_enabled():  # gloo's point-to-point work has no completion callback: the moment it leaves
            trace.add(f"send {what} of micro-batch {tag // 2 // self.num_stages} to rank {peer}", "comm", posted,
                      trace.now())
        self._sends.append((work, tensor))  # the buffer must outlive the send
        return work

    def _irecv(self, peer: int | None, tag: int, what: str) -> tuple[dist.Work, torch.Tensor]:
        if peer is None:
            raise ValueError(f"stage {self.stage} of {self.num_stages} has no stage to receive its {what} from")
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        return dist.irecv(buffer, src=peer, tag=tag), buffer

    def send_activation(self, microbatch: int, output: torch.Tensor) -> dist.Work:
        """Start sending this stage's output of ``microbatch`` to the next stage (non-blocking)."""
        self._check_microbatch(microbatch)
        return self._send(output, self.next_rank, self._tag(self.stage, False, microbatch), "activation")

    def irecv_activation(self, microbatch: int) -> tuple[dist.Work, torch.Tensor]:
        """Post the receive of the previous stage's output of ``microbatch``: ``(work, buffer)``, the buffer
        filled once ``work.wait()`` returns."""
        self._check_microbatch(microbatch)
        return self._irecv(self.prev_rank, self._tag(self.stage - 1, False, microbatch), "activation")

    def recv_activation(self, microbatch: int) -> torch.Tensor:
        """The previous stage's output of ``microbatch``: a fresh ``[b, s, h]`` buffer that requires grad."""
        work, buffer = self.irecv_activation(microbatch)
        work.wait()
        return buffer.requires_grad_(True)

    def send_gradient(self, microbatch: int, grad_input: torch.Tensor) -> dist.Work:
        """Start sending the gradient of this stage's input of ``microbatch`` to the previous stage."""
        self._check_microbatch(microbatch)
        return self._send(grad_input, self.prev_rank, self._tag(self.stage - 1, True, microbatch), "gradient")

    def irecv_gradient(self, microbatch: int) -> tuple[dist.Work, torch.Tensor]:
        """Post the receive of the gradient of this stage's output of ``microbatch``: ``(work, buffer)``."""
        self._check_microbatch(microbatch)
        return self._irecv(self.next_rank, self._tag(self.stage, True, microbatch), "gradient")

    def recv_gradient(self, microbatch: int) -> torch.Tensor:
        """The gradient of this stage's output of ``microbatch``, from the next stage."""
        work, buffer = self.irecv_gradient(microbatch)
        work.wait()
        return buffer

    def wait_sends(self) -> None:
        """Wait until every send started so far has completed, and release its buffer."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
