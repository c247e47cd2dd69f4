"""Mixture-of-experts arithmetic: parameters total and active, FLOPs per token, and expert parallelism's bytes.

**Parameters.**  An MoE layer holds ``E`` experts of ``2 h f`` weights (``f`` the expert's hidden width; biases
``f + h`` more), ``n_s`` shared experts alike and a router of ``h E``; a token uses ``k`` experts, the shared
ones and the router.  So the *total* parameters (memory, checkpoint) grow with ``E`` and the *active* ones
(FLOPs: ``6`` per active parameter and token for a training step, as for a dense model) with ``k``.

**Expert parallelism's all-to-alls** (:mod:`labkit.parallel.experts.dispatch`).  Per MoE layer and micro-batch
a rank sends its kept assignments' rows, ``h`` values each, to the ranks holding their experts (dispatch) and
receives them back computed (combine); backward repeats both the other way.  Under uniform routing ``1 / ep``
of the ``T k`` rows stay on the rank, so each all-to-all sends

    ``T k h b (ep - 1) / ep`` bytes per rank,

two in forward and two in backward (:func:`ep_uniform_bytes`).  A real router is not uniform, and a rank's bytes
are its own rows: :func:`ep_messages` takes the splits it actually sent and received.

**On a cluster** (:func:`ep_all_to_all_s`, the step model's ``ep`` term) the four all-to-alls of every MoE layer
sit on the critical path (DualPipe hides them behind another micro-batch's compute; labkit's schedules do not),
on the link the ep group spans: ``ep`` ranks ``t`` apart, inside a node while ``t ep`` GPUs fit in one.
Parameters (:func:`labkit.costmodel.shapes.num_parameters`, ``expert_parameters``): the routed experts are
split over ``ep`` (not over tp: expert tensor parallelism 1, as DeepSeek-V3 trains) and their gradients
reduced, and ZeRO's states sharded, over the ``dp cp / ep`` ranks holding the same experts; the rest as in a
dense model.
"""

from __future__ import annotations

import math
from typing import Any

KINDS = ("dispatch", "combine", "dcombine", "ddispatch")  # the two all-to-alls forward, then backward


def ep_uniform_bytes(tokens: int, top_k: int, hidden: int, value_bytes: int, ep: int) -> float:
    """Bytes one rank sends in one of a layer's four all-to-alls under uniform routing (no drops)."""
    return tokens * top_k * hidden * value_bytes * (ep - 1) / ep


def ep_messages(send: list[int], receive: list[int], rank: int, row_bytes: int) -> list[tuple[str, str, int]]:
    """``(phase, kind, bytes)`` of one MoE layer call's all-to-alls on rank ``rank``, which sent ``send[j]`` rows
    to rank ``j`` and received ``receive[j]`` from it; rows of ``row_bytes`` (``h b``), the counts' exchange
    (``E - E / ep`` integers of 8 bytes) apart.  Dispatch and the combine's gradient send this rank's rows; the
    combine and the dispatch's gradient send back what it received."""
    out = sum(send) - send[rank]
    back = sum(receive) - receive[rank]
    return [("forward", "dispatch", out * row_bytes), ("forward", "combine", back * row_bytes),
            ("backward", "dcombine", out * row_bytes), ("backward", "ddispatch", back * row_bytes)]


def ep_all_to_all_s(shape: Any, layout: Any, link: Any, call_latency_s: float = 0.0, value_bytes: int = 2) -> float:
    """One all-to-all of one MoE layer and micro-batch on a GPU cluster, under uniform routing: each rank's
    ``b (s / cp) / t`` tokens (Megatron-Core splits them over the tp ranks with sequence parallelism, each
    dispatching its share) times ``k`` rows of ``h`` values, ``(ep - 1) / ep`` of them to the other ranks over
    ``link`` (``labkit.costmodel.stages.link_of``: the ep group's ranks are ``t`` apart), one message to each:
    ``(ep - 1) alpha + bytes beta``, plus a call's latency.  0 without expert parallelism."""
    if layout.ep == 1 or not shape.moe_layers:
        return 0.0
    tokens = layout.micro_batch * shape.seq_len / layout.cp / layout.tp
    nbytes = ep_uniform_bytes(tokens, shape.top_k, shape.hidden_size, value_bytes, layout.ep)
    return (layout.ep - 1) * link.alpha_s + nbytes * link.beta_s_per_byte + call_latency_s


def expected_max_normal(n: int, points: int = 20001) -> float:
    """``E[max(Z_1 .. Z_n)]`` of ``n`` independent standard normals: ``int x n phi(x) Phi(x)^(n-1) dx`` (0 for
    one; 1.03 for 4; 2.34 for 64), by the trapezoid rule on ``[-10, 10]``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    step = 20.0 / (points - 1)
    total = 0.0
    for index in range(points):
        x = -10.0 + index * step
        density = n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
        total += x * density * (0.5 if index in (0, points - 1) else 1.0)
    return total * step


def busiest_rank_share(choices: int, ep: int) -> float:
    """The busiest of ``ep`` ranks' rows over the mean when ``choices`` rows go to uniformly random ranks: the
    counts are nearly normal (mean ``c / ep``, deviation ``sqrt(c (1/ep) (1 - 1/ep))``), so about
    ``1 + E[max of ep normals] x deviation / mean`` (it leaves out that the counts sum to ``c``)."""
    mean = choices / ep
    return 1 + expected_max_normal(ep) * math.sqrt(choices * (1 / ep) * (1 - 1 / ep)) / mean
