"""Loggers for editkit's own runs: what a stream trains and scores, as it happens.

``report.json`` is written once, at the end of a run; a logger writes while the run
goes, in the formats other tools read: TensorBoard event files and CSV, as
Avalanche's and FusionBench's users expect. A stream hands each logger two kinds of
events:

- after every optimizer step, the loop's numbers (``ce``, ``penalty``, ``grad_norm``,
  ``lr``: what ``editkit.train.loop.fine_tune`` passes its ``on_step`` callback);
- after every experience, its :class:`~editkit.runs.records.StepRecord`: θ0's and the
  task's own vector's score on the task, and the merged model's score on every task
  seen so far with its absolute and normalized summary.

- at the end, the run's ``report.json`` (its recipe, final numbers and plots), to loggers
  that keep it (W&B, MLflow: the recipe as the run's config, the numbers, the file and
  the plots as artifacts).

Loggers are a registry (:data:`LOGGERS`), so one module adds another with one
``LOGGERS.register(name, Record.of(cls))``: ``cls(directory, tasks)`` builds it, and it
has the methods of :class:`RunLogger`. Heavy libraries are imported inside the builder,
so a run without loggers imports nothing new. A logger whose package is not installed
(:class:`~editkit.errors.MissingResourceError` from its builder) is left out with one
warning line; the run and the other loggers go on.

W&B and MLflow write locally, so nothing needs a network: W&B in its offline mode under
``<directory>/wandb/`` (``wandb sync`` uploads it later; ``WANDB_MODE=online`` logs live),
MLflow into a SQLite store under ``<directory>/mlflow/`` (``MLFLOW_TRACKING_URI`` names
another store or server), where a new run marks the earlier ones deleted.

Each run replaces the logs it finds in its directory: a resumed run logs the banked
experiences again, marked resumed, and the steps it trains.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Protocol, Sequence

from editkit.core.registry import Record, Registry
from editkit.errors import MissingResourceError
from editkit.runs.records import StepRecord

log = logging.getLogger(__name__)

LOGGERS: Registry[Record] = Registry("logger")
"""Every logger a run can be given by name (``--log tensorboard,csv``): name -> record whose
``build(directory, tasks)`` returns a :class:`RunLogger`."""


class RunLogger(Protocol):
    """What a stream calls; ``close`` is called once at the end of the run, also after an error."""

    def train_step(self, task: str, step: int, values: Mapping[str, float]) -> None:
        """Optimizer step ``step`` (0-based, counted per task) of ``task``'s fine-tuning."""

    def experience(self, record: StepRecord) -> None:
        """An experience is done: trained (or taken from the bank) and its merged model scored."""

    def close(self) -> None: ...


class ReportLogger(RunLogger, Protocol):
    """A logger that also keeps the run's final report (optional: the stream tells those that have ``report``)."""

    def report(self, report: Mapping[str, Any]) -> None:
        """The run is done: its ``report.json`` as written (recipe, steps, final numbers, plots' paths)."""


