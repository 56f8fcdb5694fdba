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
- ``[control]``: the negation control set (``kind = "imagenet"``; see ``editkit.edit``).

Backbone families and task sources are registries (``register_backbone`` /
``register_task_source``); each entry may register a ``check`` that says, without
loading anything large, what is missing (:func:`check_scenario`), so a run stops
before training when weights or data are absent.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import recipe as recipe_mod
from .backbones.base import Backbone
from .errors import ConfigError, MissingResourceError
from .heads import fit_probe
from .progress import NullProgress, Progress
from .recipe import Recipe
from .taujp import UnlabeledSource
from .tasks import TaskData, tensor_task

log = logging.getLogger(__name__)

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
SCENARIO_PATH_ENV = "EDITKIT_SCENARIOS"


TASK_RECIPE_KEYS = ("epochs", "steps")


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

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]


def scenario_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get(SCENARIO_PATH_ENV, "").split(os.pathsep) if p]
    return extra + [SCENARIO_DIR]


def known_scenarios() -> dict[str, Path]:
    """Scenario name -> file, from ``$EDITKIT_SCENARIOS`` first, then the built-in directory."""
    found: dict[str, Path] = {}
    for directory in scenario_dirs():
        for path in sorted(directory.glob("*.toml")):
            found.setdefault(path.stem, path)
    return found


def load_scenario(name_or_path: str | Path) -> ScenarioSpec:
    """Parse a scenario by name (see ``known_scenarios``) or by file path."""
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.is_file()):
        known = known_scenarios()
        if str(name_or_path) not in known:
            raise ConfigError(f"unknown scenario {str(name_or_path)!r}; known scenarios: {', '.join(sorted(known)) or 'none'}")
        path = known[str(name_or_path)]
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"scenario file {path} is not valid TOML: {exc}") from exc
    return parse_scenario(data, path)


def parse_scenario(data: dict[str, Any], path: Path | None = None) -> ScenarioSpec:
    where = path or "scenario"
    for key in ("name", "backbone", "tasks"):
        if key not in data:
            raise ConfigError(f"{where}: missing required key {key!r}")
    tasks = tuple(_task_spec(t, where) for t in data["tasks"])
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: task names must be unique, got {names}")
    if not tasks:
        raise ConfigError(f"{where}: a scenario needs at least one task")
    return ScenarioSpec(
        name=data["name"],
        description=data.get("description", ""),
        backbone=dict(data["backbone"]),
        heads=dict(data.get("heads", {"kind": "probe", "shots": 5})),
        tasks=tasks,
        recipe=recipe_mod.from_mapping(data.get("recipe", {})),
        generic=dict(data["generic"]) if "generic" in data else None,
        path=path,
        data=dict(data.get("data", {})),
        control=dict(data["control"]) if "control" in data else None,
    )


def _task_spec(table: dict[str, Any], where: object) -> TaskSpec:
    if "name" not in table or "source" not in table or ":" not in table["source"]:
        raise ConfigError(f"{where}: each [[tasks]] entry needs a name and a source 'kind:dataset', got {table}")
    recipe = dict(table.get("recipe", {}))
    recipe.update({k: table[k] for k in TASK_RECIPE_KEYS if k in table})
    recipe_mod.from_mapping(recipe)  # refuse unknown fields / bad values now, by name
    options = {k: v for k, v in table.items() if k not in ("name", "source", "recipe", *TASK_RECIPE_KEYS)}
    return TaskSpec(table["name"], table["source"], options, recipe)


