"""The bench's report: its rows and sections, and ``report.json`` with the PNGs written at the end.

What one bench measured becomes one JSON document here; the tables (:mod:`editkit.runs.bench.tables`) and plots
(:mod:`editkit.runs.bench.plots`) read it back, so a number printed is a number in the file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TypedDict

import numpy as np

from editkit.bank.store import Bank
from editkit.eval.accuracy import addition_summary
from editkit.eval.sweep import ModeEvaluator
from editkit.integrations.avalanche.strategies import STRATEGIES
from editkit.merge import MERGE_METHODS
from editkit.runs.bench.claims import claims
from editkit.runs.bench.config import METHODS, BenchConfig
from editkit.runs.bench.kept import pretrained_kept, stream_kept
from editkit.runs.records import StreamResult
from editkit.runs.report import jsonable, write_json
from editkit.train.recipe import Recipe, label_parts

#: How tables name each row's method: the merge methods' labels, the two reference rows and the strategies'.
METHOD_LABELS = {"pretrained": "pretrained", **{m: MERGE_METHODS.label(m) for m in METHODS}, "single-task": "single-task",
                 **{s: STRATEGIES.label(s) for s in STRATEGIES}}
#: The bank metric that records a task's peak RSS while its stream trained it.
RSS_METRIC = "bench_peak_rss_bytes"


@dataclass
class ModeState:
    """One stream of the bench (a mode, with an adapter or a penalty where compared): what the runner fills in as it
    runs and scores it, and the report reads."""

    label: str  # the mode, plus -lora for an adapter stream (BenchConfig.variants)
    recipe: Recipe  # the scenario's [recipe] with this bench's overrides
    overrides: dict[str, Any]  # those overrides, as the stream takes them
    bank: Bank
    task_recipes: dict[str, dict[str, Any]] = field(default_factory=dict)  # resolved, as the bank records them
    stream: StreamResult | None = None
    stream_seconds: float = 0.0
    trained: list[str] = field(default_factory=list)


class AdditionRow(TypedDict, total=False):
    """One row of the task-addition table (``report["addition"]["rows"]``); the ``val_*`` keys are
    the same summary on the validation splits (absent where there is nothing to tune)."""

    method: str  # pretrained | task-arithmetic | ties | single-task
    label: str
    mode: str | None
    variant: str | None  # the stream the vectors come from: the mode, or <mode>-lora for adapter vectors
    coefficient: str | None  # "1.0" | "tuned" | None
    alpha: float | None
    per_task: dict[str, float]
    absolute: float
    normalized: float | None
    class_incremental: float | None  # class protocol: mean over tasks of their accuracy among every seen class
    class_incremental_per_task: dict[str, float] | None
    bwt: float | None  # rows with a stream of models after each step (tauJp's stream, a strategy): task protocol
    class_bwt: float | None  # the same, class protocol
    val_absolute: float
    val_normalized: float | None


class StreamSection(TypedDict):
    """``report["streams"][mode]``: where the mode's vectors came from and the stream's numbers."""

    bank: str
    seconds: float
    trained: list[str]
    steps: list[dict[str, Any]]  # StepRecord fields: step, task, resumed, single_task, pretrained, merged


class CostSection(TypedDict):
    """``report["cost"][mode]``: fine-tuning (from the bank's per-step records) and merging cost."""

    finetune_seconds: float
    steps: int
    seconds_per_step: float | None  # finetune_seconds / steps: warm-up and slow spells included
    setup_seconds: float | None  # before the first steps and in the warm-up steps, summed over tasks
    steady_seconds_per_step: float | None  # each task's median step after warm-up, weighted by its steps
    steady_over_linear: float | None  # that step over the linear stream's of the same adapter (None without one)
    peak_rss_bytes: int | None
    peak_rss_mib: float | None
    merge_seconds: float
    ties_seconds: float | None
    method_seconds: dict[str, float]  # each merge method's time to build its vectors (the streamed sum: merge_seconds)
    total_seconds: float
    trained_now: list[str]
    reused: list[str]


def class_incremental(per_task: Mapping[str, float]) -> dict[str, Any]:
    """A row's class-incremental numbers: each task's accuracy among every seen class, no task id, and their mean."""
    return {"class_incremental": float(np.mean(list(per_task.values()))),
            "class_incremental_per_task": dict(per_task)}


def addition_row(method: str, ev: ModeEvaluator | None, coefficient: str | None, alpha: float | None,
                 per_task: Mapping[str, float], single: Mapping[str, float] | None, **extra: Any) -> AdditionRow:
    """One row of the addition table: ``method``'s accuracies on the test splits, normalized by ``single``'s (the
    single-task models'); ``ev``: the stream the vectors come from (None for theta_0's row)."""
    return {"method": method, "label": METHOD_LABELS[method], "mode": ev.mode if ev else None,
            "variant": ev.label if ev else None, "coefficient": coefficient, "alpha": alpha,
            "per_task": dict(per_task), **addition_summary(per_task, single), **extra}


def cost_section(state: ModeState, result: Mapping[str, Any], tasks: Sequence[str]) -> CostSection:
    """A stream's cost from its bank's per-task records (this run's or an earlier one's) and the mode's merges."""
    entries = {e.name: e for e in state.bank.entries()}
    metrics = [entries[t].metrics for t in tasks]
    finetune = float(sum(m.get("train_seconds", 0.0) for m in metrics))
    steps = int(sum(entries[t].metrics.get("train_steps", entries[t].recipe.get("steps", 0)) for t in tasks))
    rss = [m[RSS_METRIC] for m in metrics if isinstance(m.get(RSS_METRIC), (int, float))]
    merge = result["merge_seconds"]
    timed = steps and all(m.get("steady_seconds_per_step") is not None for m in metrics)  # banks before: None
    return {
        "finetune_seconds": finetune,
        "steps": steps,
        "seconds_per_step": finetune / steps if steps else None,
        "setup_seconds": sum(m["setup_seconds"] + m["warmup_seconds"] for m in metrics) if timed else None,
        "steady_seconds_per_step": (sum(m["steady_seconds_per_step"] * m["train_steps"] for m in metrics) / steps
                                    if timed else None),
        "peak_rss_bytes": int(max(rss)) if rss else None,
        "peak_rss_mib": max(rss) / 2**20 if rss else None,
        "merge_seconds": merge,
        "ties_seconds": result["method_seconds"].get("ties"),  # the report's key since its first version
        "method_seconds": dict(result["method_seconds"]),
        "total_seconds": finetune + merge,
        "trained_now": list(state.trained),
        "reused": [t for t in tasks if t not in state.trained],
    }


def with_step_ratios(cost: dict[str, CostSection]) -> dict[str, CostSection]:
    """Each stream's steady step over the linear stream's of the same adapter (``taujp-lora`` against
    ``linear-lora``): what a mode's step costs against the linearized step, without one-off work."""
    for label, section in cost.items():
        adapter = label_parts(label)[1]
        linear = cost.get("linear" if adapter == "none" else f"linear-{adapter}", {}).get("steady_seconds_per_step")
        steady = section["steady_seconds_per_step"]
        section["steady_over_linear"] = steady / linear if steady and linear else None
    return cost


def with_backward_transfer(rows: Sequence[AdditionRow], continual: Mapping[str, Any],
                           continual_class: Mapping[str, Any]) -> None:
    """Give each row that is a stream of models (task arithmetic at coefficient 1 is the model a mode's stream
    holds after each step; a strategy's row is its model) the BWT of that stream, per protocol: what claims
    against the continual strategies compare beside ACC."""
    for row in rows:
        key = (row["variant"] if row["method"] == "task-arithmetic" and row["coefficient"] == "1.0"
               else row["method"] if row["variant"] == "avalanche" else None)
        row["bwt"] = continual[key]["bwt"] if key in continual else None
        row["class_bwt"] = continual_class[key]["bwt"] if key in continual_class else None


def bench_report(spec, built, config: BenchConfig, states: Mapping[str, ModeState], tasks: Sequence[str],
                 pretrained: Mapping[str, Mapping[str, float]], results: Mapping[str, dict[str, Any]],
                 sections: Mapping[str, Any], strategies: Mapping[str, Any] | None, run_dir: Path,
                 protocols: Sequence[str]) -> dict[str, Any]:
    """``report.json``'s document: every mode's rows and sections (``results``, ``sections``), the strategies'
    (:func:`with_strategies`, which also reads every row's BWT and the claims; ``None``: the caller adds them
    later), each stream's provenance and cost, and what every row keeps of earlier tasks."""
    theta0 = next(iter(results.values()))["pretrained_class_incremental"]
    rows = [addition_row("pretrained", None, None, None, pretrained["test"], None,
                         val_absolute=addition_summary(pretrained["val"], None)["absolute"], **theta0)]
    for mode in states:
        rows += results[mode]["rows"]
    continual = {**{mode: state.stream.continual for mode, state in states.items()},
                 **{f"{mode}/{method}": numbers for mode in states
                    for method, numbers in results[mode]["continual"].items()}}
    continual_class = {mode: results[mode]["continual_class_incremental"] for mode in states
                       if results[mode]["continual_class_incremental"] is not None}
    streams: dict[str, StreamSection] = {}
    for mode, state in states.items():
        streams[mode] = {
            "bank": str(state.bank.root),
            "seconds": state.stream_seconds,
            "trained": list(state.trained),
            "steps": [{"step": s.step, "task": s.task, "resumed": s.resumed, "single_task": s.single_task,
                       "pretrained": s.pretrained, "merged": dict(s.merged)} for s in state.stream.steps],
        }
    report = jsonable({
        "scenario": spec.name,
        "scenario_file": str(spec.path) if spec.path else None,
        "backbone": built.backbone.name,
        "tasks": list(tasks),
        "modes": list(states),
        "methods": list(config.methods),
        "recipes": {m: s.recipe.to_dict() for m, s in states.items()},
        "task_recipes": {m: s.task_recipes for m, s in states.items()},
        "grid": list(config.alphas),
        "negation_grid": list(config.negation_alphas),
        "ties_k": config.ties_k,
        "method_options": {m: options for m, options in config.method_options(len(tasks)).items()
                           if m in config.methods},
        # the order the vectors were merged in, which the merged vector of these methods depends on
        "order": {m: list(tasks) for m in config.methods if MERGE_METHODS[m].order_dependent},
        "method_references": {m: MERGE_METHODS[m].reference_url for m in config.methods},
        "run_dir": str(run_dir),
        "addition": {"split": "test", "tuned_on": "val", "columns": list(tasks) + ["absolute", "normalized"], "rows": rows},
        "alpha_search": {m: results[m]["alpha_search"] for m in states},
        "single_task": {m: results[m]["single"] for m in states},
        "pretrained": dict(pretrained),
        **sections,  # negation, taujp, xi (none in a repeat after the first)
        "streams": streams,
        "protocols": list(protocols),
        # the continual-learning field's numbers of each stream's merged model after every step (and each
        # strategy's model after every experience), task- and class-incremental
        "continual": continual,
        "continual_class_incremental": continual_class,
        "kept": {"pretrained": pretrained_kept(states, tasks, protocols),
                 **{m: stream_kept(s, built, tasks, protocols) for m, s in states.items()}},
        "strategies": {},
        "strategy_cost": {},
        "cost": with_step_ratios({m: cost_section(states[m], results[m], tasks) for m in states}),
    })
    return report if strategies is None else with_strategies(report, strategies, config.claim_margin)


def with_strategies(report: dict[str, Any], strategies: Mapping[str, Any], margin: float) -> dict[str, Any]:
    """``report`` (:func:`bench_report`'s, without strategies) with the strategies' sections
    (:func:`~editkit.runs.bench.strategies.strategy_sections`) added: their rows after the modes', continual numbers,
    what they keep, their cost, then every row's BWT and the claims read from all the rows. Apart from :func:`bench_report` so that a
    bench on a cluster evaluates the merged models while the strategies still run, and adds them after."""
    rows = report["addition"]["rows"] + jsonable(strategies["rows"])
    continual = {**report["continual"], **jsonable(strategies.get("continual", {}))}
    continual_class = {**report["continual_class_incremental"],
                       **jsonable(strategies.get("continual_class_incremental", {}))}
    with_backward_transfer(rows, continual, continual_class)
    return {**report, "addition": {**report["addition"], "rows": rows}, "continual": continual,
            "continual_class_incremental": continual_class,
            "kept": {**report["kept"], **jsonable(strategies.get("kept", {}))},
            "strategies": jsonable(strategies.get("strategies", {})),
            "strategy_cost": jsonable(strategies.get("strategy_cost", {})), "claims": claims(rows, margin)}


def write_outputs(report: dict[str, Any], run_dir: Path) -> None:
    """PNGs rendered into a temporary sibling directory, moved into place, then report.json (atomic)."""
    from editkit.runs.bench.plots import render_all

    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".bench-"))
    try:
        plots = render_all(report, tmp)
        report["plots"] = plots
        for name in plots.values():
            os.replace(tmp / name, run_dir / name)
        write_json(run_dir / "report.json", report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)