"""``editkit bench --scenario toxic``: the three modes' language negation side by side.

For each mode the scenario's vector is fine-tuned into its own bank (or reused from
it), then negated with alpha chosen on validation by the control-perplexity rule
(``editkit.runs.negate_lm``). The scenario is built once and its evaluation shared by
every mode's negation (one model, one set of cached prefix states, theta_0 scored once). The report compares the modes
at their tuned alphas, and at alpha = 1:

- target perplexity (higher: more of the task removed) and control perplexity;
- selectivity, ln(target ratio) / ln(control ratio) against theta_0;
- the toxic fraction of sampled continuations, its standard error, and whether it
  is below theta_0's by more than two standard errors (of the difference);
- whether tauJp's toxic fraction is the lowest of the modes, and by how much it is above or below the
  least toxic other mode (each mode at the alpha its own rule picks: matched control perplexity).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from editkit.runs.negate_lm import (NegationEvaluation, below_by_two_stderr, ensure_vector, negate_language,
                                   negation_settings, plot_negation)
from editkit.runs.report import write_json
from editkit.scenario.build import build_scenario
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec
from editkit.settings import default_bank_dir, default_run_dir
from editkit.train.runtime import Runtime
from editkit.util.progress import NullProgress, Progress

#: How much larger tauJp's target perplexity must be than the best other mode's, at the tuned alphas.
TARGET_RATIO = 1.5


def run_language_bench(spec: ScenarioSpec, *, modes: tuple[str, ...], bank_root: Path, run_dir: Path | None,
                       recipe: Mapping[str, Any], build: BuildOptions, runtime: Runtime,
                       progress: Progress | None = None, loggers: Sequence[str] = ()) -> tuple[dict[str, Any], Path]:
    """Train (or reuse) each mode's vector, negate it, write ``report.json`` and ``negation.png``.

    loggers: log each mode's fine-tuning, when it runs, into ``<run dir>/<mode>/``."""
    progress = progress or NullProgress()
    started = time.perf_counter()
    task = spec.task_names[0]
    out_dir = run_dir or default_run_dir(spec.name, "bench")
    banks = {m: ensure_vector(spec, task, default_bank_dir(spec.name, m, root=bank_root), progress=progress,
                              build=build, runtime=runtime, loggers=loggers, log_dir=out_dir / m,
                              **{**recipe, "mode": m}) for m in modes}
    built = build_scenario(spec, seed=spec.recipe.seed, progress=progress, build=build, device=str(runtime.device))
    evaluation = NegationEvaluation(built, task, negation_settings(built), progress)
    reports = {m: negate_language(bank, task, progress=progress, runtime=runtime, evaluation=evaluation)
               for m, bank in banks.items()}
    report = {"scenario": spec.name, "task": task, "modes": reports, "comparison": compare(reports),
              "seconds": time.perf_counter() - started,
              "plots": {"negation": str(plot_negation(list(reports.values()), out_dir / "negation.png"))}}
    path = out_dir / "report.json"
    write_json(path, report)
    return report, path


def _row(report: Mapping[str, Any], alpha: float) -> Mapping[str, Any]:
    return next(r for r in report["rows"] if r["alpha"] == alpha)


def compare(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per mode at its tuned alpha: the numbers of the comparison table, and the issue's checks for tauJp."""
    per_mode = {}
    for mode, report in reports.items():
        base, tuned = _row(report, 0.0), _row(report, report["alpha"])
        per_mode[mode] = {"alpha": report["alpha"], "met": (report.get("tuning") or {}).get("met", True),
                          "control": tuned["control"], "target": tuned["target"], "selectivity": tuned["selectivity"],
                          "toxic_fraction": tuned["toxic_fraction"],
                          "toxic_fraction_stderr": tuned["toxic_fraction_stderr"], "mean_score": tuned["mean_score"],
                          "below_theta0": below_by_two_stderr(tuned, base)}
    checks = {}
    if "taujp" in per_mode and len(per_mode) > 1:
        others = [v for m, v in per_mode.items() if m != "taujp"]
        ours = per_mode["taujp"]
        ratio = ours["target"] / max(v["target"] for v in others)
        least_toxic = min(v["toxic_fraction"] for v in others)
        checks = {"target_ratio": ratio, "target_ratio_wanted": TARGET_RATIO, "target_ratio_met": ratio >= TARGET_RATIO,
                  "toxicity_below_theta0": ours["below_theta0"],
                  "toxic_fraction_vs_best_other": ours["toxic_fraction"] - least_toxic,
                  "toxic_fraction_lowest": ours["toxic_fraction"] <= least_toxic}
    return {"per_mode": per_mode, "checks": checks}

