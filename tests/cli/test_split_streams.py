"""`editkit stream --scenario split-mnist`: the shipped split scenario runs offline end to end, its five
experiences in Avalanche's class order, with the field's numbers in its report."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from editkit.cli import app

runner = CliRunner()


@pytest.mark.slow
def test_split_mnist_streams_its_five_experiences_and_reports_acc_and_bwt(tmp_path):
    result = runner.invoke(app, ["stream", "--scenario", "split-mnist", "--steps", "2", "--bank", str(tmp_path / "bank"),
                                 "--run-dir", str(tmp_path / "run"), "--mode", "linear"])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    tasks = ["mnist-5-4", "mnist-8-2", "mnist-6-9", "mnist-1-7", "mnist-0-3"]
    assert [s["task"] for s in report["steps"]] == tasks
    matrix = report["continual"]["matrix"]
    assert [sum(v is not None for v in row) for row in matrix] == [1, 2, 3, 4, 5]
    assert report["continual"]["acc"] == pytest.approx(sum(matrix[-1]) / 5)
    assert all(0.0 <= v <= 1.0 for row in matrix for v in row if v is not None)
