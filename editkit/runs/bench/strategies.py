"""The bench's Avalanche strategies (``--strategies``): run through the scenario's stream beside the modes under
each protocol the bench scores (:data:`~editkit.eval.continual.PROTOCOLS`), turned into rows of the addition
table, continual-learning numbers, what each keeps of earlier tasks and a cost of their own.

A strategy's row is its model after the last experience: ``absolute`` is the task protocol's ACC (each task under
its own head) and ``class_incremental`` the class protocol's (among every class seen, no task id), each None when
that protocol did not run. ``normalized`` is None: a mode's normalized accuracy divides by its single-task
fine-tune, which a strategy has no counterpart of, so strategies compare with modes by ACC and BWT. ``joint``
trains on every task at once: ACC only, no BWT. Rows carry ``variant = "avalanche"`` and no coefficient.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from editkit.eval.continual import PROTOCOLS, ContinualMetrics, continual_metrics, final_metrics
from editkit.integrations.avalanche.strategies import STRATEGIES, StrategyResult, check_protocol, run_strategy
from editkit.runs.bench.strategy_records import StrategyRecord, recorded_run, strategy_key

VARIANT = "avalanche"

#: A section of :func:`strategy_sections` per protocol: the ContinualMetrics of each strategy's run.
CONTINUAL_SECTIONS = {"task": "continual", "class": "continual_class_incremental"}


def run_strategies(names: Sequence[str], params: Mapping[str, Mapping[str, Any]], built, recipes: Sequence, *,
                   runtime, progress, protocols: Sequence[str],
                   records: Callable[[str, str], StrategyRecord] | None = None) -> dict[str, dict[str, StrategyResult]]:
    """``{strategy: {protocol: its run}}``: each strategy in turn over the plain backbone of ``built`` (every
    task's resolved recipe in stream order), once per protocol in :data:`PROTOCOLS` order; every protocol is
    checked against the stream before the first run. ``records(strategy, protocol)``: where a run is recorded,
    read back instead of training when it ran on the same inputs."""
    ordered = [p for p in PROTOCOLS if p in protocols]
    for protocol in protocols:
        check_protocol(built.tasks, protocol)
    return {name: {protocol: _run(name, params.get(name, {}), built, recipes, runtime=runtime, progress=progress,
                                  protocol=protocol, record=records(name, protocol) if records else None)
                   for protocol in ordered}
            for name in names}


def _run(name: str, options: Mapping[str, Any], built, recipes: Sequence, *, runtime, progress, protocol: str,
         record: StrategyRecord | None) -> StrategyResult:
    """One run of strategy ``name``, or its record's result when ``record`` holds one made on the same inputs
    (its key names the options as resolved, so a changed default trains again)."""

    def train() -> StrategyResult:
        return run_strategy(name, built, recipes, options=options, runtime=runtime, progress=progress,
                            protocol=protocol)

    if record is None:
        return train()
    key = strategy_key(record, name, built, recipes, STRATEGIES.options(name, options), [protocol], runtime,
                       split="test")
    result, was_recorded = recorded_run(record, key, train)
    if not was_recorded:
        return result
    progress.note(f"{name} ({protocol}-incremental): recorded by an earlier run ({record.path}), not trained again")
    return dataclasses.replace(result, recorded=str(record.path))


def continual(result: StrategyResult, tasks: Sequence[str]) -> ContinualMetrics:
    """The run's accuracy matrix, ACC, BWT and forgetting (``joint``: its one row, ACC only)."""
    if STRATEGIES[result.name].joint:
        return final_metrics(tasks, result.rows[-1])
    return continual_metrics(tasks, result.rows)


def strategy_row(name: str, runs: Mapping[str, StrategyResult], tasks: Sequence[str]) -> dict[str, Any]:
    """The addition table's row of a strategy (see the module docstring)."""
    task, among = runs.get("task"), runs.get("class")
    return {"method": name, "label": STRATEGIES.label(name), "mode": None, "variant": VARIANT,
            "coefficient": None, "alpha": None,
            "per_task": dict(task.rows[-1]) if task else None,
            "absolute": continual(task, tasks)["acc"] if task else None, "normalized": None,
            "class_incremental": continual(among, tasks)["acc"] if among else None,
            "class_incremental_per_task": dict(among.rows[-1]) if among else None}


def run_cost(result: StrategyResult) -> dict[str, Any]:
    """What one run cost: seconds, steps, seconds per step and peak RSS; ``recorded``: the record it was read
    back from (the numbers are then that earlier run's, perhaps another machine's), None when trained here."""
    return {"train_seconds": result.train_seconds, "steps": result.steps,
            "seconds_per_step": result.train_seconds / result.steps if result.steps else None,
            "peak_rss_mib": result.peak_rss_bytes / 2**20 if result.peak_rss_bytes else None,
            "recorded": result.recorded}


def strategy_cost(runs: Mapping[str, StrategyResult]) -> dict[str, Any]:
    """A strategy's cost in the bench, every protocol's run together (seconds and steps summed, the largest peak
    RSS), with each run's own under ``protocols``; ``recorded``: the protocols whose run was read back from an
    earlier run's record, not trained in this bench."""
    seconds, steps = sum(r.train_seconds for r in runs.values()), sum(r.steps for r in runs.values())
    peaks = [r.peak_rss_bytes for r in runs.values() if r.peak_rss_bytes]
    return {"train_seconds": seconds, "steps": steps, "seconds_per_step": seconds / steps if steps else None,
            "peak_rss_mib": max(peaks) / 2**20 if peaks else None,
            "recorded": [protocol for protocol, r in runs.items() if r.recorded],
            "protocols": {protocol: run_cost(r) for protocol, r in runs.items()}}


def strategy_kept(runs: Mapping[str, StrategyResult]) -> dict[str, Any]:
    """What a strategy keeps of earlier tasks: the first protocol's run (task, when it ran) at the top, each run's
    own under ``protocols`` (the class protocol's model copy or weights carry its growing classifier, not the
    scenario's heads)."""
    first = next(iter(runs.values()))
    return {**first.kept, "mib": first.kept["bytes"] / 2**20,
            "protocols": {protocol: dict(r.kept) for protocol, r in runs.items()}}


def strategy_sections(results: Mapping[str, Mapping[str, StrategyResult]], tasks: Sequence[str]) -> dict[str, Any]:
    """The report's parts the strategies add (``results``: :func:`run_strategies`'s): their rows, continual
    numbers per protocol (a section holds the protocols that ran), options (with where the defaults come from),
    what each keeps and cost."""
    sections: dict[str, Any] = {"rows": [strategy_row(name, runs, tasks) for name, runs in results.items()]}
    for protocol, section in CONTINUAL_SECTIONS.items():
        ran = {name: continual(runs[protocol], tasks) for name, runs in results.items() if protocol in runs}
        if ran:
            sections[section] = ran
    sections["strategies"] = {name: _described(name, runs) for name, runs in results.items()}
    sections["strategy_cost"] = {name: strategy_cost(runs) for name, runs in results.items()}
    sections["kept"] = {name: strategy_kept(runs) for name, runs in results.items()}
    return sections


def _described(name: str, runs: Mapping[str, StrategyResult]) -> dict[str, Any]:
    """A strategy's entry in the report: its record's facts, and per protocol the options it ran with and its
    scores after each experience."""
    record = STRATEGIES[name]
    return {"class": STRATEGIES.label(name), "defaults_from": record.defaults_from,
            "reference_url": record.reference_url, "rehearsal": record.rehearsal, "joint": record.joint,
            "options": {protocol: r.options for protocol, r in runs.items()},
            "rows": {protocol: r.rows for protocol, r in runs.items()}}
