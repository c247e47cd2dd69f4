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
"""

from __future__ import annotations

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
