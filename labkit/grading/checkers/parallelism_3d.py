"""Checks for exercise 10 (``10_3d_parallelism.py``): a mesh laid out in any order, and the nodes its groups span.

The student writes ``coordinates(rank, sizes, order)`` (the mixed-radix digits of a rank, the first dimension of
``order`` innermost, as Megatron-Core's ``order="tp-cp-ep-dp-pp"``), ``groups(sizes, order)`` and
``nodes_spanned(sizes, order, gpus_per_node)``.  :data:`CASES` mixes orders (labkit's ``"tp-dp-pp"``, dp or pp
innermost, tp outermost), sizes that differ (so that an answer that mixes two sizes up is right only where they
are equal), a degree of 1, a fourth dimension (``cp``) and a world of one rank; :data:`NODE_SIZES` includes
nodes that neither divide the world nor the groups (3 GPUs a node), where a group of 3 ranks straddles two nodes
and the last node is partly empty.  Three checks, one per function:

1. ``coordinates`` gives every rank of every case the reference's digits, as ints (so it is a bijection onto
   the grid);
2. ``groups`` gives, for every dimension, the reference's groups, compared as sets (the order of the groups and
   inside them does not count; a group may be a list, a tuple or a set of ints), after checking their count and
   sizes;
3. ``nodes_spanned`` gives, for every dimension and node size, the most nodes one of its groups spans.

Each check also draws two cases at random (3 to 5 dimensions, ``ep`` among them, degrees of 1 to 4, any order,
one more node size), so that no table of the fixed cases passes; none of the three may change the ``sizes`` it
is given.

Reading the order outermost first, dividing by the wrong dimension's size, grouping ranks by their own
coordinate instead of the others, counting nodes as ``ceil(len(group) / gpus_per_node)`` (as if groups were
aligned runs) or numbering nodes round robin each fail a check.  :mod:`labkit.grading.guard` forbids labkit's own
layout (``labkit.mesh``, which lays out ``"tp-dp-pp"``; ``labkit.viz.mesh_plots.group_links``), torch's ``DeviceMesh``
and the layout algebra under it (``torch.distributed._mesh_layout``, ``_pycute``), and this checker's own
reference (:func:`~labkit.grading.guard.graders_off_limits`).
"""

from __future__ import annotations

import math
import numbers
import random

from labkit.grading import CheckFailed, guard

# (sizes, order): the first failing case is the one reported, so the lesson's cube comes first.
CASES = [({"tp": 2, "dp": 2, "pp": 2}, "tp-dp-pp"), ({"tp": 4, "dp": 3, "pp": 2}, "tp-dp-pp"),
         ({"tp": 4, "dp": 3, "pp": 2}, "dp-tp-pp"), ({"tp": 8, "dp": 2, "pp": 4}, "tp-pp-dp"),
         ({"tp": 2, "dp": 4, "pp": 8}, "pp-dp-tp"), ({"tp": 3, "dp": 2, "pp": 2}, "tp-dp-pp"),
         ({"tp": 2, "dp": 3, "pp": 5}, "dp-pp-tp"), ({"tp": 1, "dp": 6, "pp": 1}, "tp-dp-pp"),
         ({"tp": 2, "cp": 2, "dp": 3, "pp": 2}, "tp-cp-dp-pp"), ({"tp": 1, "dp": 1, "pp": 1}, "tp-dp-pp")]
NODE_SIZES = (8, 4, 3)  # GPUs per node
BUILT_INS = ("torch.distributed.device_mesh", "torch.distributed._mesh_layout", "torch.distributed._pycute",
             "labkit.viz.mesh_plots.group_links")  # labkit.mesh: always
DIMENSIONS = ("tp", "cp", "ep", "dp", "pp")
RANDOM = random.SystemRandom()  # not the random module's state, which the student's file could seed


def _cases() -> list[tuple[dict[str, int], str]]:
    """:data:`CASES` and two drawn at random: 3 to 5 dimensions, ep among them (so none is one of theirs), degrees
    1 to 4, any order."""
    drawn = []
    while len(drawn) < 2:
        dims = ["ep", *RANDOM.sample([dim for dim in DIMENSIONS if dim != "ep"], RANDOM.randint(2, 4))]
        sizes = {dim: RANDOM.randint(1, 4) for dim in dims}
        order = "-".join(RANDOM.sample(dims, len(dims)))
        if 2 <= math.prod(sizes.values()) <= 128 and max(sizes.values()) > 1:
            drawn.append((sizes, order))
    return CASES + drawn


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _case(sizes: dict[str, int], order: str) -> str:
    return f"sizes={sizes}, order={order!r}"


def _digits(rank: int, sizes: dict[str, int], order: str) -> dict[str, int]:
    """The reference's coordinates (the hints quote them)."""
    found = {}
    for dim in order.split("-"):
        rank, found[dim] = divmod(rank, sizes[dim])
    return found


def _reference_groups(sizes: dict[str, int], order: str) -> dict[str, set[frozenset[int]]]:
    dims = order.split("-")
    found: dict[str, dict[tuple, set[int]]] = {dim: {} for dim in dims}
    for rank in range(math.prod(sizes.values())):
        where = _digits(rank, sizes, order)
        for dim in dims:
            found[dim].setdefault(tuple(where[o] for o in dims if o != dim), set()).add(rank)
    return {dim: {frozenset(group) for group in by_others.values()} for dim, by_others in found.items()}


