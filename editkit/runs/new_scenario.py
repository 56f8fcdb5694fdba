"""A scenario file for a user's data, in one command: ``editkit init PATH``.

What PATH holds decides the modality, and the modality the embedded scenario whose backbone, heads,
generic source and recipe the new file starts from (:data:`TEMPLATES`):

- **images** (an image folder, or a folder of image folders: one task each) -> ``offline-vision``
  (EfficientNet-Lite0 from pip, probe heads, natural-image crops for tauJp);
- **labelled text** (a CSV / JSON Lines / parquet table with ``text`` and ``label`` columns, a folder
  of split files, a ``save_to_disk`` dataset; or a folder of such tables: one task each) ->
  ``offline-text`` (all-MiniLM-L6-v2 from pip);
- **plain text** (a ``.txt`` file, one document per line, or a table with a ``text`` column and no
  label) -> ``toxic``: a causal LM fine-tuned on the text and negated by ``editkit negate``, with
  that scenario's ``[negation]`` table.

The file is written with every recipe field at its value (the template's, else the default) and
every option of the task source commented at its default, each with its help line, so a user edits
values rather than looking keys up. Data paths, and a ``--model`` given as a path, are written relative
to the scenario file, which reads them from its own folder. Nothing is loaded: the file is checked by
parsing it back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Iterable

from editkit.core.registry import Option, Record
from editkit.data import TASK_SOURCES
from editkit.data.tables import TEXT_COLUMN, format_of, read_splits
from editkit.data.user_data import IMAGE_COLUMN, LABEL_COLUMN
from editkit.data.user_images import class_dirs, image_suffixes, split_dirs
from editkit.errors import ConfigError
from editkit.io.targets import check_file_target
from editkit.models import BACKBONES
from editkit.scenario.spec import known_scenarios, load_scenario
from editkit.train.recipe import Recipe
from editkit.util.atomic import atomic_write_text

IMAGES, LABELLED_TEXT, PLAIN_TEXT = "images", "labelled text", "plain text"
#: Modality -> the embedded scenario the new file starts from.
TEMPLATES = {IMAGES: "offline-vision", LABELLED_TEXT: "offline-text", PLAIN_TEXT: "toxic"}
#: The template tables copied as they are (``[data]`` only where the new tasks' source takes its keys).
COPIED_TABLES = ("backbone", "heads", "generic", "negation")


@dataclasses.dataclass(frozen=True)
class FoundTask:
    """One task found in the data: its name, modality and source (``kind:PATH``, PATH absolute)."""

    name: str
    modality: str
    kind: str
    path: Path


# --------------------------------------------------------------------------- what the data is


def _is_image_folder(path: Path) -> bool:
    """Whether a class folder of ``path``'s train split holds images itself (a folder of image folders'
    class folders hold folders)."""
    dirs = split_dirs(path)
    train = dirs.get("train", dirs.get(""))
    return any(p.suffix.lower() in image_suffixes() for folder in class_dirs(train) for p in folder.iterdir())


def _table_modality(path: Path, fmt: str) -> str | None:
    tables = read_splits(path, fmt)
    columns = set(next(iter(tables.values())).columns)
    if TEXT_COLUMN in columns:
        return LABELLED_TEXT if LABEL_COLUMN in columns else PLAIN_TEXT
    return IMAGES if IMAGE_COLUMN in columns and LABEL_COLUMN in columns else None


def _task(path: Path) -> FoundTask | None:
    """The task ``path`` makes by itself, or None (it is not data editkit reads as one task)."""
    name = path.stem if path.is_file() else path.name
    if path.is_dir() and _is_image_folder(path):
        return FoundTask(name, IMAGES, "imagefolder", path)
    fmt = format_of(path)
    if fmt is None:
        return None
    if fmt == "text":
        return FoundTask(name, PLAIN_TEXT, "text", path)
    modality = _table_modality(path, fmt)
    if modality is None:
        return None
    return FoundTask(name, modality, "text" if modality == PLAIN_TEXT else fmt, path)


def find_tasks(data: str | os.PathLike) -> list[FoundTask]:
    """The tasks of ``data``: the one it makes itself, else one per entry of the folder that makes one.
    Refuses data of no task, and a folder that mixes modalities (one scenario has one backbone)."""
    data = Path(data).resolve()
    if not data.exists():
        raise ConfigError(f"{data} does not exist")
    found = _task(data)
    if found is not None:
        return [found]
    tasks = [t for child in sorted(data.iterdir()) if not child.name.startswith(".")
             and (t := _task(child)) is not None] if data.is_dir() else []
    if not tasks:
        raise ConfigError(f"{data} holds no data editkit reads: an image folder (train/<class>/*), a table with "
                          f"'{TEXT_COLUMN}' and '{LABEL_COLUMN}' columns (.csv, .jsonl, .parquet), a text file "
                          "(.txt), or a folder of these")
    modalities = sorted({t.modality for t in tasks})
    if len(modalities) > 1:
        listed = "; ".join(f"{m}: {', '.join(t.name for t in tasks if t.modality == m)}" for m in modalities)
        raise ConfigError(f"{data} mixes {' and '.join(modalities)} ({listed}): a scenario has one backbone, so "
                          "give each kind its own scenario (editkit init on each folder)")
    return tasks


# --------------------------------------------------------------------------- writing TOML


def toml_value(value: Any) -> str:
    """A TOML value for a string, number, boolean or flat list (JSON writes them as TOML reads them)."""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def _option_lines(options: Iterable[Any], given: dict[str, Any], *, commented: bool) -> list[str]:
    """``key = value  # help`` per option: given values written, the others (``commented``) at their default
    behind ``#``; an unset (None) default is named in the comment."""
    lines = []
    for option in options:
        name, value = option.name, given.get(option.name, option.default)
        help_text = f"  # {option.help}" if option.help else ""
        if option.name in given and value is not None:
            lines.append(f"{name} = {toml_value(value)}{help_text}")
        elif commented or value is None:
            shown = "(unset)" if value is None else toml_value(value)
            lines.append(f"# {name} = {shown}{help_text}")
        else:
            lines.append(f"{name} = {toml_value(value)}{help_text}")
    return lines


