"""Exercise 12 (the first of two) — the divergence alarm's loss test (solution).

See ``exercises/12_divergence_alarm.py``."""

import itertools
import math
import statistics
from collections.abc import Sequence


def deviations(losses: Sequence[float]) -> list[float]:
    """Each rank's loss minus the mean of the other ranks' losses (one check, at least two ranks)."""
    total, others = sum(losses), len(losses) - 1
    return [loss - (total - loss) / others for loss in losses]


def loss_band(rows: Sequence[Sequence[float]], window: int, z: float) -> tuple[float, float] | None:
    """``(sigma, limit)``: the noise of one check's deviation and the band ``z sigma / sqrt(window)``; ``None``
    when the deviations never change."""
    changes = [(now - before) ** 2 for previous, current in itertools.pairwise(rows)
               for before, now in zip(previous, current, strict=True)]
    sigma = math.sqrt(statistics.fmean(changes) / 2)  # E[(d2 - d1)^2] = 2 sigma^2 for independent d1, d2
    if sigma == 0:
        return None
    return sigma, z * sigma / math.sqrt(window)


def departed(rows: Sequence[Sequence[float]], window: int, limit: float) -> tuple[int, ...]:
    """The columns the alarm names: the rank whose mean over the last ``window`` rows is furthest from 0, if beyond
    ``limit`` (with two ranks: both); else ``()``."""
    recent = list(rows)[-window:]
    means = [statistics.fmean(column) for column in zip(*recent, strict=True)]
    furthest = max(range(len(means)), key=lambda rank: abs(means[rank]))
    if abs(means[furthest]) <= limit:
        return ()
    return (furthest,) if len(means) > 2 else tuple(range(len(means)))
