"""Running a function on N ranks: the launcher and what it needs (DESIGN.md's runtime layer).

- ``launcher``: :func:`launch` — fork N ranks from a cell, a script or pytest (pass-through under ``torchrun``),
  gather their results, turn a failed or hung rank into :class:`RankFailed` / :class:`CollectiveTimeout`;
- ``worker``: what each forked rank runs (output, stack dumps, rendezvous, result or traceback back);
- ``record``: each rank's collectives, recorded in order as they are called;
- ``compare``: the ranks' records lined up, and the first place they disagree named.

``from labkit import launch; launch.launch(fn, nprocs=4)`` and ``from labkit.launch import launch`` both work.
"""

from labkit.launch.compare import CollectiveMismatch, Disagreement, check_collectives, first_disagreement
from labkit.launch.launcher import (
    RANK_OUTPUT_MODES,
    CollectiveTimeout,
    LaunchError,
    RankFailed,
    launch,
    prepare_to_fork,
)
from labkit.launch.record import Entry, read_log, record_collectives

__all__ = ["RANK_OUTPUT_MODES", "CollectiveMismatch", "CollectiveTimeout", "Disagreement", "Entry", "LaunchError",
           "RankFailed", "check_collectives", "first_disagreement", "launch", "prepare_to_fork", "read_log",
           "record_collectives"]
