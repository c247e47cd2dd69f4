"""Checks for exercise 11 (``11_planning.py``): step_time_by_hand, one 3D step's time by hand.

The student's parts are held to :func:`labkit.costmodel.step.predict_step`'s terms (the balanced pipeline,
``head_on_last_stage=False``) on the 215 configurations of :data:`CASES`: six models (GPT-2, GPT-2 XL, Llama-2
7B and 70B with grouped-query attention and SwiGLU, GPT-3 175B, and a 64-layer GPT), ``dp``, ``tp`` and ``pp``
each from 1 to 64 (one GPU to 6144), TP groups inside a node and across nodes (``t = 16`` and ``64`` on nodes of
8, ``t = 8`` on nodes of 4, and ``t`` = 3, 5, 6 and 12, which do not divide a node), DP groups inside and across
nodes, micro-batches of 1 to 8 sequences and 1 to 16 of them, GPipe, 1F1B, interleaved 1F1B (``v`` = 2 to 5)
and ZB-H1 (with recomputation too, where an input-gradient pass outlasts a forward), on five machines (A100 and
H100 nodes of 8, V100 nodes of 16, and PCIe nodes of 4 and of 8 behind slow networks, where the DP reduction
outlasts the last backward): hand-picked cases, the plain ones first (the first failing case is the one
reported), then a sweep of every ``(dp, tp, pp)`` of 1, 2 and 4 with each schedule on GPT-2 and Llama-2 7B.
Each plausible rule for a group's link has cases where it gives another answer with the reduction exposed: a
group that spans a whole node (``t d = G``: inside), and groups whose span fits in a node without dividing it
(``t`` or ``t d`` = 3, 5, 6 on nodes of 8: the block from rank 6 crosses), so "divides the node" is told apart
from "fits in it", from "fewer than a node" and from ``d`` alone.
Five checks, building up:

1. one micro-batch's ``forward`` and ``backward`` on one stage, TP's all-reduces included (``forward_s``,
   ``backward_s``);
2. ``compute`` and ``tp`` over the step (``compute_s``, ``tp_s``);
3. the ``bubble`` (``bubble_s``: the schedule's closed form);
4. the exposed ``dp`` reduction (``dp_s``);
5. the ``step``: ``predict_step``'s without the pipeline's sends (``step_s - pp_send_s``; ZeRO 0 has no other
   term), and the sum of the parts returned.

Each compares within a relative ``1e-9`` (and ``1e-12`` of the step, for a part that is a difference, such as
``dp`` near 0).  Every case splits evenly (the ring's chunks are equal, its bytes whole: tested at import), so
the closed forms are exact.  The references are computed when this module is imported, before any guard; while
the checks run, :mod:`labkit.grading.guard` forbids labkit's step model, its event simulation and the planner
(``labkit.costmodel.step``, ``.stages``, ``.timeline``, ``.simulator``, ``.planner``: in every check's guard) and the ring costs of
``labkit.costmodel.collectives`` (:data:`BUILT_INS`).  A failure names the case and both values and, where the
value is a known mistake (no bubble, ``(p - 1) / m``, two all-reduces a layer, NVLink for a group that spans
nodes, ...), says which.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from labkit.costmodel.collectives import LinkModel
from labkit.costmodel.compute import model_flops_per_step
from labkit.costmodel.shapes import TransformerShape, num_parameters
from labkit.costmodel.step import Hardware, Layout, predict_step
from labkit.grading import CheckFailed, guard
from labkit.grading.checkers.planning_cases import MACHINES, SHAPES, SPECS

# The ring costs the exercise asks for by formula (labkit.costmodel.step, .stages, .timeline, .simulator and
# .planner are in every check's guard).
BUILT_INS = tuple(f"labkit.costmodel.collectives.{name}"
                  for name in ("ring_all_reduce_cost", "ring_reduce_scatter_cost", "ring_all_gather_cost"))
RELATIVE, ABSOLUTE = 1e-9, 1e-12  # the second is of the step
VALUE_BYTES = 2
PARTS = ("forward", "backward", "compute", "tp", "bubble", "dp", "step")


def _ring(nbytes: float, ranks: int, link: LinkModel, factor: bool = True) -> float:
    """A ring all-reduce's closed form (the hints' alternatives call it with ``factor=False``: ``2 n beta``)."""
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks if factor else 1.0
    return 2 * (ranks - 1) * link.alpha_s + 2 * share * nbytes * link.beta_s_per_byte


@dataclass(frozen=True)
class Case:
    """One configuration, ``predict_step``'s terms for it (``want``) and the ingredients the hints quote."""

    where: str
    shape: TransformerShape
    layout: Layout
    global_batch: int
    hardware: Hardware
    want: dict[str, float]
    m: int
    v: int
    forward_c: float
    backward_c: float
    tp_one: float  # one all-reduce of b s h values
    tp_link_inside: bool
    dp_reduction: float
    dp_link_inside: bool


