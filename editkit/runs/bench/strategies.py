"""The bench's Avalanche strategies (``--strategies``): run through the scenario's stream beside the modes,
turned into rows of the addition table, continual-learning numbers and a cost of their own.

A strategy's row is its model after the last experience, task-incremental: ``absolute`` is ACC, and
``normalized`` each task's final accuracy over its accuracy right after it was learnt (the matrix's
diagonal: how much of each task the strategy kept), where a mode's normalized accuracy divides by its
single-task fine-tune. ``joint`` trains on every task at once and has no diagonal: no normalized accuracy,
no BWT. Rows carry ``variant = "avalanche"`` and no coefficient.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from editkit.eval.continual import ContinualMetrics, continual_metrics, final_metrics
from editkit.integrations.avalanche.strategies import STRATEGIES, StrategyResult, run_strategy

VARIANT = "avalanche"


def run_strategies(names: Sequence[str], params: Mapping[str, Mapping[str, Any]], built, recipes: Sequence, *,
                   runtime, progress) -> dict[str, StrategyResult]:
    """Each strategy in turn over the plain backbone of ``built`` (every task's resolved recipe in stream order)."""
    return {name: run_strategy(name, built, recipes, options=params.get(name, {}), runtime=runtime, progress=progress)
            for name in names}


def continual(result: StrategyResult, tasks: Sequence[str]) -> ContinualMetrics:
    """The strategy's accuracy matrix, ACC, BWT and forgetting (``joint``: its one row, ACC only)."""
    if STRATEGIES[result.name].joint:
        return final_metrics(tasks, result.rows[-1])
    return continual_metrics(tasks, result.rows)


def strategy_row(result: StrategyResult, tasks: Sequence[str]) -> dict[str, Any]:
    """The addition table's row of a strategy (see the module docstring)."""
    last = result.rows[-1]
    absolute = sum(last[t] for t in tasks) / len(tasks)
    normalized = None
    if not STRATEGIES[result.name].joint:
        learnt = {t: result.rows[i][t] for i, t in enumerate(tasks)}
        normalized = sum(last[t] / learnt[t] for t in tasks if learnt[t] > 0) / len(tasks)
    among = result.class_rows[-1]
    return {"method": result.name, "label": STRATEGIES.label(result.name), "mode": None, "variant": VARIANT,
            "coefficient": None, "alpha": None, "per_task": dict(last), "absolute": absolute,
            "normalized": normalized, "class_incremental": sum(among[t] for t in tasks) / len(tasks),
            "class_incremental_per_task": dict(among)}


def strategy_cost(result: StrategyResult) -> dict[str, Any]:
    """What the strategy's training cost: seconds, steps, peak RSS and the examples it keeps."""
    return {"train_seconds": result.train_seconds, "steps": result.steps,
            "seconds_per_step": result.train_seconds / result.steps if result.steps else None,
            "peak_rss_mib": result.peak_rss_bytes / 2**20 if result.peak_rss_bytes else None,
            "buffer_size": result.buffer_size}


def strategy_sections(results: Mapping[str, StrategyResult], tasks: Sequence[str]) -> dict[str, Any]:
    """The report's parts the strategies add: their rows, continual numbers, options (with where the defaults
    come from) and cost."""
    return {
        "rows": [strategy_row(r, tasks) for r in results.values()],
        "continual": {name: continual(r, tasks) for name, r in results.items()},
        "strategies": {name: _described(name, r) for name, r in results.items()},
        "strategy_cost": {name: strategy_cost(r) for name, r in results.items()},
    }


def _described(name: str, result: StrategyResult) -> dict[str, Any]:
    """A strategy's entry in the report: its record's facts, the options it ran with and its scores."""
    record = STRATEGIES[name]
    return {"class": STRATEGIES.label(name), "options": result.options, "defaults_from": record.defaults_from,
            "reference_url": record.reference_url, "rehearsal": record.rehearsal, "joint": record.joint,
            "rows": result.rows, "class_rows": result.class_rows}
