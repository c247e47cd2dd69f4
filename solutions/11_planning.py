"""Exercise 11 — Planning a training run: predict one 3D step's time by hand (solution).

Before a team rents a thousand GPUs for a month it predicts, for every layout it could choose, how long one
training step takes, and where the time goes.  ``labkit plan`` does it with
:func:`labkit.costmodel.step.predict_step`; here you derive the main terms yourself, from what the lessons before
measured (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 3).  The notation (``shape``: a :class:`~labkit.costmodel.shapes.TransformerShape`,
``layout``: a :class:`~labkit.costmodel.step.Layout`, ``hardware``: a :class:`~labkit.costmodel.step.Hardware`)::

    d, t, p = layout.dp, layout.tp, layout.pp          ranks: d * t * p, numbered node by node
    b = layout.micro_batch                             sequences per micro-batch
    L, h, s = shape.num_layers, shape.hidden_size, shape.seq_len
    X = hardware.flops                                 FLOP/s one GPU reaches on the model's matrices
    G = hardware.gpus_per_node
    values and gradients in bf16: 2 bytes each
    (hardware.cores and hardware.layer_overhead_s are not used here)

The pipeline here is *balanced*: every stage computes the same share of the model (``predict_step(...,
head_on_last_stage=False)``).  A real one is not: the output layer sits on the last stage, which sets the pace
(lesson 11 prices it).  Build the step up in six parts, each one a question the lessons answered:

**1. Micro-batches.**  How many micro-batches of ``b`` sequences does each of the ``d`` replicas run a step?

**2. One micro-batch's compute on one stage** (``F_c``, ``B_c``).  ``model_flops_per_step(shape, b,
recompute=layout.recompute)`` (which you may call) counts one micro-batch's FLOPs through the whole model,
forward and backward, recomputation included; the replica's ``t p`` ranks share them evenly.  A backward costs
two forwards; recomputation runs the forward once more, inside the backward.  Into how many forward-sized
pieces does that split the FLOPs, and how many of them are the backward's?

**3. Tensor parallelism** (``F_tp``, ``B_tp``).  A Megatron layer all-reduces its ``b s h`` activations twice in
the forward (after attention's and the MLP's row-parallel matrices) and twice in the backward (the inputs'
gradients); a recomputed forward all-reduces again.  Price each all-reduce with lesson 01's ring on the group's
link (each of its ``2 (N - 1)`` steps moves one ``N``-th of the message, and pays ``alpha``).  Which link?  A TP
group is ``t`` neighbouring ranks from a multiple of ``t``: when does every such group stay inside one node of
``G``?  (Try ``t = 3`` on nodes of 8: ranks 6, 7 and 8.)  The all-reduces sit on the critical path; a stage
holds ``L / p`` layers.  ``F = F_c + F_tp`` and ``B = B_c + B_tp`` are one micro-batch on the stage;
``compute`` and ``tp`` are the whole step's, every micro-batch's.

**4. The pipeline's bubble**, sends left out (the ``"pp send"`` part of ``predict_step``).  Lesson 07's
closed forms, with the whole stage's ``F`` and ``B`` (TP included): GPipe and 1F1B idle ``p - 1`` slots of a
forward and a backward; interleaving ``v = layout.virtual_stages`` chunks per rank shrinks that ``v``-fold;
ZB-H1 splits each backward into an input gradient and a weight gradient of ``B / 2`` each and fills the
cool-down with the weight gradients, so what each stage downstream still costs is the longer of a forward and an
input-gradient pass (with recomputation the input gradient is the longer).

**5. Data parallelism** (``dp``).  Each rank holds ``Psi / (t p)`` of the ``Psi = num_parameters(shape)``
parameters (you may call it) and all-reduces their bf16 gradients over its ``d`` replicas, ranks ``t`` apart: a
group spanning ``t d`` consecutive ranks (when is it inside one node?).  The gradients stream out as the last
micro-batch's backward produces them, so only the part of that ring that outlasts one backward ``B`` is exposed.

**6. The step** is the sum of the whole step's parts: compute, TP, the bubble and the exposed reduction (ZeRO
stage 0, no sends: ``layout.zero`` is 0 here).

A worked example to check yourself on: GPT-2 (``TransformerShape.preset("gpt2")``: ``L = 12``, ``h = 768``, ``s =
1024``, ``Psi`` = 124,439,808) with ``Layout(dp=4, tp=2, pp=2, micro_batch=2)``, a global batch of 64, and
``Hardware(1e14, LinkModel(5e-6, 1 / 300e9), LinkModel(1e-5, 1 / 25e9), gpus_per_node=4)``: ``m = 8``; a
micro-batch is 1.75e12 FLOPs, so ``F_c`` = 1.458 ms and ``B_c`` = 2.916 ms; one TP all-reduce of 3.1 MB inside the
node takes 20.5 us: ``F_tp = B_tp`` = 0.246 ms, ``F`` = 1.704 ms and ``B`` = 3.162 ms.  So ``compute`` = 35.00 ms,
``tp`` = 3.93 ms and the 1F1B ``bubble`` 4.87 ms; the DP group spans two nodes, where the 62 MB reduction takes
3.79 ms, of which ``dp`` = 0.63 ms outlasts ``B``: a step of 44.43 ms (``predict_step`` adds 0.58 ms of pipeline
sends; with the output layer on the last stage, its default, the step is 54.85 ms, sends included).

Complete ``step_time_by_hand``, then run the grading cell of ``notebooks/11_planning_a_training_run.ipynb`` (or
``labkit grade``).  The checks compare your parts with ``predict_step``'s on 215 configurations (six models,
``dp``, ``tp`` and ``pp`` from 1 to 64, groups inside and across nodes, also groups that fit a node without
dividing it, micro-batches of 1 to 8, every schedule, with and without recomputation) to a relative ``1e-9``.
While they run, labkit's step model (``labkit.costmodel.step``, ``.stages``, ``.timeline``), its event
simulation, the planner and the ring costs of ``labkit.costmodel.collectives`` are switched off: write the
formulas.
"""

