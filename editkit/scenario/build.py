"""Building a parsed scenario: the backbone, every task's data, the heads, the generic source.

Everything a scenario names is looked up in the registries of the layers that
implement it (``editkit.models.BACKBONES`` / ``HEADS``, ``editkit.data.TASK_SOURCES`` /
``GENERIC_SOURCES``), so this module knows no family, source or head kind. A
record's ``check`` says, without loading anything large, what is missing
(:func:`check_scenario`), so a run stops before training when weights or data are absent.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from torch import nn

from editkit.core.taujp import UnlabeledSource
from editkit.data import GENERIC_SOURCES, TASK_SOURCES, TEXT_CORPORA
from editkit.data.tasks import TaskData
from editkit.errors import ConfigError, MissingResourceError
from editkit.eval.lm_negation import LanguageNegation
from editkit.eval.toxicity import TOXICITY_SCORERS, word_flags
from editkit.models import BACKBONES, HEADS
from editkit.models.backbone import Backbone
from editkit.models.blocks import TailBackbone
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec, TaskSpec
from editkit.train.recipe import Recipe, attach_adapter
from editkit.util.progress import NullProgress, Progress


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

        return benchmark_from_tasks(self.tasks, self.backbone.batching)


def backbone_options(spec: ScenarioSpec, build: BuildOptions | None = None,
                     device: str | None = None) -> tuple[str, dict[str, Any]]:
    """(family, builder options): the scenario's ``[backbone]`` table with ``build``'s set options applied;
    ``device`` is passed on to families whose builder takes one (they build straight on it). An option
    the family does not take is refused by name."""
    options = dict(spec.backbone)
    family = options.pop("family", None)
    record = BACKBONES[family]
    given = (build or BuildOptions()).backbone()
    record.refuse_unknown(given, f"backbone family {family!r}")
    if device is not None and "device" in record.option_names:
        given["device"] = device
    return family, {**options, **given}


def build_backbone(spec: ScenarioSpec, build: BuildOptions | None = None, device: str | None = None) -> Backbone:
    family, options = backbone_options(spec, build, device)
    return BACKBONES[family].build(**options)


def task_options(spec: ScenarioSpec, task: TaskSpec, build: BuildOptions | None = None) -> dict[str, Any]:
    """Options a task's source receives: ``[data]`` defaults, the task's own keys, then ``build``'s set options.

    The scenario file's keys were checked against the source's options when it was
    loaded. Build options (``--data-root``, or what a bank recorded) apply to every task
    whose source takes them and pass by the others: one command line serves
    scenarios that mix sources.
    """
    accepted = TASK_SOURCES[task.kind].option_names
    given = {k: v for k, v in (build or BuildOptions()).tasks().items() if k in accepted}
    return {**spec.data, **task.options, **given}


def load_task(task: TaskSpec, backbone: Backbone, options: dict[str, Any]) -> TaskData:
    """The task's data from its source, given the options :func:`task_options` resolved. A text task's
    ``focus_words`` names a toxicity scorer (a file holds text); the source receives the scorer's word flags."""
    if isinstance(focus := options.get("focus_words"), str):
        options = {**options, "focus_words": word_flags(focus)}
    return TASK_SOURCES[task.kind].build(task.name, task.dataset, backbone, **options)


def check_scenario(spec: ScenarioSpec, build: BuildOptions | None = None) -> list[str]:
    """One line per missing piece (weights, each task's data, the ``[generic]`` source's data, the
    ``[negation]`` table's corpora and scorer); empty when the scenario can be built and scored.

    Uses the registered checks only: families and sources without one (packaged
    data, EfficientNet from pip) are taken as present. Downloads nothing. A piece
    two parts need (one dataset behind two corpora) is listed once.
    """
    family, options = backbone_options(spec, build)
    problems: list[str] = []
    if (check := BACKBONES[family].check) is not None:
        problems += check(**options)
    for task in spec.tasks:
        options = task_options(spec, task, build)
        if (check := TASK_SOURCES[task.kind].check) is not None:
            problems += check(task.name, task.dataset, **options)
        if isinstance(focus := options.get("focus_words"), str) and (check := TOXICITY_SCORERS[focus].check):
            problems += check()
    if spec.generic:
        generic = dict(spec.generic)
        if (check := GENERIC_SOURCES[generic.pop("kind", None)].check) is not None:
            problems += check(**generic)
    if spec.negation is not None:
        problems += _negation_problems(spec.negation)
    return list(dict.fromkeys(problems))


