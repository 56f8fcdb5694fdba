"""The language bench's comparison of modes, on hand-written negation reports."""

from __future__ import annotations

import pytest

from editkit.runs.bench.language import TARGET_RATIO, compare


def report(alpha: float, target: float, toxic: float, *, base_toxic: float = 0.10) -> dict:
    """A negation report with theta_0's row and the tuned row (1000 samples each)."""
    def row(a: float, t: float, fraction: float) -> dict:
        return {"alpha": a, "control": 50.0, "target": t, "selectivity": None, "toxic_fraction": fraction,
                "toxic_fraction_stderr": (fraction * (1 - fraction) / 1000) ** 0.5, "mean_score": fraction}

    return {"alpha": alpha, "tuning": {"met": True}, "rows": [row(0.0, 400.0, base_toxic), row(alpha, target, toxic)]}


def test_taujp_the_least_toxic_and_by_how_much():
    checks = compare({"nonlinear": report(0.1, 500.0, 0.08), "linear": report(0.1, 600.0, 0.09),
                      "taujp": report(1.0, 1200.0, 0.05)})["checks"]
    assert checks["target_ratio"] == pytest.approx(2.0) and checks["target_ratio_met"] is (2.0 >= TARGET_RATIO)
    assert checks["toxic_fraction_lowest"] is True
    assert checks["toxic_fraction_vs_best_other"] == pytest.approx(-0.03)
    # 0.10 - 0.05 = 0.05 > 2 x sqrt(0.05 x 0.95 / 1000 + 0.10 x 0.90 / 1000) = 0.023
    assert checks["toxicity_below_theta0"] is True


def test_taujp_not_the_least_toxic_says_by_how_much():
    checks = compare({"nonlinear": report(0.1, 500.0, 0.06), "taujp": report(1.0, 600.0, 0.075)})["checks"]
    assert checks["toxic_fraction_lowest"] is False
    assert checks["toxic_fraction_vs_best_other"] == pytest.approx(0.015)
    assert checks["target_ratio_met"] is False  # 1.2 < 1.5


def test_one_mode_alone_has_no_checks():
    assert compare({"taujp": report(1.0, 600.0, 0.07)})["checks"] == {}
