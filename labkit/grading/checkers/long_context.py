"""Checks for exercise 13 (``13_long_context.py``): the LSE merge, the zig-zag split, blockwise attention.

Four checks, building up:

1. ``merge_partials`` is exact: partials over disjoint (scattered, not only contiguous) sets of keys merge into the
   attention over all of them, in fp64 to 1e-12, for tensors of 2 to 4 dimensions; in either order and folded over
   eight blocks; a query that saw no key in one part takes the other part whole, and one that saw none in either
   gets ``0`` and ``-inf``, never ``nan``; scores a thousand times larger than usual (``lse`` in the thousands) do
   not overflow.  Merging by the larger LSE only, adding or averaging the outputs, forgetting to rescale or
   exponentiating the LSEs directly all fail here.  It is then handed what a real caller has (:func:`_probe`):
   tensors laid out transposed, as ``.transpose(0, 1)`` leaves them (not contiguous: ``.view`` across the leading
   dimensions fails), in float32 (the result keeps the dtype) and on the ``meta`` device, which stands for a GPU (a tensor
   made without ``device=`` is on the CPU and fails there);
2. ``zigzag_positions`` over ``cp`` = 1 to 8 and lengths that ``2 cp`` divides and that it does not (padded at the
   end): every position of the padded sequence on exactly one rank, rank ``r`` holding chunk ``r`` then chunk
   ``2 cp - 1 - r``, every rank as many tokens and as much causal work.  A split right only for ``cp = 2`` (a
   mirror fixed at chunk 3), the contiguous split, padding to a multiple of ``cp`` only, or the chunks in the
   other order fail here.  The positions are taken as a caller takes them, never coerced: a list (tuple, range)
   of ints or a 1-D integer tensor; a generator (read once) or floats (no index) fail;
3. ``blockwise_attention``: causal attention equal to the textbook formula (fp64, 1e-10; out and lse) at block
   sizes that divide the sequence and that do not (37 tokens in blocks of 8, 5 in blocks of 64, blocks of 1), head
   sizes 5 and 12, on ``[s, d]``, ``[b, s, d]`` and ``[b, a, s, d]``, and with scores a thousand times the usual
   (an unshifted softmax overflows, a mask of -1e4 lets masked keys through); no tensor larger than ``q`` or the
   ``s x block`` scores of one block is formed, and none ``[..., s, n]`` wider than a block (``n`` not the head
   size): the whole ``s x s`` matrix fails, however it is masked afterwards, and so do blocks of another size than
   the one asked for; and ``merge_partials`` is called once a block of keys (at least ``blocks - 1`` times); then
   the same probes as the merge's (a ``.view`` of q, an ``arange`` or ``full`` without ``device=`` or with a
   fixed dtype fail);
4. ring attention from the three: for ``cp`` = 2, 3 and 4 and uneven lengths, each rank's queries at its zig-zag
   positions merge the partial results of every rank's keys, in ring order, into the whole sequence's attention.

While the checks run, :mod:`labkit.grading.guard` switches off ``labkit.parallel`` (its blockwise kernel, merge and
layouts), however its code is loaded again (:mod:`labkit.grading.copies`), and torch's :data:`BUILT_INS`: context
parallelism's head-tail load balancer (the zig-zag split), its SDPA merger and ring attention, and flex attention.
This checker refuses torch's fused attention too: ``F.scaled_dot_product_attention`` and every ``aten`` attention
kernel (flash, memory-efficient, cuDNN, flex), seen by a dispatch mode that also measures the largest tensor
created.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.grading import CheckFailed, copies, guard

FUSED_ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|flex_attention")
REASON = "torch's fused attention is switched off here: compute the scores, the mask and the softmax yourself"


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


# torch's own answers, refused by the guard: context parallelism's load balancers (head-tail: the zig-zag split),
# its SDPA merger and ring attention (torch 2.9 and later keep them in _context_parallel, earlier ones in
# _attention), and flex attention, which returns a block's LSE
BUILT_INS = tuple(name for name in ("torch.distributed.tensor.experimental._context_parallel",
                                    "torch.distributed.tensor.experimental._attention",
                                    "torch.nn.attention.flex_attention") if _exists(name))


class _Watch(TorchDispatchMode):
    """Refuses torch's fused attention kernels and records the largest tensor any operation creates, and the
    widest ``[..., seq_len, n]`` one whose last dimension is not the head size (scores over ``n`` keys)."""

    def __init__(self, seq_len: int = 0, head_dim: int = 0) -> None:
        super().__init__()
        self.numel, self.shape, self.widest = 0, (), ()
        self.seq_len, self.head_dim = seq_len, head_dim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if FUSED_ATTENTION.search(func.__name__):
            raise guard.Forbidden(f"called {func.__name__}: {REASON}")
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(tensor, torch.Tensor):
                continue
            if tensor.numel() > self.numel:
                self.numel, self.shape = tensor.numel(), tuple(tensor.shape)
            if (tensor.dim() >= 2 and tensor.shape[-2] == self.seq_len and tensor.shape[-1] != self.head_dim
                    and tensor.shape[-1] > (self.widest[-1] if self.widest else 0)):
                self.widest = tuple(tensor.shape)
        return out


@contextmanager
def _watched(seq_len: int = 0, head_dim: int = 0) -> Iterator[_Watch]:
    """No fused attention (the Python entry point too, where a CPU falls back to its math path) while watching."""
    original = F.scaled_dot_product_attention

    def refused(*args, **kwargs):
        raise guard.Forbidden(f"called F.scaled_dot_product_attention: {REASON}")

    F.scaled_dot_product_attention = refused
    try:
        with _Watch(seq_len, head_dim) as watch:
            yield watch
    finally:
        F.scaled_dot_product_attention = original


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
               k_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook formula over the keys given, causal by positions: ``(out, lse)`` (``0, -inf`` for a query
    that sees none of them)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe.unsqueeze(-1)) @ v, lse


def _qkv(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, dtype=torch.float64, generator=generator) * (scale if i == 0 else 1.0)
            for i in range(3)]


def _pair(result: object, what: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
        raise CheckFailed(f"{what} returned {type(result).__name__}; expected a tuple (out, lse) of two tensors")
    out, lse = result
    if tuple(out.shape) != shape or tuple(lse.shape) != shape[:-1]:
        raise CheckFailed(f"{what} returned out {tuple(out.shape)} and lse {tuple(lse.shape)}; expected {shape} "
                          f"and {shape[:-1]}")
    if torch.isnan(out).any() or torch.isnan(lse).any():
        raise CheckFailed(f"{what} returned nan: a row with no key has lse = -inf in a part, and -inf - (-inf) "
                          "is nan; give such a row weight 0")
    return out, lse


def _compare(found: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor], what: str,
             tolerance: float) -> None:
    for name, mine, theirs in zip(("out", "lse"), found, expected, strict=True):
        both_inf = torch.isinf(mine) & torch.isinf(theirs) & (torch.sign(mine) == torch.sign(theirs))
        error = torch.where(both_inf, torch.zeros_like(mine), (mine - theirs).abs())
        if not torch.all(error <= tolerance):
            where = tuple(int(i) for i in torch.nonzero(~(error <= tolerance))[0])
            raise CheckFailed(f"{what}: {name} at {where} is {mine[where].item():.6g}, expected "
                              f"{theirs[where].item():.6g} (attention over all the keys)")


def _transposed(tensor: torch.Tensor) -> torch.Tensor:
    """The same values laid out as ``.transpose(0, 1)`` leaves them (as a ``[s, b, ...]`` layout seen batch-first
    does): not contiguous, and ``.view`` across the leading dimensions fails."""
    return tensor.transpose(0, 1).contiguous().transpose(0, 1)


def _probe(function: Callable, args: tuple, what: str, expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``function`` on the inputs a caller also has, not only contiguous fp64 CPU tensors: the same values laid out
    with gaps (``.view`` fails there), in fp32 (the result keeps the inputs' dtype) and on the ``meta`` device,
    which stands in for a GPU (needs none, computes no values): every tensor made without ``device=`` is on the CPU
    and fails there, or comes back on the wrong device."""
    shape = tuple(expected[0].shape)
    like = {"laid out transposed (not contiguous)": (_transposed, torch.float64),
            "in float32": (lambda t: t.float(), torch.float32), "on the meta device": (lambda t: t.to("meta"),
                                                                                     torch.float64)}
    for how, (change, dtype) in like.items():
        given = tuple(change(arg) if isinstance(arg, torch.Tensor) else arg for arg in args)
        device = given[0].device
        try:
            result = function(*given)
        except Exception as error:  # any failure is the student's
            hint = ("create new tensors on the inputs' device (device=q.device), as on a GPU" if device.type == "meta"
                    else "use .reshape, not .view, on a tensor that may not be contiguous" if dtype == torch.float64
                    else "keep the inputs' dtype (dtype=q.dtype)")
            raise CheckFailed(f"{what} of tensors {how} raised {type(error).__name__}: "
                              f"{str(error).splitlines()[0].split('. ')[0][:160]}: {hint}") from None
        if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result)):
            raise CheckFailed(f"{what} of tensors {how} returned {type(result).__name__}; expected (out, lse)")
        for name, tensor, want in zip(("out", "lse"), result, (shape, shape[:-1]), strict=True):
            if tensor.device != device or tensor.dtype != dtype or tuple(tensor.shape) != want:
                raise CheckFailed(f"{what} of tensors {how} returned {name} of {tensor.dtype}, shape "
                                  f"{tuple(tensor.shape)}, on {tensor.device}; expected {dtype}, {want}, on {device}: "
                                  "make new tensors like the inputs (device=q.device, dtype=q.dtype)")
        if device.type != "meta":
            _compare(tuple(t.double() for t in result), expected, f"{what} of tensors {how}",
                     1e-9 if dtype == torch.float64 else 1e-4)


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_merge(module) -> None:
    """merge_partials combines two partial results exactly (any order, many blocks, empty parts, large scores)"""
    copies.refuse_copies_of_labkit()
    for shape, scale in (((9, 4), 1.0), ((2, 3, 12, 8), 1.0), ((1, 2, 6, 5), 1000.0)):
        q, k, v = _qkv(shape, seed=len(shape), scale=scale)
        seq = shape[-2]
        positions = torch.arange(seq)
        whole = _reference(q, k, v, positions, positions)
        picked = torch.randperm(seq, generator=torch.Generator().manual_seed(seq))
        for split in (picked[: seq // 3], torch.arange(seq // 2, seq)):  # scattered keys; only late ones
            rest = torch.tensor(sorted(set(range(seq)) - set(split.tolist())))
            parts = [_reference(q, k[..., keys, :], v[..., keys, :], positions, keys) for keys in (split, rest)]
            for first, second in (parts, parts[::-1]):
                merged = _pair(module.merge_partials(*first, *second), "merge_partials", shape)
                _compare(merged, whole, f"merge_partials of two partials of {shape} (scores x{scale:g})", 1e-9)
        blocks = torch.randperm(seq, generator=torch.Generator().manual_seed(1)).chunk(4)
        out, lse = torch.zeros_like(q), torch.full(shape[:-1], float("-inf"), dtype=q.dtype)
        for keys in blocks:  # one block at a time, in no particular order
            out, lse = _pair(module.merge_partials(out, lse, *_reference(q, k[..., keys, :], v[..., keys, :],
                                                                         positions, keys)),
                             "merge_partials", shape)
        _compare((out, lse), whole, f"merge_partials folded over 4 blocks of {shape}", 1e-9)
    empty = (torch.zeros(3, 4, dtype=torch.float64), torch.full((3,), float("-inf"), dtype=torch.float64))
    out, lse = _pair(module.merge_partials(*empty, *empty), "merge_partials of two empty parts", (3, 4))
    if not (torch.all(out == 0) and torch.all(torch.isneginf(lse))):
        raise CheckFailed("merge_partials of two parts that saw no key must give out = 0 and lse = -inf")
    q, k, v = _qkv((2, 3, 12, 8), seed=4)
    positions, early = torch.arange(12), torch.arange(5)
    parts = (*_reference(q, k[..., early, :], v[..., early, :], positions, early),
             *_reference(q, k[..., 5:, :], v[..., 5:, :], positions, positions[5:]))
    _probe(module.merge_partials, parts, "merge_partials", _reference(q, k, v, positions, positions))
    copies.refuse_copies_of_labkit()


def _positions(found: object, call: str) -> list[int]:
    """The positions as a caller uses them: read more than once (to pick q, k and v), and as an index.  A list (or
    tuple, range) of ints or a 1-D integer tensor; a generator, floats or a tensor of floats fail, naming what came
    back."""
    if isinstance(found, torch.Tensor):
        if found.dim() != 1 or found.is_floating_point() or found.is_complex() or found.dtype in (torch.bool,
                                                                                                 torch.uint8):
            raise CheckFailed(f"{call} returned a tensor of {found.dtype}, shape {tuple(found.shape)}; positions "
                              "index q, k and v: expected a list of ints (or a 1-D tensor of torch.long)")
        return found.tolist()
    if not isinstance(found, (list, tuple, range)):
        kind = "an iterator, which can be read only once" if isinstance(found, Iterator) else "not a list"
        raise CheckFailed(f"{call} returned a {type(found).__name__} ({kind}); expected a list of ints: a caller "
                          "reads the positions more than once (for q, k and v) and indexes tensors with them")
    bad = next((p for p in found if isinstance(p, bool) or not isinstance(p, numbers.Integral)), None)
    if bad is not None:
        raise CheckFailed(f"{call} returned a list holding {bad!r} ({type(bad).__name__}); positions index tensors: "
                          "every one an int (integer division // keeps them ints)")
    return [int(p) for p in found]


def _expected_zigzag(seq_len: int, cp: int, rank: int) -> list[int]:
    chunk = -(-seq_len // (2 * cp))
    return [p for index in (rank, 2 * cp - 1 - rank) for p in range(index * chunk, (index + 1) * chunk)]


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_zigzag(module) -> None:
    """zigzag_positions gives rank r chunks r and 2cp-1-r of the padded sequence, for any cp and length"""
    copies.refuse_copies_of_labkit()
    for cp in range(1, 9):
        for seq_len in sorted({2 * cp * 3, 2 * cp * 5 + 1, 2 * cp * 4 - 1, 2 * cp + cp, 97, max(1, cp - 1)}):
            padded = -(-seq_len // (2 * cp)) * 2 * cp
            held = []
            for rank in range(cp):
                found = _positions(module.zigzag_positions(seq_len, cp, rank),
                                   f"zigzag_positions({seq_len}, {cp}, {rank})")
                expected = _expected_zigzag(seq_len, cp, rank)
                if found != expected:
                    hint = (" (the same positions in another order: chunk r first, then its mirror)"
                            if sorted(found) == sorted(expected) else
                            f" (pad to a multiple of 2 cp = {2 * cp}: {padded} tokens, chunks of {padded // (2 * cp)})"
                            if len(found) != len(expected) else "")
                    raise CheckFailed(f"zigzag_positions({seq_len}, {cp}, {rank}) returned {found[:12]}"
                                      f"{'...' if len(found) > 12 else ''}; expected {expected[:12]}"
                                      f"{'...' if len(expected) > 12 else ''}{hint}")
                held += found
            if sorted(held) != list(range(padded)):
                raise CheckFailed(f"zigzag_positions over cp={cp} ranks do not hold each of the {padded} positions "
                                  "exactly once")
    copies.refuse_copies_of_labkit()


# (tokens, block, head size, leading dimensions, scale of the scores): blocks that divide the length and ones that
# do not; head sizes no block matches (a tensor [..., s, n] with n not the head size holds scores over n keys);
# 2-D, 3-D and 4-D tensors; scores 1,000 and 10,000 times the usual (an unshifted softmax overflows; a mask of -1e4
# lets masked keys in)
CASES = ((37, 8, 5, (), 1.0), (64, 16, 12, (2, 3), 1.0), (5, 64, 5, (3,), 1.0), (33, 1, 5, (2, 3), 1.0),
         (100, 32, 12, (), 1.0), (16, 16, 5, (2,), 1.0), (40, 8, 12, (2, 3), 1000.0), (29, 4, 5, (), 10000.0))


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_blockwise(module) -> None:
    """blockwise_attention equals causal attention at any block size and never forms the s x s scores"""
    copies.refuse_copies_of_labkit()
    merge, merges = module.merge_partials, []

    def counted(*args):
        merges.append(1)
        return merge(*args)

    for seq, block, dim, leading, scale in CASES:
        shape = (*leading, seq, dim)
        q, k, v = _qkv(shape, seed=seq + block, scale=scale)
        positions = torch.arange(seq)
        where = f"blockwise_attention of {shape} in blocks of {block}" + (f", scores x{scale:g}" if scale > 1 else "")
        merges.clear()
        module.merge_partials = counted
        try:
            with _watched(seq, dim) as watch:
                found = _pair(module.blockwise_attention(q, k, v, block), where, shape)
        finally:
            module.merge_partials = merge
        _compare(found, _reference(q, k, v, positions, positions), where, 1e-10 if scale == 1 else 1e-8)
        widest = watch.widest[-1] if watch.widest else 0
        allowed = max(q.numel(), math.prod(leading) * seq * min(block, seq))
        if watch.numel > allowed or widest > min(block, seq):
            shown = watch.widest if widest > min(block, seq) else watch.shape
            raise CheckFailed(f"{where} formed a tensor of shape {shown}; one block's scores are "
                              f"{(*leading, seq, min(block, seq))}: never form more of the score matrix than that")
        if len(merges) < -(-seq // block) - 1:
            raise CheckFailed(f"{where} called merge_partials {len(merges)} times for {-(-seq // block)} blocks of "
                              "keys: walk the keys block by block and merge each block's partial result in")
    q, k, v = _qkv((2, 3, 21, 5), seed=5)
    with _watched():
        _probe(module.blockwise_attention, (q, k, v, 8), "blockwise_attention",
               _reference(q, k, v, torch.arange(21), torch.arange(21)))
    copies.refuse_copies_of_labkit()


@guard.no_shortcuts(built_ins=BUILT_INS)
def check_ring(module) -> None:
    """ring attention built from the two: each rank's zig-zag queries merge every rank's keys, in ring order"""
    copies.refuse_copies_of_labkit()
    for cp, seq_len in ((2, 13), (3, 24), (4, 30)):
        padded = -(-seq_len // (2 * cp)) * 2 * cp
        q, k, v = _qkv((2, padded, 4), seed=cp)
        held = [torch.tensor(_positions(module.zigzag_positions(seq_len, cp, rank),
                                        f"zigzag_positions({seq_len}, {cp}, {rank})")) for rank in range(cp)]
        everything = torch.arange(padded)
        for rank, mine in enumerate(held):
            out = torch.zeros(2, len(mine), 4, dtype=torch.float64)
            lse = torch.full((2, len(mine)), float("-inf"), dtype=torch.float64)
            for step in range(cp):  # the keys of rank - step arrive at step `step`
                theirs = held[(rank - step) % cp]
                part = _reference(q[:, mine], k[:, theirs], v[:, theirs], mine, theirs)
                out, lse = _pair(module.merge_partials(out, lse, *part), "merge_partials", (2, len(mine), 4))
            whole = _reference(q[:, mine], k, v, mine, everything)
            _compare((out, lse), whole, f"ring attention, cp={cp}, {seq_len} tokens, rank {rank}", 1e-9)
    copies.refuse_copies_of_labkit()


CHECKS = [check_merge, check_zigzag, check_blockwise, check_ring]
