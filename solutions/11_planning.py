"""Exercise 11 — Planning a training run: predict one 3D step's time by hand (solution).

Before a team rents a thousand GPUs for a month it predicts, for every layout it could choose, how long one
training step takes, and where the time goes.  ``labkit plan`` does it with
:func:`labkit.costmodel.step.predict_step`; here you derive the same numbers yourself, from the closed forms of
the lessons before (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", section 3).  The notation (``shape``: a :class:`~labkit.costmodel.memory.TransformerShape`,
``layout``: a :class:`~labkit.costmodel.step.Layout`, ``hardware``: a :class:`~labkit.costmodel.step.Hardware`)::

    d, t, p = layout.dp, layout.tp, layout.pp          ranks: d * t * p, numbered node by node
    b = layout.micro_batch                             sequences per micro-batch
    L, h, s = shape.num_layers, shape.hidden_size, shape.seq_len
    X = hardware.flops                                 FLOP/s one GPU reaches on the model's matrices
    G = hardware.gpus_per_node
    values and gradients in bf16: 2 bytes each
    (hardware.cores and hardware.layer_overhead_s are not used here)

**1. Micro-batches.**  Each of the ``d`` replicas takes ``global_batch / d`` sequences, in ``m = global_batch /
(d b)`` micro-batches of ``b``.

**2. One micro-batch's compute on one stage.**  ``model_flops_per_step(shape, b, recompute=layout.recompute)``
(lesson 11's count, which you may call) gives one micro-batch's FLOPs through the whole model, forward and
backward; the ``t p`` model-parallel ranks of a replica share them evenly.  The backward costs two forwards, so
they are ``passes = 3`` forward-sized pieces; with full recomputation the forward runs again inside the backward,
``passes = 4``::

    F_c = model_flops_per_step(shape, b, recompute) / (t p) / passes / X
    B_c = (passes - 1) F_c

**3. Tensor parallelism.**  A Megatron layer all-reduces its ``b s h`` activations twice in the forward (``g``,
after attention's and the MLP's row-parallel matrices) and twice in the backward (``f``, the inputs' gradients);
recomputation runs the forward again, two more in the backward.  A ring all-reduce of ``n`` bytes over ``N``
ranks (lesson 01) takes::

    T(n, N) = 2 (N - 1) alpha + 2 (N - 1) / N * n * beta          (0 when N = 1)

on its link: ``hardware.intra_node`` (NVLink) when the group lies inside one node, ``hardware.inter_node``
otherwise.  A TP group is ``t`` neighbouring ranks starting at a multiple of ``t``: inside one node exactly when
``t`` divides ``G`` (``t = 16`` on nodes of 8 crosses two; so does ``t = 3``: ranks 6, 7 and 8).  Each stage
holds ``L / p`` layers, and the all-reduces wait for nothing but themselves (on the critical path)::

    F_tp = 2 (L / p) T(2 b s h, t),    B_tp = 2 (L / p) T(2 b s h, t)   (4 (L / p) T with recomputation)
    F = F_c + F_tp,   B = B_c + B_tp   ("forward", "backward": one micro-batch on one stage)

Over the step the stage runs every micro-batch once: ``compute = m (F_c + B_c)`` and ``tp = m (F_tp + B_tp)``.

**4. The pipeline's bubble.**  With uniform stages and the sends between them left out (free here; lesson 11's
simulator places them, the ``"pp send"`` part of ``predict_step``), each schedule idles for its closed form
(lesson 07), with ``F`` and ``B`` the whole rank's, TP included::

    GPipe, 1F1B:          (p - 1)(F + B)
    interleaved 1F1B:     (p - 1)(F + B) / v     (v = layout.virtual_stages chunks per rank, each of F / v, B / v)
    ZB-H1:                (p - 1) F              (the weight-gradient passes fill the backward half)

**5. Data parallelism.**  Each rank holds ``Psi / (t p)`` of the ``Psi = num_parameters(shape)`` parameters
(you may call it) and all-reduces their ``2 Psi / (t p)`` gradient bytes over the ``d`` replicas, a ring over its
DP group: ranks ``t`` apart, spanning ``t d`` consecutive ranks, inside a node exactly when ``t d`` divides ``G``.
The reduction starts as the last micro-batch's backward starts and runs beside it, so only what outlasts one
``B`` is exposed::

    dp = max(0, T(2 Psi / (t p), d) - B)

**6. The step.**  ``step = compute + tp + bubble + dp`` (ZeRO stage 0, no sends: ``layout.zero`` is 0 here).

For example GPT-2 (``TransformerShape.preset("gpt2")``: ``L = 12``, ``h = 768``, ``s = 1024``, ``Psi`` =
124,439,808) with ``Layout(dp=4, tp=2, pp=2, micro_batch=2)``, a global batch of 64, and ``Hardware(1e14,
LinkModel(5e-6, 1 / 300e9), LinkModel(1e-5, 1 / 25e9), gpus_per_node=4)``: ``m = 8``; a micro-batch is 1.75e12
FLOPs, so ``F_c`` = 1.458 ms and ``B_c`` = 2.916 ms; one TP all-reduce of 3.1 MB inside the node takes 20.5 us,
two a layer each way on a stage's 6 layers: ``F_tp = B_tp`` = 0.246 ms, ``F`` = 1.704 ms and ``B`` = 3.162 ms.
So ``compute`` = 35.00 ms, ``tp`` = 3.93 ms and the 1F1B ``bubble`` 4.87 ms; the DP group spans ``t d = 8``
ranks, two nodes, where the 62 MB reduction takes 3.79 ms, of which ``dp`` = 0.63 ms outlasts ``B``: a step of
44.43 ms (``predict_step`` adds 1.09 ms of pipeline sends).

Complete ``step_time_by_hand``, then run the grading cell of ``notebooks/11_planning_a_training_run.ipynb`` (or
``labkit grade``).  The checks compare your parts with ``predict_step``'s on 206 configurations (six models,
``dp``, ``tp`` and ``pp`` from 1 to 64, TP groups inside and across nodes, micro-batches of 1 to 8, every schedule,
with and without recomputation) to a relative ``1e-9``.  While they run, labkit's step model
(``labkit.costmodel.step``: ``predict_step``, ``stage_times``, ``closed_form_makespan``), its event simulation,
the planner and the ring costs of ``labkit.costmodel.collectives`` are switched off: write the formulas.
"""

from __future__ import annotations

from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.memory import num_parameters

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
        bubble = (p - 1) * forward
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
