"""``--log tensorboard,csv``: what the loggers write is what the run reports and banks.

The end-to-end test runs a reduced two-task offline-vision stream through the CLI and
reads its logs back the way their users do (TensorBoard's ``EventAccumulator``, the csv
module); the ground truth is the run's ``report.json``, the bank's metrics (written by the
stream, not by a logger) and the learning-rate schedule computed by hand.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.runs.bench.run import BenchConfig
from editkit.runs.loggers import LOGGERS, open_loggers, parse_loggers
from editkit.runs.records import StepRecord

from helpers.scenarios import write_scenario

runner = CliRunner()
TASKS = ["digits", "mnist"]
STEPS = 3
#: lr 1e-4, warmup round(0.1 * 3) = 0 steps, then cosine: 0.5 * (1 + cos(pi * s / 3)) for s = 0, 1, 2.
LRS = [1e-4, 0.75e-4, 0.25e-4]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``directory``: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


# --- names ------------------------------------------------------------------------------------


def test_names_are_parsed_and_unknown_ones_refused_with_the_known_listed():
    assert parse_loggers("tensorboard, csv") == ("tensorboard", "csv")
    assert parse_loggers(["csv", "csv"]) == ("csv",)
    assert parse_loggers("") == parse_loggers(None) == ()
    with pytest.raises(ConfigError, match=r"unknown logger 'neptune'; known: csv, mlflow, tensorboard, wandb"):
        parse_loggers("csv,neptune")
    assert BenchConfig(log="csv,tensorboard").validated().log == ("csv", "tensorboard")


# --- closing ----------------------------------------------------------------------------------


class Probe:
    """A logger that remembers what it was told and whether it was closed."""

    built: list["Probe"] = []

    def __init__(self, directory: Path, tasks: list[str]) -> None:
        self.steps, self.records, self.closed = [], [], False
        Probe.built.append(self)

    def train_step(self, task, step, values):
        self.steps.append((task, step, dict(values)))

    def experience(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


def broken(directory: Path, tasks: list[str]):
    raise OSError("disk full")


@pytest.fixture
def probe_loggers():
    Probe.built.clear()
    LOGGERS.register("probe", Record.of(Probe))
    LOGGERS.register("broken", Record.of(broken))
    yield
    LOGGERS.unregister("probe")
    LOGGERS.unregister("broken")


def test_loggers_are_closed_when_the_run_fails_and_when_another_fails_to_build(tmp_path, probe_loggers):
    with pytest.raises(RuntimeError, match="training failed"):
        with open_loggers(["csv", "probe"], tmp_path, TASKS) as logger:
            logger.train_step("digits", 0, {"ce": 2.5, "lr": 1e-4})
            raise RuntimeError("training failed")
    (probe,) = Probe.built
    assert probe.closed and probe.steps == [("digits", 0, {"ce": 2.5, "lr": 1e-4})]
    assert read_csv(tmp_path / "steps.csv") == [{"experience": "0", "task": "digits", "step": "0", "ce": "2.5",
                                                  "lr": "0.0001"}]
    with pytest.raises(OSError, match="disk full"):
        with open_loggers(["probe", "broken"], tmp_path, TASKS):
            pass
    assert Probe.built[1].closed


def test_csv_rows_are_on_disk_before_the_run_ends(tmp_path):
    record = StepRecord(step=1, task="mnist", pretrained=0.5, single_task=0.8,
                        merged={"per_task": {"digits": 0.7, "mnist": 0.6}, "absolute": 0.65, "normalized": 0.9})
    with open_loggers(["csv"], tmp_path, TASKS) as logger:
        logger.experience(record)
        (row,) = read_csv(tmp_path / "experiences.csv")  # read while the file is still open
    assert row == {"experience": "1", "task": "mnist", "resumed": "False", "pretrained": "0.5", "single_task": "0.8",
                   "merged_absolute": "0.65", "merged_normalized": "0.9", "merged_digits": "0.7", "merged_mnist": "0.6"}


def test_no_logger_writes_nothing_and_imports_no_tensorboard(tmp_path):
    with open_loggers((), tmp_path, TASKS) as logger:
        assert logger is None
    assert list(tmp_path.iterdir()) == []
    code = ("import sys, editkit.cli.app, editkit.runs.stream, editkit.runs.bench.run; "
            "sys.exit(any(m.startswith(('tensorboard', 'torch.utils.tensorboard')) for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- end to end -------------------------------------------------------------------------------


def test_unknown_logger_is_refused_before_anything_runs(tmp_path):
    scenario = write_scenario(tmp_path, TASKS, "log-mini")
    for command in ("stream", "bench"):
        result = runner.invoke(app, [command, "--scenario", str(scenario), "--log", "tensorboard,neptune",
                                     "--bank" if command == "stream" else "--bank-root", str(tmp_path / "bank"),
                                     "--run-dir", str(tmp_path / "run")])
        assert result.exit_code == 1, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and "unknown logger 'neptune'; known: csv, mlflow, tensorboard, wandb" in lines[0], \
            result.output
    assert not (tmp_path / "bank").exists() and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("logged")
    scenario = write_scenario(root, TASKS, "log-mini", train_size=64, test_size=40)
    args = ["stream", "--scenario", str(scenario), "--steps", str(STEPS), "--bank", str(root / "bank"),
            "--run-dir", str(root / "run"), "--log", "tensorboard,csv,wandb,mlflow"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return root, args, json.loads((root / "run" / "report.json").read_text())


@pytest.mark.slow
def test_event_file_holds_the_reported_scores_and_the_steps(logged_run):
    root, _, report = logged_run
    logged = scalars(root / "run" / "tensorboard")
    bank = Bank(root / "bank")
    for seen, step in enumerate(report["steps"], start=1):
        task = step["task"]
        assert logged[f"single_task/{task}"] == {seen: pytest.approx(step["single_task"], rel=1e-6)}
        assert logged[f"pretrained/{task}"] == {seen: pytest.approx(step["pretrained"], rel=1e-6)}
        merged = bank.get(task).metrics["merged"]  # the bank's copy, written by the stream itself
        assert merged == step["merged"]
        for other, score in merged["per_task"].items():
            assert logged[f"merged/{other}"][seen] == pytest.approx(score, rel=1e-6)
        assert logged["merged/absolute"][seen] == pytest.approx(merged["absolute"], rel=1e-6)
        assert logged["merged/normalized"][seen] == pytest.approx(merged["normalized"], rel=1e-6)
        assert sorted(logged[f"train/{task}/lr"].items()) == [(s, pytest.approx(lr, rel=1e-6)) for s, lr in enumerate(LRS)]
        for key in ("ce", "penalty", "grad_norm"):
            assert sorted(logged[f"train/{task}/{key}"]) == list(range(STEPS))
    assert logged["merged/absolute"][len(TASKS)] == pytest.approx(report["final"]["absolute"], rel=1e-6)


@pytest.mark.slow
def test_csv_has_one_row_per_step_per_task_and_the_reported_scores(logged_run):
    root, _, report = logged_run
    steps = read_csv(root / "run" / "steps.csv")
    assert [(r["experience"], r["task"], r["step"]) for r in steps] == [
        (str(i), task, str(s)) for i, task in enumerate(TASKS) for s in range(STEPS)]
    assert [float(r["lr"]) for r in steps] == pytest.approx(LRS * len(TASKS), rel=1e-12)
    for r in steps:
        assert math.isfinite(float(r["ce"])) and float(r["ce"]) > 0
        assert float(r["grad_norm"]) > 0
        # tau = 0 before the first update, so J tau = 0; then every task has a source (the generic one at least)
        assert float(r["penalty"]) == 0.0 if r["step"] == "0" else float(r["penalty"]) > 0
    # The event file and the CSV carry the same step values.
    logged = scalars(root / "run" / "tensorboard")
    for r in steps:
        assert logged[f"train/{r['task']}/ce"][int(r["step"])] == pytest.approx(float(r["ce"]), rel=1e-6)
    experiences = read_csv(root / "run" / "experiences.csv")
    assert len(experiences) == len(TASKS)
    for row, step in zip(experiences, report["steps"]):
        assert (int(row["experience"]), row["task"], row["resumed"]) == (step["step"], step["task"], "False")
        assert float(row["single_task"]) == step["single_task"] and float(row["pretrained"]) == step["pretrained"]
        assert float(row["merged_absolute"]) == step["merged"]["absolute"]
        assert float(row["merged_normalized"]) == step["merged"]["normalized"]
        for task in TASKS:
            expected = step["merged"]["per_task"].get(task)
            assert row[f"merged_{task}"] == ("" if expected is None else repr(expected))


@pytest.mark.slow
def test_a_resumed_run_replaces_the_logs(logged_run):
    root, args, report = logged_run
    result = runner.invoke(app, args + ["--resume"])  # everything banked: nothing is trained
    assert result.exit_code == 0, result.output
    assert read_csv(root / "run" / "steps.csv") == []
    experiences = read_csv(root / "run" / "experiences.csv")
    assert [(r["task"], r["resumed"]) for r in experiences] == [(t, "True") for t in TASKS]
    assert [float(r["merged_absolute"]) for r in experiences] == [s["merged"]["absolute"] for s in report["steps"]]
    logged = scalars(root / "run" / "tensorboard")
    assert not any(tag.startswith("train/") for tag in logged)  # the first run's curves were replaced
    assert logged["merged/absolute"] == {i + 1: pytest.approx(s["merged"]["absolute"], rel=1e-6)
                                         for i, s in enumerate(report["steps"])}


# --- W&B and MLflow, read back by their own readers ---------------------------------------------

STEP_VALUES = {"ce": 2.5, "penalty": 0.25, "grad_norm": 1.5, "lr": 1e-4}
RECORDS = [StepRecord(step=0, task="digits", pretrained=0.1, single_task=0.9,
                      merged={"per_task": {"digits": 0.9}, "absolute": 0.9, "normalized": 1.0}),
           StepRecord(step=1, task="mnist", pretrained=0.2, single_task=0.8,
                      merged={"per_task": {"digits": 0.85, "mnist": 0.75}, "absolute": 0.8, "normalized": 0.95})]


def fake_run(directory: Path, names: list[str], *, reach_report: bool = True) -> dict:
    """Two tasks of three optimizer steps each, their experiences and (``reach_report``) the report, told to the
    loggers ``names``; returns the report."""
    plot = directory / "stream.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    plot.write_bytes(b"\x89PNG not really")
    report = {"scenario": "log-mini", "backbone": "tiny", "recipe": {"mode": "taujp", "lr": 1e-4, "steps": STEPS},
              "steps": [r.to_dict() for r in RECORDS], "final": {"per_task": {"digits": 0.85, "mnist": 0.75},
                                                                 "absolute": 0.8, "normalized": 0.95},
              "plots": [str(plot)]}
    with open_loggers(names, directory, TASKS) as logger:
        for record in RECORDS:
            for step in range(STEPS):
                logger.train_step(record.task, step, {**STEP_VALUES, "ce": STEP_VALUES["ce"] + step})
            logger.experience(record)
        if reach_report:
            logger.report(report)
    return report


def wandb_records(directory: Path) -> dict[str, list]:
    """The records of the offline run in ``directory/wandb``, by kind, as W&B's own datastore reads them."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (path,) = (directory / "wandb").glob("offline-run-*/run-*.wandb")
    store = datastore.DataStore()
    store.open_for_scan(str(path))
    records: dict[str, list] = {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        records.setdefault(kind, []).append(getattr(record, kind))
    return records


def _items(items) -> dict[str, object]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_wandb_offline_run_holds_the_steps_the_matrix_rows_the_recipe_and_the_report(tmp_path):
    pytest.importorskip("wandb")
    report = fake_run(tmp_path, ["wandb"])
    records = wandb_records(tmp_path)
    rows = [_items(h.item) for h in records["history"]]
    for task in TASKS:
        steps = [r for r in rows if f"train/{task}/ce" in r]
        assert [r[f"train/{task}/step"] for r in steps] == list(range(STEPS))
        assert [r[f"train/{task}/ce"] for r in steps] == [2.5, 3.5, 4.5]
        assert all(r[f"train/{task}/{k}"] == STEP_VALUES[k] for r in steps for k in ("penalty", "grad_norm", "lr"))
    matrix = [r for r in rows if "tasks_seen" in r]
    assert [(r["tasks_seen"], r["merged/digits"], r.get("merged/mnist")) for r in matrix] == [(1, 0.9, None),
                                                                                           (2, 0.85, 0.75)]
    assert matrix[1]["single_task/mnist"] == 0.8 and matrix[1]["merged/absolute"] == 0.8
    config = {}
    for update in records["config"]:
        config.update(_items(update.update))
    assert {k: config[k] for k in ("scenario", "backbone", "mode", "lr", "steps")} == {
        "scenario": "log-mini", "backbone": "tiny", "mode": "taujp", "lr": 1e-4, "steps": STEPS}
    summary = {}
    for update in records["summary"]:
        summary.update(_items(update.update))
    assert {k: summary[k] for k in ("final/absolute", "final/normalized", "final/digits", "final/mnist")} == {
        "final/absolute": 0.8, "final/normalized": 0.95, "final/digits": 0.85, "final/mnist": 0.75}
    (artifact,) = records["artifact"]
    files = {entry.path: entry for entry in artifact.manifest.contents}
    assert artifact.name == "report" and set(files) == {"report.json", "stream.png"}
    assert json.loads(Path(files["report.json"].local_path).read_text()) == report
    assert records["exit"][0].exit_code == 0


def test_mlflow_local_run_holds_the_steps_the_matrix_rows_the_recipe_and_the_report(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    report = fake_run(tmp_path, ["mlflow"])
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("editkit").experiment_id])
    history = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for key in run.data.metrics}
    for task in TASKS:
        assert history[f"train/{task}/ce"] == {0: 2.5, 1: 3.5, 2: 4.5}
        assert all(history[f"train/{task}/{k}"] == dict.fromkeys(range(STEPS), STEP_VALUES[k])
                   for k in ("penalty", "grad_norm", "lr"))
    assert history["merged/digits"] == {1: 0.9, 2: 0.85} and history["merged/mnist"] == {2: 0.75}
    assert history["merged/absolute"] == {1: 0.9, 2: 0.8} and history["single_task/mnist"] == {2: 0.8}
    assert history["final/absolute"] == {2: 0.8} and history["final/mnist"] == {2: 0.75}
    assert run.data.params == {"scenario": "log-mini", "backbone": "tiny", "mode": "taujp", "lr": "0.0001",
                               "steps": str(STEPS)}
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"report.json", "stream.png"}
    assert json.loads(Path(client.download_artifacts(run.info.run_id, "report.json", str(tmp_path))).read_text()) \
        == report
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name

    fake_run(tmp_path, ["mlflow"], reach_report=False)  # a run that fails before its report replaces the logs
    (failed,) = client.search_runs([client.get_experiment_by_name("editkit").experiment_id])
    assert failed.info.status == "FAILED" and "final/absolute" not in failed.data.metrics


