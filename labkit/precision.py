"""Mixed precision: number formats, the autocast policy, fp32 master weights and a dynamic loss scaler.

**Formats.**  A floating-point number is ``sign x 1.mantissa x 2^exponent``.  The exponent bits set the
*range*, the mantissa bits the *precision* (machine epsilon ``2^-mantissa_bits``: the gap after 1.0):

========  ========  ========  ===========  ==============  ==================  =========
format    exponent  mantissa  largest      smallest normal  smallest subnormal  epsilon
========  ========  ========  ===========  ==============  ==================  =========
fp32      8         23        3.4e38       1.2e-38         1.4e-45             1.2e-7
fp16      5         10        65504        6.1e-5          6.0e-8              9.8e-4
bf16      8         7         3.4e38       1.2e-38         9.2e-41             7.8e-3
========  ========  ========  ===========  ==============  ==================  =========

(:func:`format_table` prints these from ``torch.finfo``.)  Below the smallest normal number a format has
*subnormals*, which trade precision for range down to the smallest subnormal; anything smaller becomes 0.
bf16 keeps fp32's 8 exponent bits, so whatever fits in fp32 fits in bf16, only coarser; fp16 has 3 more
mantissa bits than bf16 but its range ends at 65504 above and 6e-8 below.

**Why gradients vanish in fp16.**  A mean loss over ``B`` tokens hands each token ``1/B`` of the gradient, and
gradient accumulation over ``k`` micro-batches another ``1/k``; many gradient values of a healthy model lie
below 6e-8 and become 0 in fp16.  :func:`gradient_underflow` measures it on a real model: it computes the
gradients in fp32, in fp16 autocast, in fp16 autocast with the loss multiplied by a scale ``S``, and in bf16
autocast, and reports the fraction that vanished.  Multiplying the loss by ``S`` multiplies every gradient
by ``S`` (backpropagation is linear), lifting small values into fp16's range; dividing by ``S`` afterwards,
in fp32, undoes it ("Mixed Precision Training", Micikevicius et al., ICLR 2018).  Too large an ``S`` and the
largest values overflow to ``inf`` instead.

**Autocast policy** (:func:`autocast_dtype`).  ``torch.autocast`` runs matrix multiplications in the low
precision and keeps precision-sensitive operations (softmax, norms, losses, reductions) in fp32; the
parameters stay fp32.  On a CPU the low precision is bf16 (fp16 CPU kernels are slow and need scaling); on a
GPU it is bf16 where supported (Ampere and later) and fp16 otherwise.  bf16 needs no loss scaling; fp16 does.

**fp32 master weights** (:class:`MasterWeights`).  When the *model itself* is cast to 16 bits (halving weight
and gradient memory), the update ``lr * g`` is often below half an ulp of the weight (bf16 spacing near 1.0
is 0.0078) and adding it changes nothing.  So the optimizer steps an fp32 *master* copy of every weight, and
the model's weights are the master's values cast down after each step.  Bytes per parameter with Adam
(the ZeRO paper's accounting, Rajbhandari et al. 2020)::

    fp32 training:    4 (weight) + 4 (gradient) + 4 + 4 (Adam's two moments)                 = 16
    mixed precision:  2 (weight) + 2 (gradient) + 4 (master) + 4 + 4 (moments, in fp32)       = 16

Mixed precision saves no model-state memory: the "2 + 2 + 12" buys speed (16-bit math and half the bytes
moved per weight read) and halves *activation* memory; ZeRO then shards the 12.  During the step the fp32
gradients exist too (4 more bytes per parameter, briefly; real implementations convert bucket by bucket).
``labkit.costmodel.memory`` measures all of this.

**Dynamic loss scaling** (:class:`DynamicLossScaler`), the algorithm of ``torch.amp.GradScaler``:

1. ``scale(loss)`` multiplies the loss by the current scale ``S`` before ``backward()``;
2. ``unscale_(optimizer)`` multiplies every gradient by ``1/S`` and records whether any was ``inf`` or ``nan``;
3. ``step(optimizer)`` calls ``optimizer.step()`` only if none was: an overflowed step is *skipped*;
4. ``update()`` halves ``S`` after an overflow (``backoff_factor``) and doubles it after ``growth_interval``
   consecutive good steps (``growth_factor``); the good-step counter restarts after either.

So ``S`` settles just below the largest scale that does not overflow, probing upwards every
``growth_interval`` steps at the price of one skipped step.  The scale is rounded to float32 after every
change, as GradScaler keeps it in a float32 tensor, so the two produce the same scale sequence and skip the
same steps.  GradScaler keeps the overflow flag on the device so nothing waits for the GPU until ``update``;
this scaler reads it once per step (``.item()``), which costs one host-device synchronisation on a GPU.

**Under data parallelism** every rank must skip the same steps, or the replicas diverge.  With plain DDP
this holds by itself: the gradient all-reduce spreads an ``inf`` to every rank (``inf + x = inf``).  It does
not when ranks check *different* gradients (ZeRO-2/3 shards, tensor-parallel slices), so ``unscale_``
all-reduces the flag (``MAX``, 4 bytes) over the process group, as PyTorch's ``ShardedGradScaler`` does.
Every rank must therefore call ``unscale_``/``step`` the same number of times.

**Speed** (``labkit.measure.time_step``).  On a GPU, 16-bit matrix multiplications run on tensor cores at several times
the fp32 rate.  On a CPU the answer depends on the instruction set (AVX-512 BF16 / AMX speed bf16 up; without
them bf16 is emulated and can be *slower* than fp32): measure, do not assume.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from labkit import dist

# --------------------------------------------------------------------------------------------------------
# Formats


@dataclass
class FloatFormat:
    """One floating-point format's facts, from ``torch.finfo``."""

    name: str
    dtype: torch.dtype
    bits: int
    exponent_bits: int
    mantissa_bits: int  # stored fraction bits (the leading 1 is implicit)
    max: float
    smallest_normal: float
    smallest_subnormal: float
    epsilon: float  # gap between 1.0 and the next number: 2^-mantissa_bits


