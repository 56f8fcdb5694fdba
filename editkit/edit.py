"""Add or negate banked task vectors and score the edited model on the scenario's tasks.

The bank records which scenario each vector came from; the scenario is rebuilt
(data, heads, backbone) to evaluate, and its backbone must be the bank's base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .arithmetic import TaskVector, addition_coefficients, combine, negation_coefficients
from .bank import Bank
from .errors import BankError, IncompatibleVectorsError
from .evaluate import EvalTask, addition_summary, evaluate_vector, negation_summary
from .progress import NullProgress, Progress
from .scenario import BuiltScenario, ScenarioSpec, build_scenario, known_scenarios, load_scenario


@dataclass
class EditResult:
    coefficients: dict[str, float]
    mode: str
    vector: TaskVector
    report: dict[str, Any]


def open_bank(path: str | Path) -> Bank:
    bank = Bank(path)
    if not bank.exists() or not len(bank):
        raise BankError(f"no task vectors in {Path(path)}: run `editkit stream` first or pass --bank DIR")
    return bank


def scenario_of(bank: Bank, names: Sequence[str], progress: Progress) -> BuiltScenario:
    """Rebuild the scenario the selected vectors were fine-tuned in, and check its base model."""
    entries = [bank.get(n) for n in names]
    scenarios = {e.scenario for e in entries}
    if len(scenarios) != 1 or None in scenarios:
        raise BankError(f"vectors {list(names)} come from different or unknown scenarios {sorted(map(str, scenarios))}")
    seed = int(entries[0].recipe.get("seed", 0))
    built = build_scenario(_find_scenario(scenarios.pop(), entries[0].metrics.get("scenario_file")), seed=seed,
                           progress=progress)
    if built.backbone.fingerprint() != bank.base:
        raise IncompatibleVectorsError(
            f"bank {bank.root} was built on another base model than scenario {built.spec.name!r}'s {built.backbone.name}"
        )
    return built


def _find_scenario(name: str, recorded_file: str | None) -> ScenarioSpec:
    """By name among the known scenarios, else the file the stream recorded in the bank."""
    if name in known_scenarios() or not recorded_file or not Path(recorded_file).is_file():
        return load_scenario(name)
    return load_scenario(recorded_file)


def _evaluate(built: BuiltScenario, vector: TaskVector | None, mode: str, tasks: Sequence[str], progress: Progress,
              description: str) -> dict[str, float]:
    evals = [EvalTask(name, built.heads[name], built.task(name).test) for name in tasks]
    return evaluate_vector(built.backbone.module, mode, vector.tensors if vector else None, evals, progress=progress,
                           description=description)


def add(bank: Bank, names: Sequence[str], alpha: float | Sequence[float] = 1.0, *, progress: Progress | None = None) -> EditResult:
    """theta_0 + sum alpha_i tau_i, scored on the added vectors' tasks (absolute and normalized)."""
    progress = progress or NullProgress()
    coefficients = addition_coefficients(list(names), alpha)
    vector = combine(bank, coefficients)
    built = scenario_of(bank, list(coefficients), progress)
    tasks = [bank.get(n).task for n in coefficients]
    per_task = _evaluate(built, vector, vector.mode, tasks, progress, "evaluating sum")
    single = {bank.get(n).task: bank.get(n).metrics.get("single_task") for n in coefficients}
    report = {"operation": "add", "scenario": built.spec.name, "mode": vector.mode, "coefficients": coefficients,
              "per_task": per_task, "single_task": single, **addition_summary(per_task, single)}
    return EditResult(coefficients, vector.mode, vector, report)


def negate(bank: Bank, name: str, alpha: float = 1.0, *, progress: Progress | None = None) -> EditResult:
    """theta_0 - alpha tau: target accuracy (forgetting) and control accuracy on the scenario's other tasks."""
    progress = progress or NullProgress()
    coefficients = negation_coefficients(name, alpha)
    vector = combine(bank, coefficients)
    built = scenario_of(bank, [name], progress)
    target = bank.get(name).task
    tasks = [target] + [t for t in built.task_names if t != target]
    per_task = _evaluate(built, vector, vector.mode, tasks, progress, "evaluating negation")
    pretrained = _evaluate(built, None, vector.mode, tasks, progress, "evaluating pretrained")
    report = {"operation": "negate", "scenario": built.spec.name, "mode": vector.mode, "coefficients": coefficients,
              "target_task": target, "per_task": per_task, "pretrained": pretrained,
              **negation_summary(target, per_task, pretrained)}
    return EditResult(coefficients, vector.mode, vector, report)
