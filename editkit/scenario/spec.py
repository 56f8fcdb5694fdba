"""Scenarios: declarative files under ``scenarios/`` turned into runnable streams.

A scenario file (TOML) names a backbone, a head kind, an optional generic
unlabeled source, an ordered list of tasks (each a data source) and a recipe.
``load_scenario`` parses and validates it; ``build_scenario`` loads the backbone
and the data, fits or builds the heads, and exposes the tasks as an Avalanche
benchmark (``train_stream`` / ``valid_stream`` / ``test_stream``, one experience
per task, task label = position in the stream).

Optional parts of a scenario file:

- ``[data]``: options every task's source receives (``data_root``, ``augment``...);
  a ``[[tasks]]`` entry's own keys win.
- per-task recipe values: ``epochs`` / ``steps`` keys of a ``[[tasks]]`` entry, or
  an inline ``recipe = {...}`` table in it (see :func:`task_recipes` for precedence).
- ``[control]``: the negation control set (``kind = "imagenet"``; see ``editkit.runs.edit``).
- ``[merge]``: how the stream merges its banked vectors before scoring them after each experience
  (``method`` and that method's options; default: the mode's own, see ``editkit.merge.continual``).
- ``[negation]``: how negating a language task is scored (control and prompt corpora,
  toxicity scorer, alpha grid and rule, samples; the fields of
  :class:`~editkit.eval.lm_negation.LanguageNegation`).

A user's data is named by path: ``source = "imagefolder:photos"``, ``"csv:reviews.csv"``, and a corpus
``file:forget.txt`` wherever a corpus name goes (``text:file:...``, ``[generic] corpus``, ``[negation]``
``control_text`` / ``prompts``). A relative path is read from the scenario file's folder, so a
scenario and its data move together; the parsed spec holds absolute paths. So is a ``[backbone]`` value
its family reads as a path (``weights = "resnet18.pth"``, ``pretrained = "ckpt.pt"``, ``model =
"my-model"``, a folder beside the file): each family declares which of its options may be paths and how
a path is told from a name (``resnet18``, ``openai``, a hub id stay as written; see
:attr:`~editkit.core.registry.Record.paths`).

Every table is checked when the file is loaded, before anything is built: a key
that is not a scenario key, not a recipe field, or not an option of the named
backbone family, head kind, generic source or task source (as their registries
declare them) is refused by name with the list of known keys. A misspelt option
must never run with its default and bank vectors.

Building (loading what a spec names) is ``editkit.scenario.build``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from editkit.core.registry import Registry
from editkit.data import GENERIC_SOURCES, TASK_SOURCES
from editkit.errors import ConfigError
from editkit.eval.lm_negation import LanguageNegation
from editkit.eval.toxicity import TOXICITY_SCORERS
from editkit.merge.continual import StreamMerge
from editkit.models import BACKBONES, HEADS
# SCENARIO_DIR and known_scenarios are this module's names too: where the files are is the catalog's
from editkit.scenario.catalog import SCENARIO_DIR, known_scenarios, read_scenario, scenario_file  # noqa: F401
from editkit.train import recipe as recipe_mod
from editkit.train.recipe import Recipe
from editkit.util.paths import PathRule

#: The tables and values a scenario file may hold at its top level.
SCENARIO_KEYS = ("name", "description", "backbone", "heads", "generic", "data", "control", "negation", "merge",
                 "tasks", "recipe", "precision")
#: What a scenario's ``precision`` may name: the one its numbers were measured in (``auto`` resolves to it).
SCENARIO_PRECISIONS = ("bf16", "fp32")
TASK_RECIPE_KEYS = ("epochs", "steps")
#: Keys of a ``[[tasks]]`` entry besides its source's options.
TASK_KEYS = ("name", "source", "recipe", *TASK_RECIPE_KEYS)
CONTROL_KEYS = ("kind",)
DEFAULT_HEAD_KIND = "probe"
#: How a corpus name refers to a user's file (``editkit.data.user_data``).
FILE_CORPUS = "file:"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    source: str  # "<kind>:<dataset>", e.g. "packaged:mnist"
    options: dict[str, Any] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)  # per-task recipe overrides

    @property
    def kind(self) -> str:
        return self.source.split(":", 1)[0]

    @property
    def dataset(self) -> str:
        return self.source.split(":", 1)[1]


@dataclass(frozen=True)
class ScenarioSpec:
    """A parsed scenario file."""

    name: str
    description: str
    backbone: dict[str, Any]
    heads: dict[str, Any]
    tasks: tuple[TaskSpec, ...]
    recipe: Recipe
    generic: dict[str, Any] | None = None
    path: Path | None = None
    data: dict[str, Any] = field(default_factory=dict)
    control: dict[str, Any] | None = None
    negation: LanguageNegation | None = None
    merge: StreamMerge | None = None
    #: The precision the runtime's ``auto`` resolves to for this scenario (None: the device's default).
    precision: str | None = None

    @property
    def language(self) -> bool:
        """A language-model scenario (``[heads] kind = "lm"``): its scores are perplexities, not accuracies."""
        return self.heads.get("kind") == "lm"

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def reordered(self, order: Sequence[str]) -> ScenarioSpec:
        """The same scenario with its tasks arriving in ``order`` (every task once)."""
        if sorted(order) != sorted(self.task_names):
            raise ConfigError(f"task order {list(order)} is not an order of {self.name!r}'s tasks "
                              f"({', '.join(self.task_names)})")
        by_name = {t.name: t for t in self.tasks}
        return dataclasses.replace(self, tasks=tuple(by_name[name] for name in order))


def load_scenario(name_or_path: str | Path | ScenarioSpec) -> ScenarioSpec:
    """Parse and check a scenario by name (see ``known_scenarios``) or by file path; a spec already parsed
    (:meth:`ScenarioSpec.reordered`, say) is its own."""
    if isinstance(name_or_path, ScenarioSpec):
        return name_or_path
    path = scenario_file(name_or_path)
    return parse_scenario(read_scenario(path), path)


def parse_scenario(data: dict[str, Any], path: Path | None = None) -> ScenarioSpec:
    where = path or "scenario"
    _refuse_unknown(data, SCENARIO_KEYS, f"{where}: top level")
    for key in ("name", "backbone", "tasks"):
        if key not in data:
            raise ConfigError(f"{where}: missing required key {key!r}")
    base = path.parent if path is not None else None
    tasks = tuple(_with_paths(_task_spec(t, where), base) for t in data["tasks"])
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: task names must be unique, got {names}")
    if not tasks:
        raise ConfigError(f"{where}: a scenario needs at least one task")
    spec = ScenarioSpec(
        name=data["name"],
        description=data.get("description", ""),
        backbone=_backbone_with_paths(data["backbone"], base),
        heads={"kind": DEFAULT_HEAD_KIND, **data.get("heads", {})},
        tasks=tasks,
        recipe=recipe_mod.from_mapping(data.get("recipe", {})),
        generic=_generic_with_paths(data["generic"], base) if "generic" in data else None,
        path=path,
        data=dict(data.get("data", {})),
        control=dict(data["control"]) if "control" in data else None,
        negation=_negation(data["negation"], where, base) if "negation" in data else None,
        merge=StreamMerge.from_table(data["merge"], str(where)) if "merge" in data else None,
        precision=_precision(data.get("precision"), where),
    )
    _check_options(spec, where)
    return spec


def _precision(value: Any, where: object) -> str | None:
    if value is not None and value not in SCENARIO_PRECISIONS:
        raise ConfigError(f"{where}: precision {value!r} is not one of {', '.join(SCENARIO_PRECISIONS)}")
    return value


def _refuse_unknown(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join(known)}")


def _record(registry: Registry, name: Any, where: str):
    try:
        return registry[name]
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _check_options(spec: ScenarioSpec, where: object) -> None:
    """Every extension table's keys against the options its registry record declares."""
    backbone = dict(spec.backbone)
    family = backbone.pop("family", None)
    _record(BACKBONES, family, f"{where}: [backbone]").refuse_unknown(backbone, f"{where}: [backbone] of family {family!r}")
    heads = dict(spec.heads)
    kind = heads.pop("kind")
    _record(HEADS, kind, f"{where}: [heads]").refuse_unknown(heads, f"{where}: [heads] of kind {kind!r}")
    if spec.generic is not None:
        generic = dict(spec.generic)
        kind = generic.pop("kind", None)
        _record(GENERIC_SOURCES, kind, f"{where}: [generic]").refuse_unknown(generic, f"{where}: [generic] of kind {kind!r}")
    if spec.control is not None:
        _refuse_unknown(spec.control, CONTROL_KEYS, f"{where}: [control]")
    for task in spec.tasks:
        source = _record(TASK_SOURCES, task.kind, f"{where}: task {task.name!r}")
        source.refuse_unknown(task.options, f"{where}: task {task.name!r} (source {task.kind!r})")
        source.refuse_unknown(spec.data, f"{where}: [data], given to task {task.name!r} (source {task.kind!r})")
        if (focus := {**spec.data, **task.options}.get("focus_words")) is not None:
            _record(TOXICITY_SCORERS, focus, f"{where}: task {task.name!r}, focus_words")


