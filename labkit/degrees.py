"""The parallel degrees, checked in one place: how many ranks each dimension of a layout spans.

A degree reaches labkit from many doors — ``--cp 4`` on the trainer's command line, ``Mesh(cp=4)``,
``parallelize(..., Mesh)``, a cost-model ``Layout(cp=4)``, ``labkit plan --cp 4``, a published run's table, a
formula's ``tp_degree`` — and every door calls :func:`check_degree` (or :func:`check_degrees`, :func:`check_ep`)
before it uses one, so that a bad value is the same ``ValueError``, naming the flag or argument and the value,
before any process starts; the code behind the door trusts what came through.  (torchtitan's ``ParallelDims``
does the same for its mesh.)  What a degree must divide (the heads, the layers, the experts, the sequence) is
the business of the technique it splits, and is checked there.

=======  ==========================================================  =============================================
degree   what it counts                                              folded over
=======  ==========================================================  =============================================
``dp``   data-parallel replicas (with ZeRO or FSDP: shards)
``tp``   ranks that split each layer's matrices (Megatron-LM)
``pp``   pipeline ranks, each holding a run of layers (its stages)
``cp``   ranks that share one sequence (context parallelism)
``ep``   ranks the experts of an MoE layer are split over           ``dp x cp``: it adds no rank of its own
=======  ==========================================================  =============================================

This module needs no process group: the layer below everything else (``tests/test_layout.py``).
"""

from __future__ import annotations

from typing import Any

MEANINGS = {"dp": "data-parallel replicas", "tp": "ranks splitting each layer's matrices",
            "pp": "pipeline ranks", "cp": "ranks sharing one sequence", "ep": "ranks the experts are split over"}


def check_degree(name: str, value: Any, label: str | None = None) -> int:
    """``value`` as the degree ``name`` (a key of :data:`MEANINGS`, or a formula's argument such as
    ``tp_degree``): an integer >= 1, else ``ValueError`` naming ``label`` (``name`` by default; ``"--cp"`` for a
    flag) and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        meaning = MEANINGS.get(name.removesuffix("_degree"), "a number of ranks")
        raise ValueError(f"{label or name} must be an integer >= 1, got {value!r} ({meaning})")
    return value


def check_degrees(dp: Any = 1, tp: Any = 1, pp: Any = 1, cp: Any = 1, labels: dict[str, str] | None = None
                  ) -> dict[str, int]:
    """:func:`check_degree` for each of ``dp, tp, pp, cp``; returns them by name, outermost first (``pp, dp,
    cp, tp``, the mesh's order).  ``labels``: how to name each in an error (``{"cp": "--cp"}``)."""
    labels = labels or {}
    given = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    return {name: check_degree(name, value, labels.get(name)) for name, value in given.items()}


def check_ep(ep: Any, dp: int, cp: int = 1, label: str | None = None) -> int:
    """``ep`` a degree that divides ``dp * cp`` (expert parallelism is folded over those ranks); ``ValueError``
    naming it."""
    check_degree("ep", ep, label)
    if (dp * cp) % ep:
        raise ValueError(f"expert parallelism is folded over the dp x cp ranks: {label or 'ep'}={ep} must divide "
                         f"dp * cp = {dp} * {cp} = {dp * cp}")
    return ep
