"""Exercise 10 — 3D parallelism: lay the ranks out in any order, and see which groups leave the node.

3D parallelism runs ``tp``-way tensor parallelism inside ``pp`` pipeline stages, and ``dp`` replicas of that
whole pipeline: ``dp * tp * pp`` ranks, each with one coordinate per dimension.  The ranks that differ from a
rank in one coordinate only form its *group* of that dimension: TP all-reduces activations in every layer, PP
passes activations and their gradients from stage to stage, DP reduces the gradients once a step.

Which global rank gets which coordinates is a choice, the **order**: the dimensions named innermost (fastest
varying) first, joined by ``-``, as Megatron-Core's ``initialize_model_parallel(order="tp-cp-ep-dp-pp")`` names
them.  In ``"tp-dp-pp"`` (labkit's ``Mesh``, the lesson's layout) the coordinates are the digits of the rank
written in a mixed radix, tp's digit lowest::

    rank = tp + tp_size * (dp + dp_size * pp)

and in ``"dp-tp-pp"`` dp's digit is the lowest.  ``torchrun`` puts ``gpus_per_node`` consecutive ranks on each
node (rank ``r`` on node ``r // gpus_per_node``), so the order decides which groups stay on a node's NVLink and
which wait on the network between nodes.  The lesson printed Megatron's order; this exercise asks what any
other order does.

Complete ``coordinates``, ``groups`` and ``nodes_spanned``, then run the try-it cell and the grading cell of
``notebooks/10_3d_parallelism.ipynb`` (or ``labkit grade``).  The checks try several orders and sizes (1 to 64
ranks, degrees that differ, a degree of 3 on nodes of 4, a fourth dimension ``cp``), two cases drawn at random
each time (up to five dimensions), and node sizes that do not divide the groups; coordinates are ints, a group
any list, tuple or set of ints, and the ``sizes`` you are given stay as they were.  While they run, labkit's own layout (``labkit.mesh``, ``labkit.viz.mesh_plots.group_links``)
and torch's ``DeviceMesh`` are switched off.
"""

from __future__ import annotations

import math  # noqa: F401 (math.prod multiplies the sizes)


def coordinates(rank: int, sizes: dict[str, int], order: str) -> dict[str, int]:
    """The coordinates of global rank ``rank`` (``0 <= rank < `` the product of ``sizes``): ``{dim: index}`` for
    every dimension of ``sizes`` (e.g. ``{"tp": 8, "dp": 2, "pp": 4}``), when the ranks are laid out in
    ``order`` (its dimensions, innermost first, joined by ``-``: ``"tp-dp-pp"``; it names every dimension of
    ``sizes`` once, and may have more than three)."""
    # TODO: read the rank as a number in a mixed radix, the innermost dimension's digit lowest: that digit is
    #       what is left over after dividing by that dimension's size, and the quotient holds the other digits.
    #       Check: in "tp-dp-pp" with {"tp": 2, "dp": 2, "pp": 2}, rank 5 is pp 1, dp 0, tp 1 (section 1's table).
    raise NotImplementedError("coordinates")


def groups(sizes: dict[str, int], order: str) -> dict[str, list[list[int]]]:
    """Every group of every dimension: ``{dim: [group, ...]}``, a group being the global ranks (ints) whose
    coordinates differ in ``dim`` only; ``world_size // sizes[dim]`` groups of ``sizes[dim]`` ranks each.  The
    order of the groups, and of the ranks inside one, does not matter."""
    # TODO: two ranks share a group of ``dim`` when all their *other* coordinates are equal: collect the ranks
    #       under those other coordinates (``coordinates`` gives them).  In "tp-dp-pp" the TP groups are runs of
    #       neighbouring ranks; in another order they are not.
    raise NotImplementedError("groups")


def nodes_spanned(sizes: dict[str, int], order: str, gpus_per_node: int) -> dict[str, int]:
    """For each dimension, the most nodes that one of its groups spans, with ``gpus_per_node`` consecutive ranks
    to a node: 1 when every group of that dimension stays inside one node (its traffic on NVLink), more when
    some group waits on the network between nodes."""
    # TODO: the node of a rank is the one torchrun puts it on; count the distinct nodes of each group.  A group
    #       of 3 ranks can span two nodes of 4, and a group of 2 ranks a stride apart can span two nodes of 8.
    raise NotImplementedError("nodes_spanned")
