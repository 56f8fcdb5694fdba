"""Scenarios: declarative files under ``scenarios/`` turned into runnable streams.

A scenario file (TOML) names a backbone, a head kind, an optional generic
unlabeled source, an ordered list of tasks (each a data source) and a recipe.
``load_scenario`` parses and validates it; ``build_scenario`` loads the backbone
and the data, fits or builds the heads, and exposes the tasks as an Avalanche
benchmark (``train_stream`` / ``valid_stream`` / ``test_stream``, one experience
per task, task label = position in the stream).
"""

from __future__ import annotations

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
from .errors import ConfigError
from .heads import fit_probe
from .progress import NullProgress, Progress
from .recipe import Recipe
from .taujp import UnlabeledSource
from .tasks import TaskData, tensor_task

log = logging.getLogger(__name__)

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
SCENARIO_PATH_ENV = "EDITKIT_SCENARIOS"


@dataclass(frozen=True)
class TaskSpec:
    name: str
    source: str  # "<kind>:<dataset>", e.g. "packaged:mnist"
    options: dict[str, Any] = field(default_factory=dict)


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
    )


def _task_spec(table: dict[str, Any], where: object) -> TaskSpec:
    if "name" not in table or "source" not in table or ":" not in table["source"]:
        raise ConfigError(f"{where}: each [[tasks]] entry needs a name and a source 'kind:dataset', got {table}")
    options = {k: v for k, v in table.items() if k not in ("name", "source")}
    return TaskSpec(table["name"], table["source"], options)


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


def register_backbone(family: str):
    def wrap(fn):
        BACKBONES[family] = fn
        return fn

    return wrap


def register_task_source(kind: str):
    def wrap(fn):
        TASK_SOURCES[kind] = fn
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


def build_backbone(spec: ScenarioSpec) -> Backbone:
    options = dict(spec.backbone)
    family = options.pop("family", None)
    if family not in BACKBONES:
        raise ConfigError(f"scenario {spec.name!r}: unknown backbone family {family!r}; known: {', '.join(sorted(BACKBONES))}")
    return BACKBONES[family](**options)


def load_task(task: TaskSpec, backbone: Backbone) -> TaskData:
    kind, dataset = task.source.split(":", 1)
    if kind not in TASK_SOURCES:
        raise ConfigError(f"task {task.name!r}: unknown source kind {kind!r}; known: {', '.join(sorted(TASK_SOURCES))}")
    return TASK_SOURCES[kind](task.name, backbone, {"dataset": dataset, **task.options})


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

        return {t.name: zero_shot_head_for_task(backbone, t) for t in tasks}
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


def build_scenario(spec: ScenarioSpec, *, seed: int = 0, progress: Progress | None = None) -> BuiltScenario:
    """Load backbone, every task's data, heads and the generic source."""
    progress = progress or NullProgress()
    with progress.task(f"loading {spec.name}", total=len(spec.tasks) + 2) as bar:
        backbone = build_backbone(spec)
        bar.advance()
        tasks = []
        for task in spec.tasks:
            tasks.append(load_task(task, backbone))
            bar.advance()
        heads = build_heads(spec, backbone, tasks, seed)
        generic = build_generic(spec, backbone, seed)
        bar.advance()
    return BuiltScenario(spec, backbone, tasks, heads, generic)
