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
from editkit.scenario.build import adapter_arms, build_scenario
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec
from editkit.settings import default_bank_dir
from editkit.train.recipe import label_parts
from editkit.train.runtime import Runtime
from editkit.util.progress import NullProgress, Progress

#: How much larger tauJp's target perplexity must be than the best other mode's, at the tuned alphas.
TARGET_RATIO = 1.5


def run_language_bench(spec: ScenarioSpec, *, variants: Mapping[str, Mapping[str, Any]], bank_root: Path,
                       run_dir: Path, build: BuildOptions, runtime: Runtime, progress: Progress | None = None,
                       loggers: Sequence[str] = ()) -> tuple[dict[str, Any], Path]:
    """Train (or reuse) each stream's vector, negate it, write ``report.json`` and ``negation.png``.

    variants: label (a mode, or <mode>-lora) -> its recipe overrides (``BenchConfig.variants``); each label has
    its own bank. Vectors with an adapter are scored on theta_0 carrying it (one evaluation per adapter).
    loggers: log each fine-tuning, when it runs, into ``<run dir>/<label>/``."""
    progress = progress or NullProgress()
    started = time.perf_counter()
    task = spec.task_names[0]
    built = build_scenario(spec, seed=spec.recipe.seed, progress=progress, build=build, device=str(runtime.device),
                           precision=runtime.precision)
    # the streams without an adapter train on the shared scenario (one loaded model, every text's prefix states
    # computed once); an adapter stream builds its own, as the adapter stays on the model it trained
    banks = {label: ensure_vector(spec, task, default_bank_dir(spec.name, label, root=bank_root), progress=progress,
                                  build=build, runtime=runtime, loggers=loggers, log_dir=run_dir / label,
                                  built=built if label_parts(label)[1] == "none" else None, **overrides)
             for label, overrides in variants.items()}
    recipes: dict[str, list[Mapping[str, Any]]] = {}
    for bank in banks.values():
        recipe = bank.get(task).recipe
        recipes.setdefault(recipe.get("adapter", "none"), []).append(recipe)
    evaluations = {adapter: NegationEvaluation(arm, task, negation_settings(arm), progress)
                   for adapter, arm in adapter_arms(built, recipes).items()}
    reports = {label: negate_language(bank, task, progress=progress, runtime=runtime,
                                      evaluation=evaluations[bank.get(task).recipe.get("adapter", "none")])
               for label, bank in banks.items()}
    report = {"scenario": spec.name, "task": task, "modes": reports, "comparison": compare(reports),
              "seconds": time.perf_counter() - started,
              "plots": {"negation": str(plot_negation(list(reports.values()), run_dir / "negation.png"))}}
    path = run_dir / "report.json"
    write_json(path, report)
    return report, path


def _row(report: Mapping[str, Any], alpha: float) -> Mapping[str, Any]:
    return next(r for r in report["rows"] if r["alpha"] == alpha)


def compare(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per stream label (a mode, or <mode>-lora) at its tuned alpha: the numbers of the comparison table; and the
    checks for the first tauJp stream against the other modes with the same adapter (or none)."""
    per_mode = {}
    for mode, report in reports.items():
        base, tuned = _row(report, 0.0), _row(report, report["alpha"])
        per_mode[mode] = {"alpha": report["alpha"], "met": (report.get("tuning") or {}).get("met", True),
                          "control": tuned["control"], "target": tuned["target"], "selectivity": tuned["selectivity"],
                          "toxic_fraction": tuned["toxic_fraction"],
                          "toxic_fraction_stderr": tuned["toxic_fraction_stderr"], "mean_score": tuned["mean_score"],
                          "below_theta0": below_by_two_stderr(tuned, base)}
    checks = {}
    parts = {label: label_parts(label) for label in per_mode}
    ours_label = next((label for label, (mode, _) in parts.items() if mode == "taujp"), None)
    arm = [label for label in per_mode if ours_label and parts[label][1] == parts[ours_label][1]]
    if ours_label is not None and len(arm) > 1:  # tauJp against the other modes of its arm (LoRA with LoRA)
        others = [per_mode[label] for label in arm if label != ours_label]
        ours = per_mode[ours_label]
        ratio = ours["target"] / max(v["target"] for v in others)
        least_toxic = min(v["toxic_fraction"] for v in others)
        checks = {"target_ratio": ratio, "target_ratio_wanted": TARGET_RATIO, "target_ratio_met": ratio >= TARGET_RATIO,
                  "toxicity_below_theta0": ours["below_theta0"],
                  "toxic_fraction_vs_best_other": ours["toxic_fraction"] - least_toxic,
                  "toxic_fraction_lowest": ours["toxic_fraction"] <= least_toxic}
    return {"per_mode": per_mode, "checks": checks}