def _table(name: str, values: dict[str, Any]) -> list[str]:
    return [f"[{name}]"] + [f"{key} = {toml_value(value)}" for key, value in values.items()] + [""]


def _recipe_lines(template: dict[str, Any]) -> list[str]:
    """Every recipe field at the template's value, else its default, with its help."""
    fields = [Option(f.name, f.default, f.metadata.get("help", "")) for f in dataclasses.fields(Recipe)]
    return ["[recipe]"] + _option_lines(fields, {f.name: template.get(f.name, f.default) for f in fields},
                                        commented=False)


def _relative(path: Path, out: Path) -> str:
    return os.path.relpath(path, out.resolve().parent)


def _model_value(model: str, family: str, out: Path) -> str:
    """``--model`` as the scenario file at ``out`` is to hold it: relative to the file's folder where the family
    reads it as a path (a checkpoint directory here), as given where it is a name (a hub id)."""
    path = Path(model).expanduser()
    rule = BACKBONES[family].paths.get("model")
    return _relative(path.resolve(), out) if rule is not None and rule(model, path.exists()) else model


def _task_lines(task: FoundTask, out: Path) -> list[str]:
    record: Record = TASK_SOURCES[task.kind]
    dataset = _relative(task.path, out)
    source = f"text:file:{dataset}" if task.kind == "text" else f"{task.kind}:{dataset}"
    return ["[[tasks]]", f"name = {toml_value(task.name)}", f"source = {toml_value(source)}",
            *_option_lines(record.options, {}, commented=True), ""]


def scenario_text(tasks: list[FoundTask], out: Path, *, name: str, model: str | None = None) -> str:
    """The commented scenario file of ``tasks`` (see the module docstring) to be written at ``out``."""
    modality = tasks[0].modality
    template_name = TEMPLATES[modality]
    template = tomllib.loads(known_scenarios()[template_name].read_text())
    backbone = dict(template["backbone"])
    if model:
        backbone["model"] = _model_value(model, backbone["family"], out)
    lines = [f"# Scenario for {modality}, written by `editkit init` from the embedded scenario {template_name!r}.",
             "# Run it with: editkit stream --scenario " + out.name,
             "# Paths are read from this file's folder. Keys commented out show their default.", "",
             f"name = {toml_value(name)}",
             f"description = {toml_value(f'{len(tasks)} task(s) of {modality}: ' + ', '.join(t.name for t in tasks))}",
             "", *_table("backbone", backbone), *_table("heads", template.get("heads", {}))]
    accepted = set(TASK_SOURCES[tasks[0].kind].option_names)
    data = {k: v for k, v in template.get("data", {}).items() if k in accepted}
    if data:
        lines += _table("data", data)
    if "generic" in template:
        lines += ["# Unlabeled data for the tauJp penalty; a text corpus may be your own file: corpus = \"file:PATH\""]
        lines += _table("generic", template["generic"])
    for task in tasks:
        lines += _task_lines(task, out)
    if "negation" in template:
        lines += ["# How `editkit negate NAME` scores the negated model; control_text and prompts may name your own",
                  "# files as \"file:PATH\" (a folder of val.txt and test.txt keeps every prompt)."]
        lines += _table("negation", template["negation"])
    lines += _recipe_lines(template.get("recipe", {}))
    return "\n".join(lines) + "\n"


def new_scenario(data: str | os.PathLike, out: str | os.PathLike | None = None, *, name: str | None = None,
                 model: str | None = None, force: bool = False) -> tuple[Path, list[FoundTask]]:
    """Write the scenario file of ``data`` at ``out`` (default ``<name>.toml`` here) and return its path and
    tasks. ``model`` replaces the template backbone's model (a Hugging Face id or directory, for text).
    Refuses an existing file unless ``force``; the file written parses as a scenario."""
    tasks = find_tasks(data)
    name = name or Path(data).resolve().stem
    out = Path(out) if out is not None else Path(f"{name}.toml")
    check_file_target(out, force=force)
    if model is not None and "model" not in load_scenario(TEMPLATES[tasks[0].modality]).backbone:
        raise ConfigError(f"--model applies to text backbones; {tasks[0].modality} use the "
                          f"{TEMPLATES[tasks[0].modality]} backbone (edit [backbone] to change it)")
    text = scenario_text(tasks, out, name=name, model=model)
    atomic_write_text(out, text)
    load_scenario(out)  # what was written is a valid scenario
    return out, tasks
