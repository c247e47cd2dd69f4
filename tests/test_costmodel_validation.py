"""Lesson 11's step model held out of sample (labkit.costmodel.validation): its three kernel efficiencies fitted on
the Megatron-LM README's H100 table, scored on Narayanan et al. 2021's Table 1 (A100), Llama 3's Table 4, MosaicML's
MPT table and 25 unseen rows published 2022-2024, beside two constant baselines, as the module docstring
pre-registers; the earlier one-efficiency model beside it; and the planner beside Narayanan et al.'s choices.

Run with ``pytest -s`` to see every row's measured, predicted and baseline MFU.
"""

from __future__ import annotations

import math

import pytest

from labkit.costmodel import validation
from labkit.costmodel.compute import GPUS, narayanan_flops
from labkit.costmodel.published import LLAMA3_405B, MEGATRON_WEAK_SCALING, NARAYANAN_2021
from labkit.costmodel.shapes import num_parameters
from labkit.costmodel.validation import (
    FIT_SET,
    FLOP_EFFICIENCY,
    SPEARMAN_CRITICAL,
    executed_ratio,
    fit_efficiency,
    held_out,
    leave_one_out,
    planner_agreement,
    score,
    squared_error,
)


def _show(result) -> None:
    print(f"\n{result.name}: measured, predicted, constant, constant HFU (MFU %)")
    for run, *values in zip(result.runs, result.measured, result.predicted, result.constant,
                            result.hardware_constant, strict=True):
        print(f"  {run.name:<30} " + " ".join(f"{100 * value:6.1f}" for value in values))
    print(f"  RMS (points): model {100 * result.rms:.2f}, constant {100 * result.constant_rms:.2f}, constant HFU "
          f"{100 * result.hardware_constant_rms:.2f}; rank correlation {result.rank_correlation}")


# --------------------------------------------------------------------------------------------------------
# Narayanan et al. 2021's Table 1 as data


def test_narayanan_table_gives_its_sizes_its_aggregates_and_its_percentages():
    """Table 1: each shape (vocabulary 51,200, sequence 2,048, the output layer tied) counts the size printed to
    its digits; TFLOP/s x GPUs is the aggregate PFLOP/s; TFLOP/s over the A100's 312 rounds to the printed
    percentage; and the FLOPs behind them are equation 3's, recomputation included, so labkit's MFU of a row is
    about three quarters of it."""
    for run in NARAYANAN_2021:
        billions = num_parameters(run.shape()) / 1e9
        assert round(billions, 1) == float(run.parameters.removesuffix("B")), run.name
        assert abs(run.tflops_per_gpu * run.gpus / 1e3 - run.aggregate_pflops) <= 0.05 + 0.5 * run.gpus / 1e3
        assert abs(run.tflops_per_gpu / 312 - run.mfu) <= 0.005 + 0.5 / 312
        assert run.counted_flops() == narayanan_flops(run.global_batch, run.seq_len, run.num_layers,
                                                      run.hidden_size, run.vocab_size)
        assert 0.73 < run.model_mfu / (run.tflops_per_gpu * 1e12 / GPUS["A100 80GB"].peak_bf16_flops) < 0.77
        assert run.gpus == run.tp * run.pp * run.dp and run.global_batch % run.dp == 0
    assert NARAYANAN_2021[-1].model_mfu == pytest.approx(0.392, abs=5e-4)  # the "52 %" of the 1T row


def test_narayanan_runs_are_modelled_as_the_paper_ran_them():
    for run in NARAYANAN_2021:
        layout = run.layout()
        assert layout.recompute and layout.zero == 0 and run.gpu == "A100 80GB" and run.tied_embeddings
        assert run.plan_options() == {"flash_attention": False, "dropout": True, "gradient_bytes": 2,
                                      "overlap_gather": False, "overlap_tp": False} and not run.overlap_dp
        assert layout.schedule == ("interleaved" if run.pp > 1 else "1f1b")


# --------------------------------------------------------------------------------------------------------
# The fit, and the scores


def test_the_earlier_models_efficiency_is_the_least_squares_fit_on_the_fit_set_alone():
    fitted = fit_efficiency(FIT_SET)
    assert round(fitted, 3) == FLOP_EFFICIENCY == 0.530
    here = squared_error(FLOP_EFFICIENCY, FIT_SET)
    assert here <= squared_error(FLOP_EFFICIENCY - 0.002, FIT_SET)
    assert here <= squared_error(FLOP_EFFICIENCY + 0.002, FIT_SET)
    assert all(run not in FIT_SET for runs in validation.HELD_OUT.values() for run in runs)
    assert all(run not in FIT_SET for runs in validation.UNSEEN.values() for run in runs)


