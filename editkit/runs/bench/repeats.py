"""A bench repeated over seeds (``--seeds N``) or task orders (``--orders N``): every row as mean ± std.

Each repeat is a whole one-run bench with its own report and PNGs in ``<run-dir>/<repeat>/``; the run
directory's ``report.json`` holds what this module derives from them: the addition rows (means, each with its
``spread``), every stream's ACC / BWT / forgetting and cost, and claims whose margin is at least two standard
errors of the paired differences (:mod:`editkit.runs.bench.claims`).

- **Seeds**: seed ``k`` of N is the recipe's seed plus ``k``; it fine-tunes every stream and builds the
  scenario (its few-shot heads, its reg batches) with that seed.
- **Orders** (OPCM's protocol): order 0 is the scenario's, the others seeded permutations of its tasks, each
  different; every order keeps the recipe's seed, so only the order in which the tasks arrive changes (and with
  it what each step's penalty sees and what a ``sequential`` stream starts from).

The first repeat's banks are the ones a one-run bench uses (``<bank-root>/<scenario>-<mode>``), so a finished
``editkit bench`` is reused as it; the others live under ``<bank-root>/<repeat>/``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from editkit.errors import ConfigError
from editkit.runs.bench.claims import ACCURACIES, CONTINUAL, claims, row_key

#: A row's numbers given as spreads over the repeats.
ROW_KEYS = tuple(dict.fromkeys(ACCURACIES + CONTINUAL))
#: The continual-learning numbers of each stream, as spreads over the repeats.
CONTINUAL_KEYS = ("acc", "bwt", "forgetting")
#: The cost table's numbers that are worth a spread (the rest are per-run bookkeeping).
COST_KEYS = ("finetune_seconds", "steady_seconds_per_step", "steady_over_linear", "peak_rss_mib", "merge_seconds")


@dataclass(frozen=True)
class Repeat:
    """One run of a repeated bench: its seed and task order, and the folder name of its report and banks."""

    name: str  # seed-<s> | order-<k>
    seed: int
    order: tuple[str, ...]


def repeat_count(value: int, option: str, what: str) -> int:
    """``value`` as a number of runs, refused by ``option``'s name under 1."""
    count = int(value)
    if count < 1:
        raise ConfigError(f"{option} is a number of {what}, at least 1; got {count}")
    return count


def seed_repeats(first: int, count: int, order: Sequence[str]) -> list[Repeat]:
    """Seeds ``first, first + 1, ..., first + count - 1``, every one over the scenario's order."""
    count = repeat_count(count, "--seeds", "seeds")
    return [Repeat(f"seed-{first + k}", first + k, tuple(order)) for k in range(count)]


def order_repeats(tasks: Sequence[str], count: int, seed: int) -> list[Repeat]:
    """The scenario's order, then ``count - 1`` other orders of ``tasks``, drawn as seeded permutations."""
    count = repeat_count(count, "--orders", "task orders")
    if count > math.factorial(len(tasks)):
        raise ConfigError(f"--orders {count}: {len(tasks)} tasks have only {math.factorial(len(tasks))} orders")
    generator = torch.Generator().manual_seed(seed)
    orders = [tuple(tasks)]
    while len(orders) < count:
        order = tuple(tasks[i] for i in torch.randperm(len(tasks), generator=generator).tolist())
        if order not in orders:
            orders.append(order)
    return [Repeat(f"order-{k}", seed, order) for k, order in enumerate(orders)]


def repeat_bank_root(root: Path, repeat: Repeat, first: Repeat) -> Path:
    """Where a repeat's banks live: ``root`` for the first (a one-run bench's), ``root/<repeat>`` else."""
    return Path(root) if repeat == first else Path(root) / repeat.name


def spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Mean, sample standard deviation (0 for one value) and the values; None when any run lacks the number."""
    if not values or any(v is None for v in values):
        return None
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": list(values)}


def mean_rows(per_run: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The first run's rows with every accuracy replaced by its mean over the runs, ``spread`` beside them
    and ``alpha`` the tuned coefficients' mean (``alphas``: each run's)."""
    by_run = [{row_key(r): r for r in rows} for rows in per_run]
    out = []
    for row in per_run[0]:
        matched = [rows.get(row_key(row)) for rows in by_run]
        if any(m is None for m in matched):
            raise ConfigError(f"the repeated benches disagree on their rows: {row_key(row)} is missing from one")
        alphas = [m["alpha"] for m in matched]
        numbers = {key: spread([m.get(key) for m in matched]) for key in ROW_KEYS}
        per_task = {t: statistics.fmean(m["per_task"][t] for m in matched) for t in row["per_task"] or ()}
        out.append({**row, "per_task": per_task if row["per_task"] is not None else None,
                    **{key: s["mean"] if s else None for key, s in numbers.items()},
                    "alpha": statistics.fmean(alphas) if None not in alphas else None, "alphas": alphas,
                    "spread": numbers})
    return out


def mean_sections(per_run: Sequence[Mapping[str, Mapping[str, Any]]], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each stream's ``keys`` of a per-stream report section (``continual``, ``cost``) as spreads over the runs."""
    return {label: {key: spread([section[label].get(key) for section in per_run]) for key in keys}
            for label in per_run[0]}


def describe(report: Mapping[str, Any]) -> str:
    """What a repeated report is over, for titles: ``seeds 0, 1, 2`` or ``3 task orders``."""
    repeats = report["repeats"]
    if repeats["over"] == "seeds":
        return f"seeds {', '.join(str(r['seed']) for r in repeats['runs'])}"
    return f"{len(repeats['runs'])} task orders"


def aggregate(reports: Sequence[Mapping[str, Any]], repeats: Sequence[Repeat], over: str, runs: Sequence[Path],
              margin: float) -> dict[str, Any]:
    """The report of a bench over ``repeats`` (``over``: seeds | orders), from each run's report (in ``runs``)."""
    first = reports[0]
    per_run_rows = [r["addition"]["rows"] for r in reports]
    rows = mean_rows(per_run_rows)
    judged = claims(rows, margin, per_run_rows)
    if judged is not None:
        judged["over"] = over
    return {
        "scenario": first["scenario"],
        "backbone": first["backbone"],
        "tasks": first["tasks"],
        "modes": first["modes"],
        "methods": first["methods"],
        "repeats": {"over": over, "runs": [{"name": r.name, "seed": r.seed, "order": list(r.order), "run_dir": str(d)}
                                           for r, d in zip(repeats, runs)]},
        "addition": {**first["addition"], "rows": rows},
        "protocols": first.get("protocols", ["task"]),
        "continual": mean_sections([r["continual"] for r in reports], CONTINUAL_KEYS),
        "continual_class_incremental": mean_sections([r.get("continual_class_incremental", {}) for r in reports],
                                                     CONTINUAL_KEYS),
        "kept": first.get("kept", {}),
        "cost": mean_sections([r["cost"] for r in reports], COST_KEYS),
        "claims": judged,
        "torch_threads": first.get("torch_threads"),
        "runtime": first.get("runtime"),
        "timings": {"run_seconds": [r["timings"]["total_seconds"] for r in reports]},
    }
