"""Add or negate banked task vectors and score the edited model on the scenario's tasks.

The bank records which scenario each vector came from (and, in each entry's
provenance, the scenario file and the backbone / data options the run was given);
the scenario is rebuilt (data, heads, backbone) to evaluate, with the build options
given now laid over the recorded ones, and its backbone must be the bank's base.

Adding merges the selected vectors with any registered merge method (task arithmetic
by default, TIES, DARE, MagMax, OPCM: ``editkit.merge.MERGE_METHODS``) and its options.

Negation reports target accuracy (lower is better) and control accuracy: on the
scenario's other tasks, or on ImageNet validation when the scenario asks for it
(``[control] kind = "imagenet"``) and a local copy exists (``editkit.data.imagenet``).
With ``tune_alpha`` the coefficient is chosen on validation data, as in the paper:
the alpha of the grid with the lowest target accuracy among those keeping control
accuracy >= 95% (``NEGATION_RETAIN``) of the pretrained model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from editkit.core.modes import Mode
from editkit.merge import MERGE_METHODS, method_options
from editkit.merge.arithmetic import TaskVector, addition_coefficients, combine, merged_vector, negation_coefficients
from editkit.bank.store import Bank
from editkit.merge.coefficients import NEGATION_RETAIN, PAPER_GRID_POINTS, alpha_grid, select_negation_alpha
from editkit.train.runtime import Runtime, default_runtime
from editkit.errors import ConfigError
from editkit.eval.accuracy import ClassificationScorer, addition_summary, evaluate_vector, negation_summary
from editkit.eval.scorers import task_scorer
from editkit.util.progress import NullProgress, Progress
from editkit.scenario.build import BuiltScenario
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import bank_scenario, recorded_build

log = logging.getLogger(__name__)

#: Coefficient grid searched on validation (the paper's).
ALPHA_GRID = tuple(alpha_grid(PAPER_GRID_POINTS))
CONTROLS = ("auto", "tasks", "imagenet")
IMAGENET = "ImageNet"


@dataclass
class EditResult:
    """What an edit scored: the vector added to theta_0, its numbers, and the scenario it was scored in (its
    backbone holding theta_0, its heads and test splits), for writing the edited model
    (:func:`editkit.runs.export.export_edit`)."""

    coefficients: dict[str, float]
    mode: str
    vector: TaskVector
    report: dict[str, Any]
    built: BuiltScenario | None = None

    @property
    def backbone(self) -> Any:
        return None if self.built is None else self.built.backbone


def _evaluate(built: BuiltScenario, vector: TaskVector | None, mode: str, tasks: Sequence[str], progress: Progress,
              description: str, *, runtime: Runtime, split: str = "test",
              extra: Mapping[str, ClassificationScorer] | None = None) -> dict[str, float]:
    """Each task's score on ``split`` (``test`` or ``val``), by the scorer its head calls for (accuracy;
    teacher-forced accuracy for text-to-text heads); names in ``extra`` use those eval tasks."""
    extra = extra or {}
    evals = [extra.get(name) or task_scorer(name, built.heads[name], getattr(built.task(name), split),
                                            built.backbone.batching) for name in tasks]
    return evaluate_vector(built.backbone.module, mode, vector.tensors if vector else None, evals, progress=progress,
                           description=description, runtime=runtime, vector_mode=vector.mode if vector else None)


def _weights_scores(built: BuiltScenario, vector: TaskVector, tasks: Sequence[str], progress: Progress,
                    description: str, *, runtime: Runtime,
                    extra: Mapping[str, ClassificationScorer] | None = None) -> dict[str, float] | None:
    """Each task's score of the ordinary model at the weights theta_0 + ``vector`` (what a written model holds)
    when the vector is linearized, its own scores being f_lin's; None for a non-linear vector, whose scores
    are already the weights'."""
    if not Mode(vector.mode).linearized:
        return None
    return _evaluate(built, vector, "nonlinear", tasks, progress, f"{description} (weights)", runtime=runtime,
                     extra=extra)


