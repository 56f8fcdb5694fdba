"""The verdict a language negation reports (``detox_checks``), on rows whose numbers are set by hand."""

from __future__ import annotations

import math

from editkit.runs.negate_lm import detox_checks


def row(alpha, fraction, n=1000, controls=(100.0, 50.0), distinct=0.8):
    return {"alpha": alpha, "toxic_fraction": fraction, "toxic_fraction_stderr": math.sqrt(fraction * (1 - fraction) / n),
            "controls": {"a": controls[0], "b": controls[1]}, "distinct_2": distinct}


def test_a_vector_that_carries_and_a_negation_that_halves_with_language_kept():
    # +tau 0.12 vs 0.08: difference 0.04 > 2 * hypot(0.0103, 0.0086) = 0.027; -2 tau 0.03: <= 0.04, 0.05 > 0.019
    rows = [row(0.0, 0.08), row(-1.0, 0.12), row(1.0, 0.05), row(2.0, 0.03, controls=(109.0, 54.0), distinct=0.73)]
    assert detox_checks(rows, 2.0) == {"carries": True, "removes": True, "control_kept": True, "varied": True}


def test_each_check_fails_on_its_own_number():
    base, plus = row(0.0, 0.08), row(-1.0, 0.095)  # +0.015 < 2 s.e. of the difference (0.025)
    assert not detox_checks([base, plus, row(1.0, 0.03)], 1.0)["carries"]
    # 0.045 is below theta_0 by more than 2 s.e. but more than half of 0.08: not removed
    assert not detox_checks([base, plus, row(1.0, 0.045)], 1.0)["removes"]
    assert not detox_checks([base, plus, row(1.0, 0.03, n=40)], 1.0)["removes"]  # halved, within the noise
    assert not detox_checks([base, plus, row(1.0, 0.03, controls=(100.0, 55.5))], 1.0)["control_kept"]  # 1.11 x
    assert not detox_checks([base, plus, row(1.0, 0.03, distinct=0.71)], 1.0)["varied"]  # 0.8875 x
