"""A user's tables: CSV, JSON Lines, parquet files and Hugging Face datasets (saved with ``save_to_disk``, or a
dataset repository's files, or a dataset id found in the local hub cache).

A table is read whole into columns (:class:`Table`); a user's labelled texts, image lists and text
corpora are small enough, and a whole read lets every problem (a missing column, a label of no
class) be found before any work. Reading is cached per file state, so the scenario check and the
build that follows read a file once.

Where the splits come from (:func:`read_splits`), first that applies:

- PATH is a directory written by ``DatasetDict.save_to_disk`` (``dataset_dict.json``): its splits;
- for the ``hf-dataset`` format, PATH is a dataset repository as the hub lays it out
  (``data/train-00000-of-00001.parquet``...; a snapshot of the local hub cache is one): each split's
  parquet shards; a PATH that is no folder and not written as a path is a dataset id (``user/name``),
  whose snapshot is looked up in the local Hugging Face hub cache (``HF_HOME`` / ``HF_HUB_CACHE``),
  never online;
- PATH is a directory holding ``<split>.<ext>`` files of the format (``train.csv`` and ``test.csv``;
  ``val`` / ``validation`` / ``dev`` count too, see :data:`~editkit.data.tasks.SPLIT_ALIASES`);
- PATH is a file, or a ``Dataset.save_to_disk`` directory, whose table has a ``split`` column: its rows
  grouped by that column's values;
- otherwise the one table, under the split name ``""``: the caller holds a test split out.

A plain ``.txt`` file is a table too: one document per non-blank line, as the column ``text``.
The ``datasets`` package is needed only for ``save_to_disk`` directories (it is not a dependency);
parquet (a hub copy's too) is read with pyarrow, CSV, JSON Lines and text with the standard library.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from editkit.data.sources import _hf_label_names, hub_snapshot, parquet_files
from editkit.data.tasks import SPLIT_ALIASES
from editkit.errors import DataError, MissingResourceError
from editkit.util.hub import hf_hub_cache
from editkit.util.paths import written_as_path

#: The format of a Hugging Face ``datasets`` dataset: a folder, or a dataset id in the local hub cache.
HF_DATASET = "hf-dataset"
#: Table format -> the file suffixes it reads (``hf-dataset``: folders only).
SUFFIXES: dict[str, tuple[str, ...]] = {"csv": (".csv", ".tsv"), "jsonl": (".jsonl", ".json"),
                                        "parquet": (".parquet",), HF_DATASET: (), "text": (".txt",)}
SPLIT_COLUMN = "split"
#: The column of a plain text file's documents, and the default text column of every table.
TEXT_COLUMN = "text"
#: What ``save_to_disk`` writes: a DatasetDict's index, a Dataset's state.
DATASET_DICT_FILE, DATASET_STATE_FILE = "dataset_dict.json", "state.json"


@dataclass
class Table:
    """Rows as columns: ``columns[name][i]`` is row i's value; ``where`` names the table in messages;
    ``classes`` holds a column's class names where the table declares them (a ClassLabel feature), so
    its integer values index them."""

    columns: dict[str, list[Any]]
    where: str
    classes: dict[str, list[str]] = field(default_factory=dict)
    base: Path | None = None  # the directory a relative file path in a cell is read from

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def column(self, name: str) -> list[Any]:
        """Column ``name``; a missing one is refused naming the columns there are."""
        if name not in self.columns:
            raise DataError(f"{self.where} has no column {name!r}; its columns: {', '.join(self.columns) or 'none'}")
        return self.columns[name]

    def rows(self, indices: list[int]) -> "Table":
        """The table of rows ``indices`` (in that order)."""
        return Table({k: [v[i] for i in indices] for k, v in self.columns.items()}, self.where, self.classes,
                     self.base)


def file_states(path: Path) -> list[tuple[str, int, int]]:
    """(name relative to ``path``, size, modification time in ns) of every file under ``path`` (the file
    itself for a file), sorted by name; one ``os.walk`` and one ``stat`` per file."""
    path = Path(path)
    if path.is_file():
        stat = path.stat()
        return [(path.name, stat.st_size, stat.st_mtime_ns)]
    found = []
    prefix = len(os.path.join(str(path), ""))
    for directory, _, names in os.walk(path):
        for name in names:
            full = os.path.join(directory, name)
            stat = os.stat(full)
            found.append((full[prefix:], stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def fingerprint(path: Path, states: list[tuple[str, int, int]] | None = None) -> str:
    """Identity of a file or folder as it is now: every file's relative name, size and modification time
    (:func:`file_states`, or ``states`` when the caller has them), not its content: reading a 10k-image folder
    to hash it would cost what caching saves."""
    digest = hashlib.sha256(str(Path(path).resolve()).encode())
    for name, size, mtime in file_states(path) if states is None else states:
        digest.update(f"{name}|{size}|{mtime}\n".encode())
    return digest.hexdigest()[:32]


# --------------------------------------------------------------------------- one table


def _read_csv(path: Path) -> Table:
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle, delimiter="\t" if path.suffix == ".tsv" else ",")
        rows = list(reader)
        names = list(reader.fieldnames or [])
    return Table({name: [row[name] for row in rows] for name in names}, str(path), base=path.parent)


def _read_jsonl(path: Path) -> Table:
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not JSON Lines (one object per line) or a JSON list: {exc}") from None
    if not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path}: every line must be a JSON object (column -> value)")
    names = list(dict.fromkeys(name for row in rows for name in row))
    return Table({name: [row.get(name) for row in rows] for name in names}, str(path), base=path.parent)


def _read_parquet(path: Path) -> Table:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    names = {c: n for c in table.column_names if (n := _hf_label_names(table.schema.metadata, c))}
    return Table(table.to_pydict(), str(path), names, base=path.parent)


def _datasets_module(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise MissingResourceError(f"reading the Hugging Face dataset saved at {path} needs the datasets "
                                   "package: pip install \"editkit[data]\" (or: pip install datasets)") from None
    return datasets


def _dataset_table(dataset: Any, where: str) -> Table:
    """A ``datasets.Dataset`` as a table: images as their undecoded ``{bytes, path}``, ClassLabel names kept."""
    datasets = _datasets_module(Path(where))
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(name, datasets.Image(decode=False))
    classes = {name: list(f.names) for name, f in dataset.features.items() if isinstance(f, datasets.ClassLabel)}
    return Table(dataset.to_dict(), where, classes)


def _read_lines(path: Path) -> Table:
    """A plain text file: one document per line (blank lines skipped), as the column ``text``."""
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return Table({TEXT_COLUMN: [line for line in lines if line]}, str(path), base=path.parent)


READERS: dict[str, Callable[[Path], Table]] = {".csv": _read_csv, ".tsv": _read_csv, ".jsonl": _read_jsonl,
                                               ".json": _read_jsonl, ".parquet": _read_parquet, ".txt": _read_lines}


def format_of(path: str | os.PathLike) -> str | None:
    """The table format of a file (by its suffix) or folder (a ``save_to_disk`` directory, else the format of
    its split files); None when it holds none (or does not exist)."""
    path = Path(path)
    if path.is_file():
        return next((fmt for fmt, suffixes in SUFFIXES.items() if path.suffix.lower() in suffixes), None)
    if not path.is_dir():
        return None
    if _is_saved_dataset(path):
        return HF_DATASET
    stems = {p.suffix.lower() for p in path.iterdir() if p.stem.lower() in SPLIT_ALIASES}
    found = next((fmt for fmt, suffixes in SUFFIXES.items() if stems & set(suffixes)), None)
    return found or (HF_DATASET if parquet_files(path, "train") else None)


# --------------------------------------------------------------------------- where the data is


def dataset_is_path(value: str, exists: bool) -> bool:
    """The path rule of the ``hf-dataset`` format (:mod:`editkit.util.paths`): a folder when one exists or the
    value is written as a path; any other value is a dataset id, looked up in the local hub cache."""
    return exists or written_as_path(value)


def locate(path: str | os.PathLike, fmt: str) -> Path:
    """The file or folder that holds the data ``path`` names in format ``fmt``: ``path`` itself, or, for a
    dataset id of the ``hf-dataset`` format, its snapshot in the local hub cache. Refuses data that is not
    there in one line (for a dataset id, naming both ways to provide it)."""
    given = Path(path).expanduser()
    if fmt != HF_DATASET or dataset_is_path(str(path), given.exists()):
        if not given.exists():
            raise DataError(f"{given} does not exist")
        return given
    snapshot = hub_snapshot(str(path))
    if snapshot is None:
        raise DataError(f"{path} is no folder, and no dataset {str(path)!r} is in the Hugging Face hub cache "
                        f"{hf_hub_cache()}: name a folder written by save_to_disk, or fetch the dataset into the hub "
                        f"cache where there is internet (datasets.load_dataset({str(path)!r}), or huggingface-cli "
                        f"download --repo-type dataset {path}) and point HF_HOME or HF_HUB_CACHE at that cache")
    return snapshot


# --------------------------------------------------------------------------- splits


def read_splits(path: str | os.PathLike, fmt: str) -> dict[str, Table]:
    """The tables of ``path`` in format ``fmt`` (a key of :data:`SUFFIXES`) by the user's split names (see the
    module docstring); ``""`` names the one table of data without splits. Refuses a missing path (a dataset id
    the hub cache lacks: :func:`locate`), a file of another format and a directory with nothing to read."""
    path = locate(path, fmt)
    return _read_splits(path.resolve(), fmt, fingerprint(path))


@functools.lru_cache(maxsize=16)
def _read_splits(path: Path, fmt: str, state: str) -> dict[str, Table]:
    if fmt == HF_DATASET:
        return _hf_dataset_splits(path)
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES[fmt]:
            raise DataError(f"{path} is not a {fmt} file (expected {' or '.join(SUFFIXES[fmt])})")
        return _by_split_column(READERS[path.suffix.lower()](path))
    files = {p.stem: p for p in sorted(path.iterdir()) if p.suffix.lower() in SUFFIXES[fmt]
             and p.stem.lower() in SPLIT_ALIASES}
    if not files:
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise DataError(f"{path} holds no {fmt} split files (train{SUFFIXES[fmt][0]}, test{SUFFIXES[fmt][0]}...); "
                        f"it has: {found}")
    return {stem: READERS[file.suffix.lower()](file) for stem, file in files.items()}


def _by_split_column(table: Table) -> dict[str, Table]:
    if SPLIT_COLUMN not in table.columns:
        return {"": table}
    groups: dict[str, list[int]] = {}
    for index, value in enumerate(table.columns[SPLIT_COLUMN]):
        groups.setdefault(str(value), []).append(index)
    return {name: table.rows(rows) for name, rows in groups.items()}


def _is_saved_dataset(path: Path) -> bool:
    return (path / DATASET_DICT_FILE).is_file() or (path / DATASET_STATE_FILE).is_file()


def _hf_dataset_splits(path: Path) -> dict[str, Table]:
    """A ``save_to_disk`` folder's splits, else a dataset repository's parquet shards by split."""
    if _is_saved_dataset(path):
        return _saved_dataset_splits(path)
    if shards := _parquet_shards(path):
        return shards
    raise DataError(f"{path} is not a Hugging Face dataset saved with save_to_disk (no {DATASET_DICT_FILE} or "
                    f"{DATASET_STATE_FILE}) nor a dataset repository's parquet files (data/train-*.parquet...)")


def _parquet_shards(root: Path) -> dict[str, Table]:
    """The splits of a dataset repository in the hub's layout (``data/train-00000-of-00002.parquet``...; see
    :func:`~editkit.data.sources.parquet_files`), each split's shards read as one table."""
    splits = {}
    for split in SPLIT_ALIASES:
        if files := parquet_files(root, split):
            splits[split] = _joined([_read_parquet(file) for file in files], f"{root} [{split}]")
    return splits


def _joined(tables: list[Table], where: str) -> Table:
    """Shards of one split as one table, with the first shard's columns and class names."""
    first = tables[0]
    return Table({name: [value for table in tables for value in table.column(name)] for name in first.columns},
                 where, first.classes, first.base)


def _saved_dataset_splits(path: Path) -> dict[str, Table]:
    loaded = _datasets_module(path).load_from_disk(str(path))
    if hasattr(loaded, "keys"):  # a DatasetDict
        return {name: _dataset_table(loaded[name], f"{path} [{name}]") for name in loaded.keys()}
    return _by_split_column(_dataset_table(loaded, str(path)))