from __future__ import annotations

from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.shapes import num_parameters

VALUE_BYTES = 2  # bf16 activations and gradients


def ring_all_reduce_s(nbytes: float, ranks: int, link) -> float:
    """``2 (N - 1) alpha + 2 (N - 1) / N * n * beta``: a ring all-reduce of ``nbytes`` over ``ranks`` on ``link``."""
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) * link.alpha_s + 2 * (ranks - 1) / ranks * nbytes * link.beta_s_per_byte


def step_time_by_hand(shape, layout, global_batch: int, hardware) -> dict[str, float]:
    """One step of ``shape`` under ``layout`` on ``hardware``, in seconds, each part apart: ``{"forward",
    "backward"}`` (one micro-batch on one stage, TP included) and ``{"compute", "tp", "bubble", "dp", "step"}``
    (the whole step), for ZeRO stage 0 with the pipeline's sends left out (see the module docstring)."""
    d, t, p, b = layout.dp, layout.tp, layout.pp, layout.micro_batch
    m = global_batch // (d * b)
    gpus = hardware.gpus_per_node
    # compute: the replica's FLOPs split over t p ranks, in forward-sized passes
    passes = 4 if layout.recompute else 3
    forward_c = model_flops_per_step(shape, b, recompute=layout.recompute) / (t * p) / passes / hardware.flops
    backward_c = (passes - 1) * forward_c
    # TP: two all-reduces of b s h values forward, two backward (four when the forward is recomputed), per layer
    tp_link = hardware.intra_node if gpus % t == 0 else hardware.inter_node
    one = ring_all_reduce_s(VALUE_BYTES * b * shape.seq_len * shape.hidden_size, t, tp_link)
    layers = shape.num_layers // p
    forward_tp = 2 * layers * one
    backward_tp = (4 if layout.recompute else 2) * layers * one
    forward, backward = forward_c + forward_tp, backward_c + backward_tp
    # the bubble: the schedule's closed form, with the whole rank's forward and backward
    if layout.schedule in ("gpipe", "1f1b"):
        bubble = (p - 1) * (forward + backward)
    elif layout.schedule == "interleaved":
        bubble = (p - 1) * (forward + backward) / layout.virtual_stages
    elif layout.schedule == "zb-h1":
        bubble = (p - 1) * max(forward, backward / 2)
    else:
        raise ValueError(f"unknown schedule {layout.schedule!r}")
    # DP: the stage's gradients over the d replicas, beside the last backward
    dp_link = hardware.intra_node if gpus % (t * d) == 0 else hardware.inter_node
    reduction = ring_all_reduce_s(VALUE_BYTES * num_parameters(shape) / (t * p), d, dp_link)
    dp = max(0.0, reduction - backward)
    parts = {"forward": forward, "backward": backward, "compute": m * (forward_c + backward_c),
             "tp": m * (forward_tp + backward_tp), "bubble": bubble, "dp": dp}
    parts["step"] = parts["compute"] + parts["tp"] + parts["bubble"] + parts["dp"]
    return parts
