"""Exercise 10 — 3D parallelism: the ranks of every tensor-, data- and pipeline-parallel group (solution).

3D parallelism runs ``tp``-way tensor parallelism inside ``pp`` pipeline stages, and ``dp`` replicas of that
whole pipeline: ``world_size = dp * tp * pp`` ranks.  Each rank has three coordinates ``(pp, dp, tp)``, and the
ranks that differ in only one coordinate form that dimension's *group*: a TP group holds the pieces of the same
layers (and all-reduces activations in every layer), a PP group the stages of one replica (activations pass
point to point from stage to stage), a DP group the copies of the same piece (they average gradients).

Which global rank sits where is a choice with a cost.  ``torchrun`` numbers the ranks node by node: with 8 GPUs
a node, ranks 0-7 share one node's NVLink and rank 8 is on the next node, behind a network link several times
slower.  TP talks most (four all-reduces of activations per layer, forward and backward, on the critical path),
so its groups must be neighbouring ranks; DP all-reduces the gradients once a step; PP sends the least.
**Megatron-LM's order** (also labkit's :class:`~labkit.mesh.Mesh` and torchtitan's) therefore makes tp vary
fastest and pp slowest::

    rank = (pp * dp_size + dp) * tp_size + tp

On 8 ranks with ``dp = tp = pp = 2``: TP groups ``[0, 1] [2, 3] [4, 5] [6, 7]``, DP groups ``[0, 2] [1, 3]
[4, 6] [5, 7]``, PP groups ``[0, 4] [1, 5] [2, 6] [3, 7]``.

Complete ``megatron_groups``, then run the grading cell of ``notebooks/10_3d_parallelism.ipynb`` (or
``labkit grade``).  The checks ask for the groups of many layouts (1 to 64 ranks, each dimension alone, degrees that
differ, like ``dp = 3, tp = 4, pp = 2``): that they form a grid at all (every rank once in a group of each
dimension, of the right size, two ranks sharing at most one group), that every TP group stays inside one node
of 8 (and of 4) GPUs, and that the groups are Megatron's.  While they run, labkit's ``Mesh`` and its layout
functions (``labkit.mesh``) and torch's ``DeviceMesh`` are switched off.
"""

from __future__ import annotations


def megatron_groups(world_size: int, dp: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """The groups of ``dp x tp x pp`` parallelism on ``world_size = dp * tp * pp`` ranks, laid out as Megatron
    lays them out (tp fastest, then dp, then pp): ``{"tp": groups, "dp": groups, "pp": groups}``, each a list
    of the dimension's groups (``world_size // tp`` TP groups of ``tp`` ranks, and so on), each group a list of
    global ranks (ints).  The order of the groups and of the ranks inside a group does not matter."""
    def rank(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    return {"tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
            "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)]}
