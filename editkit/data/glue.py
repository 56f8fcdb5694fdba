"""GLUE tasks in text-to-text form, from a local copy of the hub dataset ``nyu-mll/glue``.

The task source ``glue`` (``source = "glue:<cola|sst2|mrpc|rte>"``) reads the parquet files
the hub serves, in the layout ``huggingface_hub`` caches them (what
``hf download nyu-mll/glue --repo-type dataset --include "<config>/*"`` leaves)::

    <root>/datasets--nyu-mll--glue/snapshots/<rev>/<config>/{train,validation,test}-*.parquet

found as :class:`~editkit.data.hf_text.HubDataset` finds any hub dataset (``data_root``,
``$EDITKIT_DATA``, then the Hugging Face cache); nothing is downloaded. Splits, as the
authors use them: the GLUE validation split is the test split (GLUE's own test labels are
hidden), and a seeded 10% of the train split (at most 5000 examples,
:func:`~editkit.data.tasks.validation_indices`) is the validation split.

Templates are T5's own (Raffel et al., appendix D), so a T5 checkpoint trained on GLUE
recognises them: the task name, then each text column as ``<column>: <text>``; the
target is the class's name as T5 writes it:

======  ==========================================================  ====================================
config  prompt                                                      targets (label 0, label 1)
======  ==========================================================  ====================================
cola    ``cola sentence: {sentence}``                               unacceptable, acceptable
sst2    ``sst2 sentence: {sentence}``                               negative, positive
mrpc    ``mrpc sentence1: {sentence1} sentence2: {sentence2}``      not_equivalent, equivalent
rte     ``rte sentence1: {sentence1} sentence2: {sentence2}``       entailment, not_entailment
======  ==========================================================  ====================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.data.hf_text import HubDataset
from editkit.data.tasks import TaskData, validation_indices
from editkit.data.text_to_text import text_to_text_task
from editkit.errors import ConfigError

GLUE_REPO = "nyu-mll/glue"
#: Prompt tokens kept (the encoder input is cut there; the longest RTE pairs pass 256 tokens).
MAX_LENGTH = 256


@dataclass(frozen=True)
class GlueTask:
    """A GLUE config: its text columns (in prompt order) and the target text of each label."""

    columns: tuple[str, ...]
    targets: tuple[str, ...]

    def prompt(self, config: str, row: dict[str, str]) -> str:
        return " ".join([config, *(f"{column}: {row[column]}" for column in self.columns)])


GLUE_TASKS = {
    "cola": GlueTask(("sentence",), ("unacceptable", "acceptable")),
    "sst2": GlueTask(("sentence",), ("negative", "positive")),
    "mrpc": GlueTask(("sentence1", "sentence2"), ("not_equivalent", "equivalent")),
    "rte": GlueTask(("sentence1", "sentence2"), ("entailment", "not_entailment")),
}


def glue_task(config: str) -> GlueTask:
    if config not in GLUE_TASKS:
        raise ConfigError(f"unknown GLUE task {config!r}; known: {', '.join(GLUE_TASKS)}")
    return GLUE_TASKS[config]


def hub_dataset(config: str) -> HubDataset:
    """Where the config's parquet files are, and the command that fetches them on a machine with internet."""
    glue_task(config)
    return HubDataset(GLUE_REPO, config, f'hf download {GLUE_REPO} --repo-type dataset --include "{config}/*"')


def read_split(config: str, hub_split: str, data_root: str | None = None) -> tuple[list[str], list[int]]:
    """(prompts, labels) of one split of the hub dataset, ``hub_split`` in editkit's names (``val`` is the
    hub's ``validation``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = glue_task(config)
    files = hub_dataset(config).parquet(hub_split, data_root)
    table = pa.concat_tables([pq.read_table(f, columns=[*task.columns, "label"]) for f in files])
    prompts = [task.prompt(config, row) for row in table.select(list(task.columns)).to_pylist()]
    return prompts, table.column("label").to_pylist()


def glue_splits(config: str, data_root: str | None = None) -> dict[str, tuple[list[str], list[int]]]:
    """editkit's train / val / test of a GLUE config: train minus a seeded 10%, that 10%, the hub's validation."""
    prompts, labels = read_split(config, "train", data_root)
    train, val = validation_indices(len(labels))
    return {"train": ([prompts[i] for i in train], [labels[i] for i in train]),
            "val": ([prompts[i] for i in val], [labels[i] for i in val]),
            "test": read_split(config, "val", data_root)}


def _task_source(name: str, dataset: str, backbone: Any, data_root: str | None = None,
                 max_length: int = MAX_LENGTH) -> TaskData:
    if not hasattr(backbone, "teacher_forcing"):
        raise ConfigError(f"GLUE tasks are text-to-text: they need a seq2seq-lm backbone, not {backbone.name}")
    return text_to_text_task(name, glue_task(dataset).targets, backbone, glue_splits(dataset, data_root),
                             max_length=int(max_length))


def _task_check(name: str, dataset: str, data_root: str | None = None, max_length: int = MAX_LENGTH) -> list[str]:
    return hub_dataset(dataset).problems(data_root)


TASK_SOURCES.register("glue", Record.of(_task_source, check=_task_check, help={
    "data_root": "directory holding the hub-cache copy of nyu-mll/glue (default: $EDITKIT_DATA, then the Hugging "
                 "Face cache)",
    "max_length": "prompt tokens kept (longer prompts are cut)"}))