# The scores (the module docstring's), as first computed: a change of the model shows here.  Each set: (model RMS,
# constant RMS, constant-HFU RMS, rank correlation, share within 5 points), MFU points; the kernel model, then
# the earlier one-efficiency model.
HELD_OUT_SCORES = {
    "Narayanan et al. 2021 (A100)": ((5.02, 10.34, 2.70, 0.782, 0.70), (3.19, 10.34, 2.70, 0.248, 0.80)),
    "Llama 3 405B (H100)": ((2.81, 3.65, 3.65, None, 1.00), (0.13, 3.65, 3.65, None, 1.00)),
    "MosaicML MPT, FSDP (H100)": ((4.72, 5.46, 5.99, 0.280, 0.65), (9.53, 5.46, 5.99, -0.003, 0.25)),
    "published 2022-2024 (unseen)": ((7.93, 10.34, 9.12, 0.648, 0.36), (9.25, 10.34, 9.12, 0.512, 0.48)),
}


def _check(result, expected) -> None:
    rms, constant, hardware, rho, within = expected
    _show(result)
    assert round(100 * result.rms, 2) == rms and round(100 * result.constant_rms, 2) == constant
    assert round(100 * result.hardware_constant_rms, 2) == hardware and round(result.within(), 2) == within
    assert (result.rank_correlation is None) == (rho is None)
    if rho is not None:
        assert round(result.rank_correlation, 3) == rho


@pytest.mark.parametrize("model", ["kernels", "flops"])
def test_held_out_and_unseen_scores_beside_the_constant_baselines(model):
    """The verdicts lesson 11 prints.  The kernel model beats the constant on every set it was not fitted to, and
    the constant HFU on all but Narayanan et al.'s (5.0 points against 2.7); it orders Narayanan et al.'s rows
    and the unseen ones (rho above the 5 % critical value), not MPT's.  The earlier model lost to both
    constants on MPT's table and to the constant HFU on the unseen rows."""
    efficiency = validation.EFFICIENCIES if model == "kernels" else FLOP_EFFICIENCY
    scores = {result.name: result for result in held_out(efficiency) + [validation.unseen(efficiency)]}
    for name, expected in HELD_OUT_SCORES.items():
        _check(scores[name], expected[model == "flops"])
    narayanan, llama = scores["Narayanan et al. 2021 (A100)"], scores["Llama 3 405B (H100)"]
    mpt, unseen = scores["MosaicML MPT, FSDP (H100)"], scores["published 2022-2024 (unseen)"]
    assert narayanan.critical == SPEARMAN_CRITICAL[10] == 0.564 and unseen.critical == SPEARMAN_CRITICAL[25]
    assert llama.beats_constant and llama.beats_hardware_constant and not llama.orders_the_runs
    if model == "kernels":
        assert all(result.beats_constant for result in scores.values())
        assert [name for name, result in scores.items() if not result.beats_hardware_constant] == [narayanan.name]
        assert narayanan.orders_the_runs and unseen.orders_the_runs and not mpt.orders_the_runs
    else:
        assert not mpt.beats_constant and not unseen.beats_hardware_constant and not narayanan.orders_the_runs


def test_in_sample_and_leave_one_out_the_constant_wins_on_the_fit_set():
    """On the table it was fitted to, the model's RMS error (5.05 points) is about twice the constant's (2.68),
    and left out one at a time each row is predicted worse still (5.99 against 3.01); it does not order the fit
    set's rows.  Its 16B and 32B rows (pp = 1, 48 replicas reducing fp32 gradients across nodes) are where it
    falls furthest below the measurement."""
    in_sample = score("fit set", FIT_SET)
    _check(in_sample, (5.05, 2.68, 2.68, 0.383, 0.78))
    worst = sorted(zip(in_sample.runs, in_sample.predicted, in_sample.measured, strict=True),
                   key=lambda row: row[1] - row[2])[:2]
    assert {run.parameters for run, _, _ in worst} == {"16B", "32B"}
    left_out = leave_one_out()
    _check(left_out, (5.99, 3.01, 3.01, -0.050, 0.67))
    assert not left_out.beats_constant and not left_out.orders_the_runs and left_out.critical == 0.600


def test_the_baselines_are_the_fit_sets_mean_and_that_mean_times_the_executed_share():
    mean = sum(run.model_mfu for run in FIT_SET) / len(FIT_SET)
    result = score("Narayanan", NARAYANAN_2021)
    assert set(result.constant) == {mean}
    assert result.hardware_constant == pytest.approx([mean * executed_ratio(run) for run in NARAYANAN_2021])
    assert all(0.75 < executed_ratio(run) < 0.77 for run in NARAYANAN_2021)  # 3/4, the head not recomputed
    assert all(executed_ratio(run) == 1 for run in MEGATRON_WEAK_SCALING + LLAMA3_405B[:2])


# --------------------------------------------------------------------------------------------------------
# The planner beside Narayanan et al.'s (t, p)

