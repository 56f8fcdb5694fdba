"""The sections of a bench report that only its first repeat writes: negation and the diagnostics.

A repeat after the first (``--seeds`` / ``--orders``) leaves out :data:`FIRST_REPEAT_ONLY`: the repeated report
reads the addition rows, continual numbers and costs, not these. Both run on the evaluators the addition rows
were scored with (:class:`~editkit.eval.sweep.ModeEvaluator`), so linearized vectors are combined from their
cached tangents here too.
"""

from __future__ import annotations

from itertools import combinations
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from editkit.eval.accuracy import addition_summary
from editkit.eval.diagnostics import correlation, disentanglement_error, off_diagonal, pair_interference
from editkit.eval.sweep import ModeEvaluator
from editkit.merge.coefficients import select_negation_alpha
from editkit.util.progress import Progress

#: The report's keys these functions fill: ``negation`` (:func:`negation_section`), ``taujp`` and ``xi``
#: (:func:`diagnostic_sections`).
FIRST_REPEAT_ONLY = ("negation", "taujp", "xi")


def negation_section(ev: ModeEvaluator, tasks: Sequence[str], pretrained: Mapping[str, Mapping[str, float]],
                     control: str | None, progress: Progress, *, alphas: Sequence[float], retain: float) -> dict[str, Any]:
    """theta_0 - alpha tau_t for each task t: target accuracy on t, control accuracy on ``control``
    (ImageNet) or, without one, the mean over the other tasks; alpha searched over ``alphas`` on validation,
    keeping ``retain`` of theta_0's control accuracy."""
    alphas, rows = list(alphas), []
    scored = list(tasks) + ([control] if control else [])

    def target_control(accs: Mapping[str, float], target: str) -> tuple[float, float]:
        if control is not None:
            return accs[target], accs[control]
        return accs[target], float(np.mean([accs[t] for t in tasks if t != target]))

    with progress.task(f"{ev.label}: negation — coefficient search on validation", total=len(tasks) * len(alphas)) as bar:
        for target in tasks:
            p_target, p_control = target_control(pretrained["val"], target)
            curve_t, curve_c = [], []
            for a in alphas:
                t_acc, c_acc = target_control(ev.accuracies({target: -a}, "val", scored), target)
                curve_t.append(t_acc)
                curve_c.append(c_acc)
                bar.advance(1)
            best = select_negation_alpha(alphas, curve_t, curve_c, p_control, retain)
            row: dict[str, Any] = {"task": target, "val_target": curve_t, "val_control": curve_c,
                                   "val_pretrained": {"target": p_target, "control": p_control}}
            test_t, test_c = target_control(pretrained["test"], target)
            row["pretrained"] = {"target": test_t, "control": test_c}
            for label, a in (("alpha1", 1.0), ("tuned", alphas[best] if best is not None else None)):
                if a is None:
                    row[label] = {"alpha": None, "target": None, "control": None}
                    continue
                t_acc, c_acc = target_control(ev.accuracies({target: -a}, "test", scored), target)
                row[label] = {"alpha": a, "target": t_acc, "control": c_acc}
            rows.append(row)

    def mean(label: str, key: str) -> float | None:
        values = [r[label][key] for r in rows if r[label][key] is not None]
        return float(np.mean(values)) if values else None

    summary = {label: {"target": mean(label, "target"), "control": mean(label, "control")}
               for label in ("pretrained", "alpha1", "tuned")}
    return {"alphas": alphas, "retain": retain, "control": control or "other tasks", "rows": rows,
            "mean": summary}


def diagnostic_sections(evaluators: Mapping[str, ModeEvaluator], results: Mapping[str, dict[str, Any]],
                        tasks: Sequence[str], pair: tuple[str, str], progress: Progress, *, xi_grid: Sequence[float],
                        xi_samples: int) -> dict[str, Any]:
    """``taujp``: each mode's tauJp matrix on the test splits, pairwise merges at alpha = 1 and the matrix's
    correlation with their normalized accuracy; ``xi``: each mode's weight-disentanglement error over
    ``xi_grid`` for the task ``pair`` (on the ``xi`` split of ``xi_samples`` inputs)."""
    matrices: dict[str, list[list[float]]] = {}
    pairs: list[dict[str, Any]] = []
    per_method: list[dict[str, Any]] = []
    xi: dict[str, Any] = {}
    index = {t: i for i, t in enumerate(tasks)}
    for mode, ev in evaluators.items():
        if ev.linearized:  # from the cached tangents
            rows = [ev.tangent_norm_means(a, tasks, "test") for a in tasks]
        else:
            total = len(tasks) * sum(ev.data.batches("test", n) for n in tasks)
            with progress.task(f"{mode}: tauJp matrix (one jvp per test input and vector)", total=total) as bar:
                rows = [ev.tangent_norm_means(a, tasks, "test", bar=bar) for a in tasks]
        matrix = np.array([[rows[a][b] for b in tasks] for a in range(len(tasks))])
        matrices[mode] = matrix.tolist()
        single = results[mode]["single"]["test"]
        with progress.task(f"{mode}: pairwise merges (alpha = 1)", total=len(tasks) * (len(tasks) - 1) // 2) as bar:
            for a, b in combinations(tasks, 2):
                accs = ev.accuracies({a: 1.0, b: 1.0}, "test", [a, b])
                s = addition_summary(accs, single)
                pairs.append({"mode": mode, "pair": [a, b], "taujp": pair_interference(matrix, index[a], index[b]),
                              "absolute": s["absolute"], "normalized": s["normalized"]})
                bar.advance(1)
        merged = ev.accuracies({t: 1.0 for t in tasks}, "test", tasks)
        per_method.append({"mode": mode, "mean_off_diagonal": float(off_diagonal(matrix).mean()),
                           "mean_diagonal": float(np.diag(matrix).mean()),
                           **addition_summary(merged, single)})
        grid = list(xi_grid)
        with progress.task(f"{mode}: weight disentanglement xi ({pair[0]}, {pair[1]})", total=len(grid) ** 2) as bar:
            def predict(t: int, a1: float, a2: float, ev: ModeEvaluator = ev) -> torch.Tensor:
                combo = {k: c for k, c in ((pair[0], a1), (pair[1], a2)) if c != 0.0}
                return ev.predictions(combo, "xi", [pair[t]])[pair[t]]

            result = disentanglement_error(predict, grid, on_cell=lambda: bar.advance(1))
        xi[mode] = {**result.to_dict(), "mean": float(result.total.mean())}
    pair_corr = correlation([p["taujp"] for p in pairs], [p["normalized"] for p in pairs])
    method_corr = correlation([p["mean_off_diagonal"] for p in per_method], [p["normalized"] for p in per_method])
    return {
        "taujp": {"tasks": list(tasks), "split": "test", "matrices": matrices, "per_method": per_method,
                  "pairs": pairs, "correlation": pair_corr, "correlation_per_method": method_corr},
        "xi": {"pair": list(pair), "grid": list(xi_grid), "samples": xi_samples,
               "modes": xi},
    }
