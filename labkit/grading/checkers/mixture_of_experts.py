"""Checks for exercise 14 (``14_mixture_of_experts.py``): expert parallelism's dispatch.

Four checks, building up:

1. ``send_counts`` over ``ep`` = 1 to 8 and ``E`` = 8 to 256 experts, on ``[N]`` and ``[T, k]`` ids with ``k`` up
   to 8, up to a real batch (4,096 tokens x top-8: counts in the thousands): one count per rank (``ep`` integers of
   ``torch.long``), zeros for ranks no assignment reaches (experts nobody chose, the last rank's among them),
   summing to every assignment; experts owned contiguously (round-robin ownership, ``e % ep``, fails), every choice
   counted (counting tokens, or first choices only, fails); the ids left as they were;
2. ``dispatch_order``: a permutation of ``range(N)`` (``torch.long``) that sorts the ids, ties in their original
   order, on loads skewed onto one expert, on ties everywhere (one expert for all) and on 70,000 ids (a tie-break
   folded into the key, ``id * 1000 + i``, fails there); grouping by rank alone (the experts of a rank interleaved),
   a descending or unstable order fails; the result on the input's device (tried on ``meta``: numpy fails);
3. ``inverse_permutation`` undoes any permutation, random (up to 70,000), the identity, a reversal, one element
   and none, on the input's device; ``order`` itself, or ``order`` reversed, fails (they undo only their own
   kind); an answer that writes over ``order`` fails;
4. the three together in a real dispatch on 2, 3 and 4 processes: each rank routes its own tokens (uneven counts,
   some experts unused), exchanges the counts with ``all_to_all_single``, sends its rows laid out by your
   ``dispatch_order`` in your ``send_counts`` (both given the same ids, which must survive them), each expert
   transforms its rows, and the results come back and are put in place by your ``inverse_permutation``: every
   token gets exactly its experts' outputs.

Counts and indices must be ``torch.long``: a real rank's exceed 255 (uint8, which indexing also reads as a mask)
and 32,767 (int16).  While the checks run, :mod:`labkit.grading.guard` switches off ``labkit.parallel``
(labkit's own dispatch among it) and this checker refuses a fresh copy of any labkit file loaded under another
name.  (As the guard says, it stops honest shortcuts, not an adversary: code captured from labkit's functions
at import, or its source executed without a module, passes.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.grading import CheckFailed, copies, guard
from labkit.launch import launch

LAUNCH_TIMEOUT = 60.0


def _ids(shape: tuple[int, ...], n_experts: int, seed: int, skew: bool = False, unused: tuple[int, ...] = ()
         ) -> torch.Tensor:
    """Random expert ids of ``shape``; ``skew``: most on expert 1; ``unused``: experts never chosen."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(n_experts, shape, generator=generator)
    if skew:
        ids = torch.where(torch.rand(shape, generator=generator) < 0.7, torch.ones_like(ids), ids)
    for expert in unused:
        ids = torch.where(ids == expert, torch.full_like(ids, [e for e in range(n_experts) if e not in unused][0]),
                          ids)
    return ids


def _tensor(result: object, what: str, length: int) -> torch.Tensor:
    if not isinstance(result, torch.Tensor):
        raise CheckFailed(f"{what} returned {type(result).__name__}; expected a torch.Tensor of {length} integers")
    if result.dim() != 1 or result.numel() != length:
        raise CheckFailed(f"{what} returned a tensor of shape {tuple(result.shape)}; expected ({length},)")
    if result.dtype != torch.long:
        raise CheckFailed(f"{what} returned {result.dtype}; expected torch.long (int64): counts and indices of real "
                          "batches pass 255 (uint8), 32,767 (int16), and all_to_all_single and indexing take int64")
    return result


def _unchanged(before: torch.Tensor, after: torch.Tensor, what: str) -> None:
    if not torch.equal(before, after):
        raise CheckFailed(f"{what} changed its input in place: the caller's tensor is needed afterwards (the same ids "
                          "give the counts and the order; the order is used again to put the results back)")


# (ids shape, experts, ep, skewed, unused experts): [N] and [T, k]; uneven loads; the last ranks' experts unused; a
# real batch's size (4,096 tokens x top-8 over 256 experts: counts past 255, indices past 32,767)
COUNT_CASES = [((40,), 8, 2, False, ()), ((16, 2), 8, 4, False, (6, 7)), ((9, 8), 64, 8, True, ()),
               ((30, 3), 12, 3, False, (0, 1, 2, 3)), ((25, 1), 8, 8, True, (5,)), ((7, 4), 12, 1, False, ()),
               ((50,), 64, 4, True, tuple(range(48, 64))), ((4096, 8), 256, 8, True, ())]