def float_format(dtype: torch.dtype) -> FloatFormat:
    info = torch.finfo(dtype)
    mantissa_bits = -int(math.log2(info.eps))
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
    return FloatFormat(name=names.get(dtype, str(dtype)), dtype=dtype, bits=info.bits,
                       exponent_bits=info.bits - 1 - mantissa_bits, mantissa_bits=mantissa_bits, max=info.max,
                       smallest_normal=info.smallest_normal, smallest_subnormal=info.smallest_normal * info.eps,
                       epsilon=info.eps)


def format_table(dtypes: Iterable[torch.dtype] = (torch.float32, torch.float16, torch.bfloat16)) -> str:
    """The table in this module's docstring, computed from ``torch.finfo``."""
    lines = [f"{'format':<7}{'exponent':>9}{'mantissa':>9}{'largest':>11}{'smallest normal':>17}"
             f"{'smallest subnormal':>20}{'epsilon':>10}"]
    for fmt in map(float_format, dtypes):
        lines.append(f"{fmt.name:<7}{fmt.exponent_bits:>9}{fmt.mantissa_bits:>9}{fmt.max:>11.3g}"
                     f"{fmt.smallest_normal:>17.3g}{fmt.smallest_subnormal:>20.3g}{fmt.epsilon:>10.3g}")
    return "\n".join(lines)


def underflow_fraction(tensor: torch.Tensor, dtype: torch.dtype) -> float:
    """Fraction of ``tensor``'s nonzero values that become exactly 0 when cast to ``dtype``."""
    nonzero = tensor != 0
    if not nonzero.any():
        return 0.0
    return ((tensor.to(dtype) == 0) & nonzero).sum().item() / nonzero.sum().item()


def overflow_fraction(tensor: torch.Tensor, dtype: torch.dtype) -> float:
    """Fraction of ``tensor``'s finite values that become ``inf`` when cast to ``dtype``."""
    finite = torch.isfinite(tensor)
    if not finite.any():
        return 0.0
    return ((~torch.isfinite(tensor.to(dtype))) & finite).sum().item() / finite.sum().item()


