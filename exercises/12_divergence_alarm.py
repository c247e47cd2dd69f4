"""Exercise 12 (the first of two) — the divergence alarm's loss test.

Every check, each data-parallel rank reports the loss of its own batch.  The losses differ by batch noise, and by
nothing else when the run is healthy; a rank fed differently (a data bug, a shifted label) drifts away from the
others, slowly, within that noise.  Lesson 12's alarm decides which rank left, and when, in three steps.  Write
them:

1. ``deviations(losses)``: one check.  Each rank's loss minus the mean of the *other* ranks' losses.  (Why not
   the mean of all of them?  A rank's own loss would pull that mean towards itself.)
2. ``loss_band(rows, window, z)``: the noise of one check's deviation, ``sigma``, and the band ``limit`` a rank's
   mean over ``window`` checks may not leave.  ``rows`` holds the kept checks' deviations, oldest first, one
   column per rank.  Measure ``sigma`` from how much each rank's deviation *changes* from one check to the next
   (von Neumann's mean square successive difference): a rank with a steady offset has a large spread of deviations
   but small changes, so its offset must not widen its own band.  If consecutive deviations ``d1, d2`` are
   independent with standard deviation ``sigma``, what is the mean of ``(d2 - d1) ** 2``?  Average the squared
   changes over every rank and every pair of consecutive checks.  The mean of ``window`` independent deviations
   has a standard error ``sigma / sqrt(window)``; the band is ``z`` of those.  Return ``None`` when nothing ever
   changes (``sigma`` is 0: there is no noise to measure a band by).
3. ``departed(rows, window, limit)``: the ranks (column indices) the alarm names.  Average each rank's deviations
   over the last ``window`` rows only (an offset that began late is diluted in a longer average).  Take the rank
   furthest from 0, above or below; if it lies beyond ``limit`` (strictly), name it alone: the others' mean
   carries a share of its offset into every other rank's deviation, so the healthy ranks can cross the band too.
   With exactly two ranks the deviations are mirror images and which rank left cannot be told: name both.
   Otherwise name nobody.

What comes back: ``deviations`` a list of floats, one per rank; ``loss_band`` a tuple of two floats or ``None``;
``departed`` a tuple of ints (possibly empty).  ``rows`` may be any sequence of rows, a ``collections.deque`` (what
the alarm keeps) included, and nothing you receive may be modified.  Plain Python (``statistics``, ``math``) is
all it takes.

Then run the grading cell of ``notebooks/12_monitoring_and_input_pipeline.ipynb`` (or ``labkit grade``).  While the
checks run, ``labkit.monitor`` (the lesson's own alarm) is switched off: the answer must be yours.
"""

from collections.abc import Sequence


def deviations(losses: Sequence[float]) -> list[float]:
    """Each rank's loss minus the mean of the other ranks' losses (one check, at least two ranks)."""
    # TODO: one number per rank. The others' mean needs no loop over the others: what is left of the sum of all the
    #       losses without this rank's, and how many losses is that?
    raise NotImplementedError("deviations")


def loss_band(rows: Sequence[Sequence[float]], window: int, z: float) -> tuple[float, float] | None:
    """``(sigma, limit)``: the noise of one check's deviation and the band ``z sigma / sqrt(window)``; ``None``
    when the deviations never change."""
    # TODO: collect (now - before) ** 2 for each rank and each pair of consecutive rows; sigma follows from their
    #       mean (what is E[(d2 - d1) ** 2] for independent d1, d2 of standard deviation sigma?).
    raise NotImplementedError("loss_band")


def departed(rows: Sequence[Sequence[float]], window: int, limit: float) -> tuple[int, ...]:
    """The columns the alarm names: the rank whose mean over the last ``window`` rows is furthest from 0, if beyond
    ``limit`` (with two ranks: both); else ``()``."""
    # TODO: a mean per rank over the last `window` rows only; which rank is furthest from 0, either way; is it
    #       beyond the limit; and what can two ranks' mirror-image deviations not tell you?
    raise NotImplementedError("departed")