def _negation(table: dict[str, Any], where: object, base: Path | None = None) -> LanguageNegation:
    _refuse_unknown(table, tuple(f.name for f in dataclasses.fields(LanguageNegation)), f"{where}: [negation]")
    table = dict(table)
    if "prompts" in table:
        table["prompts"] = corpus_path(table["prompts"], base)
    if "control_text" in table:
        listed = table["control_text"].split(",") if isinstance(table["control_text"], str) else table["control_text"]
        table["control_text"] = [corpus_path(name, base) for name in listed]
    return LanguageNegation(**table)


# --------------------------------------------------------------------------- paths in a scenario file


def resolve_path(value: str, base: Path | None) -> str:
    """A path written in a scenario file: ``~`` expanded, a relative one read from the file's folder ``base``
    (kept relative, to the working directory, when there is no file)."""
    path = Path(value).expanduser()
    return str(path) if path.is_absolute() or base is None else os.path.abspath(base / path)


def corpus_path(name: Any, base: Path | None) -> Any:
    """A corpus name with its path resolved when it names a user's file (``file:PATH``); others unchanged."""
    if isinstance(name, str) and name.startswith(FILE_CORPUS):
        return FILE_CORPUS + resolve_path(name[len(FILE_CORPUS):], base)
    return name


def _read_from(value: Any, rule: PathRule, base: Path | None) -> Any:
    """``value`` resolved against the scenario's folder ``base`` when ``rule`` (its reader's) takes it for a path,
    told whether it names something there; a name (a tag, a hub id) or a value that is no text as it is."""
    if not isinstance(value, str):
        return value
    exists = ((base or Path()) / Path(value).expanduser()).exists()
    return resolve_path(value, base) if rule(value, exists) else value