def _case(model: str, machine: str, d: int, t: int, p: int, b: int, m: int, schedule: str, v: int,
          recompute: bool) -> Case:
    shape, hardware = SHAPES[model], MACHINES[machine]
    layout = Layout(dp=d, tp=t, pp=p, micro_batch=b, recompute=recompute, schedule=schedule, virtual_stages=v)
    psi, bsh = num_parameters(shape), b * shape.seq_len * shape.hidden_size
    # even splits: whole 4-byte elements in equal ring chunks, so the closed forms are predict_step's exactly
    if shape.num_layers % (p * v) or psi % (2 * t * p * d) or bsh % (2 * t) or (schedule == "interleaved" and m % p):
        raise AssertionError(f"exercise 11's case {model} {layout.label()} m={m} does not split evenly")
    step = predict_step(shape, layout, d * b * m, hardware, head_on_last_stage=False)  # the balanced pipeline
    want = {"forward": step.forward_s, "backward": step.backward_s, "compute": step.compute_s, "tp": step.tp_s,
            "bubble": step.bubble_s, "dp": step.dp_s, "step": step.step_s - step.pp_send_s}
    assert step.zero_s == 0 and step.microbatches == m and hardware.layer_overhead_s == 0 and hardware.cores is None
    passes = 4 if recompute else 3
    forward_c = model_flops_per_step(shape, b, recompute=recompute) / (t * p) / passes / hardware.flops
    gpus = hardware.gpus_per_node
    tp_inside, dp_inside = gpus % t == 0, gpus % (t * d) == 0
    tp_one = _ring(VALUE_BYTES * bsh, t, hardware.intra_node if tp_inside else hardware.inter_node)
    dp_reduction = _ring(VALUE_BYTES * psi / (t * p), d, hardware.intra_node if dp_inside else hardware.inter_node)
    where = f"{model}, {layout.label()}, global batch {d * b * m} (m = {m} micro-batches), on {machine}"
    return Case(where, shape, layout, d * b * m, hardware, want, m, v if schedule == "interleaved" else 1,
                forward_c, (passes - 1) * forward_c, tp_one, tp_inside, dp_reduction, dp_inside)


CASES = [_case(*spec) for spec in SPECS]


# --------------------------------------------------------------------------------------------------------
# Calling the student's function, comparing, and naming the mistake


def _parts(module, case: Case) -> dict[str, float]:
    call = "step_time_by_hand(shape, layout, global_batch, hardware)"
    try:
        parts = module.step_time_by_hand(dataclasses.replace(case.shape), case.layout, case.global_batch,
                                         case.hardware)  # a copy of the shape: a TransformerShape can be changed
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as error:
        raise CheckFailed(f"{case.where}: {call} raised {type(error).__name__}: {error}") from None
    missing = [name for name in PARTS if not isinstance(parts, dict) or name not in parts]
    if missing:
        keys = ", ".join(sorted(map(repr, parts))) if isinstance(parts, dict) else type(parts).__name__
        raise CheckFailed(f"{case.where}: {call} returned {keys}; return a dict with the keys "
                          f"{', '.join(map(repr, PARTS))} (seconds)")
    for name in PARTS:
        value = parts[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CheckFailed(f'{case.where}: your "{name}" is {value!r:.80}; each part is a number of seconds')
    return parts


def _close(got: float, want: float, step: float) -> bool:
    return math.isclose(got, want, rel_tol=RELATIVE, abs_tol=ABSOLUTE * step)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.6g} ms"