# What the planner picks for each row, restricted to the study's options (validation.NARAYANAN_OPTIONS): the
# published (t, p) in 3 rows, within 5 % by its own numbers in 5 more (8 of 10 agree); in 2 (18.4B, 39.1B) it
# prefers less TP and a deeper interleaved pipeline, by 7-12 %.
PLANNER_PICKS = {"1.7B (A100)": (1, 1), "3.6B (A100)": (1, 4), "7.5B (A100)": (2, 2), "18.4B (A100)": (2, 4),
                 "39.1B (A100)": (4, 4), "76.1B (A100)": (8, 4), "145.6B (A100)": (4, 16),
                 "310.1B (A100)": (8, 12), "529.6B (A100)": (8, 21), "1008.0B (A100)": (8, 64)}
DISAGREES = {"18.4B (A100)", "39.1B (A100)"}


@pytest.mark.parametrize("run", NARAYANAN_2021, ids=[run.name for run in NARAYANAN_2021])
def test_the_planner_beside_narayanans_choices(run):
    agreement = planner_agreement(run)
    best = agreement.result.best
    print(f"\n{run.name}: published t={run.tp} p={run.pp}; planner {best.layout.label()} {best.step.step_s:.2f} s; "
          f"the published (t, p) at best {agreement.slower:+.1%}")
    assert agreement.picked == PLANNER_PICKS[run.name]
    assert agreement.same == (agreement.picked == (run.tp, run.pp))
    assert agreement.agrees == (run.name not in DISAGREES)
    if run.name in DISAGREES:
        assert best.layout.tp < run.tp and best.layout.pp > run.pp and 0.05 < agreement.slower < 0.13
    assert agreement.published_memory <= run.cluster(validation.EFFICIENCIES).usable_bytes  # the layout fits
    assert not math.isnan(agreement.slower)


def test_mosaic_fsdp_rows_count_the_tables_parameters_and_mfu():
    """The unseen set as data: the 20 rows at 2,048 tokens, each MPT size built with exactly the table's NumParams,
    and labkit's MFU of each row (its FLOPs, from the printed tokens a second a GPU) within half a point of the
    table's own MFU (which counts ``6 N`` and attention)."""
    from labkit.costmodel.published_fsdp import MOSAIC_FSDP, MPT_ROWS, MPT_SHAPES, mpt_shape

    assert len(MOSAIC_FSDP) == len(MPT_ROWS) == 20
    for size, (_, _, _, printed) in MPT_SHAPES.items():
        assert num_parameters(mpt_shape(size)) == printed, size
    for run, row in zip(MOSAIC_FSDP, MPT_ROWS, strict=True):
        assert abs(run.model_mfu - row[2] / 100) < 0.005, run.name
        assert (run.tp, run.pp, run.dp, run.zero) == (1, 1, run.gpus, 3)


def test_mpts_scaling_with_the_gpus_is_followed_a_little_better_than_no_change():
    """For each MPT size timed on more than one GPU count, the change of MFU from its fewest GPUs to its most: the
    kernel model misses them by less in all (17.9 points) than predicting no change (18.9)."""
    (mpt,) = [result for result in held_out() if result.name.startswith("MosaicML")]
    assert len(mpt.runs) == 20 and mpt.critical == 0.380
    changes = validation.scaling_changes(mpt)
    assert {size for size, _, _ in changes} == {"70b", "30b", "13b", "3b", "1b", "760m"}
    missed, flat = sum(abs(p - m) for _, p, m in changes), sum(abs(m) for _, _, m in changes)
    assert missed < flat and (round(100 * missed, 1), round(100 * flat, 1)) == (17.9, 18.9)


def test_the_unseen_set_was_transcribed_before_it_was_predicted_and_is_every_source_row():
    from labkit.costmodel.published_recent import (
        BLOOM_176B,
        KORTHIKANTI_2022,
        MTNLG_530B,
        RECENT_RUNS,
        TORCHTITAN_A100,
        TORCHTITAN_H100,
    )

    (runs,) = validation.UNSEEN.values()
    assert runs == RECENT_RUNS and len(runs) == 25
    assert len(TORCHTITAN_H100) + len(TORCHTITAN_A100) + len(KORTHIKANTI_2022) + len(MTNLG_530B) \
        + len(BLOOM_176B) == 25
    assert not any(run.float8 for run in runs)  # the float8 context-parallel rows are kept apart


def test_strong_scaling_beside_the_constant():
    """The README's strong-scaling figure: the constant wins on the level; on the MFU lost from the first point
    to the last, the model misses by less than a flat line, though it loses more than measured."""
    sweep = validation.strong_scaling()
    assert sweep.constant_rms < sweep.rms
    assert abs(sweep.predicted_drop - sweep.measured_drop) < sweep.measured_drop < sweep.predicted_drop
    assert 2304 in sweep.gpus  # the fit set's 177B row: in sample