def parse_loggers(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"tensorboard,csv"`` (or a sequence of names) -> the names, each checked against :data:`LOGGERS`.

    Empty or None: no logger. An unknown name raises ``ConfigError`` listing the known ones;
    a name given twice counts once.
    """
    names = value.split(",") if isinstance(value, str) else list(value or ())
    names = [n.strip() for n in names if n.strip()]
    for name in names:
        LOGGERS[name]  # refuses an unknown name, listing the known ones
    return tuple(dict.fromkeys(names))


@contextlib.contextmanager
def open_loggers(names: Sequence[str], directory: Path, tasks: Sequence[str]) -> Iterator[ReportLogger | None]:
    """The named loggers writing into ``directory`` for a stream of ``tasks``, as one; None without names.

    Every logger built is closed when the block ends, however it ends (one failing to
    build closes those built before it).
    """
    if not names:
        yield None
        return
    with contextlib.ExitStack() as stack:
        loggers = []
        for name in names:
            try:
                logger = LOGGERS[name].build(Path(directory), list(tasks))
            except MissingResourceError as exc:  # the run goes on without it
                log.warning("--log %s left out: %s", name, exc)
                continue
            stack.callback(logger.close)
            loggers.append(logger)
        yield _Fanout(loggers)


class _Fanout:
    """Several loggers behind one (closing is :func:`open_loggers`' job)."""

    def __init__(self, loggers: Sequence[RunLogger]) -> None:
        self.loggers = list(loggers)

    def train_step(self, task: str, step: int, values: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.train_step(task, step, values)

    def experience(self, record: StepRecord) -> None:
        for logger in self.loggers:
            logger.experience(record)

    def report(self, report: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            if hasattr(logger, "report"):
                logger.report(report)

    def close(self) -> None:
        pass


def experience_scalars(record: StepRecord) -> dict[str, float]:
    """An experience's numbers by TensorBoard tag: ``single_task/<task>``, ``pretrained/<task>``,
    ``merged/<task>`` for every task seen, ``merged/absolute``, ``merged/normalized`` (when defined)."""
    merged = record.merged or {}
    scalars = {f"single_task/{record.task}": record.single_task, f"pretrained/{record.task}": record.pretrained}
    scalars.update({f"merged/{task}": score for task, score in merged.get("per_task", {}).items()})
    scalars.update({f"merged/{key}": merged.get(key) for key in ("absolute", "normalized")})
    return {tag: float(value) for tag, value in scalars.items() if value is not None}


def final_scalars(report: Mapping[str, Any]) -> dict[str, float]:
    """The report's final numbers by name: ``final/absolute``, ``final/normalized``, ``final/<task>`` (the merged
    model's accuracy on each task)."""
    final = report.get("final") or {}
    scalars = {f"final/{task}": score for task, score in (final.get("per_task") or {}).items()}
    scalars.update({f"final/{key}": final.get(key) for key in ("absolute", "normalized")})
    return {name: float(value) for name, value in scalars.items() if value is not None}


def run_config(report: Mapping[str, Any]) -> dict[str, Any]:
    """The run's recipe and what it ran on, as a tracker's config: ``scenario``, ``backbone``, then every recipe
    field."""
    return {"scenario": report.get("scenario"), "backbone": report.get("backbone"), **(report.get("recipe") or {})}


def _package(name: str, extra: str) -> Any:
    """Import a logger's package, or say in one line how to get it."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise MissingResourceError(f"{name} is not installed (pip install 'editkit[{extra}]')") from None


def _plots(report: Mapping[str, Any]) -> list[Path]:
    """The report's plots that are on disk."""
    return [plot for plot in map(Path, report.get("plots") or []) if plot.is_file()]


@contextlib.contextmanager
def _quieter(name: str) -> Iterator[None]:
    """The library logger ``name`` at warnings and above, inside the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class TensorBoardLogger:
    """Event files in ``<directory>/tensorboard/``.

    Tags: ``train/<task>/<value>`` at the task's optimizer step; the experience's
    :func:`experience_scalars` at the number of tasks seen (1 after the first experience),
    so the merged curves read like ``stream.png``.
    """

    def __init__(self, directory: Path, tasks: Sequence[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # slow to import: only when asked for

        log_dir = directory / "tensorboard"
        for old in log_dir.glob("events.out.tfevents.*"):  # an earlier run's curves would mix with this one's
            old.unlink()
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def train_step(self, task: str, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"train/{task}/{key}", value, step)

    def experience(self, record: StepRecord) -> None:
        for tag, value in experience_scalars(record).items():
            self.writer.add_scalar(tag, value, record.step + 1)
        self.writer.flush()  # an interrupted run keeps every finished experience

    def close(self) -> None:
        self.writer.close()


class CSVLogger:
    """``<directory>/steps.csv`` and ``<directory>/experiences.csv``, flushed row by row.

    ``steps.csv``: ``experience, task, step`` then the loop's numbers (``ce, penalty,
    grad_norm, lr``), one row per optimizer step of every task trained in this run.
    ``experiences.csv``: one row per experience: ``experience`` (0-based, the report's
    ``step``), ``task``, ``resumed``, ``pretrained``, ``single_task``, ``merged_absolute``,
    ``merged_normalized``, then ``merged_<task>`` for every task of the stream (empty
    until the task is seen).
    """

    def __init__(self, directory: Path, tasks: Sequence[str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.tasks = list(tasks)
        self._steps_file = open(directory / "steps.csv", "w", newline="")
        self._experiences_file = open(directory / "experiences.csv", "w", newline="")
        self._steps: csv.DictWriter | None = None  # its columns are the first step's keys
        self._experiences = self._writer(self._experiences_file, [
            "experience", "task", "resumed", "pretrained", "single_task", "merged_absolute", "merged_normalized",
            *(f"merged_{t}" for t in self.tasks)])

    @staticmethod
    def _writer(file: IO[str], columns: Sequence[str]) -> csv.DictWriter:
        writer = csv.DictWriter(file, fieldnames=list(columns))
        writer.writeheader()
        file.flush()
        return writer

    def train_step(self, task: str, step: int, values: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"experience": self.tasks.index(task), "task": task, "step": step, **values}
        if self._steps is None:
            self._steps = self._writer(self._steps_file, list(row))
        self._steps.writerow(row)
        self._steps_file.flush()

    def experience(self, record: StepRecord) -> None:
        merged = record.merged or {}
        row = {"experience": record.step, "task": record.task, "resumed": record.resumed,
               "pretrained": record.pretrained, "single_task": record.single_task,
               "merged_absolute": merged.get("absolute"), "merged_normalized": merged.get("normalized"),
               **{f"merged_{t}": s for t, s in merged.get("per_task", {}).items()}}
        self._experiences.writerow(row)
        self._experiences_file.flush()

    def close(self) -> None:
        self._steps_file.close()
        self._experiences_file.close()


class WandbLogger:
    """A W&B run in ``<directory>/wandb/``, offline unless ``WANDB_MODE`` says otherwise.

    Each optimizer step: ``train/<task>/<value>`` with ``train/<task>/step`` as its x-axis; each experience: the
    :func:`experience_scalars` (one row of the accuracy matrix: ``merged/<task>`` for every task seen) with
    ``tasks_seen``; at the end the recipe as the run's config, :func:`final_scalars` in its summary, and
    ``report.json`` and the plots as an artifact ``report``. The run exits 0, or 1 when the stream did not reach
    its report.
    """

    def __init__(self, directory: Path, tasks: Sequence[str]) -> None:
        wandb = _package("wandb", "wandb")
        self.wandb = wandb
        settings = wandb.Settings(silent=True, console="off", disable_git=True, x_disable_stats=True)
        shutil.rmtree(directory / "wandb", ignore_errors=True)  # W&B writes into <dir>/wandb/; this run replaces it
        self.run = wandb.init(dir=str(directory), project=os.environ.get("WANDB_PROJECT", "editkit"),
                              name=directory.name, mode=os.environ.get("WANDB_MODE", "offline"), settings=settings,
                              reinit="create_new")
        for task in tasks:
            self.run.define_metric(f"train/{task}/*", step_metric=f"train/{task}/step")
        self.run.define_metric("tasks_seen")
        for prefix in ("merged", "single_task", "pretrained"):
            self.run.define_metric(f"{prefix}/*", step_metric="tasks_seen")
        self.exit_code = 1  # until the report comes: a run that did not reach it failed

    def train_step(self, task: str, step: int, values: Mapping[str, float]) -> None:
        self.run.log({f"train/{task}/step": step, **{f"train/{task}/{k}": v for k, v in values.items()}})

    def experience(self, record: StepRecord) -> None:
        self.run.log({"tasks_seen": record.step + 1, **experience_scalars(record)})

    def report(self, report: Mapping[str, Any]) -> None:
        self.run.config.update(run_config(report), allow_val_change=True)
        self.run.summary.update(final_scalars(report))
        artifact = self.wandb.Artifact("report", type="report")
        with artifact.new_file("report.json", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2, default=str)
        for plot in _plots(report):
            artifact.add_file(str(plot))
        self.run.log_artifact(artifact)
        self.exit_code = 0

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)


class MLflowLogger:
    """An MLflow run (experiment ``editkit``) in a SQLite store under ``<directory>/mlflow/`` with its artifacts
    beside it, unless ``MLFLOW_TRACKING_URI`` names another store.

    Metrics: ``train/<task>/<value>`` at the task's optimizer step; each experience's
    :func:`experience_scalars` (one row of the accuracy matrix) at the number of tasks seen; at the end the recipe
    as the run's parameters, :func:`final_scalars`, and ``report.json`` and the plots as artifacts. The run ends
    FINISHED, or FAILED when the stream did not reach its report.
    """

    def __init__(self, directory: Path, tasks: Sequence[str]) -> None:
        _package("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        store, server = directory / "mlflow", os.environ.get("MLFLOW_TRACKING_URI")
        store.mkdir(parents=True, exist_ok=True)
        with _quieter("mlflow"):  # its lines about creating the store's tables are not the user's to read
            self.client = MlflowClient(tracking_uri=server or f"sqlite:///{(store / 'mlflow.db').resolve()}")
            experiment = self.client.get_experiment_by_name("editkit")
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
                "editkit", artifact_location=(store / "artifacts").resolve().as_uri())
        if server is None:  # this run replaces the earlier ones of its own store (MLflow keeps them, deleted)
            for earlier in self.client.search_runs([experiment_id]):
                self.client.delete_run(earlier.info.run_id)
        self.run_id = self.client.create_run(experiment_id, run_name=directory.name).info.run_id
        self.status = "FAILED"

    def _metrics(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in values.items()])

    def train_step(self, task: str, step: int, values: Mapping[str, float]) -> None:
        self._metrics({f"train/{task}/{k}": v for k, v in values.items()}, step)

    def experience(self, record: StepRecord) -> None:
        self._metrics(experience_scalars(record), record.step + 1)

    def report(self, report: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in run_config(report).items()]
        self.client.log_batch(self.run_id, params=params)
        self._metrics(final_scalars(report), len(report.get("steps") or []))
        self.client.log_dict(self.run_id, dict(report), "report.json")
        for plot in _plots(report):
            self.client.log_artifact(self.run_id, str(plot))
        self.status = "FINISHED"

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status=self.status)


LOGGERS.register("tensorboard", Record.of(TensorBoardLogger, label="TensorBoard"))
LOGGERS.register("csv", Record.of(CSVLogger, label="CSV"))
LOGGERS.register("wandb", Record.of(WandbLogger, label="Weights & Biases (offline)"))
LOGGERS.register("mlflow", Record.of(MLflowLogger, label="MLflow (local store)"))
