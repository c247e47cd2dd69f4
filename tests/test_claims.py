"""labkit.claims: computed claims fail in every run, measured ones print a verdict for a learner and fail in strict
mode; the sanitizer masks what is marked measured and nothing else."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from labkit import claims
from tests.notebook_outputs import comparable, sanitize_patterns

BAND = claims.Band(0.8, 1.25, source="spread of 10 runs on the reference machine: 0.86x to 1.17x")
POINTS = claims.Band(-0.005, 0.10, source="the runtime only adds idle time; CI measured up to 7 points",
                     relative=False)


@pytest.fixture
def learner(monkeypatch):
    monkeypatch.delenv(claims.STRICT_VARIABLE, raising=False)


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv(claims.STRICT_VARIABLE, "1")


def test_exact_prints_its_words_and_raises_naming_both_values_in_any_mode(learner, capsys):
    assert claims.exact("bytes sent equal the model's", 5_314_560, 5_314_560) == 5_314_560
    assert capsys.readouterr().out == "✓ bytes sent equal the model's: 5314560\n"
    assert claims.exact("a bubble", Fraction(3, 11), Fraction(3, 11), shown="3/11")
    with pytest.raises(claims.ClaimFailed, match=r"bytes: expected 10, got 11"):
        claims.exact("bytes", 11, 10)


def test_holds_and_close_are_computed_claims_that_fail_in_a_learners_run(learner, capsys):
    claims.holds("communication never shrinks with t", True, shown="5.7 ms, 28.2 ms")
    assert capsys.readouterr().out == "✓ communication never shrinks with t: 5.7 ms, 28.2 ms\n"
    with pytest.raises(claims.ClaimFailed, match="does not hold"):
        claims.holds("the bubble shrinks", False)
    assert claims.close("the split model's loss equals the dense one's", 2.4e-7, tolerance=1e-5) == 2.4e-7
    assert "~2.4e-07" in capsys.readouterr().out  # a rounding difference prints as measured
    with pytest.raises(claims.ClaimFailed, match="beyond 1e-05"):
        claims.close("parity", 3e-5, tolerance=1e-5)
    with pytest.raises(claims.ClaimFailed):
        claims.close("parity", float("nan"), tolerance=1e-5)
    claims.close("a ratio", 8.00001, 8.0, tolerance=1e-4, relative=True)
    with pytest.raises(claims.ClaimFailed, match="relative"):
        claims.close("a ratio", 8.1, 8.0, tolerance=1e-4, relative=True)


def test_a_measured_miss_is_a_visible_verdict_for_a_learner_and_the_notebook_goes_on(learner, capsys):
    assert claims.measured("the step takes the model's time", 0.0316, 0.0306, BAND, unit="ms", scale=1e3,
                           spec=".1f")
    out = capsys.readouterr().out
    assert out == "✓ the step takes the model's time: measured ~31.6 ms, within 0.8x to 1.25x of 30.6 ms\n"
    assert not claims.measured("the step takes the model's time", 0.0808, 0.0306, BAND, unit="ms", scale=1e3,
                               spec=".1f")
    out = capsys.readouterr().out
    assert out.startswith("✗ the step takes the model's time: expected 0.8x to 1.25x of 30.6 ms, measured ~80.8 ms")
    assert claims.BUSY in out and BAND.source in out
    assert not claims.measured_holds("t = 4 slower than t = 2", False, shown="~0.08 s, ~0.17 s",
                                     source="2 ranks per core at t = 4")
    assert "✗ t = 4 slower than t = 2: not so this time (~0.08 s, ~0.17 s)" in capsys.readouterr().out


def test_a_measured_miss_fails_in_strict_mode_naming_the_band_and_its_source(strict):
    with pytest.raises(claims.ClaimFailed, match=r"measured ~80.8 ms.*strict mode.*spread of 10 runs"):
        claims.measured("the step", 0.0808, 0.0306, BAND, unit="ms", scale=1e3, spec=".1f")
    with pytest.raises(claims.ClaimFailed, match="not so this time"):
        claims.measured_holds("an order", False, shown="~1, ~2", source="a margin of 2x")
    assert claims.measured("the step", 0.0316, 0.0306, BAND)  # a hit is a hit in either mode


def test_a_strict_miss_is_told_apart_from_a_computed_claims_failure_and_any_other_error(strict):
    for measured in (lambda: claims.measured("the step", 2.0, 1.0, BAND),
                     lambda: claims.measured_holds("an order", False, shown="~1, ~2", source="a margin of 2x")):
        with pytest.raises(claims.ClaimFailed) as missed:
            measured()
        assert claims.strict_miss(f"ClaimFailed: {missed.value}")
    for computed in (lambda: claims.exact("bytes", 1, 2), lambda: claims.holds("an order", False),
                     lambda: claims.close("a sum", 1.0, 2.0, tolerance=0.1)):
        with pytest.raises(claims.ClaimFailed) as failed:
            computed()
        assert not claims.strict_miss(f"ClaimFailed: {failed.value}")
    assert not claims.strict_miss("NameError: name 'seconds' is not defined")


def test_a_difference_band_reads_in_points_and_both_edges_count(learner, capsys):
    assert claims.measured("bubble near its closed form", 0.373, 0.273, POINTS, unit="%", scale=100, spec=".1f")
    assert "within -0.5 to +10 points of 27.3%" in capsys.readouterr().out
    assert not claims.measured("bubble near its closed form", 0.26, 0.273, POINTS, unit="%", scale=100,
                               spec=".1f")
    assert "(~-1.3 points)" in capsys.readouterr().out
    assert claims.measured("model fed measured durations", 0.15, 0.149, POINTS, unit="%", scale=100,
                           expected_measured=True)
    assert "of ~14.9%" in capsys.readouterr().out


def test_a_band_must_say_where_it_comes_from_and_be_ordered():
    with pytest.raises(ValueError, match="where it comes from"):
        claims.Band(0.5, 2.0, source=" ")
    with pytest.raises(ValueError, match="low <= high"):
        claims.Band(2.0, 0.5, source="x")
    with pytest.raises(ValueError, match="margin"):
        claims.measured_holds("x", True, shown="", source="")
    assert not claims.Band(0.5, 2.0, source="x").contains(1.0, 0.0)
    assert not claims.Band(0.5, 2.0, source="x").contains(float("nan"), 1.0)


def test_every_claim_is_recorded_and_reported_per_file(learner, tmp_path, monkeypatch, capsys):
    log = tmp_path / "06.jsonl"
    monkeypatch.setenv(claims.LOG_VARIABLE, str(log))
    claims.exact("bytes", 3, 3)
    claims.close("parity", 1e-7, tolerance=1e-5)
    claims.measured("step", 2.0, 1.0, BAND)
    claims.measured_holds("order", True, shown="~1 < ~2", source="a 2x margin, measured")
    entries = claims.read_log([str(log)])
    assert [entry["kind"] for entry in entries] == ["exact", "close", "measured", "measured_holds"]
    assert [entry["holds"] for entry in entries] == [True, True, False, True]
    assert json.loads(log.read_text().splitlines()[2])["source"] == BAND.source
    table = claims.report(entries)
    assert table.startswith("## 06.jsonl") and "✗ [measured] step | band 0.8 to 1.25x; spread" in table
    assert "within 1e-05" in table and "margin: a 2x margin" in table


def test_the_sanitizer_masks_values_marked_measured_and_never_a_models_output():
    patterns = sanitize_patterns()

    def sanitized(text: str) -> str:
        return comparable([{"output_type": "stream", "name": "stdout", "text": text}], patterns)["stdout"][0]

    model = "t = 2: model 30.6 ms, of which 5.7 ms in 21 collectives; 102.5 s a step, 1.33x; 450 GB/s; MFU 52.2%"
    assert sanitized(model) == model  # what the models compute is compared digit for digit
    assert sanitized("measured ~80.8 ms, ~0.62x, ~-1.29 ms, ~1,044.0 ms, ~3.6e-03, ~nan") == (
        "measured ~<MEASURED> ms, ~<MEASURED>x, ~<MEASURED> ms, ~<MEASURED> ms, ~<MEASURED>, ~<MEASURED>")
    assert sanitized("  ~99.9 ms\n ~100.1 ms") == sanitized(" ~100.1 ms\n ~100.1 ms")  # a column's padding
    # labkit.train's own progress line: every field is measured, in its own format
    line = "[##] step    20/40 loss 2.1149, +0.866 above the floor | per rank: 2.088 2.142 | MiB/step: all_reduce 0.45 | 43.0 ms/step"
    assert sanitized(line) == "[##] step    20/40 loss <LOSS> | per rank: <LOSSES> | MiB/step: all_reduce 0.45 | <TIME> ms/step"
    below = line.replace("+0.866 above the floor", "0.004 below the floor (one batch's noise)")
    assert sanitized(below) == sanitized(line)
    assert sanitized("final loss 1.438 of the model") == "final loss 1.438 of the model"  # not the trainer's line
