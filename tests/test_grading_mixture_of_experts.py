"""Exercise 14's grader: its cases reach every rule the lesson teaches, its hints name the mistake, and no copy of
labkit's router runs inside a student's call however it was loaded.  (The wrong answers themselves, each failing
exactly the checks that name it, are in tests/wrong_answers.py, run by tests/test_grading.py.)"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from labkit import grading
from labkit.grading import guard
from labkit.grading.checkers import mixture_of_experts as checks
from labkit.grading.checkers import own_code
from labkit.grading.checkers import routing_rules as rules
from tests.conftest import REPO
from tests.wrong_answers import BY_NAME

ROUTER = REPO / "labkit" / "parallel" / "experts" / "router.py"


def test_a_copy_of_labkits_router_is_refused_however_it_was_loaded_and_the_students_own_code_is_not(tmp_path):
    """Built from labkit's file and never registered, or its source executed into a plain namespace: refused.
    The same source in the student's own file runs (a short answer may compile to what labkit's does)."""
    student = tmp_path / "14_mixture_of_experts.py"
    student.write_text(ROUTER.read_text())
    previous = sys.getprofile()

    def from_spec(path, name, register=False):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        if register:  # as grading.load_exercise registers the student's file (its dataclasses need it)
            sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    try:
        with own_code.only_own_code(checks.FILES, str(student)):
            assert from_spec(student, "students_router", register=True).expert_capacity(24, 2, 8, 1.25) == 8
    finally:
        sys.modules.pop("students_router", None)
    for load in (lambda: from_spec(ROUTER, "unregistered_router"), lambda: exec(ROUTER.read_text(), {})):
        with pytest.raises(guard.Forbidden, match="this exercise asks you to write it yourself"):
            with own_code.only_own_code(checks.FILES, str(student)):
                load()
    copy = from_spec(ROUTER, "loaded_before", register=True)  # before the block: refused when its code runs
    try:
        with pytest.raises(guard.Forbidden, match="expert_capacity from labkit's labkit/parallel/experts/router.py"):
            with own_code.only_own_code(checks.FILES, str(student)):
                copy.expert_capacity(24, 2, 8, 1.25)
    finally:
        sys.modules.pop("loaded_before", None)
    assert sys.getprofile() is previous


def test_a_refusal_the_students_code_catches_is_raised_when_its_call_returns():
    namespace: dict = {}
    with pytest.raises(guard.Forbidden, match="a copy of labkit's own code"):
        with own_code.only_own_code(checks.FILES, None):
            try:
                exec(ROUTER.read_text(), namespace)
            except guard.Forbidden:
                pass  # caught, and an answer returned regardless


def test_a_profile_hook_set_before_still_sees_every_call_and_is_put_back():
    seen: list[str] = []

    def earlier(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    def students_function():
        return 1

    sys.setprofile(earlier)
    try:
        with own_code.only_own_code(checks.FILES, None):
            students_function()
        assert sys.getprofile() is earlier
    finally:
        sys.setprofile(None)
    assert "students_function" in seen


def test_bincount_on_meta_is_only_given_a_size_while_a_probe_runs():
    ids = torch.tensor([0, 2, 2]).to("meta")
    with checks._meta_counts():
        assert torch.bincount(ids, minlength=5).shape == (5,)
    with pytest.raises(NotImplementedError):
        torch.bincount(ids, minlength=5)


def test_every_capacity_case_rounds_alike_in_any_float_order_and_the_cases_reach_every_rounding():
    """The exact ``ceil`` is what any order of the float product gives (no case sits a rounding error from a whole
    number), and the cases hold whole products (one more fails), fractions below a half (rounding down or to the
    nearest fails) and shares below one choice."""
    products = []
    for tokens, top_k, n_experts, factor in rules.CAPACITY_CASES:
        if factor is None:
            continue
        exact = rules.capacity(tokens, top_k, n_experts, factor)
        orders = (factor * tokens * top_k / n_experts, factor * (tokens * top_k / n_experts),
                  tokens * top_k * factor / n_experts, tokens * top_k / n_experts * factor,
                  factor * tokens / n_experts * top_k)
        assert {math.ceil(value) for value in orders} == {exact}, (tokens, top_k, n_experts, factor)
        products.append(rules.Fraction(factor) * tokens * top_k / n_experts)
    assert sum(p.denominator == 1 for p in products) >= 4
    assert sum(p.denominator > 1 and p - math.floor(p) < rules.Fraction(1, 2) for p in products) >= 3
    assert any(p < 1 for p in products)


def test_no_route_case_has_a_near_tie_that_another_float_order_could_break():
    for case in rules.ROUTE_CASES + [case for case, _ in rules.COMBINE_CASES]:
        _, scores, bias = case.inputs()
        if scores.numel() == 0 or case.top_k == case.n_experts:
            continue
        ranked = (scores.detach().double() + bias.double()).sort(dim=-1, descending=True).values
        assert float((ranked[..., case.top_k - 1] - ranked[..., case.top_k]).min()) > 1e-5, case.label()


def test_the_layers_bias_changes_the_choices_and_the_ranks_own_loads_disagree_with_the_groups():
    """Without both, the layer check could not tell a bias update that ignores the other ranks, or one that
    averages the ranks' own steps, from the rule."""
    from labkit.launch import launch

    def steps(setting):
        import torch.distributed as dist

        rank = dist.get_rank()
        gate, experts = rules.layer_weights(setting)
        bias, changed, disagreed, averages_differ = torch.zeros(setting.n_experts), False, False, False
        for x, target in rules.layer_batches(setting, rank, gate):
            want = rules.layer_step(rules.reference_functions(setting), x, target, gate, experts, bias, setting)
            unbiased = rules.choose((x @ gate).softmax(-1) if setting.kind == "softmax" else (x @ gate).sigmoid(),
                                    torch.zeros(setting.n_experts), setting.top_k)
            changed |= not torch.equal(unbiased, want["ids"])
            local = rules.bias_step(bias, rules.loads(want["ids"], setting.n_experts), setting.rate)
            disagreed |= not torch.allclose(local, want["bias"])
            averaged = local.clone()
            dist.all_reduce(averaged)
            averages_differ |= not torch.allclose(averaged / dist.get_world_size(), want["bias"])
            bias = want["bias"]
        return changed, disagreed, averages_differ

    for setting in rules.LAYER_SETTINGS:
        results = launch(steps, setting, nprocs=setting.world, rank_output="none")
        assert any(changed for changed, _, _ in results), setting.label()
        assert all(disagreed for _, disagreed, _ in results), setting.label()
        assert any(differ for _, _, differ in results), setting.label()


