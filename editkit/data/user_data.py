"""A user's tables and text files as tasks and text corpora, named in a scenario file with no code.

Task sources (PATH relative to the scenario file, or absolute; splits as :mod:`editkit.data.tables`
finds them: a ``split`` column, split files in a folder, or a test split held out per class):

``csv:PATH``, ``jsonl:PATH``, ``parquet:PATH``, ``hf-dataset:PATH``
    Labelled rows. With a text column (``text_column``, default ``text``) and a label column
    (``label_column``, default ``label``) they are a text-classification task for a text encoder, as
    ``labelled-text`` datasets are (same ``max_length`` / size options). A table without that text
    column but with an image column (``image_column``, default ``image``) is an image task: a cell is
    a file path (relative to the table's folder) or image bytes as Hugging Face stores them.
    ``hf-dataset`` reads a folder written by ``save_to_disk`` (needs the ``data`` extra: ``pip install
    "editkit[data]"``), a dataset repository's parquet files, or a dataset id (``user/name``, no folder of that
    name) from the local Hugging Face hub cache, never online (:func:`~editkit.data.tables.locate`).
    Class names are the labels' values, sorted (numbers in numeric order), or a ClassLabel's names.

Text corpora (``TEXT_CORPORA``): ``file:PATH``, accepted wherever a corpus name is: the text of a
language task (``source = "text:file:forget.txt"``), a ``[generic]`` table's ``corpus``, and the
``[negation]`` table's ``control_text`` and ``prompts``. A ``.txt`` file is one document per
non-blank line; a CSV / JSON Lines / parquet file or a ``save_to_disk`` folder gives its ``text``
column (``file:PATH#column`` names another). Splits: the data's own (a folder of ``train.txt``,
``val.txt``, ``test.txt``...; a ``split`` column), else the documents shuffled with the corpus seed
and cut 80 / 10 / 10. Text that is only scored (``control_text``, ``prompts``) may come as val and test
alone: its train split is then empty, and none of its documents is held back for training.

Every source's check reads the data (nothing else is loaded, nothing is written) and returns one
line per problem: a missing path, a missing column (with the columns there are), fewer than two
classes, a test label train lacks, an empty corpus.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from editkit.core.registry import Record
from editkit.data import TASK_SOURCES, TEXT_CORPORA
from editkit.data.tables import (HF_DATASET, TEXT_COLUMN, Table, dataset_is_path, fingerprint, format_of, locate,
                                  read_splits)
from editkit.data.tasks import LabelledTexts, TaskData, split_roles, validation_indices
from editkit.data.text import SPLITS
from editkit.data.text_classification import SIZE_HELP, eval_sizes, labelled_task
from editkit.data.user_images import IMAGE_HELP, TEST_FRACTION, held_out_roles, image_task
from editkit.errors import DataError, EditkitError
from editkit.util.paths import always_a_path

LABEL_COLUMN, IMAGE_COLUMN = "label", "image"
#: A corpus without splits of its own: the shares of its documents held out as val and test.
CORPUS_HELD_OUT = 0.1


# --------------------------------------------------------------------------- labelled rows


@dataclass
class Rows:
    """A user's labelled rows, every split together: ``values[i]`` (a text or an image) has class
    ``labels[i]`` (an index into ``classes``); ``roles`` gives each split's rows (``train``, ``test``,
    ``val`` when the data has one)."""

    values: list[Any]
    labels: list[int]
    classes: list[str]
    roles: dict[str, list[int]]
    image: bool
    base: Path | None = None


def _role_tables(path: str, fmt: str) -> dict[str, Table]:
    tables = read_splits(path, fmt)
    roles = {"train": ""} if "" in tables else split_roles(tables)
    if "train" not in roles:
        raise DataError(f"{path} has no train split (its splits: {', '.join(tables)}); name one 'train'")
    return {role: tables[name] for role, name in roles.items()}


def _value_column(table: Table, text_column: str, image_column: str) -> tuple[str, bool]:
    """(the column holding the examples, whether they are images)."""
    if text_column in table.columns:
        return text_column, False
    if image_column in table.columns:
        return image_column, True
    raise DataError(f"{table.where} has no column {text_column!r} (text) or {image_column!r} (images); "
                    f"its columns: {', '.join(table.columns) or 'none'}")


def _label_names(table: Table, column: str) -> list[str]:
    """Each row's label as its class name (a ClassLabel's name, else the value as text); an empty one refused."""
    values, declared = table.column(column), table.classes.get(column)
    names = [declared[v] if declared and isinstance(v, int) else ("" if v is None else str(v)) for v in values]
    if "" in names:
        raise DataError(f"{table.where}: row {names.index('')} has no {column!r} value")
    return names


def class_order(names: Sequence[str]) -> list[str]:
    """Distinct class names sorted, numbers in numeric order (``2`` before ``10``)."""
    return sorted(set(names), key=lambda n: (0, int(n), n) if n.lstrip("-").isdigit() else (1, 0, n))


def labelled_rows(path: str, fmt: str, text_column: str = TEXT_COLUMN, label_column: str = LABEL_COLUMN,
                  image_column: str = IMAGE_COLUMN) -> Rows:
    """The labelled rows of the table(s) at ``path``; refuses (one line per problem) a missing column, fewer
    than two classes and a label of an evaluation split that train lacks."""
    tables = _role_tables(path, fmt)
    column, image = _value_column(tables["train"], text_column, image_column)
    names = {role: _label_names(table, label_column) for role, table in tables.items()}
    declared = tables["train"].classes.get(label_column)
    classes = list(declared) if declared else class_order(names["train"])
    problems = [] if len(set(names["train"])) >= 2 else [
        f"{tables['train'].where}: {len(set(names['train']))} class(es) in {label_column!r} "
        f"({', '.join(sorted(set(names['train']))) or 'none'}): a task needs two or more"]
    for role in ("val", "test"):
        if role in tables:
            unknown = class_order(set(names[role]) - set(classes))
            problems += [f"{tables[role].where}: label {label!r} is not a class of train (train's classes: "
                         f"{', '.join(classes)})" for label in unknown]
    if problems:
        raise DataError("\n".join(problems))
    rows = Rows([], [], classes, {}, image, tables["train"].base)
    index = {name: i for i, name in enumerate(classes)}
    for role, table in tables.items():
        values = table.column(column)
        if not image and (bad := next((i for i, v in enumerate(values) if not isinstance(v, str) or not v), None)) \
                is not None:
            raise DataError(f"{table.where}: row {bad} of {column!r} is not a text ({values[bad]!r})")
        rows.roles[role] = list(range(len(rows.values), len(rows.values) + len(values)))
        rows.values += values
        rows.labels += [index[n] for n in names[role]]
    return rows


def _texts(rows: Rows, members: Sequence[int]) -> LabelledTexts:
    return LabelledTexts([rows.values[i] for i in members], [rows.labels[i] for i in members], rows.classes)


def text_splits(rows: Rows) -> dict[str, LabelledTexts]:
    """train / val / test of text rows; validation is 10% of train (seed 0) when the data has none."""
    roles = dict(rows.roles)
    if "val" not in roles:
        train_idx, val_idx = validation_indices(len(roles["train"]))
        roles["train"], roles["val"] = ([roles["train"][i] for i in train_idx],
                                        [roles["train"][i] for i in val_idx])
    return {split: _texts(rows, roles[split]) for split in SPLITS}


def table_task(name: str, dataset: str, backbone: Any, fmt: str, *, text_column: str = TEXT_COLUMN,
               label_column: str = LABEL_COLUMN, image_column: str = IMAGE_COLUMN,
               test_fraction: float = TEST_FRACTION, seed: int = 0, max_length: int = 64,
               train_size: int | None = None, eval_size: int | None = None,
               val_size: int | None = None) -> TaskData:
    """The labelled table(s) at ``dataset`` as the task ``name`` (see the module docstring)."""
    rows = labelled_rows(dataset, fmt, text_column, label_column, image_column)
    rows.roles = held_out_roles(rows.roles, rows.labels, test_fraction, seed)
    if rows.image:
        return image_task(name, backbone, rows.values, rows.labels, rows.roles, rows.classes,
                          key=f"{fingerprint(locate(dataset, fmt))}-{image_column}", base=rows.base,
                          train_size=train_size, eval_size=eval_size, seed=seed)
    return labelled_task(name, text_splits(rows), backbone, max_length, eval_sizes(train_size, eval_size, val_size))


def _table_source(fmt: str) -> Record:
    """The task source of one table format: :func:`table_task` with ``fmt`` fixed, checked by reading."""

    def build(name: str, dataset: str, backbone: Any, text_column: str = TEXT_COLUMN,
              label_column: str = LABEL_COLUMN, image_column: str = IMAGE_COLUMN,
              test_fraction: float = TEST_FRACTION, seed: int = 0, max_length: int = 64,
              train_size: int | None = None, eval_size: int | None = None, val_size: int | None = None) -> TaskData:
        return table_task(name, dataset, backbone, fmt, text_column=text_column, label_column=label_column,
                          image_column=image_column, test_fraction=test_fraction, seed=seed,
                          max_length=max_length, train_size=train_size, eval_size=eval_size, val_size=val_size)

    def check(name: str, dataset: str, text_column: str = TEXT_COLUMN, label_column: str = LABEL_COLUMN,
              image_column: str = IMAGE_COLUMN, **_: Any) -> list[str]:
        return problems_of(lambda: labelled_rows(dataset, fmt, text_column, label_column, image_column),
                           f"task {name!r}: ")

    build.__doc__ = f"The {fmt} table(s) at ``dataset`` as a task (:func:`table_task`)."
    rule = dataset_is_path if fmt == HF_DATASET else always_a_path
    return Record.of(build, check=check, paths={"dataset": rule}, help={
        **IMAGE_HELP, **SIZE_HELP, "text_column": "column of the texts", "label_column": "column of the labels",
        "image_column": "column of the images (file paths or bytes), read when there is no text column"})


def problems_of(read: Any, prefix: str = "") -> list[str]:
    """What reading raises, one line per problem (empty when it reads)."""
    try:
        read()
    except EditkitError as exc:
        return [prefix + line for line in str(exc).splitlines()]
    return []


# --------------------------------------------------------------------------- file: corpora


def corpus_documents(path: str, column: str = TEXT_COLUMN) -> dict[str, list[str]]:
    """The non-empty documents of a corpus file or folder by its own split names (``""``: no splits)."""
    fmt = format_of(path)
    if fmt is None:
        raise DataError(f"{path} does not exist" if not Path(path).exists() else
                        f"{path} is no text file (.txt, .csv, .jsonl, .parquet) or folder of split files")
    tables = read_splits(path, fmt)
    found = {name: [t for t in table.column(column) if isinstance(t, str) and t.strip()]
             for name, table in tables.items()}
    if not any(found.values()):
        raise DataError(f"the corpus {path} is empty: no document in {', '.join(t.where for t in tables.values())}")
    return found


@functools.lru_cache(maxsize=32)
def _corpus_splits(path: str, column: str, seed: int, state: str) -> dict[str, list[str]]:
    documents = corpus_documents(path, column)
    roles = {"train": ""} if "" in documents else split_roles(documents)
    splits = {role: documents[name] for role, name in roles.items()}
    if "train" not in splits and {"val", "test"} <= set(splits):
        return {"train": [], **splits}  # text that is only scored (control text, prompts): every document kept
    if "train" not in splits:
        raise DataError(f"the corpus {path} has no train split (its splits: {', '.join(documents)}): name one "
                        "'train', or give val and test splits for text that is only scored (control text, prompts)")
    if "test" not in splits or "val" not in splits:
        held = ["val", "test"] if "test" not in splits else ["val"]
        splits.update(_held_out_documents(splits, held, seed, path))
    return splits


def _held_out_documents(splits: dict[str, list[str]], held: list[str], seed: int, path: str) -> dict[str, list[str]]:
    """Train cut with ``seed``: each split of ``held`` takes :data:`CORPUS_HELD_OUT` of the documents
    (at least one), train the rest."""
    train = splits["train"]
    count = max(1, round(CORPUS_HELD_OUT * len(train)))
    if len(train) < count * len(held) + 1:
        raise DataError(f"the corpus {path} has {len(train)} document(s): {len(held) + 1} or more are needed to "
                        f"hold out {' and '.join(held)} (or give its splits as files)")
    order = np.random.default_rng(seed).permutation(len(train))
    out = {split: [train[i] for i in order[k * count:(k + 1) * count]] for k, split in enumerate(held)}
    out["train"] = [train[i] for i in order[len(held) * count:]]
    return out


def _split_reference(reference: str) -> tuple[str, str]:
    path, _, column = reference.partition("#")
    return path, column or TEXT_COLUMN


def corpus_split(reference: str, split: str, seed: int = 0) -> list[str]:
    """One split (``train`` / ``val`` / ``test``) of the corpus ``file:<reference>``."""
    path, column = _split_reference(reference)
    if not Path(path).exists():
        raise DataError(f"{path} does not exist")
    return list(_corpus_splits(str(Path(path).resolve()), column, seed, fingerprint(Path(path)))[split])


def corpus_problems(reference: str) -> list[str]:
    """One line per problem of the corpus ``file:<reference>`` (see the module docstring)."""
    return problems_of(lambda: corpus_split(reference, "train"), f"corpus file:{reference}: ")


def file_corpus(reference: str) -> Record:
    """The ``TEXT_CORPORA`` record of ``file:<reference>`` (``PATH`` or ``PATH#column``)."""
    return Record.of(functools.partial(corpus_split, reference),
                     check=functools.partial(corpus_problems, reference))


for _fmt in ("csv", "jsonl", "parquet", HF_DATASET):
    TASK_SOURCES.register(_fmt, _table_source(_fmt))
TEXT_CORPORA.register_family("file", file_corpus, form="PATH[#column]")