def test_a_logger_whose_package_is_missing_is_left_out_in_one_line(tmp_path, monkeypatch, caplog):
    import importlib

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name, *a: (_ for _ in ()).throw(ImportError(name)) if name in ("wandb", "mlflow")
                        else real(name, *a))
    fake_run(tmp_path, ["wandb", "csv", "mlflow"])
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "--log wandb left out: wandb is not installed (pip install 'editkit[wandb]')",
        "--log mlflow left out: mlflow is not installed (pip install 'editkit[mlflow]')"]
    assert len(read_csv(tmp_path / "steps.csv")) == STEPS * len(TASKS)  # the run and the other loggers went on
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlflow").exists()


@pytest.mark.slow
def test_a_streams_trackers_hold_its_reported_numbers_and_recipe(logged_run):
    """The stream itself tells the trackers its report: their final numbers, config and artifact are report.json's."""
    from mlflow.tracking import MlflowClient

    root, _, report = logged_run
    run_dir = root / "run"
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("editkit").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["final/absolute"] == pytest.approx(report["final"]["absolute"], rel=1e-12)
    assert run.data.params["lr"] == json.dumps(report["recipe"]["lr"]) and run.data.params["scenario"] == "log-mini"
    for task in TASKS:
        assert run.data.metrics[f"final/{task}"] == pytest.approx(report["final"]["per_task"][task], rel=1e-12)
    records = wandb_records(run_dir)
    summary = {}
    for update in records["summary"]:
        summary.update(_items(update.update))
    assert summary["final/normalized"] == pytest.approx(report["final"]["normalized"], rel=1e-12)
    (artifact,) = records["artifact"]
    assert {entry.path for entry in artifact.manifest.contents} == {"report.json", "stream.png"}