def task_recipes(spec: ScenarioSpec, **overrides: Any) -> dict[str, Recipe]:
    """Each task's recipe: the scenario's ``[recipe]``, then the task's own values, then ``overrides``.

    Later levels win field by field; a level that gives ``steps`` without ``epochs``
    clears an ``epochs`` from below (so ``--steps 5`` beats per-task epochs, and
    ``--epochs 2`` beats both). ``None`` overrides mean "keep".
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    return {t.name: spec.recipe.with_overrides(**t.recipe).with_overrides(**given) for t in spec.tasks}


# --- building ---------------------------------------------------------------------------------


@dataclass
class BuiltScenario:
    """A scenario with its backbone, data and heads loaded."""

    spec: ScenarioSpec
    backbone: Backbone
    tasks: list[TaskData]
    heads: dict[str, nn.Module]
    generic: UnlabeledSource | None = None

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def task(self, name: str) -> TaskData:
        for task in self.tasks:
            if task.name == name:
                return task
        raise ConfigError(f"scenario {self.spec.name!r} has no task {name!r}; tasks: {', '.join(self.task_names)}")

    def benchmark(self):
        """The tasks as an Avalanche benchmark (imported lazily: avalanche takes seconds to import)."""
        from .avalanche_bridge import benchmark_from_tasks

        return benchmark_from_tasks(self.tasks)


BACKBONES: dict[str, Callable[..., Backbone]] = {}
TASK_SOURCES: dict[str, Callable[[str, Backbone, dict[str, Any]], TaskData]] = {}
#: family -> check(**backbone options) -> list of missing pieces (one line each)
BACKBONE_CHECKS: dict[str, Callable[..., list[str]]] = {}
#: kind -> check(task name, options) -> list of missing pieces (one line each)
TASK_SOURCE_CHECKS: dict[str, Callable[[str, dict[str, Any]], list[str]]] = {}


def register_backbone(family: str, *, check: Callable[..., list[str]] | None = None):
    """Register a backbone builder ``fn(**options) -> Backbone`` (options: the scenario's
    ``[backbone]`` table minus ``family``, plus CLI overrides). ``check(**options)``
    lists what is missing offline without loading anything large."""

    def wrap(fn):
        BACKBONES[family] = fn
        if check is not None:
            BACKBONE_CHECKS[family] = check
        return fn

    return wrap


def register_task_source(kind: str, *, check: Callable[[str, dict[str, Any]], list[str]] | None = None):
    """Register a task loader ``fn(name, backbone, options) -> TaskData`` for sources ``kind:dataset``
    (``options["dataset"]`` is the part after the colon). ``check(name, options)`` lists
    what is missing."""

    def wrap(fn):
        TASK_SOURCES[kind] = fn
        if check is not None:
            TASK_SOURCE_CHECKS[kind] = check
        return fn

    return wrap


@register_backbone("efficientnet-lite0")
def _efficientnet(image_size: int = 32, pretrained: bool = True) -> Backbone:
    from .backbones import efficientnet

    return efficientnet.build(image_size=image_size, pretrained=pretrained)


@register_task_source("packaged")
def _packaged_task(name: str, backbone: Backbone, options: dict[str, Any]) -> TaskData:
    """A dataset shipped inside pip/Debian packages; ``train_size`` / ``test_size`` keep a prefix (the
    splits are already in seeded random order), for quick reduced runs."""
    from .data.packaged import load_packaged

    dataset = load_packaged(options["dataset"])
    train, test = dataset.train, dataset.test
    n_train, n_test = options.get("train_size", len(train)), options.get("test_size", len(test))
    return tensor_task(
        name,
        dataset.classes,
        backbone.preprocess_arrays(train.images[:n_train]),
        torch.from_numpy(train.labels[:n_train]),
        backbone.preprocess_arrays(test.images[:n_test]),
        torch.from_numpy(test.labels[:n_test]),
    )


def _clip_check(model: str = "ViT-B-32", pretrained: str | None = "openai", cache_dir: str | None = None,
                **_: Any) -> list[str]:
    from .backbones.clip import check_weights

    problem = check_weights(model, pretrained, cache_dir=cache_dir)
    return [problem] if problem else []


@register_backbone("clip", check=_clip_check)
def _clip(
    model: str = "ViT-B-32",
    pretrained: str | None = "openai",
    cache_dir: str | None = None,
    quick_gelu: bool | None = None,
    device: str | None = None,
    seed: int = 0,
) -> Backbone:
    """open_clip CLIP (see ``editkit.backbones.clip.build_clip``), built on the CPU then moved to ``device``.

    ``pretrained = "random"``: random weights drawn from ``seed`` (the same in every
    process and every run, so banks, resumes and torchrun ranks agree on theta_0).
    """
    from .backbones.clip import RANDOM_TAGS, build_clip

    with torch.random.fork_rng(devices=[]):
        if pretrained is None or str(pretrained).strip().lower() in RANDOM_TAGS:
            torch.manual_seed(seed)
        backbone = build_clip(model, pretrained, cache_dir=cache_dir, quick_gelu=quick_gelu)
    if device and device != "cpu":
        backbone.clip_model.to(device)
    return backbone


def _vision8_options(options: dict[str, Any]) -> dict[str, Any]:
    known = {"dataset", "data_root", "augment", "hub_cache_dir", "download"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"vision8 task options {unknown} are unknown; known: {sorted(known)}")
    return options


def _vision8_check(name: str, options: dict[str, Any]) -> list[str]:
    from .data.vision8 import locate

    options = _vision8_options(options)
    try:
        locate(options["dataset"], data_root=options.get("data_root"), hub_cache_dir=options.get("hub_cache_dir"),
               download=bool(options.get("download", False)))
    except MissingResourceError as exc:
        return [str(exc)]
    return []


@register_task_source("vision8", check=_vision8_check)
def _vision8_task(name: str, backbone: Backbone, options: dict[str, Any]) -> TaskData:
    """One of the eight CLIP datasets (``vision8:Cars`` ...), preprocessed lazily per image.

    Options: ``data_root`` (else ``$EDITKIT_DATA``), ``augment`` (open_clip's train-time
    transform for the train split; default true, as the paper), ``hub_cache_dir``,
    ``download`` (fetch the parquet copy from the hub when reachable; default false).
    """
    from .data.vision8 import load_task as load_vision8

    options = _vision8_options(options)
    task = load_vision8(options["dataset"], backbone, data_root=options.get("data_root"),
                        augment=bool(options.get("augment", True)), hub_cache_dir=options.get("hub_cache_dir"),
                        download=bool(options.get("download", False)))
    return dataclasses.replace(task, name=name)


def backbone_options(spec: ScenarioSpec, overrides: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """(family, builder options): the scenario's ``[backbone]`` table with ``overrides`` (None = keep) applied."""
    options = dict(spec.backbone)
    family = options.pop("family", None)
    if family not in BACKBONES:
        raise ConfigError(f"scenario {spec.name!r}: unknown backbone family {family!r}; known: {', '.join(sorted(BACKBONES))}")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    accepted = inspect.signature(BACKBONES[family]).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in given if k not in accepted and not takes_any)
    if unknown:
        raise ConfigError(f"backbone family {family!r} has no option(s) {unknown} (it takes {', '.join(accepted)})")
    return family, {**options, **given}


