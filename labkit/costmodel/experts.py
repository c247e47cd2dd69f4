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
sit on the critical path (DualPipe hides them behind another micro-batch's compute; labkit's schedules do not).
The ep group's ranks are ``t`` apart, ``g`` of them on each node it spans (``g = ep`` inside one node:
:func:`labkit.costmodel.hardware.node_members`).  A rank's rows for the ``g - 1`` others of its node go over
NVLink, and those for the ``ep - g`` ranks elsewhere through *its own* network adapter, one GPU's network bandwidth
(50 GB/s on H100 nodes: no ring's channels spread an all-to-all over the node's other adapters), both at once
(:func:`labkit.costmodel.collectives.all_to_all_seconds`): for ``ep = 16`` over two nodes of 8, ``7/16`` of the
rows at 450 GB/s beside ``8/16`` at 50 GB/s, the second the longer by far.

**Node-limited routing** (DeepSeek-V3, DeepSeek-AI 2024, sections 2.1.2 and 3.2.2): each token goes to experts on
at most ``M = 4`` nodes, and its dispatch sends it *once* to each such node, over InfiniBand to the GPU of the same
index there, which forwards it over NVLink to the GPUs holding its experts (combine: the reverse, summed on the node
first).  Then ``D`` rows of a token (``h b`` bytes each) cross the network rather than ``k (ep - g) / ep``:
``D`` the expected number of *other* nodes its ``k`` experts land on (:func:`distinct_nodes`), and NVLink carries
the forwarded rows besides (:func:`ep_node_bytes`).  ``TransformerShape.max_nodes`` turns it on (the
``deepseek-v3`` preset sets 4).  The model keeps routing uniform, within the ``M`` nodes: at ep = 64 over 8 nodes a
token uses 3.63 of its 4 nodes, 3.18 other ones; DeepSeek's router picks the ``M`` nodes whose best experts score
highest, which tends to use all four (3.5 other nodes), so the model errs a little on the cheap side.

Parameters (:func:`labkit.costmodel.shapes.num_parameters`, ``expert_parameters``): the routed experts are
split over ``ep`` (not over tp: expert tensor parallelism 1, as DeepSeek-V3 trains) and their gradients
reduced, and ZeRO's states sharded, over the ``dp cp / ep`` ranks holding the same experts; the rest as in a
dense model.
"""

from __future__ import annotations

import math
from typing import Any

from labkit.costmodel.collectives import all_to_all_seconds
from labkit.costmodel.hardware import node_members

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


def distinct_nodes(nodes: int, experts_per_node: int, top_k: int, max_nodes: int | None = None) -> float:
    """The expected number of nodes a token's ``top_k`` distinct experts land on, routing uniform over the ``nodes
    x experts_per_node`` experts: exactly (choices without replacement) ``n (1 - C((n - 1) x, k) / C(n x, k))``,
    node by node the chance that not all ``k`` choices miss it; ``n (1 - (1 - 1/n)^k)`` (with replacement) is
    its limit for ``x >> k``.  Node-limited routing (``max_nodes = M < n``): the token's ``M`` nodes uniform, then
    its ``k`` experts uniform among their ``M x``: the same formula with ``M`` for ``n`` (``M`` raised to the
    ``ceil(k / x)`` nodes that hold ``k`` experts, where a layout puts fewer than ``k / M`` on a node).  Every node,
    the token's own among them, is as likely to be hit, so ``(n - 1) / n`` of the count are other nodes."""
    if top_k > nodes * experts_per_node:
        raise ValueError(f"top_k={top_k} experts do not fit on {nodes} nodes of {experts_per_node} experts")
    used = nodes if max_nodes is None else min(nodes, max(max_nodes, -(-top_k // experts_per_node)))
    return used * (1 - math.comb((used - 1) * experts_per_node, top_k) / math.comb(used * experts_per_node, top_k))


def ep_node_bytes(tokens: float, top_k: int, hidden: int, value_bytes: int, ep: int, local: int,
                  num_experts: int, max_nodes: int | None = None) -> tuple[float, float]:
    """``(over NVLink, over the network)``: bytes that leave one rank in one all-to-all under uniform routing,
    ``local`` of the ep group's ranks on each of its ``ep / local`` nodes.  Each of the ``T k`` rows goes to a
    uniformly chosen rank: ``(local - 1) / ep`` of them to the rank's node, ``(ep - local) / ep`` to other nodes.
    With ``max_nodes`` (node-limited routing, module docstring): a token crosses the network once per other node
    it uses, ``T D`` rows (:func:`distinct_nodes`), and each of its ``k (n - 1) / n`` rows for other nodes is
    forwarded over NVLink there unless it arrived on the GPU holding its expert (``(local - 1) / local`` of them;
    by symmetry a rank forwards as many of other ranks' rows as other ranks forward of its own)."""
    row, nodes = hidden * value_bytes, ep // local
    on_node = tokens * top_k * (local - 1) / ep * row
    if max_nodes is None:
        return on_node, tokens * top_k * (ep - local) / ep * row
    other = distinct_nodes(nodes, num_experts // ep * local, top_k, max_nodes) * (nodes - 1) / nodes
    forwarded = tokens * top_k * (nodes - 1) / nodes * (local - 1) / local * row
    return on_node + forwarded, tokens * other * row


def ep_all_to_all_s(shape: Any, layout: Any, hardware: Any, value_bytes: int = 2) -> float:
    """One all-to-all of one MoE layer and micro-batch on a GPU cluster (``hardware``: a
    :class:`labkit.costmodel.stages.Hardware`), under uniform routing: each rank's ``b (s / cp) / t`` tokens
    (Megatron-Core splits them over the tp ranks with sequence parallelism, each dispatching its share) times ``k``
    rows of ``h`` values, split by :func:`ep_node_bytes` between NVLink, one message to each of the ``local - 1``
    ranks of its node, and its own network adapter, one message to each of the ``ep - local`` others (node-limited:
    to the ``ep / local - 1`` other nodes); the two at once (module docstring), plus a call's latency.  0 without
    expert parallelism."""
    if layout.ep == 1 or not shape.moe_layers:
        return 0.0
    local = node_members(hardware.gpus_per_node, layout.tp, layout.ep)
    limited = getattr(shape, "max_nodes", None)
    tokens = layout.micro_batch * shape.seq_len / layout.cp / layout.tp
    on_node, off_node = ep_node_bytes(tokens, shape.top_k, shape.hidden_size, value_bytes, layout.ep, local,
                                      shape.num_experts, limited)
    messages = layout.ep - local if limited is None else layout.ep // local - 1
    return all_to_all_seconds((local - 1, on_node), (messages, off_node), hardware.intra_node,
                              hardware.inter_node) + hardware.call_latency_s


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
