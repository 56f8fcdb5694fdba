"""Output that reads in a log: written to a pipe or a file, editkit's console lays a wide table out at its
full width (nothing cut to "…"; ``COLUMNS`` still wins when set), and progress is one line per finished
task, with no carriage-return frames."""

from __future__ import annotations

import io

import pytest
from rich.table import Table

from editkit.cli.console import LogConsole, RichProgress, redraws, step_table
from editkit.runs.records import StepRecord, TrainingCost

from helpers.cli import FINISHED_TASK

COLUMNS = [f"a long column header number {i}" for i in range(12)]


@pytest.fixture(autouse=True)
def no_columns(monkeypatch):
    """What a pipe in CI sees: no COLUMNS, no forced colour or interactivity."""
    for variable in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(variable, raising=False)


def wide_table() -> Table:
    table = Table(title="a table many columns wide, with long headers and long cells")
    for name in COLUMNS:
        table.add_column(name)
    table.add_row(*[f"ctrl ppl {i} / toxic ± s.e. < theta_0 - 2 s.e." for i in range(len(COLUMNS))])
    return table


def rendered(console: LogConsole) -> str:
    console.print(wide_table())
    return console.file.getvalue()


def test_a_wide_table_written_to_a_stream_is_laid_out_whole():
    text = rendered(LogConsole(file=io.StringIO()))
    assert "…" not in text
    assert all(name in text for name in COLUMNS)  # every header on one line, none wrapped
    assert max(len(line) for line in text.splitlines()) > 80 * 5


def test_columns_when_set_still_bounds_the_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    text = rendered(LogConsole(file=io.StringIO()))
    assert max(len(line) for line in text.splitlines()) <= 100


def test_a_terminal_keeps_its_own_width():
    console = LogConsole(file=io.StringIO(), force_terminal=True, width=90, color_system=None)
    assert max(len(line) for line in rendered(console).splitlines()) <= 90


@pytest.mark.parametrize("force_terminal", [False, True])  # True: rich's view of a log with FORCE_COLOR set
def test_progress_to_a_stream_is_one_line_per_finished_task(force_terminal):
    console = LogConsole(file=io.StringIO(), force_terminal=force_terminal)
    assert not redraws(console)
    progress = RichProgress(console)
    for description, total in (("training", 2000), ("evaluating", 300)):
        with progress.task(description, total=total) as bar:
            for step in range(total):
                bar.advance(1, ce=1.0 / (step + 1), penalty=0.5)
    text = console.file.getvalue()
    assert "\r" not in text and "\x1b[" not in text  # no frames, no cursor moves
    lines = text.splitlines()
    assert len(lines) == 2 and all(FINISHED_TASK.match(line) for line in lines), text
    assert lines[0].startswith("training: 2000/2000 in ") and lines[0].endswith("ce 0.0005  penalty 0.5000")
    assert lines[1].startswith("evaluating: 300/300 in ")


def test_an_interrupted_task_prints_nothing():
    console = LogConsole(file=io.StringIO())
    with pytest.raises(KeyboardInterrupt):
        with RichProgress(console).task("training", total=10) as bar:
            bar.advance(3)
            raise KeyboardInterrupt
    assert console.file.getvalue() == ""


def step_title(cost: TrainingCost) -> str:
    merged = {"per_task": {"a": 0.9}, "absolute": 90.0, "normalized": 100.0}
    step = StepRecord(step=0, task="a", pretrained=0.5, single_task=0.9, cost=cost, merged=merged)
    return step_table(step, {"a": 0.9}).title


def test_a_stream_step_shows_its_median_steady_step_beside_its_fine_tuning_seconds():
    # 2 warm-up steps of 1.0 s and 8 steady steps of 0.2 s: 2.6 s, 0.26 s over all 10 steps
    cost = TrainingCost(train_seconds=2.6, seconds_per_step=0.26, train_steps=10, steady_seconds_per_step=0.2)
    assert step_title(cost).endswith("0.200 s/step (steady), 2.6 s fine-tuning")


def test_a_bank_from_before_steps_were_timed_shows_seconds_over_steps():
    cost = TrainingCost(train_seconds=2.6, seconds_per_step=0.26, train_steps=10)
    assert step_title(cost).endswith("0.26 s/step")


def test_a_stream_step_title_is_one_line_in_a_log():
    """Printed off a terminal, the step's title (longer than its table) stays one line: rich wraps a title to the
    table's width, which broke '0.200 s/step' / '(steady), 2.6 s fine-tuning' onto two lines of a log."""
    cost = TrainingCost(train_seconds=2.6, seconds_per_step=0.26, train_steps=10, steady_seconds_per_step=0.2)
    merged = {"per_task": {"a": 0.9}, "absolute": 90.0, "normalized": 100.0}
    step = StepRecord(step=0, task="a", pretrained=0.5, single_task=0.9, cost=cost, merged=merged)
    console = LogConsole(file=io.StringIO(), width=80)
    console.print(step_table(step, {"a": 0.9}))
    title = step_title(cost)
    assert any(line.strip() == title.strip() for line in console.file.getvalue().splitlines()), console.file.getvalue()
