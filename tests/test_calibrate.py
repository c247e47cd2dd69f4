"""This machine's calibration cannot carry a link faster than a memory copy (issue 41): the alpha-beta fit on
medians of repeated samples, refused above the copy bandwidth or when flat (labkit.costmodel.collectives),
the bound measured (labkit.measure), kept and checked in the saved constants (labkit.costmodel.calibration),
and calibrate measuring a refused link again, loudly, before it gives up (labkit.calibrate)."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict

import pytest

from labkit import calibrate as calibrate_module
from labkit.costmodel.calibration import Calibration, average, load, save
from labkit.costmodel.collectives import LinkModel, fit_alpha_beta
from labkit.launch import launch
from labkit.measure import measure_alpha_beta, measure_copy_bandwidth

SIZES = (8, 1 << 14, 1 << 17, 1 << 20)  # calibrate's link sizes
COPY = 42e9  # one thread's copy of a 1 MiB message on the 2-core reference machine, bytes per second
ALPHA, BETA = 400e-6, 1 / 1.5e9  # a plausible gloo ring step there: 0.4 ms, 1.5 GB/s


def _line(alpha: float, beta: float, noise: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)) -> list[float]:
    return [(alpha + size * beta) * factor for size, factor in zip(SIZES, noise, strict=True)]


def test_a_flat_slope_is_refused_above_the_copy_bandwidth_naming_the_times_and_the_fit():
    flat = _line(2e-3, 1 / 437e9)  # what the issue saw: the size dependence drowned in noise
    assert fit_alpha_beta(SIZES, flat).bandwidth_bytes_per_s == pytest.approx(437e9, rel=1e-6)  # unbounded: absurd
    with pytest.raises(ValueError, match=r"437\.0 GB/s.*1,048,576 B 2002\.4 us.*above 42\.0 GB/s"):
        fit_alpha_beta(SIZES, flat, max_bandwidth_bytes_per_s=COPY)


def test_times_that_do_not_grow_with_the_size_are_refused_rather_than_guessed():
    falling = [4e-3, 4e-3, 1e-3, 1.2e-3]  # a scheduler hiccup on the small messages
    assert fit_alpha_beta(SIZES, falling).beta_s_per_byte > 0  # unbounded: the old two-point guess
    with pytest.raises(ValueError, match="do not grow with the message size"):
        fit_alpha_beta(SIZES, falling, max_bandwidth_bytes_per_s=COPY)


def test_a_larger_message_lifts_a_flat_fit_above_the_noise():
    """What CI's browser run measured beside JupyterLab and Chromium: a ring step's times flat from 8 B to 1 MiB
    (milliseconds of scheduling noise against the 1 MiB message's 0.7 ms of bandwidth); the messages of 8 MiB and
    64 MiB that calibrate adds on each new measurement carry the bandwidth term (1.5 GB/s here) well above 3 ms more
    of noise, and the fit comes back within 10 % of it."""
    observed = [3060.4e-6, 1473.1e-6, 4659.4e-6, 1279.7e-6]
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta(SIZES, observed, max_bandwidth_bytes_per_s=COPY)
    larger = (8 << 20, 64 << 20)
    sizes, times = (*SIZES, *larger), observed + [ALPHA + size * BETA + 3e-3 for size in larger]
    assert fit_alpha_beta(sizes, times, max_bandwidth_bytes_per_s=COPY).bandwidth_bytes_per_s == pytest.approx(
        1 / BETA, rel=0.1)


def test_a_good_noisy_fit_passes_below_the_copy_bandwidth():
    link = fit_alpha_beta(SIZES, _line(ALPHA, BETA, (1.03, 0.97, 1.02, 0.98)), max_bandwidth_bytes_per_s=COPY)
    assert link.alpha_s == pytest.approx(ALPHA, rel=0.1) and link.beta_s_per_byte == pytest.approx(BETA, rel=0.05)
    exact = fit_alpha_beta(SIZES, _line(ALPHA, BETA), max_bandwidth_bytes_per_s=1.6e9)  # just below the bound
    assert exact.beta_s_per_byte == pytest.approx(BETA, rel=1e-9)
    with pytest.raises(ValueError, match="above 1.4 GB/s"):  # just above it: refused
        fit_alpha_beta(SIZES, _line(ALPHA, BETA), max_bandwidth_bytes_per_s=1.4e9)


def test_an_outlier_sample_moves_the_median_not_the_fit():
    """Five samples a size, the largest message's slowed threefold once by a burst of load elsewhere: their
    means tilt the line, their medians (what the fit takes from repeated samples) do not."""
    samples = [[t, t * 1.01, t * 0.99, t * 3 if size == max(SIZES) else t, t * 1.02] for size, t in
               zip(SIZES, _line(ALPHA, BETA), strict=True)]
    robust = fit_alpha_beta(SIZES, samples, max_bandwidth_bytes_per_s=COPY)
    assert robust.alpha_s == pytest.approx(ALPHA, rel=0.03) and robust.beta_s_per_byte == pytest.approx(BETA, rel=0.03)
    means = fit_alpha_beta(SIZES, [statistics.fmean(values) for values in samples])
    assert abs(means.beta_s_per_byte / BETA - 1) > 0.3  # the checker above would have caught the mean


def test_a_negative_latency_is_clipped_to_none():
    # calibrate's all-reduce amid compute: two sizes, its line through them meets the time axis below zero
    link = fit_alpha_beta(SIZES[-2:], [0.1e-3, 2e-3], max_bandwidth_bytes_per_s=COPY)
    assert link.alpha_s == 0.0 and link.beta_s_per_byte == pytest.approx(1.9e-3 / (SIZES[-1] - SIZES[-2]))


def _calibration(**changes) -> Calibration:
    constants = dict(flops=48e9, layer_overhead_s=8e-4, alpha_s=ALPHA, beta_s_per_byte=BETA,
                     optimizer_s_per_parameter=1.2e-8, cores=2, ranks=8, machine="laptop", loaded_alpha_s=2e-3,
                     loaded_beta_s_per_byte=1 / 0.5e9, throughput=(1.0, 1.9), straggle=(1.0, 1.1),
                     pass_overhead_s=1e-4, copy_bytes_per_s=COPY)
    return Calibration(**(constants | changes))


def test_a_calibration_refuses_a_link_faster_than_its_memory_copy():
    good = _calibration()
    assert "below one thread's memory copy at 42.0 GB/s" in good.describe()
    with pytest.raises(ValueError, match=r"the gloo ring step at 437\.0 GB/s.*copies memory \(42\.0 GB/s"):
        _calibration(beta_s_per_byte=1 / 437e9)
    with pytest.raises(ValueError, match=r"the all-reduce amid compute at 437\.0 GB/s"):
        _calibration(loaded_beta_s_per_byte=1 / 437e9)
    with pytest.raises(ValueError, match="must be > 0"):
        _calibration(beta_s_per_byte=0.0)
    with pytest.raises(ValueError, match="must be > 0"):
        _calibration(loaded_beta_s_per_byte=0.0)  # a loaded latency without a bandwidth
    for negative in ("loaded_alpha_s", "alpha_s", "copy_bytes_per_s"):
        with pytest.raises(ValueError, match=">= 0"):
            _calibration(**{negative: -1e-6})
    assert _calibration(loaded_alpha_s=0.0, loaded_beta_s_per_byte=0.0).loaded_link == good.link  # not measured


def test_a_calibration_saved_before_the_copy_was_measured_still_loads(tmp_path):
    older = asdict(_calibration())
    del older["copy_bytes_per_s"]
    older["beta_s_per_byte"] = 1 / 437e9  # unchecked: there is no measured copy to hold it to
    (tmp_path / "calibration.json").write_text(json.dumps(older))
    loaded = load(tmp_path / "calibration.json")
    assert loaded is not None and loaded.copy_bytes_per_s == 0.0 and "memory copy not measured" in loaded.describe()
    assert load(save(_calibration(), tmp_path / "new.json")) == _calibration()


def test_calibrations_averaged_around_a_run_keep_their_links_below_the_copy():
    before = _calibration(beta_s_per_byte=1 / 40e9, copy_bytes_per_s=40e9)  # each link at its own bound
    after = _calibration(beta_s_per_byte=1 / 20e9, copy_bytes_per_s=20e9)
    both = average([before, after])
    assert both.copy_bytes_per_s == pytest.approx(30e9) and both.link.bandwidth_bytes_per_s < 30e9
    assert average([before, _calibration(copy_bytes_per_s=0.0)]).copy_bytes_per_s == 40e9  # unmeasured: left out


def test_one_threads_copy_bandwidth_is_measured():
    rate = measure_copy_bandwidth(1 << 20, repeats=3)
    assert 1e8 < rate < 1e12, f"{rate / 1e9:.2f} GB/s"
    with pytest.raises(ValueError, match="nbytes and repeats"):
        measure_copy_bandwidth(0)


def _refusal_on_each_rank() -> str:
    try:
        measure_alpha_beta(SIZES, iterations=2, max_bandwidth_bytes_per_s=1.0)  # no link is that slow
    except ValueError as error:
        return str(error)
    return "accepted"


def test_every_rank_refuses_the_same_link_so_none_is_left_waiting():
    refusals = launch(_refusal_on_each_rank, nprocs=2, timeout=60, rank_output="none")
    assert refusals[0] == refusals[1] and refusals[0] != "accepted"


def test_calibrate_measures_a_refused_link_again_and_gives_up_after_attempts(monkeypatch):
    attempts = []

    def flaky(sizes: tuple[int, ...]) -> LinkModel:
        attempts.append(sizes)
        if len(attempts) < 3:
            raise ValueError(f"refusal {len(attempts)}")
        return LinkModel(ALPHA, BETA)

    refused: list[str] = []
    assert calibrate_module._until_physical(flaky, SIZES, refused) == LinkModel(ALPHA, BETA)
    assert refused == ["refusal 1", "refusal 2"]
    # each new measurement adds a message 8 times the largest: its bandwidth term 8 times higher above the noise
    assert attempts == [SIZES, (*SIZES, 8 << 20), (*SIZES, 8 << 20, 64 << 20)]

    def flat(sizes: tuple[int, ...]) -> LinkModel:
        raise ValueError("flat")

    refused.clear()
    assert calibrate_module._until_physical(flat, SIZES, refused) is None
    assert refused == ["flat"] * calibrate_module.ATTEMPTS

    # the parent: each refusal a warning and a progress line; no physical fit left, a ValueError, nothing saved
    monkeypatch.setattr(calibrate_module, "_fit_compute", lambda *args: (48e9, 8e-4, 1e-4))
    monkeypatch.setattr(calibrate_module, "measure_copy_bandwidth", lambda *args, **kwargs: COPY)
    job = {"ring": LinkModel(ALPHA, BETA), "loaded": LinkModel(2e-3, 1 / 0.5e9), "refused": ["the first fit"],
           "curve": {1: 0.01, 2: 0.011, 4: 0.021, 8: 0.042}, "rounds": [[0.04] * 8, [0.05] * 8]}
    monkeypatch.setattr(calibrate_module, "launch", lambda *args, **kwargs: [job])
    lines: list[str] = []
    with pytest.warns(UserWarning, match="refused and the link measured again: the first fit"):
        measured = calibrate_module.calibrate(micro_batches=(1, 2), repeats=1, progress=lines.append)
    assert measured.copy_bytes_per_s == COPY and measured.link == LinkModel(ALPHA, BETA)
    assert any("REFUSED" in line for line in lines) and any("42.0 GB/s" in line for line in lines)
    job.update(loaded=None, refused=["flat"] * 3)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="unphysical after 3 measurements.*flat"):
        calibrate_module.calibrate(micro_batches=(1, 2), repeats=1)