def _call(module, name: str, *args):
    """The student's ``name(*args)`` (``CheckFailed`` saying what it raised, or that it changed ``sizes``)."""
    given = [dict(arg) if isinstance(arg, dict) else arg for arg in args]
    try:
        found = getattr(module, name)(*given)
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as error:
        raise CheckFailed(f"{name}{tuple(args)!r} raised {type(error).__name__}: {error}") from None
    if given != list(args):
        raise CheckFailed(f"{name}{tuple(args)!r} changed the sizes it was given (to {given[1 if name == 'coordinates' else 0]}): "
                          "the caller's dict is not yours to change; read it, or work on a copy")
    return found


def _mapping(value, call: str, keys, what: str) -> dict:
    if not isinstance(value, dict) or set(value) != set(keys):
        found = sorted(map(repr, value)) if isinstance(value, dict) else type(value).__name__
        raise CheckFailed(f"{call} returned {found!s:.120}; return a dict with one entry per dimension, "
                          f"{', '.join(map(repr, keys))}, each {what}")
    return value


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_coordinates(module) -> None:
    """coordinates(rank, sizes, order): every rank's digits, the first dimension of order innermost"""
    for sizes, order in _cases():
        for rank in range(math.prod(sizes.values())):
            call = f"coordinates({rank}, {sizes}, {order!r})"
            found = _mapping(_call(module, "coordinates", rank, sizes, order), call, sizes, "an int")
            expected = _digits(rank, sizes, order)
            if not all(_is_int(value) for value in found.values()):
                raise CheckFailed(f"{call} returned {found}: each coordinate is an int (an index into the grid), "
                                  "not a float: // and % (or divmod) keep ints")
            if found != expected:
                inner = order.split("-")[0]
                raise CheckFailed(
                    f"{call} returned {found}; expected {expected}. In {order!r} {inner} is innermost: its "
                    f"coordinate is rank % {sizes[inner]}, and rank // {sizes[inner]} holds the others, read the "
                    f"same way in the order's next dimension (rank = {_formula(sizes, order)})")


def _formula(sizes: dict[str, int], order: str) -> str:
    dims = order.split("-")
    text = dims[-1]
    for dim in reversed(dims[:-1]):
        text = f"{dim} + {sizes[dim]} * ({text})"
    return text


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_groups(module) -> None:
    """groups(sizes, order): each dimension's groups, the ranks that differ in that coordinate only"""
    for sizes, order in _cases():
        call = f"groups({sizes}, {order!r})"
        world_size = math.prod(sizes.values())
        found = _mapping(_call(module, "groups", sizes, order), call, sizes, "a list of groups")
        expected = _reference_groups(sizes, order)
        for dim, degree in sizes.items():
            value = found[dim]
            if not (isinstance(value, (list, tuple)) and all(isinstance(group, (list, tuple, set, frozenset))
                                                              and all(map(_is_int, group)) for group in value)):
                raise CheckFailed(f'{call}["{dim}"] is {value!r:.120}; each dimension is a list of groups, each '
                                  "group a list of global ranks (ints)")
            value = [[int(rank) for rank in group] for group in value]
            sizes_found = sorted({len(group) for group in value})
            if len(value) != world_size // degree or sizes_found != [degree]:
                raise CheckFailed(f'{call}["{dim}"]: {len(value)} group(s) of sizes {sizes_found}; expected '
                                  f"{world_size // degree} groups of {degree} ranks (world size {world_size} / "
                                  f"{dim} = {degree})")
            if {frozenset(group) for group in value} != expected[dim]:
                wrong = [sorted(group) for group in value if frozenset(group) not in expected[dim]]
                if not wrong:  # every group is right, but one comes twice and another is missing
                    missing = min(sorted(group) for group in expected[dim] - {frozenset(g) for g in value})
                    raise CheckFailed(f'{call}["{dim}"] repeats a group and misses {missing}')
                rank = min(min(wrong))
                right = sorted(next(group for group in expected[dim] if rank in group))
                raise CheckFailed(f'{call}["{dim}"] includes {min(wrong)}, where the {dim.upper()} group of rank '
                                  f"{rank} is {right}: the ranks whose coordinates other than {dim} equal rank "
                                  f"{rank}'s ({_digits(rank, sizes, order)})")


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_nodes_spanned(module) -> None:
    """nodes_spanned(sizes, order, gpus_per_node): the most nodes a group of each dimension spans (8, 4, 3 GPUs)"""
    for sizes, order in _cases():
        groups = _reference_groups(sizes, order)
        for gpus in (*NODE_SIZES, RANDOM.choice((2, 5, 6, 7))):
            call = f"nodes_spanned({sizes}, {order!r}, {gpus})"
            found = _mapping(_call(module, "nodes_spanned", sizes, order, gpus), call, sizes, "an int")
            for dim in sizes:
                spans = {group: len({rank // gpus for rank in group}) for group in groups[dim]}
                most = max(spans.values())
                if found[dim] != most or not _is_int(found[dim]):
                    widest = sorted(max(spans, key=spans.get))
                    raise CheckFailed(
                        f"{call}[{dim!r}] is {found[dim]!r}; expected {most}, the nodes of the widest {dim.upper()} "
                        f"group, {widest}: nodes {sorted({rank // gpus for rank in widest})} (torchrun puts rank r "
                        f"on node r // {gpus}; a group need not start at a node's first GPU, nor be consecutive)")


CHECKS = [check_coordinates, check_groups, check_nodes_spanned]