def _compare(case: Case, parts: dict[str, float], name: str, formula: str,
             mistakes: list[tuple[float, str]]) -> None:
    """``CheckFailed`` naming the case, both values, the formula and the mistakes (at most two) the value matches."""
    got, want, step = parts[name], case.want[name], case.want["step"]
    if _close(got, want, step):
        return
    known: list[str] = []
    for value, text in mistakes:
        if _close(got, value, step) and not _close(value, want, step) and text not in known:
            known.append(text)
    hint = "" if not known else f": {known[0]}" if len(known) == 1 else f": either {known[0]}; or {known[1]}"
    raise CheckFailed(f'{case.where}: your "{name}" is {_ms(got)}, predict_step\'s {_ms(want)} ({formula}){hint}')


def _tp_mistakes(case: Case, count: int) -> list[tuple[float, str]]:
    """``count`` all-reduces per layer, each priced as a plausible mistake prices it."""
    t, layers, hardware = case.layout.tp, case.shape.num_layers // case.layout.pp, case.hardware
    nbytes = VALUE_BYTES * case.layout.micro_batch * case.shape.seq_len * case.shape.hidden_size
    link = hardware.intra_node if case.tp_link_inside else hardware.inter_node
    found = []
    if case.layout.recompute and count > 2:
        found.append(((count - 2) * layers * case.tp_one, "recomputation runs the forward's two all-reduces "
                      "again inside the backward: four there"))
    found += [(count * layers * case.tp_one / 2, "one all-reduce per layer each way, where Megatron's layer has "
               "two (after attention and after the MLP): four a layer and micro-batch, six when recomputing"),
              (count * layers * _ring(nbytes, t, link, factor=False), "your ring all-reduce sends 2 n beta; it "
               "sends 2 (N - 1) / N * n * beta (each of the 2 (N - 1) steps moves one chunk of n / N)"),
              (0.0, "without TP's all-reduces, which lie on the critical path")]
    if not case.tp_link_inside:
        found.append((count * layers * _ring(nbytes, t, hardware.intra_node), f"your all-reduces run on the "
                      f"intra-node link, but a TP group of t = {t} on nodes of {hardware.gpus_per_node} spans "
                      f"nodes (inside one only when t divides the GPUs a node)"))
    elif t > 1:
        found.append((count * layers * _ring(nbytes, t, hardware.inter_node), f"a TP group of t = {t}, which divides "
                      f"a node of {hardware.gpus_per_node}, stays inside one: intra-node link"))
    return found


def _bubble(case: Case, forward: float, backward: float) -> float:
    """The schedule's closed form (the hints apply it to other F and B than predict_step's)."""
    p = case.layout.pp
    if case.layout.schedule == "zb-h1":
        return (p - 1) * max(forward, backward / 2)
    return (p - 1) * (forward + backward) / case.v


def _follows_from_yours(case: Case, parts: dict[str, float], name: str, own: float) -> list[tuple[float, str]]:
    """A part computed right from the student's own forward or backward, which are wrong (the first check)."""
    if _close(parts["forward"], case.want["forward"], case.want["step"]) and \
            _close(parts["backward"], case.want["backward"], case.want["step"]):
        return []
    return [(own, f"your {name} follows from your forward and backward ({_ms(parts['forward'])}, "
                  f"{_ms(parts['backward'])}), which are not predict_step's ({_ms(case.want['forward'])}, "
                  f"{_ms(case.want['backward'])}): see the first check")]