def _path_rules(registry: Registry, name: Any) -> Mapping[str, PathRule]:
    """The path rules of the record ``name`` (none for a name the registry lacks, refused by the option check)."""
    return registry[name].paths if isinstance(name, str) and name in registry else {}


def _with_paths(task: TaskSpec, base: Path | None) -> TaskSpec:
    """The task with a path in its source resolved: the dataset of a source that reads paths (its record's
    ``paths`` name ``dataset``), or a ``file:`` corpus of any source."""
    rules = _path_rules(TASK_SOURCES, task.kind)
    dataset = (_read_from(task.dataset, rules["dataset"], base) if "dataset" in rules
               else corpus_path(task.dataset, base))
    return dataclasses.replace(task, source=f"{task.kind}:{dataset}")


def _backbone_with_paths(table: dict[str, Any], base: Path | None) -> dict[str, Any]:
    """The ``[backbone]`` table with each value its family reads as a path resolved against the scenario's folder."""
    rules = _path_rules(BACKBONES, table.get("family"))
    return {key: _read_from(value, rules[key], base) if key in rules else value for key, value in table.items()}


def _generic_with_paths(table: dict[str, Any], base: Path | None) -> dict[str, Any]:
    """The ``[generic]`` table with its corpus (or each corpus of a list) resolved against the scenario's folder."""
    def resolved(value: Any) -> Any:
        return corpus_path(value, base) if isinstance(value, str) else [corpus_path(v, base) for v in value]

    return {key: resolved(value) if key == "corpus" else value for key, value in table.items()}


def _task_spec(table: dict[str, Any], where: object) -> TaskSpec:
    if "name" not in table or "source" not in table or ":" not in table["source"]:
        raise ConfigError(f"{where}: each [[tasks]] entry needs a name and a source 'kind:dataset', got {table}")
    recipe = dict(table.get("recipe", {}))
    recipe.update({k: table[k] for k in TASK_RECIPE_KEYS if k in table})
    recipe_mod.from_mapping(recipe)  # refuse unknown fields / bad values now, by name
    options = {k: v for k, v in table.items() if k not in TASK_KEYS}
    return TaskSpec(table["name"], table["source"], options, recipe)


def task_recipes(spec: ScenarioSpec, **overrides: Any) -> dict[str, Recipe]:
    """Each task's recipe: the scenario's ``[recipe]``, then the task's own values, then ``overrides``.

    Later levels win field by field; a level that gives ``steps`` without ``epochs``
    clears an ``epochs`` from below (so ``--steps 5`` beats per-task epochs, and
    ``--epochs 2`` beats both). ``None`` overrides mean "keep".
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    return {t.name: spec.recipe.with_overrides(**t.recipe).with_overrides(**given) for t in spec.tasks}
