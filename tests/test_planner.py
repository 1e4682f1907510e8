"""The planner on synthetic points: the fit, the card table, and accum: auto."""

from __future__ import annotations

import math

import pytest

from gradaccum import planner
from gradaccum.records import Line

MODEL = Line(fixed_mib=1000.0, per_sample_mib=3.5)


def test_fit_recovers_a_line() -> None:
    micro = [256, 512, 1024, 2048, 4096]
    fit = planner.line_through_points(micro, [1000 + 3.5 * m for m in micro])
    assert fit.fixed_mib == pytest.approx(1000) and fit.per_sample_mib == pytest.approx(3.5)
    assert fit.r2 == pytest.approx(1.0)


def test_fit_with_noise_reports_r2() -> None:
    fit = planner.line_through_points([1, 2, 3, 4], [10, 13, 15, 19])
    assert 0.9 < fit.r2 < 1.0 and fit.per_sample_mib == pytest.approx(2.9)


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(ValueError, match="two or more distinct micro-batch sizes"):
        planner.line_through_points([512, 512], [1.0, 2.0])


def test_largest_micro_batch_and_smallest_accum() -> None:
    budget = 1000 + 3.5 * 8192  # exactly 8192 samples fit
    assert planner.largest_micro_batch(MODEL, budget, 32768) == 8192
    assert planner.smallest_accum_by_line(MODEL, budget, 32768) == 4
    assert planner.largest_micro_batch(MODEL, 1e9, 32768) == 32768  # never more than the batch
    assert planner.smallest_accum_by_line(MODEL, 1e9, 32768) == 1
    assert planner.smallest_accum_by_line(MODEL, 900, 32768) is None  # the fixed part alone does not fit


def test_smallest_accum_accounts_for_ceil() -> None:
    model = Line(fixed_mib=0.0, per_sample_mib=1.0)
    accum = planner.smallest_accum_by_line(model, 3, 10)  # at most 3 per micro-batch: ceil(10/4) = 3 fits, accum 4
    assert accum == 4 and math.ceil(10 / accum) <= 3


def test_card_table() -> None:
    rows = planner.card_table(MODEL, 32768, [8, 141], margin=0.1)  # 1000 + 3.5 x 32768 fits in 141 GB
    small, big = rows
    # By hand: 8 GiB less 10% is 7372.8 MiB; (7372.8 - 1000) / 3.5 = 1820.8 samples; 32768 / 1820 = 18.004,
    # so accum 19, micro-batches of ceil(32768 / 19) = 1725, predicted 1000 + 3.5 x 1725 = 7037.5 MiB.
    assert small["usable_mib"] == 7373 and small["largest_micro_batch"] == 1820
    assert (small["smallest_accum"], small["micro_batch"], small["predicted_peak_mib"]) == (19, 1725, 7038)
    assert big["smallest_accum"] == 1 and big["micro_batch"] == 32768


def test_options_per_lever_fastest_first() -> None:
    """Checkpointing fits a bigger micro-batch in the same memory; the option that runs faster comes first."""
    fits = {False: MODEL, True: Line(fixed_mib=1000.0, per_sample_mib=1.0)}
    speeds = {False: ([256, 4096], [900.0, 1000.0]), True: ([256, 4096], [600.0, 700.0])}
    budget = 1000 + 3.5 * 8192  # the plain model fits micro-batch 8192: accum 4 for batch 32768
    options = planner.options(fits, speeds, budget, 32768)
    assert [o["checkpointing"] for o in options] == [False, True]
    plain, ckpt = options
    assert (plain["accum"], plain["micro_batch"], plain["images_per_s"]) == (4, 8192, 1000.0)  # beyond: the last
    assert ckpt["accum"] == 2 and ckpt["micro_batch"] == 16384 and ckpt["predicted_peak_mib"] == 1000 + 16384
    slow_plain = {**speeds, False: ([256, 4096], [300.0, 400.0])}
    assert planner.options(fits, slow_plain, budget, 32768)[0]["checkpointing"]
    roomy = 1000 + 3.5 * 32768  # both fit accum 1: the same work, checkpointing adds a recomputed forward
    assert [o["accum"] for o in planner.options(fits, slow_plain, roomy, 32768)] == [1, 1]
    assert not planner.options(fits, slow_plain, roomy, 32768)[0]["checkpointing"]  # a slow sweep point aside
    assert planner.options(fits, speeds, 500.0, 32768) == []  # nothing fits: not even the fixed part
    cards = planner.card_table(MODEL, 32768, [8, 40], 0.1, fits, speeds)
    assert all("options" in c for c in cards) and cards[1]["options"][0]["accum"] <= cards[0]["options"][0]["accum"]


def test_a_bent_curve_is_predicted_from_its_points_not_under_them() -> None:
    """Checkpointing's peaks on the CPU (measured): the line alone predicted 3% under the middle point."""
    micro, peaks = [64, 256, 512], [896.0, 1170.0, 1395.0]
    fit = planner.line_through_points(micro, peaks)
    assert fit.fixed_mib + fit.per_sample_mib * 256 < 0.97 * 1170  # what the line alone would say
    assert [planner.predict_mib(fit, m) for m in micro] == peaks
    assert planner.predict_mib(fit, 160) == pytest.approx(896 + (1170 - 896) * 96 / 192)  # joined
    assert planner.predict_mib(fit, 1024) == pytest.approx(1395 + fit.per_sample_mib * 512)  # the line's slope
    assert planner.predict_mib(fit, 32) == pytest.approx(896 - fit.per_sample_mib * 32)


def test_a_noisy_small_point_never_lowers_a_larger_ones_prediction() -> None:
    fit = planner.line_through_points([64, 128, 256], [900.0, 890.0, 1100.0])
    assert fit.points == [(64, 900.0), (128, 900.0), (256, 1100.0)]


def test_largest_micro_batch_inverts_the_joined_points() -> None:
    fit = planner.line_through_points([64, 256, 512], [896.0, 1170.0, 1395.0])
    for budget in (900.0, 1000.0, 1170.0, 1300.0, 2000.0):
        m = planner.largest_micro_batch(fit, budget, 4096)
        assert planner.predict_mib(fit, m) <= budget < planner.predict_mib(fit, m + 1)
    assert planner.largest_micro_batch(fit, 10.0, 4096) == 0
