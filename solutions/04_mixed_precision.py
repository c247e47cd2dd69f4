"""Exercise 04 — the dynamic loss scaler: unscale, skip a step that overflowed, back off and grow (solution).

In fp16 many gradient values are smaller than 6e-8 and round to zero.  Multiplying the loss by a scale ``S``
multiplies every gradient by ``S`` and lifts them into range; dividing the gradients by ``S`` before the
optimizer step undoes it.  Too large an ``S`` makes the largest gradients overflow to ``inf`` (or ``nan``), so
a *dynamic* scaler adapts ``S`` during training, exactly as ``torch.amp.GradScaler`` does:

- after backward, unscale the gradients and look for ``inf``/``nan``;
- if there is one, *skip* the optimizer step (the gradients are garbage) and halve ``S``;
- otherwise step, and after ``growth_interval`` such good steps in a row double ``S`` (probing for a larger
  scale: fewer underflows); the count of good steps starts again from 0 after an overflow and after a growth.

One training step with these functions::

    (loss * scale).backward()
    stepped = scaled_step(optimizer, scale)
    scale, good_steps = update_scale(scale, not stepped, good_steps, growth_interval=...)
"""

import torch


def unscale_gradients(parameters: list[torch.nn.Parameter], scale: float) -> bool:
    """Divide the ``.grad`` of every parameter in ``parameters`` by ``scale``, in place — all of them, even after
    finding an overflow (skip a parameter whose ``.grad`` is ``None``).  Return ``True`` if any gradient holds an
    ``inf`` or a ``nan``, else ``False``."""
    found_inf = False
    for parameter in parameters:
        if parameter.grad is None:
            continue
        if not torch.isfinite(parameter.grad).all():
            found_inf = True
        parameter.grad.div_(scale)
    return found_inf


def scaled_step(optimizer: torch.optim.Optimizer, scale: float) -> bool:
    """Unscale the gradients of every parameter in every group of ``optimizer.param_groups`` (with
    ``unscale_gradients``), then call ``optimizer.step()`` only if none overflowed.  Return whether the optimizer
    stepped."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    found_inf = unscale_gradients(parameters, scale)
    if found_inf:
        return False
    optimizer.step()
    return True


def update_scale(scale: float, found_inf: bool, good_steps: int, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """The scale and good-step count for the next step, as ``(new_scale, new_good_steps)``.

    ``good_steps`` counts the steps without overflow since the scale last changed.  After an overflow
    (``found_inf``): multiply the scale by ``backoff_factor`` and restart the count at 0.  Otherwise this step is
    one more good step; when the count reaches ``growth_interval``, multiply the scale by ``growth_factor`` and
    restart the count at 0.  Example, ``growth_interval=2``, starting from ``(8.0, 0)``: a good step gives
    ``(8.0, 1)``, another ``(16.0, 0)``, a good one ``(16.0, 1)``, an overflow ``(8.0, 0)``.
    """
    if found_inf:
        return scale * backoff_factor, 0
    good_steps += 1
    if good_steps == growth_interval:
        return scale * growth_factor, 0
    return scale, good_steps
