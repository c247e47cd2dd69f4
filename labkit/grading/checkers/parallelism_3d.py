"""Checks for exercise 10 (``10_3d_parallelism.py``): megatron_groups, the ranks of every TP, DP and PP group.

The student's function gives the groups of the layouts in :data:`LAYOUTS`: 1 to 64 ranks, each dimension alone,
two at a time, cubes and degrees that differ (``dp = 3, tp = 4, pp = 2``), so an answer that mixes two degrees
up is right only where they happen to be equal.  Three checks:

1. the groups form a grid: for each dimension, ``world_size // degree`` groups of ``degree`` ranks (ints) that
   together hold every rank once, and no two ranks share two groups (two ranks in one TP group differ in their
   tp coordinate only, so they cannot also share a DP or a PP group);
2. every TP group stays inside one node: with 8 GPUs a node (and with 4, where the group fits), its ranks
   ``r`` have the same ``r // gpus``: ``torchrun``'s numbering, node by node;
3. the groups are Megatron's: ``rank = (pp * dp_size + dp) * tp_size + tp``, compared as sets (the order of
   the groups and inside them does not count).

An order with dp fastest is a grid but sends TP across nodes (checks 2 and 3 fail); picotron's grid,
``arange(world_size).view(dp, pp, tp)``, keeps TP inside a node but is not Megatron's (check 3 fails).
:mod:`labkit.grading.guard` forbids labkit's own layout (``labkit.mesh``: ``mesh_groups`` is this exercise's
answer) and torch's ``DeviceMesh``.
"""

from __future__ import annotations

from labkit.grading import CheckFailed, guard

# (world_size, dp, tp, pp): the first failing layout is the one reported, so the common cube comes first.
LAYOUTS = [(8, 2, 2, 2), (24, 3, 4, 2), (16, 2, 4, 2), (12, 3, 2, 2), (16, 4, 2, 2), (18, 3, 2, 3), (8, 1, 2, 4),
           (8, 4, 1, 2), (8, 2, 4, 1), (32, 2, 8, 2), (64, 4, 8, 2), (6, 3, 1, 2), (8, 8, 1, 1), (8, 1, 8, 1),
           (8, 1, 1, 8), (1, 1, 1, 1)]
NODE_SIZES = (8, 4)  # GPUs per node
DIMS = ("tp", "dp", "pp")
BUILT_INS = ("torch.distributed.device_mesh",)  # labkit.mesh: in every check's guard (guard.LABKIT_IMPLEMENTATIONS)


def _layout(world_size: int, dp: int, tp: int, pp: int) -> str:
    return f"world_size={world_size}, dp={dp}, tp={tp}, pp={pp}"


def _reference(world_size: int, dp: int, tp: int, pp: int) -> dict[str, set[frozenset[int]]]:
    """Megatron's groups, written out here as sets (the hints quote them)."""
    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    return {"tp": {frozenset(rank(p, d, t) for t in range(tp)) for p in range(pp) for d in range(dp)},
            "dp": {frozenset(rank(p, d, t) for d in range(dp)) for p in range(pp) for t in range(tp)},
            "pp": {frozenset(rank(p, d, t) for p in range(pp)) for d in range(dp) for t in range(tp)}}