@guard.no_shortcuts
def check_send_counts(module) -> None:
    """send_counts gives each rank the assignments its experts take (any ep, k, uneven and empty ranks)"""
    copies.refuse_copies_of_labkit()
    for shape, n_experts, ep, skew, unused in COUNT_CASES:
        ids = _ids(shape, n_experts, seed=sum(shape) + ep, skew=skew, unused=unused)
        what = f"send_counts of ids {tuple(shape)} over {n_experts} experts and ep={ep}"
        given = ids.clone()
        found = _tensor(module.send_counts(given, n_experts, ep), what, ep)
        _unchanged(ids, given, what)
        owner = ids.reshape(-1) // (n_experts // ep)
        expected = torch.tensor([int((owner == rank).sum()) for rank in range(ep)])
        if not torch.equal(found, expected):
            hint = ""
            if int(found.sum()) != ids.numel():
                hint = f" (they sum to {int(found.sum())}; there are {ids.numel()} assignments: every choice counts)"
            elif torch.equal(found, torch.bincount(ids.reshape(-1) % ep, minlength=ep)):
                hint = " (experts are held contiguously: rank r holds experts r E/ep .. (r+1) E/ep - 1, not e % ep)"
            raise CheckFailed(f"{what} returned {found.tolist()}; expected {expected.tolist()}{hint}")
    copies.refuse_copies_of_labkit()


ORDER_CASES = [((40,), 8, 2, False, ()), ((33,), 12, 3, True, ()), ((64,), 64, 8, True, tuple(range(32, 64))),
               ((20,), 8, 4, False, (0, 1, 2, 3, 4, 5, 6)), ((1,), 4, 2, False, ()), ((0,), 4, 2, False, ()),
               ((70000,), 256, 8, True, ())]