def require_scenario(spec: ScenarioSpec, build: BuildOptions | None = None) -> None:
    """Refuse a scenario that cannot start offline before anything is built, trained or written: a
    :class:`MissingResourceError` whose message is a header and one line per missing piece (:func:`check_scenario`)."""
    problems = check_scenario(spec, build)
    if problems:
        lines = [f"scenario {spec.name!r} cannot start: {len(problems)} missing piece{'s' if len(problems) > 1 else ''} "
                 "(nothing was trained, no bank was written)"]
        raise MissingResourceError("\n".join(lines + [f"  - {problem}" for problem in problems]))


def _negation_problems(negation: LanguageNegation) -> list[str]:
    """What scoring a negation needs besides the tasks: its control and prompt corpora and its scorer."""
    checks = [TEXT_CORPORA[corpus].check for corpus in (*negation.control_text, negation.prompts)]
    checks.append(TOXICITY_SCORERS[negation.scorer].check)
    return [line for check in checks if check is not None for line in check()]


def build_heads(spec: ScenarioSpec, backbone: Backbone, tasks: list[TaskData], seed: int) -> dict[str, nn.Module]:
    """Each task's fixed head, of the ``[heads]`` table's kind."""
    options = dict(spec.heads)
    record = HEADS[options.pop("kind")]
    datasets = {t.name: t.dataset for t in spec.tasks}
    return {t.name: record.build(backbone, t, datasets[t.name], seed, **options) for t in tasks}


def build_generic(spec: ScenarioSpec, backbone: Backbone, seed: int) -> UnlabeledSource | None:
    """The ``[generic]`` table's unlabeled source, or None without one."""
    if not spec.generic:
        return None
    options = dict(spec.generic)
    return GENERIC_SOURCES[options.pop("kind", None)].build(backbone, seed, **options)


def build_scenario(
    spec: ScenarioSpec,
    *,
    seed: int = 0,
    progress: Progress | None = None,
    build: BuildOptions | None = None,
    device: str | None = None,
    precision: str = "fp32",
) -> BuiltScenario:
    """Load backbone, every task's data, heads and the generic source.

    build: options laid over the scenario file's ``[backbone]`` table and every task's
    source options; device: where backbone families that take one build the model;
    precision: the runtime's, in which a language model's own passes run (its prefix states, perplexities and
    samples: :attr:`~editkit.models.blocks.TailBackbone.precision`), set before any data reads them.
    """
    progress = progress or NullProgress()
    with progress.task(f"loading {spec.name}", total=len(spec.tasks) + 2) as bar:
        backbone = build_backbone(spec, build, device)
        if isinstance(backbone, TailBackbone):
            backbone.precision = precision
        bar.advance()
        tasks = []
        for task in spec.tasks:
            tasks.append(load_task(task, backbone, task_options(spec, task, build)))
            bar.advance()
        heads = build_heads(spec, backbone, tasks, seed)
        generic = build_generic(spec, backbone, seed)
        bar.advance()
    return BuiltScenario(spec, backbone, tasks, heads, generic)


def adapter_arms(built: BuiltScenario, recipes: Mapping[str, Sequence[Recipe | Mapping[str, Any]]]
                 ) -> dict[str, BuiltScenario]:
    """One built scenario per adapter (``recipes``: adapter -> the recipes, or banked recipe dictionaries, of the
    vectors it holds), its theta_0 carrying that adapter. The first arm is ``built``; another gets a copy of its
    backbone (whole: a language model's tail is also a part of the model it samples with), sharing data, heads
    and sources: an adapter sits on the trainable module only and adds zero at initialisation, so the
    frozen-prefix states of a text and theta_0's outputs hold for every arm."""
    arms: dict[str, BuiltScenario] = {}
    for adapter in recipes:  # copies first, from the backbone without any adapter
        arms[adapter] = replace(built, backbone=copy.deepcopy(built.backbone)) if arms else built
    for adapter, arm in arms.items():
        attach_adapter(arm.backbone.module, recipes[adapter])
    return arms