def build_backbone(spec: ScenarioSpec, overrides: dict[str, Any] | None = None) -> Backbone:
    family, options = backbone_options(spec, overrides)
    return BACKBONES[family](**options)


def task_options(spec: ScenarioSpec, task: TaskSpec, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Options a task's source receives: ``[data]`` defaults, the task's own keys, then ``overrides``."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    return {**spec.data, **task.options, **given, "dataset": task.dataset}


def load_task(task: TaskSpec, backbone: Backbone, options: dict[str, Any] | None = None) -> TaskData:
    kind, dataset = task.source.split(":", 1)
    if kind not in TASK_SOURCES:
        raise ConfigError(f"task {task.name!r}: unknown source kind {kind!r}; known: {', '.join(sorted(TASK_SOURCES))}")
    return TASK_SOURCES[kind](task.name, backbone, options if options is not None else {"dataset": dataset, **task.options})


def check_scenario(spec: ScenarioSpec, *, backbone_overrides: dict[str, Any] | None = None,
                   task_overrides: dict[str, Any] | None = None) -> list[str]:
    """One line per missing piece (weights, each task's data); empty when the scenario can be built.

    Uses the registered checks only: families and sources without one (packaged
    data, EfficientNet from pip) are taken as present. Downloads nothing.
    """
    family, options = backbone_options(spec, backbone_overrides)
    problems: list[str] = []
    if family in BACKBONE_CHECKS:
        problems += BACKBONE_CHECKS[family](**options)
    for task in spec.tasks:
        check = TASK_SOURCE_CHECKS.get(task.kind)
        if check is None:
            if task.kind not in TASK_SOURCES:
                problems.append(f"task {task.name!r}: unknown source kind {task.kind!r}; known: {', '.join(sorted(TASK_SOURCES))}")
            continue
        problems += check(task.name, task_options(spec, task, task_overrides))
    return problems


def probe_head(backbone: Backbone, task: TaskData, *, shots: int, seed: int) -> nn.Module:
    """Logistic-regression probe on theta_0 features of ``shots`` train examples per class."""
    targets = getattr(task.train, "targets", None)
    labels = torch.as_tensor(list(targets) if targets is not None else [item[1] for item in task.train])
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for c in range(task.num_classes):
        members = (labels == c).nonzero().flatten()
        chosen += members[torch.randperm(len(members), generator=generator)[:shots]].tolist()
    inputs = torch.stack([task.train[i][0] for i in chosen])
    return fit_probe(backbone.features(inputs), labels[chosen], task.num_classes, seed=seed)


def build_heads(spec: ScenarioSpec, backbone: Backbone, tasks: list[TaskData], seed: int) -> dict[str, nn.Module]:
    kind = spec.heads.get("kind", "probe")
    if kind == "probe":
        return {t.name: probe_head(backbone, t, shots=int(spec.heads.get("shots", 5)), seed=seed) for t in tasks}
    if kind == "zero-shot":
        from .backbones.clip import zero_shot_head_for_task

        datasets = {t.name: t.dataset for t in spec.tasks}
        return {t.name: zero_shot_head_for_task(backbone, t, dataset=datasets.get(t.name)) for t in tasks}
    raise ConfigError(f"scenario {spec.name!r}: unknown head kind {kind!r} (probe or zero-shot)")


def build_generic(spec: ScenarioSpec, backbone: Backbone, seed: int) -> UnlabeledSource | None:
    if not spec.generic:
        return None
    kind = spec.generic.get("kind")
    if kind != "natural-crops":
        raise ConfigError(f"scenario {spec.name!r}: unknown generic source {kind!r} (natural-crops)")
    from .data.natural import natural_crops

    images = natural_crops(n=int(spec.generic.get("size", 2000)), size=int(spec.generic.get("crop", 32)), seed=seed)
    return UnlabeledSource("generic", backbone.preprocess_arrays(images), seed=seed)


def build_scenario(
    spec: ScenarioSpec,
    *,
    seed: int = 0,
    progress: Progress | None = None,
    backbone_overrides: dict[str, Any] | None = None,
    task_overrides: dict[str, Any] | None = None,
) -> BuiltScenario:
    """Load backbone, every task's data, heads and the generic source.

    backbone_overrides / task_overrides: values replacing the scenario file's
    ``[backbone]`` options / every task's source options (``None`` values = keep).
    """
    progress = progress or NullProgress()
    with progress.task(f"loading {spec.name}", total=len(spec.tasks) + 2) as bar:
        backbone = build_backbone(spec, backbone_overrides)
        bar.advance()
        tasks = []
        for task in spec.tasks:
            tasks.append(load_task(task, backbone, task_options(spec, task, task_overrides)))
            bar.advance()
        heads = build_heads(spec, backbone, tasks, seed)
        generic = build_generic(spec, backbone, seed)
        bar.advance()
    return BuiltScenario(spec, backbone, tasks, heads, generic)