def add(bank: Bank, names: Sequence[str], alpha: float | Sequence[float] = 1.0, *, method: str = "task-arithmetic",
        params: Mapping[str, Any] | Sequence[str] | None = None, progress: Progress | None = None,
        build: BuildOptions | None = None, runtime: Runtime | None = None, weights_scores: bool = False) -> EditResult:
    """theta_0 + the selected vectors merged by ``method`` (task arithmetic: sum alpha_i tau_i), scored on their
    tasks (absolute and normalized).

    method: a registered merge method (``editkit.merge.MERGE_METHODS``); params: its options, as a
        mapping or ``key=value`` strings (unknown keys are refused, naming the known ones; unset ones take the
        method's defaults for this many vectors); the method merges alpha_i tau_i in the order of ``names``
        (see :func:`merged_vector`), which the report records (``order``) for a method the order changes.
    build: options laid over what the stream recorded; runtime: where to evaluate (default: one
        process on the CPU, fp32).
    weights_scores: for linearized vectors, also score the ordinary model at the weights theta_0 + the merged
        vector (what a written model holds: ``editkit add --out``), as ``report["weights"]``
        (``per_task``, ``absolute``, ``normalized``) beside the linearized model's scores.
    """
    progress = progress or NullProgress()
    runtime = runtime or default_runtime()
    coefficients = addition_coefficients(list(names), alpha)
    options = method_options(method, params or {}, tasks=len(coefficients))
    vector = merged_vector(bank, coefficients, method, options)
    built = bank_scenario(bank, list(coefficients), build, progress=progress, runtime=runtime)
    tasks = [bank.get(n).task for n in coefficients]
    per_task = _evaluate(built, vector, vector.mode, tasks, progress, f"evaluating {method}", runtime=runtime)
    single = {bank.get(n).task: bank.get(n).metrics.get("single_task") for n in coefficients}
    known = single if None not in single.values() else None  # imported vectors were never scored alone
    report = {"operation": "add", "scenario": built.spec.name, "mode": vector.mode, "method": method,
              "options": options, "coefficients": coefficients, "per_task": per_task, "single_task": single,
              **addition_summary(per_task, known)}
    if MERGE_METHODS[method].order_dependent:  # the merged vector depends on the order the vectors were folded in
        report["order"] = list(coefficients)
    if weights_scores and (weights := _weights_scores(built, vector, tasks, progress, f"evaluating {method}",
                                                      runtime=runtime)) is not None:
        report["weights"] = {"per_task": weights, **addition_summary(weights, known)}
    return EditResult(coefficients, vector.mode, vector, report, built)


def negate(
    bank: Bank,
    name: str,
    alpha: float = 1.0,
    *,
    progress: Progress | None = None,
    control: str = "auto",
    control_data: str | Path | None = None,
    tune_alpha: bool = False,
    grid: Sequence[float] | None = None,
    min_control: float = NEGATION_RETAIN,
    build: BuildOptions | None = None,
    runtime: Runtime | None = None,
    weights_scores: bool = False,
) -> EditResult:
    """theta_0 - alpha tau: target accuracy (forgetting) and control accuracy.

    control: ``tasks`` = the scenario's other tasks; ``imagenet`` = ImageNet validation
        (a local copy must exist: ``control_data``, ``$EDITKIT_IMAGENET`` or the data
        root); ``auto`` = ImageNet when the scenario names it as control
        (``[control] kind = "imagenet"``) or ``control_data`` is given and a copy is
        found, else the other tasks.
    tune_alpha: choose alpha from ``grid`` (default 0, 0.05, ..., 1) on validation
        splits: lowest target accuracy with control >= ``min_control`` x the pretrained
        control; ``alpha`` is then ignored. Task validation splits are the 10% held out
        of train; for ImageNet a seeded 10% (<= 5000) of its validation split is used
        for tuning and the rest for reporting.
    build: options laid over what the stream recorded; runtime: where to evaluate (default: one
        process on the CPU, fp32).
    weights_scores: for linearized vectors, also score the ordinary model at the weights theta_0 - alpha tau
        (what a written model holds: ``editkit negate --out``), as ``report["weights"]`` (``per_task``,
        ``target``, ``control``...) beside the linearized model's scores.
    """
    progress = progress or NullProgress()
    runtime = runtime or default_runtime()
    if control not in CONTROLS:
        raise ConfigError(f"control {control!r} is not one of {', '.join(CONTROLS)}")
    coefficients = negation_coefficients(name, alpha)
    vector = combine(bank, coefficients)  # reads and verifies the vector before anything is built
    build = recorded_build(bank, name, build)
    built = bank_scenario(bank, name, build, progress=progress, runtime=runtime)
    if hasattr(built.backbone, "prefix"):  # scored by accuracy below, which a language model has none of
        raise ConfigError(f"vector {name!r} was fine-tuned on a language model: give its scenario a [negation] "
                          "table to negate it (perplexities and sampled text)")
    target = bank.get(name).task
    imagenet = imagenet_control(built, control, control_data, build, tune_alpha)
    if imagenet is not None:
        controls, report_extra, tune_extra = [IMAGENET], {IMAGENET: imagenet[0]}, {IMAGENET: imagenet[1]}
    else:
        controls, report_extra, tune_extra = [t for t in built.task_names if t != target], {}, {}
    tasks = [target] + controls
    tuning = None
    if tune_alpha:
        unit = combine(bank, negation_coefficients(name, 1.0))
        tuning = _tune_negation(built, unit, target, tasks, tune_extra, grid or ALPHA_GRID, min_control, progress,
                                runtime)
        alpha = tuning["alpha"]
        coefficients = negation_coefficients(name, alpha)
        vector = combine(bank, coefficients)
    per_task = _evaluate(built, vector, vector.mode, tasks, progress, "evaluating negation", extra=report_extra,
                         runtime=runtime)
    pretrained = _evaluate(built, None, vector.mode, tasks, progress, "evaluating pretrained", extra=report_extra,
                           runtime=runtime)
    report = {"operation": "negate", "scenario": built.spec.name, "mode": vector.mode, "coefficients": coefficients,
              "target_task": target, "per_task": per_task, "pretrained": pretrained,
              **negation_summary(target, per_task, pretrained)}
    if imagenet is not None or tune_alpha:
        report.update(alpha=alpha, control_set="imagenet" if imagenet is not None else "tasks")
    if tuning is not None:
        report["tuning"] = tuning
    if weights_scores and (weights := _weights_scores(built, vector, tasks, progress, "evaluating negation",
                                                      runtime=runtime, extra=report_extra)) is not None:
        report["weights"] = {"per_task": weights, **negation_summary(target, weights, pretrained)}
    return EditResult(coefficients, vector.mode, vector, report, built)


