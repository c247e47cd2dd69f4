"""Exercise 03 — the learning rate for a large batch: the linear scaling rule, warmup and cosine decay (solution).

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
"""

import math


def global_batch(per_rank_batch: int, world_size: int, accumulation_steps: int) -> int:
    """The number of samples whose gradients are averaged into one optimizer step."""
    return per_rank_batch * world_size * accumulation_steps


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """The linear scaling rule: ``base_lr`` worked for ``base_batch`` samples; the rate for ``global_batch``."""
    return base_lr * global_batch / base_batch


def lr_at(step: int, *, base_lr: float, base_batch: int, per_rank_batch: int, world_size: int,
          accumulation_steps: int, warmup_steps: int, warmup_start_factor: float, total_steps: int) -> float:
    """The learning rate of optimizer step ``step``: linear warmup to the scaled rate, then cosine decay to 0."""
    peak = scaled_lr(base_lr, base_batch, global_batch(per_rank_batch, world_size, accumulation_steps))
    if step < warmup_steps:
        return peak * (warmup_start_factor + (1 - warmup_start_factor) * step / warmup_steps)
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return peak * (1 + math.cos(math.pi * progress)) / 2
