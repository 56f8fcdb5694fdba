"""``editkit predict``: an exported model's predictions on your inputs, from its directory alone.

The directory ``--out`` wrote holds the program (and ``model.onnx``, which ``runtime="onnx"`` runs in ONNX Runtime
instead) and, in ``editkit.json``, how its inputs are made (:mod:`editkit.models.inputs`); nothing else is read: no
bank, no scenario. Inputs:

- an image model: image files, or folders of them (read recursively, in name order; other files in a folder are
  passed over); each image is preprocessed as the manifest says, whatever its size or mode;
- a text model: a ``.txt`` file (one input per non-empty line), or a ``.csv`` / ``.jsonl`` table whose ``column``
  holds the texts; texts are tokenized by the saved tokenizer and cut as the manifest says.

An input the model cannot read (an image given to a text model, a file that is neither) is refused by name before
anything runs. Each row of the result is one input and one task: its predicted class and that class's probability
(the softmax of the task's logits).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from editkit.errors import ConfigError, DataError
from editkit.models.inputs import IMAGE, TEXT, image_transform, pad_right
from editkit.io.read import Export, read_export
from editkit.util.progress import NullProgress, Progress

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"})
TEXT_SUFFIXES = frozenset({".txt", ".csv", ".jsonl"})
#: Inputs per program call.
BATCH = 64
#: Characters of a text shown as its input's name.
SHOWN = 60


@dataclass(frozen=True)
class Prediction:
    """One input's prediction for one task."""

    input: str
    task: str
    predicted: str
    probability: float

    def to_json(self) -> dict[str, Any]:
        return {"input": self.input, "task": self.task, "class": self.predicted, "probability": self.probability}


# --------------------------------------------------------------------------- reading inputs


def _kind_of(path: Path) -> str | None:
    suffix = path.suffix.lower()
    return IMAGE if suffix in IMAGE_SUFFIXES else TEXT if suffix in TEXT_SUFFIXES else None


def image_files(inputs: Sequence[Path | str]) -> list[Path]:
    """The image files named, and those inside the folders named (recursively, in name order)."""
    files: list[Path] = []
    for given in map(Path, inputs):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.is_file() and _kind_of(p) == IMAGE)
            if not found:
                raise DataError(f"{given} holds no image file ({', '.join(sorted(IMAGE_SUFFIXES))})")
            files += found
        elif not given.is_file():
            raise DataError(f"{given} does not exist")
        elif _kind_of(given) == TEXT:
            raise DataError(f"{given} is a text file, and this model takes images")
        else:
            files.append(given)
    return files


def _open_image(path: Path) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"{path} is not an image this model can read ({type(exc).__name__})") from None


def texts_of(inputs: Sequence[Path | str], column: str) -> list[tuple[str, str]]:
    """(name, text) of every input: each non-empty line of a ``.txt`` file, each row's ``column`` of a table."""
    found: list[tuple[str, str]] = []
    for given in map(Path, inputs):
        if not given.is_file():
            raise DataError(f"{given} does not exist or is not a file: give a .txt, .csv or .jsonl file")
        kind = _kind_of(given)
        if kind == IMAGE:
            raise DataError(f"{given} is an image, and this model takes text")
        if kind is None:
            raise DataError(f"{given} is not a text file this model reads: .txt (one input per line), .csv or .jsonl "
                            f"(column {column!r})")
        rows = _table_texts(given, column) if given.suffix.lower() != ".txt" else [
            (f"{given.name}:{number}", line.strip())
            for number, line in enumerate(given.read_text(encoding="utf-8").splitlines(), 1) if line.strip()]
        found += rows
    if not found:
        raise DataError("the inputs hold no text")
    return found


def _table_texts(path: Path, column: str) -> list[tuple[str, str]]:
    if path.suffix.lower() == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
    else:
        try:
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not JSON Lines ({exc})") from None
    if rows and column not in rows[0]:
        raise DataError(f"{path} has no column {column!r} (columns: {', '.join(map(str, rows[0]))}): pass --column")
    return [(f"{path.name}:{number}", str(row[column])) for number, row in enumerate(rows, 1)]


# --------------------------------------------------------------------------- running the program


def _batches(export: Export, inputs: Sequence[Path | str], column: str) -> tuple[list[str], Iterator[tuple]]:
    """The inputs' names and their program inputs, a batch at a time."""
    spec = export.input
    if spec.get("kind") == IMAGE:
        files = image_files(inputs)
        transform = image_transform(spec)

        def images() -> Iterator[tuple]:
            for start in range(0, len(files), BATCH):
                yield (torch.stack([transform(_open_image(f)) for f in files[start:start + BATCH]]),)

        return [str(f) for f in files], images()
    if spec.get("kind") == TEXT:
        named = texts_of(inputs, column)
        tokenizer = export.tokenizer()

        def texts() -> Iterator[tuple]:
            for start in range(0, len(named), BATCH):
                chunk = [text for _, text in named[start:start + BATCH]]
                ids = tokenizer(chunk, truncation=spec.get("max_length") is not None, max_length=spec.get("max_length"),
                                add_special_tokens=True)["input_ids"]
                yield pad_right([torch.tensor(i, dtype=torch.long) for i in ids], int(spec.get("pad_id", 0)))

        return [f"{name}: {text[:SHOWN]}" for name, text in named], texts()
    raise ConfigError(f"editkit predict reads image and text-classification models; {export.directory} takes "
                      f"{spec.get('kind')!r} inputs (editkit.json's input says how to call its program)")


def predict(directory: Path | str, inputs: Sequence[Path | str], *, tasks: Sequence[str] | None = None,
            column: str = "text", runtime: str = "torch", progress: Progress | None = None) -> list[Prediction]:
    """The predictions of the model in ``directory`` on ``inputs`` for ``tasks`` (default: every task it does), run
    by ``runtime`` (:data:`~editkit.io.read.RUNTIMES`: the program, or ``model.onnx`` in ONNX Runtime)."""
    export = read_export(directory)
    known = [t["name"] for t in export.tasks]
    chosen = list(tasks or known)
    unknown = [t for t in chosen if t not in known]
    if unknown:
        raise ConfigError(f"the model does no task {', '.join(map(repr, unknown))}: its tasks are {', '.join(known)}")
    if not inputs:
        raise ConfigError("give the inputs to predict: image files or folders, or a text file")
    classes = {t["name"]: t["classes"] for t in export.tasks}
    program = export.model(runtime)
    names, batches = _batches(export, inputs, column)
    predictions: list[Prediction] = []
    with (progress or NullProgress()).task("predicting", total=-(-len(names) // BATCH)) as bar, torch.inference_mode():
        for batch in batches:
            logits = program(*batch)
            offset = len(predictions) // len(chosen)
            rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
                task: torch.softmax(logits[task].double(), dim=-1).max(dim=-1) for task in chosen}
            for i in range(len(batch[0])):
                for task in chosen:
                    probability, index = rows[task][0][i], rows[task][1][i]
                    predictions.append(Prediction(names[offset + i], task, str(classes[task][int(index)]),
                                                  float(probability)))
            bar.advance()
    return predictions