def _tune_negation(built: BuiltScenario, unit: TaskVector, target: str, tasks: Sequence[str],
                   extra: Mapping[str, ClassificationScorer], grid: Sequence[float], min_control: float, progress: Progress,
                   runtime: Runtime) -> dict[str, Any]:
    """Evaluate theta_0 - alpha tau on validation for each alpha of the grid; pick the paper's alpha."""
    def score(vector: TaskVector | None, description: str) -> tuple[float, float]:
        acc = _evaluate(built, vector, unit.mode, tasks, progress, description, split="val", extra=extra,
                        runtime=runtime)
        return acc[target], float(np.mean([acc[t] for t in tasks if t != target]))

    target_0, control_0 = score(None, "validation: pretrained")
    rows = []
    for a in grid:
        t_acc, c_acc = (target_0, control_0) if a == 0 else score(unit * float(a), f"validation: alpha {a:.2f}")
        rows.append({"alpha": float(a), "target": t_acc, "control": c_acc})
    threshold = min_control * control_0
    chosen = select_negation_alpha([r["alpha"] for r in rows], [r["target"] for r in rows],
                                   [r["control"] for r in rows], control_0, min_control)
    best = rows[chosen] if chosen is not None else {"alpha": 0.0, "target": target_0, "control": control_0}
    log.info("negation alpha %.2f: validation target %.3f, control %.3f (>= %.3f)", best["alpha"], best["target"],
             best["control"], threshold)
    return {"alpha": best["alpha"], "split": "validation", "min_control": min_control,
            "control_pretrained": control_0, "target_pretrained": target_0, "threshold": threshold, "grid": rows}


def imagenet_control(built: BuiltScenario, control: str, control_data: str | Path | None, build: BuildOptions,
                     tune_alpha: bool) -> tuple[ClassificationScorer, ClassificationScorer | None] | None:
    """(report scorer, tuning scorer or None) on ImageNet validation, or None to use the other tasks.

    A copy is looked for at ``control_data``, ``$EDITKIT_IMAGENET``, then under the data root
    (``build``'s, else the scenario's). Without tuning the whole validation split is reported;
    with it a seeded 10% (<= 5000) is held out for choosing alpha and the rest is reported."""
    wanted = control == "imagenet" or (control == "auto" and (
        control_data is not None or (built.spec.control or {}).get("kind") == "imagenet"))
    if not wanted:
        return None
    from editkit.data.imagenet import load_imagenet_val

    split = load_imagenet_val(control_data, build.data_root or built.spec.data.get("data_root"))
    if split is None:
        if control == "imagenet":
            from editkit.errors import MissingResourceError

            raise MissingResourceError(
                "no local ImageNet validation copy: pass --control-data DIR (or set EDITKIT_IMAGENET) to a directory "
                "holding data/validation-*.parquet (the ILSVRC/imagenet-1k layout) or val/<wordnet id>/*.JPEG, "
                "or use --control tasks"
            )
        log.info("no local ImageNet validation copy: control accuracy is measured on the other tasks")
        return None
    from editkit.data.vision8 import zero_shot_head_for_task
    from editkit.models.clip import ClipBackbone
    from editkit.data.clip_templates import imagenet_classnames
    from editkit.data.vision8 import TransformedSubset
    from editkit.data.tasks import TaskData, validation_indices

    backbone = built.backbone
    if not isinstance(backbone, ClipBackbone):
        raise ConfigError(f"ImageNet control needs a CLIP backbone (zero-shot head); {backbone.name} is not one")
    classes = imagenet_classnames()
    head = zero_shot_head_for_task(backbone, TaskData(IMAGENET, classes, None, None, None), dataset="imagenet")
    transform = backbone.val_preprocess or backbone.preprocess
    if not tune_alpha:
        return ClassificationScorer(IMAGENET, head, TransformedSubset(split, None, transform)), None
    report_idx, tune_idx = validation_indices(len(split))  # tune on a held-out 10%, report on the rest
    return (ClassificationScorer(IMAGENET, head, TransformedSubset(split, report_idx, transform)),
            ClassificationScorer(IMAGENET, head, TransformedSubset(split, tune_idx, transform)))
