"""Where a banked vector comes from, and whether it still fits: every provenance question, answered once.

A stream records with each vector the scenario file, the build options and each task's source options
(:func:`scenario_provenance`); the bank records the base model's fingerprint. Whatever later asks "which scenario
made this vector, with what, on which base, and would a run now make the same one" asks here, so each refusal has
one wording wherever it is met (``add``, ``negate``, ``bench``, ``generate``, an export, an import, a resumed
stream):

- :func:`recorded_scenario`, :func:`recorded_build`: the scenario and the build options a vector was made with;
- :func:`bank_backbone`, :func:`bank_scenario`: those rebuilt, checked against the bank's base (:func:`check_base`);
- :func:`staleness`, :func:`refuse_stale`: what a run of the scenario now would make otherwise;
- :func:`import_target`: the scenario and task a vector made elsewhere is banked under.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from editkit.bank.store import Bank, VectorEntry
from editkit.core.artifacts import sha256_file
from editkit.errors import BankError, ConfigError, IncompatibleVectorsError
from editkit.models.backbone import Backbone
from editkit.scenario.build import BuiltScenario, build_backbone, build_scenario, task_options
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec, known_scenarios, load_scenario
from editkit.train.recipe import Recipe, attach_adapter, describe_differences
from editkit.train.runtime import Runtime
from editkit.util.progress import Progress

# --------------------------------------------------------------------------- what a vector records


def scenario_provenance(spec: ScenarioSpec, build: BuildOptions) -> dict[str, Any]:
    """What a banked vector records so ``add`` / ``negate`` / ``bench`` can rebuild its scenario: the scenario
    file and the build options it was made with; and every task's source options as the run used them, so a later
    run can tell a vector made from other data (:func:`staleness`)."""
    options = {t.name: json.loads(json.dumps(task_options(spec, t, build), default=str)) for t in spec.tasks}
    return {"scenario_file": str(spec.path.resolve()) if spec.path else None, "build": build.to_json(),
            "task_options": options}


def scenario_identity(spec: ScenarioSpec, build: BuildOptions) -> dict[str, Any]:
    """What a score computed on a scenario depends on, wherever its file lies: the provenance with the file's
    content (its sha256) in place of its path, so a record made on one node of a cluster is read on another that
    installed editkit elsewhere, and an edited file is never taken for the one scored."""
    identity = scenario_provenance(spec, build)
    identity["scenario_file"] = "sha256:" + sha256_file(spec.path) if spec.path else None
    return identity


def find_scenario(name: str, recorded_file: str | None) -> ScenarioSpec:
    """By name among the known scenarios, else the file the stream recorded (a scenario of the user's own)."""
    if name in known_scenarios() or not recorded_file or not Path(recorded_file).is_file():
        return load_scenario(name)
    return load_scenario(recorded_file)


def recorded_scenario(entry: VectorEntry) -> ScenarioSpec:
    """The scenario banked vector ``entry`` was fine-tuned in."""
    return find_scenario(entry.scenario, entry.provenance.get("scenario_file"))


def recorded_build(bank: Bank, name: str, given: BuildOptions | None = None) -> BuildOptions:
    """The build options vector ``name``'s stream recorded, with the ``given`` ones laid over them."""
    recorded = BuildOptions.from_json(bank.get(name).provenance.get("build"))
    return (given or BuildOptions()).over(recorded)


def import_target(scenario: str | Path, name: str, task: str | None) -> tuple[ScenarioSpec, str]:
    """The scenario a vector made elsewhere (a checkpoint, a PEFT adapter) is banked under, and its task
    (default: the vector's name), refused by name when the scenario has no such task."""
    spec = load_scenario(scenario)
    task = task or name
    if task not in spec.task_names:
        raise ConfigError(f"scenario {spec.name!r} has no task {task!r} (tasks: {', '.join(spec.task_names)}); "
                          "name the vector after one or pass its task")
    return spec, task


# --------------------------------------------------------------------------- the base model


def check_base(bank: Bank | str | None, backbone: Backbone | str, fingerprint: str | None = None) -> None:
    """Refuse ``backbone`` (or the backbone of that name whose ``fingerprint`` is given) for vectors fine-tuned
    from another base model (``bank``: their bank, or its base fingerprint): theta_0 of one model plus the task
    vectors of another is neither. A bank without vectors fits any model."""
    base, holder = (bank.base, f"bank {bank.root}") if isinstance(bank, Bank) else (bank, "the vectors' bank")
    name = backbone if isinstance(backbone, str) else backbone.name
    fingerprint = fingerprint or backbone.fingerprint()
    if base is not None and base != fingerprint:
        raise IncompatibleVectorsError(
            f"{holder} was built on another base model than {name}: its vectors were fine-tuned from {base[:19]}…, "
            f"the model is {fingerprint[:19]}…; pass the bank of this model, or the model of this bank")


# --------------------------------------------------------------------------- rebuilt from the bank


def bank_backbone(bank: Bank, name: str, build: BuildOptions | None = None) -> Backbone:
    """The backbone vector ``name`` was fine-tuned on, built alone (no task data) with the options its stream
    recorded (``build`` laid over them), its adapter attached, checked against the bank's base."""
    entry = bank.get(name)
    backbone = build_backbone(recorded_scenario(entry), recorded_build(bank, name, build))
    attach_adapter(backbone.module, [entry.recipe])
    check_base(bank, backbone)
    return backbone


def bank_scenario(bank: Bank, names: str | Sequence[str], build: BuildOptions | None = None, *,
                  progress: Progress | None = None, runtime: Runtime | None = None) -> BuiltScenario:
    """The scenario vectors ``names`` were fine-tuned in, rebuilt (data, heads, backbone) with the options the first
    one's stream recorded (``build`` laid over them) and its seed, on ``runtime``'s device and precision when given
    (else the CPU), the vectors' adapters attached, checked against the bank's base. Vectors of different or unknown
    scenarios are refused."""
    names = [names] if isinstance(names, str) else list(names)
    entries = [bank.get(n) for n in names]
    scenarios = {e.scenario for e in entries}
    if len(scenarios) != 1 or None in scenarios:
        raise BankError(f"vectors {names} come from different or unknown scenarios {sorted(map(str, scenarios))}")
    placed = {} if runtime is None else {"device": str(runtime.device), "precision": runtime.precision}
    built = build_scenario(recorded_scenario(entries[0]), seed=int(entries[0].recipe.get("seed", 0)),
                           progress=progress, build=recorded_build(bank, names[0], build), **placed)
    attach_adapter(built.backbone.module, [e.recipe for e in entries])
    if runtime is not None:
        runtime.place(built.backbone.module)
    check_base(bank, built.backbone)
    return built


# --------------------------------------------------------------------------- stale vectors


def staleness(entry: VectorEntry, recipe: Recipe | dict[str, Any], *, scenario: ScenarioSpec | str,
              build: BuildOptions | None = None, precision: str | None = None) -> str:
    """Each way banked vector ``entry`` differs from what a run of ``scenario`` with ``recipe`` (and ``build``, its
    steps in ``precision``) would fine-tune now, as one line (``"lam 1.0 banked, 3.0 now, task option focus_words
    None banked, 'profanity' now"``): the scenario, the recipe's fields, the task's source options (given the
    scenario itself, not only its name) and the precision, each where the bank recorded it (vectors banked before it
    did are compared by recipe alone). Empty when the vector is what the run would make."""
    name = scenario if isinstance(scenario, str) else scenario.name
    if entry.scenario != name:
        return f"scenario {entry.scenario!r} banked, {name!r} now"
    wanted = recipe.to_dict() if isinstance(recipe, Recipe) else dict(recipe)
    banked = entry.provenance.get("precision")
    ran = (f"precision {banked} banked, {precision} now"
           if None not in (banked, precision) and banked != precision else "")
    options = ("" if isinstance(scenario, str)
               else _task_option_differences(entry, scenario, build or BuildOptions()))
    return ", ".join(part for part in (describe_differences(entry.recipe, wanted), options, ran) if part)


def refuse_stale(bank: Bank, entry: VectorEntry, differences: str, remedy: str) -> None:
    """The one refusal of a banked vector that a run now would fine-tune otherwise (``differences``, from
    :func:`staleness`; nothing is refused when empty). ``remedy``: what the command lets the user do about it."""
    if differences:
        raise BankError(f"bank {bank.root} holds {entry.name!r}, fine-tuned with another recipe or data than this "
                        f"run's ({differences}): {remedy}")


def _task_option_differences(entry: VectorEntry, spec: ScenarioSpec, build: BuildOptions) -> str:
    """The task's source options whose banked value is not the scenario's now (empty where they agree, or where
    the bank recorded none: vectors banked before it did)."""
    recorded = (entry.provenance.get("task_options") or {}).get(entry.task)
    if recorded is None or entry.task not in spec.task_names:
        return ""
    current = scenario_provenance(spec, build)["task_options"].get(entry.task, {})
    return ", ".join(f"task option {key} {recorded.get(key)!r} banked, {current.get(key)!r} now"
                     for key in sorted(set(recorded) | set(current)) if recorded.get(key) != current.get(key))
