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

Loggers are a registry (:data:`LOGGERS`), so one module adds another (W&B, MLflow)
with one ``LOGGERS.register(name, Record.of(cls))``: ``cls(directory, tasks)`` builds
it, and it has the three methods of :class:`RunLogger`. Heavy libraries are imported
inside the builder, so a run without loggers imports nothing new.

Each run replaces the logs it finds in its directory: a resumed run logs the banked
experiences again, marked resumed, and the steps it trains.
"""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Protocol, Sequence

from editkit.core.registry import Record, Registry
from editkit.runs.records import StepRecord

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
def open_loggers(names: Sequence[str], directory: Path, tasks: Sequence[str]) -> Iterator[RunLogger | None]:
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
            logger = LOGGERS[name].build(Path(directory), list(tasks))
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


LOGGERS.register("tensorboard", Record.of(TensorBoardLogger, label="TensorBoard"))
LOGGERS.register("csv", Record.of(CSVLogger, label="CSV"))
