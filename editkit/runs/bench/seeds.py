"""``editkit bench --seeds N``: one whole bench per seed, then every row as mean ± std over the seeds.

Seed ``k`` of N is the recipe's seed plus ``k``: it fine-tunes every stream and builds the scenario (its
few-shot heads, its reg batches) with that seed. The first seed's banks are the ones a one-seed bench uses
(``<bank-root>/<scenario>-<mode>``), so a finished ``editkit bench`` is reused as its first seed; the others
live under ``<bank-root>/seed-<s>/``. Each seed writes its own full report into ``<run-dir>/seed-<s>/``; the
run directory's ``report.json`` holds what this module derives from them: the addition rows (means, each with
its ``spread``), the cost of every stream, and claims whose margin is at least two standard errors of the
paired differences (:mod:`editkit.runs.bench.claims`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from editkit.errors import ConfigError
from editkit.runs.bench.claims import ACCURACIES, claims, row_key

#: The continual-learning numbers of each stream, as spreads over the seeds.
CONTINUAL_KEYS = ("acc", "bwt", "forgetting")
#: The cost table's numbers that are worth a spread (the rest are per-seed bookkeeping).
COST_KEYS = ("finetune_seconds", "steady_seconds_per_step", "steady_over_linear", "peak_rss_mib", "merge_seconds")


def seed_list(first: int, count: int) -> list[int]:
    """``first, first + 1, ..., first + count - 1``."""
    if count < 1:
        raise ConfigError(f"--seeds is a number of seeds, at least 1; got {count}")
    return [first + k for k in range(count)]


def seed_bank_root(root: Path, seed: int, first: int) -> Path:
    """Where seed ``seed``'s banks live: ``root`` for the first seed (a one-seed bench's), ``root/seed-<s>`` else."""
    return Path(root) if seed == first else Path(root) / f"seed-{seed}"


def spread(values: Sequence[float | None]) -> dict[str, Any] | None:
    """Mean, sample standard deviation (0 for one value) and the values; None when any seed lacks the number."""
    if not values or any(v is None for v in values):
        return None
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": list(values)}


def mean_rows(per_seed: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The first seed's rows with every accuracy replaced by its mean over the seeds, ``spread`` beside them
    and ``alpha`` the tuned coefficients' mean (``alphas``: each seed's)."""
    by_seed = [{row_key(r): r for r in rows} for rows in per_seed]
    out = []
    for row in per_seed[0]:
        matched = [rows.get(row_key(row)) for rows in by_seed]
        if any(m is None for m in matched):
            raise ConfigError(f"seed reports disagree on their rows: {row_key(row)} is missing from one")
        alphas = [m["alpha"] for m in matched]
        numbers = {key: spread([m[key] for m in matched]) for key in ACCURACIES}
        out.append({**row, "per_task": {t: statistics.fmean(m["per_task"][t] for m in matched) for t in row["per_task"]},
                    **{key: s["mean"] if s else None for key, s in numbers.items()},
                    "alpha": statistics.fmean(alphas) if None not in alphas else None, "alphas": alphas,
                    "spread": numbers})
    return out


def mean_cost(per_seed: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each stream's :data:`COST_KEYS` as spreads over the seeds."""
    return {label: {key: spread([cost[label].get(key) for cost in per_seed]) for key in COST_KEYS}
            for label in per_seed[0]}


def mean_continual(per_seed: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each stream's ACC, BWT and forgetting as spreads over the seeds."""
    return {label: {key: spread([continual[label][key] for continual in per_seed]) for key in CONTINUAL_KEYS}
            for label in per_seed[0]}


def aggregate(reports: Sequence[Mapping[str, Any]], seeds: Sequence[int], runs: Sequence[Path],
              margin: float) -> dict[str, Any]:
    """The report of a bench over ``seeds``, from each seed's report (written into ``runs``)."""
    first = reports[0]
    per_seed_rows = [r["addition"]["rows"] for r in reports]
    rows = mean_rows(per_seed_rows)
    return {
        "scenario": first["scenario"],
        "backbone": first["backbone"],
        "tasks": first["tasks"],
        "modes": first["modes"],
        "methods": first["methods"],
        "seeds": list(seeds),
        "runs": {str(seed): str(run) for seed, run in zip(seeds, runs)},
        "addition": {**first["addition"], "rows": rows},
        "continual": mean_continual([r["continual"] for r in reports]),
        "cost": mean_cost([r["cost"] for r in reports]),
        "claims": claims(rows, margin, per_seed_rows),
        "torch_threads": first.get("torch_threads"),
        "runtime": first.get("runtime"),
        "timings": {"seed_seconds": [r["timings"]["total_seconds"] for r in reports]},
    }