@pytest.mark.parametrize("name, check, hint", [
    ("moe_route_ignores_bias", 0, "chosen by the scores alone: the bias must move the choice"),
    ("moe_route_ascending", 0, "the right experts, in the wrong order: best first"),
    ("moe_route_two_dimensions", 0, "[7, 3, 16] (float32, not contiguous), top-4, a bias of about 0.2 raised"),
    ("moe_route_float_ids", 0, "returned torch.float64; expected torch.int64"),
    ("moe_route_numpy", 0, "of tensors on another device than the CPU failed"),
    ("moe_weights_not_renormalised", 1, "not renormalised: with k > 1 divide by the sum"),
    ("moe_weights_renormalised_for_one", 1, "renormalised with k = 1: a lone weight divided by itself is 1"),
    ("moe_weights_over_kept", 1, "renormalised over the kept choices only"),
    ("moe_weights_dropped_kept", 1, "a dropped choice keeps its weight"),
    ("moe_weights_detached", 1, "carries no gradient to the scores"),
    ("moe_weights_cpu_zeros", 1, "not on the expected device meta"),
    ("moe_capacity_floor", 2, "rounded down, or to the nearest"),
    ("moe_capacity_floor_plus_one", 2, "one more than the share when it is a whole number"),
    ("moe_capacity_tokens_not_choices", 2, "T tokens make T k choices"),
    ("moe_capacity_float", 2, "returned 6.0 (float); expected an int"),
    ("moe_capacity_none_is_zero", 2, "expected None: no capacity factor, no limit"),
    ("moe_capacity_labkits_explorer", 2, "from labkit's labkit/viz/experts_plots.py"),
    ("moe_capacity_exec_labkit_source", 2, "a copy of labkit"),
    ("moe_kept_token_major", 3, "a token's choices served together"),
    ("moe_kept_off_by_one", 3, "one more than the capacity kept"),
    ("moe_kept_per_column", 3, "a capacity for each rank of choice"),
    ("moe_kept_last_first", 3, "the queue served from its end"),
    ("moe_kept_view", 3, "(not contiguous)"),
    ("moe_kept_python_loop", 3, "of tensors on another device than the CPU failed"),
    ("moe_kept_none_on_cpu", 3, "returned one on cpu"),
    ("moe_kept_unregistered_copy", 3, "labkit/parallel/experts/router.py"),
    ("moe_aux_f_from_scores", 4, "f taken from the scores"),
    ("moe_aux_f_over_tokens", 4, "f over the T tokens"),
    ("moe_aux_raw_scores", 4, "P from the raw scores"),
    ("moe_aux_first_choices", 4, "f from the first choices only"),
    ("moe_bias_sign_flipped", 5, "the sign turned"),
    ("moe_bias_proportional", 5, "a step proportional to the gap"),
    ("moe_bias_ties_move", 5, "an expert exactly at the mean moved"),
    ("moe_bias_integer_mean", 5, "the mean load rounded down"),
    ("moe_bias_first_choices", 5, "loads from the first choices only"),
    ("moe_bias_in_place", 5, "changed its input in place"),
    ("moe_bias_local_loads", 6, "moved by this rank's loads alone"),
    ("moe_bias_averaged_biases", 6, "the ranks' own steps, averaged"),
])
def test_the_hints_name_the_mistake(name, check, hint, tmp_path):
    result = grading.run_check(checks.CHECKS[check], BY_NAME[name].write(tmp_path / name))
    assert not result.passed and hint in result.message, result.message