def _groups(module, world_size: int, dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The student's groups, of the promised types (``CheckFailed`` saying what came back otherwise)."""
    call = f"megatron_groups({_layout(world_size, dp, tp, pp)})"
    try:
        groups = module.megatron_groups(world_size, dp, tp, pp)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as error:
        raise CheckFailed(f"{call} raised {type(error).__name__}: {error}") from None
    if not isinstance(groups, dict) or set(groups) != set(DIMS):
        keys = sorted(map(repr, groups)) if isinstance(groups, dict) else None
        raise CheckFailed(f"{call} returned {type(groups).__name__}" + (f" with keys {', '.join(keys)}" if keys
                          else "") + '; return a dict with the keys "tp", "dp" and "pp"')
    for dim in DIMS:
        value = groups[dim]
        if not (isinstance(value, list) and all(isinstance(group, list) and all(
                isinstance(rank, int) and not isinstance(rank, bool) for rank in group) for group in value)):
            raise CheckFailed(f'{call}["{dim}"] is {value!r:.120}; each dimension is a list of groups, each group '
                              "a list of global ranks (ints)")
    return groups


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_the_groups_form_a_grid(module) -> None:
    """each dimension's groups hold every rank once, in groups of its degree, and no two ranks share two groups"""
    for layout in LAYOUTS:
        world_size, dp, tp, pp = layout
        groups = _groups(module, *layout)
        degrees = {"tp": tp, "dp": dp, "pp": pp}
        for dim in DIMS:
            sizes = sorted({len(group) for group in groups[dim]})
            if len(groups[dim]) != world_size // degrees[dim] or sizes != [degrees[dim]]:
                raise CheckFailed(f"{_layout(*layout)}: {len(groups[dim])} {dim.upper()} group(s) of sizes {sizes}; "
                                  f"expected world_size // {dim} = {world_size // degrees[dim]} groups of {dim} = "
                                  f"{degrees[dim]} ranks (first group: {groups[dim][0] if groups[dim] else []})")
            ranks = sorted(rank for group in groups[dim] for rank in group)
            if ranks != list(range(world_size)):
                twice = sorted({rank for rank in ranks if ranks.count(rank) > 1})
                missing = sorted(set(range(world_size)) - set(ranks))
                raise CheckFailed(f"{_layout(*layout)}: the {dim.upper()} groups hold " + (
                    f"rank(s) {twice[:8]} more than once" if twice else "") + (" and " if twice and missing else "")
                    + (f"not rank(s) {missing[:8]}" if missing else "") + (
                    f"; ranks outside 0..{world_size - 1}" if not twice and not missing else "")
                    + ": each rank belongs to one group of each dimension")
        shared: dict[tuple[int, int], str] = {}
        for dim in DIMS:
            for group in map(sorted, groups[dim]):
                for i, a in enumerate(group):
                    for b in group[i + 1:]:
                        if (a, b) in shared:
                            raise CheckFailed(
                                f"{_layout(*layout)}: ranks {a} and {b} share a {shared[a, b].upper()} group and a "
                                f"{dim.upper()} group; two ranks of one group differ in that dimension's "
                                "coordinate only, so they share no other group")
                        shared[a, b] = dim


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_every_tp_group_stays_inside_a_node(module) -> None:
    """every TP group stays inside one node of 8 and of 4 GPUs (ranks numbered node by node)

    TP's all-reduces run in every layer, on the critical path: a group split over two nodes would run them at
    the network's speed."""
    for layout in LAYOUTS:
        world_size, dp, tp, pp = layout
        groups = _groups(module, *layout)
        for gpus in NODE_SIZES:
            if tp > gpus or world_size % gpus:
                continue
            for group in groups["tp"]:
                nodes = sorted({rank // gpus for rank in group})
                if len(nodes) > 1:
                    raise CheckFailed(
                        f"{_layout(*layout)}, {gpus} GPUs a node: the TP group {sorted(group)} spans nodes {nodes} "
                        f"(rank r is on node r // {gpus}); TP all-reduces activations in every layer, so its "
                        "ranks must be neighbours: tp varies fastest, rank = (pp * dp_size + dp) * tp_size + tp")


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_the_groups_are_megatrons(module) -> None:
    """the groups are Megatron's, rank = (pp * dp_size + dp) * tp_size + tp, for degrees that differ too"""
    for layout in LAYOUTS:
        groups = _groups(module, *layout)
        expected = _reference(*layout)
        for dim in DIMS:
            found = {frozenset(group) for group in groups[dim]}
            if found != expected[dim]:
                wrong = min((sorted(group) for group in groups[dim] if frozenset(group) not in expected[dim]),
                            default=[])
                right = min(sorted(group) for group in expected[dim] - found)
                raise CheckFailed(f"{_layout(*layout)}: your {dim.upper()} groups include {wrong}, where Megatron's "
                                  f"include {right} (all: {sorted(sorted(group) for group in expected[dim])[:6]}"
                                  f"{' ...' if len(expected[dim]) > 6 else ''}); rank = (pp * dp_size + dp) * "
                                  "tp_size + tp: tp steps by 1, dp by tp_size, pp by dp_size * tp_size")


CHECKS = [check_the_groups_form_a_grid, check_every_tp_group_stays_inside_a_node, check_the_groups_are_megatrons]
