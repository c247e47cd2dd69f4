"""Activation checkpointing (recomputation): trade a second forward pass for the activations of whole blocks.

**Activation checkpointing** (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016) keeps only
each checkpointed block's *input* (``s b h`` values) and re-runs the block's forward during the backward pass
to rebuild the rest, one block at a time.  For ``L`` blocks with ``A`` bytes of activations each,
checkpointing all of them cuts ``L A`` to about ``L s b h x bytes + A``, at the price of a second forward
through them: at most a third more compute, since a backward costs about two forwards.  PyTorch's
non-reentrant checkpoint stops recomputing once every tensor the backward needs is rebuilt, so a block whose
last operation saves only its input (a linear layer) never re-runs it (lesson 04 counts the FLOPs).
:func:`checkpoint_blocks` applies it to the first ``count`` blocks (``torch.utils.checkpoint`` with
``use_reentrant=False``); recomputation is deterministic, so the gradients are the same bit for bit.

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022) show that most of a
block's activations are cheap to keep and the attention core (softmax, its dropout) is the expensive part to
store and the cheap part to recompute: *selective* recomputation of that core alone.  Fused attention kernels
(``scaled_dot_product_attention``'s flash path) already recompute it in their backward.  The analytical count
of what each choice keeps is ``labkit.costmodel.memory.activation_bytes``; ``labkit.measure.ActivationMeter``
measures it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: Sequence[nn.Module], count: int) -> None:
    """Make the first ``count`` of ``blocks`` (e.g. ``TinyGPT.blocks``) recompute their activations during
    backward; the others save them as usual.  ``count=0`` turns checkpointing off.

    Each checkpointed block's ``forward`` is replaced, on that instance only, by
    ``torch.utils.checkpoint.checkpoint(type(block).forward, block, ...)``: parameter names, ``state_dict``
    and the model's code are unchanged.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(blocks):
        raise ValueError(f"count must be an integer in [0, {len(blocks)}], got {count!r}")
    for index, block in enumerate(blocks):
        block.__dict__.pop("forward", None)  # back to the class's forward
        if index < count:
            block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=False)


def checkpointed_blocks(blocks: Sequence[nn.Module]) -> int:
    """How many of ``blocks``, from the first, :func:`checkpoint_blocks` has made recompute."""
    count = 0
    while count < len(blocks) and "forward" in blocks[count].__dict__:
        count += 1
    return count