# --------------------------------------------------------------------------------------------------------
# The checks


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_one_micro_batch(module) -> None:
    """one micro-batch's forward and backward on one stage: its share of the FLOPs, then TP's all-reduces"""
    for case in CASES:
        parts = _parts(module, case)
        layers = case.shape.num_layers // case.layout.pp
        t, p, passes = case.layout.tp, case.layout.pp, 4 if case.layout.recompute else 3
        share = [(case.forward_c * t * p, "one micro-batch's FLOPs on one rank are the model's / (t p)"),
                 (case.forward_c * t, "divide the model's FLOPs by t p, not p"),
                 (case.forward_c * p, "divide the model's FLOPs by t p, not t")]
        forward_mistakes = [(case.forward_c, "the compute without TP's two all-reduces per layer")]
        forward_mistakes += [(case.forward_c + value, text) for value, text in _tp_mistakes(case, 2)]
        forward_mistakes += [(value + 2 * layers * case.tp_one, text) for value, text in share]
        forward_mistakes.append((case.forward_c * t * p, "the whole model's forward on one rank, as in plain data "
                                 "parallelism: its t p model-parallel ranks share it, and TP all-reduces twice a "
                                 "layer"))
        forward_mistakes.append((case.forward_c * passes / 3 + 2 * layers * case.tp_one,
                                 "F is the step's FLOPs / 4 when recomputing: the four passes are forward, "
                                 "forward again, and the backward's two"))
        _compare(case, parts, "forward", "F = model_flops_per_step(shape, b, recompute) / (t p) / passes / X + "
                 f"2 (L / p) T(2 b s h, t), with passes = {passes}", forward_mistakes)
        count = 4 if case.layout.recompute else 2
        backward_mistakes = [(case.backward_c, "the compute without TP's all-reduces")]
        backward_mistakes += [(case.backward_c + value, text) for value, text in _tp_mistakes(case, count)]
        backward_mistakes += [(2 * case.forward_c + count * layers * case.tp_one,
                               "with recomputation the backward holds the forward again: B_c = 3 F_c")]
        _compare(case, parts, "backward", f"B = (passes - 1) F_c + {count} (L / p) T(2 b s h, t)",
                 backward_mistakes)


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_compute_and_tp_over_the_step(module) -> None:
    """compute and TP over the step: every micro-batch's matrix work, and the all-reduces inside it"""
    for case in CASES:
        parts = _parts(module, case)
        m, forward, backward = case.m, case.want["forward"], case.want["backward"]
        compute = case.forward_c + case.backward_c
        _compare(case, parts, "compute", "m (F_c + B_c), without communication",
                 [(compute, f"one micro-batch's; the stage runs all m = {m} of them"),
                  (m * (forward + backward), 'TP\'s all-reduces go in "tp", not in "compute"'),
                  (m * compute * case.layout.tp * case.layout.pp, "the whole model's FLOPs on each rank, as in "
                   "plain data parallelism: its t p model-parallel ranks share them"),
                  (m * compute * case.layout.dp, "a rank runs its replica's m micro-batches, not the whole "
                   "batch's"), (m * compute / case.layout.dp, f"m = global_batch / (d b) = {m} already counts "
                                "the replicas")])
        tp = forward + backward - compute
        _compare(case, parts, "tp", "m (F_tp + B_tp)", [(tp, f"one micro-batch's; the stage runs all m = {m}")]
                 + [(m * value, text) for value, text in _tp_mistakes(case, 6 if case.layout.recompute else 4)])


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_the_bubble(module) -> None:
    """the bubble of each schedule: lesson 07's closed forms, with this stage's F and B"""
    formulas = {"gpipe": "(p - 1)(F + B)", "1f1b": "(p - 1)(F + B)", "interleaved": "(p - 1)(F + B) / v",
                "zb-h1": "(p - 1) max(F, B / 2)"}
    for case in CASES:
        parts = _parts(module, case)
        p, m, v, schedule = case.layout.pp, case.m, case.v, case.layout.schedule
        full = (p - 1) * (case.want["forward"] + case.want["backward"])
        mistakes = _follows_from_yours(case, parts, "bubble", _bubble(case, parts["forward"], parts["backward"]))
        # the schedule's own mistakes first: where two give one value, the first two are named
        if schedule == "interleaved":
            mistakes += [(full / v / v, "divided by v twice: in (p - 1)(F + B) / v, F and B are the whole rank's "
                                        "(its v chunks), not one chunk's"),
                         (full, f"not divided by v: interleaving v = {v} chunks per rank shrinks the bubble v-fold")]
        if schedule == "zb-h1":
            mistakes.append((full, "ZB-H1 fills the backward's share of the bubble with weight-gradient passes: "
                                   "(p - 1) max(F, B / 2)"))
            mistakes.append(((p - 1) * case.want["forward"], "(p - 1) F holds only while a forward is at least as "
                             "long as an input-gradient pass (B / 2); with recomputation I is longer: each stage "
                             "downstream costs the longer of the two, (p - 1) max(F, B / 2)"))
        else:
            mistakes.append(((p - 1) * max(case.want["forward"], case.want["backward"] / 2),
                             f"(p - 1) max(F, B / 2) is ZB-H1's; {schedule} idles {formulas[schedule]}"))
        mistakes += [(0.0, "no bubble; the first stage waits p - 1 forwards for the last one to start, and the last "
                           "stage p - 1 backwards for the first one to finish"),
                     (full / m, "(p - 1) / m is the bubble's fraction of the ideal time m (F + B): the bubble "
                                "itself is (p - 1)(F + B)"),
                     (full / (m + p - 1), "(p - 1) / (m + p - 1) is the bubble's share of the whole pipeline's "
                                          "time: the bubble itself is (p - 1)(F + B)"),
                     (_bubble(case, case.forward_c, case.backward_c),
                      "the idle slots last a whole forward and backward, TP's all-reduces included")]
        _compare(case, parts, "bubble", f"{formulas[schedule]}, with F and B one micro-batch's on the stage, TP "
                 "included", mistakes)


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_the_data_parallel_reduction(module) -> None:
    """the data-parallel reduction: the part of it that nothing hides"""
    for case in CASES:
        parts = _parts(module, case)
        d, t, p, hardware = case.layout.dp, case.layout.tp, case.layout.pp, case.hardware
        backward, reduction = case.want["backward"], case.dp_reduction
        nbytes = VALUE_BYTES * num_parameters(case.shape) / (t * p)
        link = hardware.intra_node if case.dp_link_inside else hardware.inter_node
        mistakes = [(reduction, "not overlapped: the reduction starts with the last micro-batch's backward and "
                                "runs beside it, so only what outlasts B is exposed"),
                    (0.0, f"all of it hidden; only one backward (B = {_ms(backward)}) runs beside it")]
        others = [(reduction - case.m * backward, "a stage's gradients are complete only after its last backward: "
                                                  "one B hides the reduction, not m"),
                  (reduction - case.backward_c, "the last backward's TP all-reduces run beside it too"),
                  (_ring(nbytes, d, link, factor=False) - backward, "your ring all-reduce sends 2 n beta; it sends "
                                                                    "2 (N - 1) / N * n * beta"),
                  (_ring(nbytes * t * p, d, link) - backward, "each rank reduces its own Psi / (t p) parameters' "
                                                              "gradients, not Psi")]
        nodes = hardware.gpus_per_node
        if not case.dp_link_inside:
            others.append((_ring(nbytes, d, hardware.intra_node) - backward, f"a DP group's d = {d} ranks are t = "
                           f"{t} apart: they span t d = {t * d} ranks, " + (
                               f"more than a node of {nodes} holds" if t * d > nodes else
                               f"and the blocks of {t * d} ranks that start at multiples of {t * d} do not all fit "
                               f"in nodes of {nodes}") + " (inside one only when t d divides it)"))
        elif d > 1:
            others.append((_ring(nbytes, d, hardware.inter_node) - backward, f"a DP group spanning t d = {t * d} "
                           f"ranks, which divides a node of {nodes}, stays inside one: intra-node link"))
        mistakes += [(value, text) for value, text in others if value > 0]  # 0 is "all of it hidden"
        mistakes = _follows_from_yours(case, parts, "dp", max(0.0, reduction - parts["backward"])) + mistakes
        _compare(case, parts, "dp", f"max(0, T(2 Psi / (t p), d) - B), with T = {_ms(reduction)} and B = "
                 f"{_ms(backward)}", mistakes)


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_the_step(module) -> None:
    """the step: compute + tp + bubble + dp, as predict_step predicts it without the pipeline's sends"""
    for case in CASES:
        parts = _parts(module, case)
        total = parts["compute"] + parts["tp"] + parts["bubble"] + parts["dp"]
        if not _close(parts["step"], total, case.want["step"]):
            raise CheckFailed(f'{case.where}: your "step" ({_ms(parts["step"])}) is not the sum of your parts, '
                              f'compute + tp + bubble + dp = {_ms(total)}')
        wrong = [name for name in PARTS[2:-1] if not _close(parts[name], case.want[name], case.want["step"])]
        names = " and ".join([", ".join(wrong[:-1]), wrong[-1]] if len(wrong) > 1 else wrong)
        why = f"; your {names} {'differs' if len(wrong) == 1 else 'differ'} from predict_step's" if wrong else ""
        _compare(case, parts, "step", f"compute + tp + bubble + dp{why}", [])


CHECKS = [check_one_micro_batch, check_compute_and_tp_over_the_step, check_the_bubble,
          check_the_data_parallel_reduction, check_the_step]
