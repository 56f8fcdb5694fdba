"""ACC, BWT and forgetting of an accuracy matrix, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from editkit.eval.continual import continual_metrics

TASKS = ["a", "b", "c"]


def test_three_tasks_by_hand():
    rows = [{"a": 0.9}, {"a": 1.0, "b": 0.7}, {"a": 0.85, "b": 0.6, "c": 0.5}]
    metrics = continual_metrics(TASKS, rows)
    assert metrics["matrix"] == [[0.9, None, None], [1.0, 0.7, None], [0.85, 0.6, 0.5]]
    assert metrics["acc"] == pytest.approx((0.85 + 0.6 + 0.5) / 3)
    # BWT: a 0.85 - 0.9, b 0.6 - 0.7 -> -0.075; forgetting from each task's best: a 1.0 - 0.85, b 0.7 - 0.6 -> 0.125
    assert metrics["bwt"] == pytest.approx(-0.075)
    assert metrics["forgetting"] == pytest.approx(0.125)


def test_a_later_task_that_helps_an_earlier_one_is_positive_transfer_and_no_forgetting():
    metrics = continual_metrics(["a", "b"], [{"a": 0.6}, {"a": 0.8, "b": 0.9}])
    assert metrics["bwt"] == pytest.approx(0.2) and metrics["forgetting"] == pytest.approx(-0.2)
    assert metrics["acc"] == pytest.approx(0.85)


def test_one_task_has_no_backward_transfer():
    metrics = continual_metrics(["a"], [{"a": 0.7}])
    assert metrics["acc"] == 0.7 and metrics["bwt"] is None and metrics["forgetting"] is None


def test_a_missing_score_is_refused_by_name():
    with pytest.raises(ValueError, match="no accuracy of task 'a' after experience 1"):
        continual_metrics(["a", "b"], [{"a": 0.7}, {"b": 0.9}])
    with pytest.raises(ValueError, match="one row of scores per experience"):
        continual_metrics(["a", "b"], [{"a": 0.7}])
