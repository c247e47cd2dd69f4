"""Redundant experts: evening out expert parallelism's load by giving the busiest experts more than one copy.

However well a router is balanced, the loads it gives the experts differ, and the rank holding the busiest ones
sets the pace of every all-to-all (lesson 14, section 6).  DeepSeek-V3 serves with **redundant experts**
(DeepSeek-AI 2024, section 3.4.1: 32 of them for prefilling, chosen from the loads observed and recomputed every
ten minutes): an expert given ``c`` copies, each on its own GPU, splits its tokens ``c`` ways, and the copies are
packed so that every GPU carries about the same load.  DeepSeek published the algorithm as the Expert Parallelism
Load Balancer (EPLB, github.com/deepseek-ai/EPLB), hierarchical so as to respect node-limited routing (a token's
experts lie in at most 4 *groups* of experts, and a group stays on one node):

1. **groups to nodes**: the groups' loads packed onto the nodes, the same number of groups on each, heaviest
   first, each onto the lightest node that has room (:func:`balanced_packing`);
2. **copies within a node**: the node's share of the copies added one at a time, each to the expert whose load
   per copy is the largest (:func:`replicate`): the greedy rule that minimises the largest load per copy;
3. **copies to GPUs**: the node's copies packed onto its GPUs, the same number on each, by the rule of step 1.

One node and one group make it EPLB's *global* policy.  Both packings are the longest-processing-time rule of
scheduling (Graham 1969) with equal counts per bin: greedy, not optimal, and fast enough to rerun as the loads
drift.  Ties go to the lower index (the heavier of equal items first in index order, the first of equally light
bins), which reproduces EPLB's published example (``tests/test_experts.py``; lesson 14 prints it).
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_divides(name: str, value: object, whole: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or whole % value:
        raise ValueError(f"{name} must be a positive integer dividing {what} ({whole}), got {value!r}")
    return whole // value


def balanced_packing(weights: Sequence[float], packs: int) -> list[list[int]]:
    """Items ``0 .. n-1`` of ``weights`` into ``packs`` packs of ``n / packs`` items each: heaviest first (equal
    weights: lower index first), each into the lightest pack that still has room (equal: the lower pack).  Returns
    each pack's items in the order they were placed."""
    size = _check_divides("packs", packs, len(weights), "the number of items")
    contents: list[list[int]] = [[] for _ in range(packs)]
    load = [0.0] * packs
    for item in sorted(range(len(weights)), key=lambda index: -weights[index]):
        pack = min((p for p in range(packs) if len(contents[p]) < size), key=lambda p: load[p])
        contents[pack].append(item)
        load[pack] += weights[item]
    return contents


def replicate(loads: Sequence[float], copies: int) -> tuple[list[int], list[int]]:
    """``copies`` physical experts for the ``len(loads)`` logical ones: each expert once, in order, then every
    further copy to the expert whose load per copy is then the largest (equal: the lower id).  Returns the
    physical experts' logical ids and each logical expert's number of copies."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < len(loads):
        raise ValueError(f"copies must be an integer >= the {len(loads)} experts (one each at least), got {copies!r}")
    count = [1] * len(loads)
    physical = list(range(len(loads)))
    for _ in range(copies - len(loads)):
        busiest = max(range(len(loads)), key=lambda e: loads[e] / count[e])
        physical.append(busiest)
        count[busiest] += 1
    return physical, count


def rebalance_experts(loads: Sequence[float], copies: int, groups: int, nodes: int,
                      gpus: int) -> list[list[int]]:
    """One MoE layer's placement: ``loads`` the expected tokens of each of its experts (grouped contiguously into
    ``groups`` groups), ``copies`` physical experts in all over ``gpus`` GPUs on ``nodes`` nodes.  Returns each
    GPU's experts (logical ids, one entry per copy; GPUs in order, node by node).  ``groups`` not divisible by
    ``nodes``: EPLB's global policy (one group, one node).  See the module docstring."""
    for name, value in (("groups", groups), ("nodes", nodes), ("gpus", gpus), ("copies", copies)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if copies < len(loads):
        raise ValueError(f"copies must be an integer >= the {len(loads)} experts (one each at least), got {copies}")
    if groups % nodes:  # the groups cannot stay whole on the nodes: EPLB's global policy
        groups, nodes = 1, 1
    group_size = _check_divides("groups", groups, len(loads), "the experts")
    gpus_per_node = _check_divides("nodes", nodes, gpus, "the GPUs")
    _check_divides("gpus", gpus, copies, "the copies")
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(groups)]
    placement = []
    for node_groups in balanced_packing(group_loads, nodes):  # step 1
        held = [g * group_size + i for g in node_groups for i in range(group_size)]
        physical, count = replicate([loads[e] for e in held], copies // nodes)  # step 2
        per_copy = [loads[held[p]] / count[p] for p in physical]
        for gpu in balanced_packing(per_copy, gpus_per_node):  # step 3
            placement.append([held[physical[slot]] for slot in gpu])
    return placement


def gpu_loads(loads: Sequence[float], placement: Sequence[Sequence[int]]) -> list[float]:
    """Each GPU's load when every expert's tokens split evenly over its copies in ``placement``."""
    copies = [0] * len(loads)
    for gpu in placement:
        for expert in gpu:
            copies[expert] += 1
    return [sum(loads[expert] / copies[expert] for expert in gpu) for gpu in placement]
