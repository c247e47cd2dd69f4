"""Exercise 03 — the learning rate for a large batch: the linear scaling rule, warmup and cosine decay.

Data parallelism multiplies the batch: ``world_size`` ranks each take ``per_rank_batch`` samples, and gradient
accumulation adds ``accumulation_steps`` micro-batches before every optimizer step.  The *global batch* — the
number of samples averaged into one update — is the product of all three.

The **linear scaling rule** (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): a learning rate ``base_lr``
that works for a batch of ``base_batch`` samples becomes ``base_lr * global_batch / base_batch``.  Because a
large rate diverges in the first steps, it is reached by a **linear warmup**, starting from
``warmup_start_factor`` times the scaled rate, and afterwards it **decays along a cosine** to 0.

Conventions (the same as ``labkit.lr``): ``step`` counts the optimizer steps already taken, so step 0 is
the first update.  With ``peak`` the scaled rate, ``w = warmup_steps``, ``s = warmup_start_factor`` and
``T = total_steps``::

    step <  w:   lr = peak * (s + (1 - s) * step / w)                         (s * peak at step 0)
    step >= w:   lr = peak * (1 + cos(pi * (step - w) / (T - w))) / 2         (peak at step w, 0 at step T)

``lr_at`` is only asked about steps ``0 <= step <= T``, with ``0 <= w < T``.

Complete the three functions, then run the grading cell of ``notebooks/03_batch_size_and_lr.ipynb`` (or
``labkit grade``).  The checks compare your numbers with a reference on many runs: several world sizes,
accumulation steps, warmup lengths and start factors.  While they run, labkit's own schedule (``labkit.lr``)
is switched off: the answer must be yours.
"""

import math  # noqa: F401  (you will need it)


def global_batch(per_rank_batch: int, world_size: int, accumulation_steps: int) -> int:
    """The number of samples whose gradients are averaged into one optimizer step."""
    # TODO: every rank's batch, on every rank, for every accumulated micro-batch.
    raise NotImplementedError("global_batch")


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: ``base_lr`` worked for ``base_batch`` samples; the rate for ``global_batch``."""
    # TODO: k times the batch, k times the learning rate.
    raise NotImplementedError("scaled_lr")


def lr_at(step: int, *, base_lr: float, base_batch: int, per_rank_batch: int, world_size: int,
          accumulation_steps: int, warmup_steps: int, warmup_start_factor: float, total_steps: int) -> float:
    """The learning rate of optimizer step ``step``: linear warmup to the scaled rate, then cosine decay to 0."""
    # TODO: peak = scaled_lr(...) of global_batch(...); then the two formulas in the module docstring.
    #       Check your ends: step 0 gives warmup_start_factor * peak, step warmup_steps gives the peak.
    raise NotImplementedError("lr_at")