@guard.no_shortcuts
def check_dispatch_order(module) -> None:
    """dispatch_order groups the assignments by rank, then expert, keeping the order of equals"""
    copies.refuse_copies_of_labkit()
    for shape, n_experts, ep, skew, unused in ORDER_CASES:
        ids = _ids(shape, n_experts, seed=shape[0] + n_experts, skew=skew, unused=unused)
        what = f"dispatch_order of {shape[0]} ids over {n_experts} experts and ep={ep}"
        given = ids.clone()
        order = _tensor(module.dispatch_order(given, n_experts, ep), what, ids.numel())
        _unchanged(ids, given, what)
        if not torch.equal(torch.sort(order).values, torch.arange(ids.numel())):
            raise CheckFailed(f"{what} returned {order.tolist()[:12]}...: not a permutation of range({ids.numel()})")
        expected = torch.sort(ids, stable=True).indices.tolist() if ids.numel() > 100 else \
            sorted(range(ids.numel()), key=lambda i: (int(ids[i]), i))
        if order.tolist() != expected:
            laid = ids[order].tolist()
            hint = (" (the ranks are in order but their experts are interleaved: within a rank, group by expert)"
                    if laid != sorted(laid) and [e // (n_experts // ep) for e in laid] == sorted(
                        e // (n_experts // ep) for e in laid) else
                    " (the ids come out sorted, but equal ids must keep their original order: a stable sort)"
                    if laid == sorted(laid) else "")
            raise CheckFailed(f"{what}: ids[order] is {laid[:16]}{'...' if len(laid) > 16 else ''}; expected "
                              f"{[int(ids[i]) for i in expected][:16]}{hint}")
    _same_device(lambda t: module.dispatch_order(t, 8, 2), torch.tensor([3, 1, 2]), "dispatch_order")
    copies.refuse_copies_of_labkit()


def _same_device(function, example: torch.Tensor, what: str) -> None:
    """The result lives where the input does (a GPU's ids give a GPU's order): tried on the ``meta`` device, which
    needs no GPU and refuses whatever would copy to the CPU (``.numpy()``, ``.tolist()``)."""
    try:
        result = function(example.to("meta"))
    except Exception as error:  # noqa: BLE001: any failure is the student's
        raise CheckFailed(f"{what} of a tensor on another device than the CPU failed ({type(error).__name__}: "
                          f"{str(error).splitlines()[0][:120]}): keep to torch operations on the input's device, "
                          "no numpy or Python lists") from None
    if not isinstance(result, torch.Tensor) or result.device.type != "meta":
        device = result.device if isinstance(result, torch.Tensor) else type(result).__name__
        raise CheckFailed(f"{what} of a tensor on another device returned one on {device}: create new tensors on "
                          "the input's device (device=...)")


@guard.no_shortcuts
def check_inverse(module) -> None:
    """inverse_permutation undoes any permutation"""
    copies.refuse_copies_of_labkit()
    generator = torch.Generator().manual_seed(3)
    cases = {"a random permutation of 50": torch.randperm(50, generator=generator),
             "a random permutation of 7": torch.randperm(7, generator=generator),
             "the identity": torch.arange(9), "a reversal": torch.arange(9).flip(0),
             "a rotation": torch.roll(torch.arange(11), 3), "one element": torch.zeros(1, dtype=torch.long),
             "no element": torch.zeros(0, dtype=torch.long)}
    cases["a random permutation of 70,000"] = torch.randperm(70000, generator=generator)
    for name, order in cases.items():
        given = order.clone()
        inverse = _tensor(module.inverse_permutation(given), f"inverse_permutation of {name}", order.numel())
        _unchanged(order, given, f"inverse_permutation of {name}")
        x = torch.arange(order.numel()) * 10 + 1
        if not torch.equal(x[order][inverse], x):
            raise CheckFailed(f"inverse_permutation of {name} {order.tolist()[:10]} returned "
                              f"{inverse.tolist()[:10]}: x[order][inverse] != x (position order[i] holds i)")
    _same_device(module.inverse_permutation, torch.tensor([2, 0, 1]), "inverse_permutation")
    copies.refuse_copies_of_labkit()


def _dispatch(module, n_experts: int, top_k: int, seed: int) -> dict:
    """One rank's dispatch with the student's functions: the real all-to-alls, each expert ``e`` computing
    ``(e + 1) * row + e`` on its rows; returns the largest error against the tokens' own expected outputs."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    local = n_experts // ep
    generator = torch.Generator().manual_seed(seed + rank)
    tokens = 3 + 5 * rank  # uneven counts
    x = torch.randn(tokens, 4, dtype=torch.float64, generator=generator)
    ids = torch.randint(n_experts - 1, (tokens, top_k), generator=generator)  # the last expert never chosen
    flat = ids.reshape(-1)
    kept = ids.clone()
    counts = module.send_counts(ids, n_experts, ep)  # the same tensors throughout, as a layer would pass them
    order = module.dispatch_order(flat, n_experts, ep)
    if not torch.equal(ids, kept):
        raise CheckFailed("send_counts or dispatch_order changed the ids in place: the dispatch needs them after")
    rows = x[order // top_k]
    per_expert = torch.bincount(flat, minlength=n_experts)
    received_counts = torch.empty_like(per_expert)
    dist.all_to_all_single(received_counts, per_expert)
    from_each = received_counts.view(ep, local)
    receive = from_each.sum(dim=1).tolist()
    received = rows.new_empty(sum(receive), 4)
    dist.all_to_all_single(received, rows.contiguous(), receive, counts.tolist())
    experts_of_rows = torch.arange(local).repeat(ep).repeat_interleave(from_each.reshape(-1)) + rank * local
    computed = received * (experts_of_rows + 1).unsqueeze(1) + experts_of_rows.unsqueeze(1)
    back = rows.new_empty(rows.shape)
    dist.all_to_all_single(back, computed, counts.tolist(), receive)
    inverse = module.inverse_permutation(order)
    outputs = back[inverse].view(tokens, top_k, 4)
    expected = x.unsqueeze(1) * (ids + 1).unsqueeze(2) + ids.unsqueeze(2)
    copies.refuse_copies_of_labkit()  # in this process too: a copy loaded here never reaches the parent
    return {"error": float((outputs - expected).abs().max()), "counts": counts.tolist()}


@guard.no_shortcuts
def check_dispatch(module) -> None:
    """the three in a real all-to-all on 2 to 4 processes: every token gets back exactly its experts' outputs"""
    copies.refuse_copies_of_labkit()
    for ep, n_experts, top_k in ((2, 4, 2), (3, 6, 1), (4, 8, 3)):
        try:
            results = launch(_dispatch, module, n_experts, top_k, 7, nprocs=ep, timeout=LAUNCH_TIMEOUT,
                             rank_output="none")
        except Exception as error:  # a rank's failure, shown as the student's
            last = [line for line in str(error).splitlines() if line.strip()][-1].strip()
            if last.startswith("NotImplementedError"):  # a stub: reported as the other checks report it
                raise NotImplementedError(last.partition(":")[2].strip()) from None
            raise CheckFailed(f"the dispatch on {ep} processes failed; a rank raised {last}") from None
        worst = max(result["error"] for result in results)
        if worst > 1e-12:
            raise CheckFailed(f"the dispatch on {ep} processes ({n_experts} experts, top-{top_k}): tokens got back "
                              f"outputs off by {worst:.3g} (counts sent: {[r['counts'] for r in results]})")
    copies.refuse_copies_of_labkit()


CHECKS = [check_send_counts, check_dispatch_order, check_inverse, check_dispatch]
