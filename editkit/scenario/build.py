"""Building a parsed scenario: the backbone, every task's data, the heads, the generic source.

Backbone families and task sources are registries (``register_backbone`` /
``register_task_source``); each entry may register a ``check`` that says, without
loading anything large, what is missing (:func:`check_scenario`), so a run stops
before training when weights or data are absent.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from editkit.core.taujp import UnlabeledSource
from editkit.data.tasks import TaskData, tensor_task
from editkit.errors import ConfigError, MissingResourceError
from editkit.models.backbone import Backbone
from editkit.models.heads import fit_probe
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec, TaskSpec
from editkit.util.progress import NullProgress, Progress

log = logging.getLogger(__name__)


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
        from editkit.integrations.avalanche.benchmark import benchmark_from_tasks

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
    from editkit.models import efficientnet

    return efficientnet.build(image_size=image_size, pretrained=pretrained)


@register_task_source("packaged")
def _packaged_task(name: str, backbone: Backbone, options: dict[str, Any]) -> TaskData:
    """A dataset shipped inside pip/Debian packages; ``train_size`` / ``test_size`` keep a prefix (the
    splits are already in seeded random order), for quick reduced runs."""
    from editkit.data.packaged import load_packaged

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
    from editkit.models.clip import check_weights

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
    """open_clip CLIP (see ``editkit.models.clip.build_clip``), built on the CPU then moved to ``device``.

    ``pretrained = "random"``: random weights drawn from ``seed`` (the same in every
    process and every run, so banks, resumes and torchrun ranks agree on theta_0).
    """
    from editkit.models.clip import RANDOM_TAGS, build_clip

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
    from editkit.data.vision8 import locate

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
    from editkit.data.vision8 import load_task as load_vision8

    options = _vision8_options(options)
    task = load_vision8(options["dataset"], backbone, data_root=options.get("data_root"),
                        augment=bool(options.get("augment", True)), hub_cache_dir=options.get("hub_cache_dir"),
                        download=bool(options.get("download", False)))
    return dataclasses.replace(task, name=name)


def backbone_options(spec: ScenarioSpec, build: BuildOptions | None = None,
                     device: str | None = None) -> tuple[str, dict[str, Any]]:
    """(family, builder options): the scenario's ``[backbone]`` table with ``build``'s set options applied;
    ``device`` is passed on to families whose builder takes one (they build straight on it)."""
    options = dict(spec.backbone)
    family = options.pop("family", None)
    if family not in BACKBONES:
        raise ConfigError(f"scenario {spec.name!r}: unknown backbone family {family!r}; known: {', '.join(sorted(BACKBONES))}")
    given = (build or BuildOptions()).backbone()
    accepted = inspect.signature(BACKBONES[family]).parameters
    if device is not None and "device" in accepted:
        given["device"] = device
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    unknown = sorted(k for k in given if k not in accepted and not takes_any)
    if unknown:
        raise ConfigError(f"backbone family {family!r} has no option(s) {unknown} (it takes {', '.join(accepted)})")
    return family, {**options, **given}


def build_backbone(spec: ScenarioSpec, build: BuildOptions | None = None, device: str | None = None) -> Backbone:
    family, options = backbone_options(spec, build, device)
    return BACKBONES[family](**options)


def task_options(spec: ScenarioSpec, task: TaskSpec, build: BuildOptions | None = None) -> dict[str, Any]:
    """Options a task's source receives: ``[data]`` defaults, the task's own keys, then ``build``'s set options."""
    return {**spec.data, **task.options, **(build or BuildOptions()).tasks(), "dataset": task.dataset}


def load_task(task: TaskSpec, backbone: Backbone, options: dict[str, Any] | None = None) -> TaskData:
    kind, dataset = task.source.split(":", 1)
    if kind not in TASK_SOURCES:
        raise ConfigError(f"task {task.name!r}: unknown source kind {kind!r}; known: {', '.join(sorted(TASK_SOURCES))}")
    return TASK_SOURCES[kind](task.name, backbone, options if options is not None else {"dataset": dataset, **task.options})


def check_scenario(spec: ScenarioSpec, build: BuildOptions | None = None) -> list[str]:
    """One line per missing piece (weights, each task's data); empty when the scenario can be built.

    Uses the registered checks only: families and sources without one (packaged
    data, EfficientNet from pip) are taken as present. Downloads nothing.
    """
    family, options = backbone_options(spec, build)
    problems: list[str] = []
    if family in BACKBONE_CHECKS:
        problems += BACKBONE_CHECKS[family](**options)
    for task in spec.tasks:
        check = TASK_SOURCE_CHECKS.get(task.kind)
        if check is None:
            if task.kind not in TASK_SOURCES:
                problems.append(f"task {task.name!r}: unknown source kind {task.kind!r}; known: {', '.join(sorted(TASK_SOURCES))}")
            continue
        problems += check(task.name, task_options(spec, task, build))
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
        from editkit.data.vision8 import zero_shot_head_for_task

        datasets = {t.name: t.dataset for t in spec.tasks}
        return {t.name: zero_shot_head_for_task(backbone, t, dataset=datasets.get(t.name)) for t in tasks}
    raise ConfigError(f"scenario {spec.name!r}: unknown head kind {kind!r} (probe or zero-shot)")


def build_generic(spec: ScenarioSpec, backbone: Backbone, seed: int) -> UnlabeledSource | None:
    if not spec.generic:
        return None
    kind = spec.generic.get("kind")
    if kind != "natural-crops":
        raise ConfigError(f"scenario {spec.name!r}: unknown generic source {kind!r} (natural-crops)")
    from editkit.data.natural import natural_crops

    images = natural_crops(n=int(spec.generic.get("size", 2000)), size=int(spec.generic.get("crop", 32)), seed=seed)
    return UnlabeledSource("generic", backbone.preprocess_arrays(images), seed=seed)


def build_scenario(
    spec: ScenarioSpec,
    *,
    seed: int = 0,
    progress: Progress | None = None,
    build: BuildOptions | None = None,
    device: str | None = None,
) -> BuiltScenario:
    """Load backbone, every task's data, heads and the generic source.

    build: options laid over the scenario file's ``[backbone]`` table and every task's
    source options; device: where backbone families that take one build the model.
    """
    progress = progress or NullProgress()
    with progress.task(f"loading {spec.name}", total=len(spec.tasks) + 2) as bar:
        backbone = build_backbone(spec, build, device)
        bar.advance()
        tasks = []
        for task in spec.tasks:
            tasks.append(load_task(task, backbone, task_options(spec, task, build)))
            bar.advance()
        heads = build_heads(spec, backbone, tasks, seed)
        generic = build_generic(spec, backbone, seed)
        bar.advance()
    return BuiltScenario(spec, backbone, tasks, heads, generic)
