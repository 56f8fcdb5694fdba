"""Edited models to take away, from the bank: the vectors combined, their scenario rebuilt, the directory written.

``editkit negate NAME --out DIR`` (a language vector: :func:`export_negation`), ``editkit add / negate --out DIR``
(the model the command scored: :func:`export_edit`) and scripts (:func:`export_vectors`) come here; what the
directory holds, and how it is written whole or not at all, is :mod:`editkit.io.export`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from editkit.bank.store import Bank
from editkit.io.card import SCORE_KEYS, provenance_of
from editkit.io.export import write_export
from editkit.io.targets import check_target
from editkit.io.peft import adapter_factors
from editkit.merge.arithmetic import TaskVector, combine, negation_coefficients
from editkit.runs.edit import EditResult
from editkit.scenario.build import BuiltScenario
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import bank_backbone, bank_scenario, recorded_scenario
from editkit.util.progress import Progress

__all__ = ["export_edit", "export_negation", "export_vectors"]


def negation_scores(report: Mapping[str, Any], alpha: float) -> dict[str, Any]:
    """What a language negation's card states: its test rows (the one at ``alpha``, the exported model,
    marked) and scorer."""
    rows = []
    for row in report.get("rows", []):
        keep = {k: row[k] for k in ("model", "alpha", "control", "target", "control_flin", "target_flin",
                                    "toxic_fraction", "toxic_fraction_stderr", "mean_score") if k in row}
        keep["exported"] = row.get("alpha") == alpha
        rows.append(keep)
    tuning = report.get("tuning")
    chosen = (f"chosen on validation by the {tuning['rule']} rule (control perplexity <= {tuning['bound']:.4g}"
              f"{'' if tuning['met'] else ', met by no alpha tried: the best one'})" if tuning else "given")
    return {"rows": rows, "scorer": (report.get("settings") or {}).get("scorer"), "alpha_choice": chosen}


def export_negation(bank: Bank, name: str, out: Path | str, *, alpha: float, report: Mapping[str, Any] | None = None,
                    force: bool = False, build: BuildOptions | None = None, progress: Progress | None = None) -> Path:
    """Write theta_0 - alpha tau of the language vector ``name`` (``editkit negate NAME --out DIR``): its Hugging
    Face directory is the model. ``report``: the negation's report (``editkit.runs.negate_lm.negate_language``),
    whose test rows (perplexities of these weights and, for linearized vectors, f_lin's; toxicity) go into the card."""
    check_target(out, force=force)
    coefficients = negation_coefficients(name, alpha)
    vector = combine(bank, coefficients)
    backbone = bank_backbone(bank, name, build)
    provenance = provenance_of(bank, coefficients, operation="negate", mode=vector.mode, build=build, alpha=alpha,
                               scores=negation_scores(report, alpha) if report else None)
    entry = bank.get(name)
    built = BuiltScenario(recorded_scenario(entry), backbone, [], {})
    return write_export(built, vector, out, base=bank.base, provenance=provenance, tasks=[], force=force,
                        adapter=adapter_factors(bank, coefficients, "task-arithmetic", vector.tensors, backbone),
                        progress=progress)


def export_edit(result: EditResult, bank: Bank, out: Path | str, *, method: str = "task-arithmetic",
                force: bool = False, build: BuildOptions | None = None, progress: Progress | None = None) -> Path:
    """Write the model ``editkit add`` or ``editkit negate`` scored (an :class:`~editkit.runs.edit.EditResult`, whose
    scenario holds theta_0, the data and the heads), the heads of the tasks it scored, its report's numbers (the
    weights' own beside the program's for linearized vectors) in the manifest and card."""
    report = result.report
    operation = report["operation"]
    alpha = -next(iter(result.coefficients.values())) if operation == "negate" else None  # theta_0 - alpha tau
    provenance = provenance_of(bank, result.coefficients, operation=operation, mode=result.mode, build=build,
                               method=method, options=report.get("options"), alpha=alpha,
                               scores={k: report[k] for k in SCORE_KEYS if k in report})
    adapter = adapter_factors(bank, result.coefficients, method, result.vector.tensors, result.backbone)
    return write_export(result.built, result.vector, out, base=bank.base, provenance=provenance,
                        tasks=list(report["per_task"]), force=force, adapter=adapter, progress=progress)


def export_vectors(bank: Bank, coefficients: Mapping[str, float], out: Path | str, *, force: bool = False,
                   build: BuildOptions | None = None, scores: Mapping[str, Any] | None = None,
                   progress: Progress | None = None) -> Path:
    """For scripts: theta_0 + sum alpha_i tau_i of the named bank vectors (``{name: alpha}``; negative for a
    negation), with the heads of their tasks, written without scoring anything (``scores``: numbers of your own
    for the card)."""
    check_target(out, force=force)
    vector: TaskVector = combine(bank, dict(coefficients))
    first = next(iter(coefficients))
    built = bank_scenario(bank, first, build)
    provenance = provenance_of(bank, coefficients, operation="add", mode=vector.mode, build=build, scores=scores)
    return write_export(built, vector, out, base=bank.base, provenance=provenance,
                        tasks=[bank.get(n).task for n in coefficients], force=force,
                        adapter=adapter_factors(bank, coefficients, "task-arithmetic", vector.tensors, built.backbone),
                        progress=progress)
