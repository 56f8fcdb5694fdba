"""The bench's cost table: steady seconds per step and their ratio to the linear stream (computed into the report by
``with_step_ratios``), worked out by hand."""

from __future__ import annotations

from rich.console import Console

from editkit.runs.bench.report import with_step_ratios
from editkit.runs.bench.tables import cost_table


def _cost(steady: float | None, setup: float | None) -> dict:
    return {"finetune_seconds": 10.0, "steps": 40, "seconds_per_step": 0.25, "setup_seconds": setup,
            "steady_seconds_per_step": steady, "peak_rss_mib": 900.0, "merge_seconds": 0.1, "ties_seconds": None,
            "total_seconds": 10.1}


def _rows(report: dict) -> dict[str, list[str]]:
    console = Console(width=250, record=True)
    console.print(cost_table(report))
    lines = console.export_text().splitlines()
    return {line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:-1]]
            for line in lines if line.startswith("│")}


def test_each_stream_is_compared_with_the_linear_stream_of_its_adapter():
    report = {"cost": with_step_ratios({"linear": _cost(0.200, 3.0), "taujp": _cost(0.230, 3.5),
                                        "linear-lora": _cost(0.100, 1.0), "taujp-lora": _cost(0.125, 1.0)})}
    assert report["cost"]["taujp-lora"]["steady_over_linear"] == 0.125 / 0.100
    rows = _rows(report)
    assert rows["taujp"][3:6] == ["3.5", "0.230", "1.15"]  # 0.230 / 0.200
    assert rows["taujp-lora"][5] == "1.25"  # 0.125 / 0.100, not against the full linear stream
    assert rows["linear"][5] == "1.00"


def test_a_report_without_steady_timings_shows_dashes():
    old = _cost(None, None)
    del old["steady_seconds_per_step"], old["setup_seconds"]  # a report written before the split
    rows = _rows({"cost": {"linear": _cost(0.2, 1.0), "nonlinear": old}})
    assert rows["nonlinear"][3:6] == ["—", "—", "—"]