@dataclass
class GradientPrecision:
    """How one precision's gradients compare with fp32's (see :func:`gradient_underflow`)."""

    vanished: float  # fraction of the nonzero fp32 gradient values that came out exactly 0
    relative_error: float  # sum |g - g_fp32| / sum |g_fp32| (inf when a value overflowed)
    overflowed: bool  # some gradient value is inf or nan


def gradient_underflow(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
                       scale: float = 2.0 ** 16) -> dict[str, GradientPrecision]:
    """Compute ``model``'s gradients of ``loss_fn(model)`` in fp16, fp16 with loss scale ``scale`` and bf16
    autocast, and compare each with fp32's.  Returns ``{"fp16": ..., "fp16_scaled": ..., "bf16": ...}``.

    ``model`` must be fp32 (its parameters; autocast lowers the computations).  Its ``.grad`` are left ``None``.
    """
    device_type = next(model.parameters()).device.type

    def gradients(dtype: torch.dtype | None, loss_scale: float) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = loss_fn(model)
        (loss.float() * loss_scale).backward()  # the scaling happens in fp32, as with GradScaler
        flat = torch.cat([parameter.grad.flatten().float() for parameter in model.parameters()
                          if parameter.grad is not None])
        return flat / loss_scale

    reference = gradients(None, 1.0)
    nonzero = reference != 0
    report = {}
    for name, dtype, loss_scale in (("fp16", torch.float16, 1.0), ("fp16_scaled", torch.float16, scale),
                                    ("bf16", torch.bfloat16, 1.0)):
        got = gradients(dtype, loss_scale)
        overflowed = not torch.isfinite(got).all().item()
        vanished = ((got == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1)
        error = math.inf if overflowed else ((got - reference).abs().sum() / reference.abs().sum()).item()
        report[name] = GradientPrecision(vanished, error, overflowed)
    model.zero_grad(set_to_none=True)
    return report


# --------------------------------------------------------------------------------------------------------
# The autocast policy


def autocast_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The low precision to compute in on ``device`` (default: ``labkit.dist.device()``): bf16 on a CPU and on
    GPUs that support it, fp16 on older GPUs (which then need a loss scaler)."""
    device = torch.device(device) if device is not None else dist.device()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def needs_loss_scaling(dtype: torch.dtype) -> bool:
    """fp16's range ends at 6e-8, so small gradients vanish without a scaler; bf16's and fp32's do not."""
    return dtype == torch.float16


def autocast(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.autocast:
    """``torch.autocast`` for ``device`` (default: ``labkit.dist.device()``) in ``dtype`` (default: the policy)."""
    device = torch.device(device) if device is not None else dist.device()
    return torch.autocast(device.type, dtype=dtype or autocast_dtype(device))


# --------------------------------------------------------------------------------------------------------
# fp32 master weights


class MasterWeights:
    """fp32 master copies of a low-precision model's parameters; build the optimizer on :meth:`parameters`.

    One training step::

        model = TinyGPT(config).to(torch.bfloat16)
        master = MasterWeights(model.parameters())
        optimizer = torch.optim.AdamW(master.parameters(), lr=1e-3)
        ...
        scaler.scale(loss).backward()          # bf16 gradients on the model
        master.step(optimizer, scaler)         # fp32 gradients -> unscale, step (or skip) -> weights cast down
        scaler.update()
        model.zero_grad(set_to_none=True)
    """

    def __init__(self, parameters: Iterable[nn.Parameter], master_dtype: torch.dtype = torch.float32):
        unique = {id(parameter): parameter for parameter in parameters if parameter.requires_grad}
        self.model_parameters: list[nn.Parameter] = list(unique.values())
        if not self.model_parameters:
            raise ValueError("MasterWeights got no parameter that requires a gradient")
        self.master_parameters: list[nn.Parameter] = [
            nn.Parameter(parameter.detach().to(master_dtype, copy=True)) for parameter in self.model_parameters]

    def parameters(self) -> list[nn.Parameter]:
        """The fp32 masters: what the optimizer updates."""
        return self.master_parameters

    def gradients_to_master(self) -> None:
        """Each master's ``.grad`` becomes its model parameter's gradient, cast up (a new fp32 tensor)."""
        for model_parameter, master in zip(self.model_parameters, self.master_parameters, strict=True):
            master.grad = None if model_parameter.grad is None else model_parameter.grad.to(master.dtype)

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Copy the masters into the model (rounded to its precision) and free the fp32 gradients."""
        for model_parameter, master in zip(self.model_parameters, self.master_parameters, strict=True):
            model_parameter.copy_(master)
            master.grad = None

    def step(self, optimizer: torch.optim.Optimizer, scaler: DynamicLossScaler | None = None) -> bool:
        """Gradients up, ``optimizer.step()`` through ``scaler`` (unscaling in fp32) if given, weights down.
        Returns whether the optimizer stepped.  ``scaler.update()`` is still the caller's."""
        self.gradients_to_master()
        if scaler is None:
            optimizer.step()
            stepped = True
        else:
            stepped = scaler.step(optimizer)
        self.master_to_model()
        return stepped


# --------------------------------------------------------------------------------------------------------
# The dynamic loss scaler


def _round_to_float32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


class DynamicLossScaler:
    """``torch.amp.GradScaler`` from scratch (see the module docstring); the same arguments and methods.

    Differences: :meth:`step` returns whether the optimizer stepped (GradScaler returns ``optimizer.step()``'s
    value), gradients of any dtype may be unscaled, and ``unscale_`` agrees on overflow with every rank of
    ``group`` when a process group exists (``sync_found_inf=False`` turns that off).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True,
                 group: torch_dist.ProcessGroup | None = None, sync_found_inf: bool = True):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.enabled = enabled
        self.group = group
        self.sync_found_inf = sync_found_inf
        self._scale = _round_to_float32(float(init_scale))
        self._growth_tracker = 0  # consecutive steps without overflow since the scale last changed
        self._found_inf: dict[int, torch.Tensor] = {}  # id(optimizer) -> 1.0 if it saw inf/nan (this step)
        self._stepped: set[int] = set()  # id(optimizer) of those that went through step() this step

    def is_enabled(self) -> bool:
        return self.enabled

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``: call ``.backward()`` on this instead of on the loss."""
        return loss * self._scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Multiply ``optimizer``'s gradients by ``1/S`` in place and record whether any was inf/nan (on any
        rank).  Call it yourself before gradient clipping; otherwise :meth:`step` does."""
        if not self.enabled:
            return
        if id(optimizer) in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        inverse_scale = _round_to_float32(1.0 / self._scale)
        found_inf = torch.zeros((), dtype=torch.float32)
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if parameter.grad.is_sparse:
                    raise TypeError("DynamicLossScaler unscales dense gradients only")
                found_inf = found_inf.to(parameter.grad.device)
                found_inf = torch.maximum(found_inf, parameter.grad.isfinite().logical_not().any().float())
                parameter.grad.mul_(inverse_scale)
        if self.sync_found_inf and dist.is_initialized():
            found_inf = found_inf.to(dist.device())
            torch_dist.all_reduce(found_inf, op=torch_dist.ReduceOp.MAX, group=self.group)
        self._found_inf[id(optimizer)] = found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not done yet) and call ``optimizer.step()`` unless a gradient overflowed.  Returns
        whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if id(optimizer) in self._stepped:
            raise RuntimeError("step() has already been called on this optimizer since the last update()")
        if id(optimizer) not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(id(optimizer))
        if self._found_inf[id(optimizer)].item() > 0:
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Back off after an overflow (in any optimizer this step), grow after ``growth_interval`` good steps."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("no inf checks were recorded before update(): call step(optimizer) first")
        found_inf = any(flag.item() > 0 for flag in self._found_inf.values())
        if found_inf:
            self._scale = _round_to_float32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = _round_to_float32(self._scale * self.growth_factor)
                if math.isfinite(grown):  # at float32's top the scale stays put
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf.clear()
        self._stepped.clear()

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys, so either scaler loads the other's checkpoint."""
        if not self.enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if not state_dict:
            raise RuntimeError("the state dict is empty: it was saved from a disabled scaler")
        self._scale = _round_to_float32(float(state_dict["scale"]))
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])
