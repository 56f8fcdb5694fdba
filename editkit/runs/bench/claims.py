"""The bench's claims: where tauJp task arithmetic at alpha = 1 stands against the best baseline and the best
tauJp variant, on absolute and normalized accuracy, and against the continual-learning strategies on what their
rows share: ACC and BWT, task- and class-incremental.

A difference is ``ahead`` or ``behind`` only beyond a margin, else a ``tie``. One seed has no spread of its
own, so its margin is a fixed accuracy difference (0.5 points by default). Over several runs
(``editkit bench --seeds N`` or ``--orders N``) the rows are means and each claim compares means with a margin
of at least two standard errors of the difference: the runs are paired (the two rows of one run share its
scenario build, heads, task order and reg batches), so the standard error is that of the per-run differences,
``std / sqrt(N)``.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence, TypedDict

from editkit.core.modes import Mode
from editkit.integrations.avalanche.strategies import STRATEGIES
from editkit.merge import MERGE_METHODS

ACCURACIES = ("absolute", "normalized")
#: What tauJp's stream and a strategy's are compared on: ACC and BWT under each protocol. Not ``normalized``: a
#: mode's divides by its single-task models, a strategy has none (its own diagonal is BWT's business).
CONTINUAL = ("absolute", "bwt", "class_incremental", "class_bwt")


class Comparison(TypedDict, total=False):
    """One claim of ``report["claims"]``: tauJp at alpha = 1 against the row ``against`` on one accuracy."""

    verdict: str  # ahead | tie | behind (see verdict)
    difference: float  # tauJp's accuracy minus the other row's (a fraction, as every accuracy in the report)
    margin: float  # the fixed margin, or two standard errors of the difference where that is larger
    against: dict[str, Any]
    differences: list[float]  # over runs only: each run's difference
    standard_error: float | None  # over runs only: of the mean difference (None with one run)


def verdict(difference: float, margin: float) -> str:
    """``ahead`` or ``behind`` only when the difference exceeds the margin; ``tie`` within it, ends included."""
    if difference > margin:
        return "ahead"
    return "behind" if difference < -margin else "tie"


def row_key(row: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    """What identifies a row across seeds: its method, stream and coefficient (the tuned alpha may differ)."""
    return row["method"], row["variant"], row["coefficient"]


def _describe(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"method": row["method"], "mode": row["mode"], "variant": row["variant"], "alpha": row["alpha"],
            **{key: row.get(key) for key in dict.fromkeys(ACCURACIES + CONTINUAL)}}


def standard_error(differences: Sequence[float]) -> float | None:
    """Of the mean of paired differences: their sample standard deviation over sqrt(N); None under 2 runs."""
    if len(differences) < 2:
        return None
    return statistics.stdev(differences) / math.sqrt(len(differences))


def _compare(ours: Mapping[str, Any], others: Sequence[Mapping[str, Any]], key: str, margin: float,
             per_run: Sequence[Mapping[tuple, Mapping[str, Any]]] | None) -> Comparison | None:
    """``ours`` against the best of ``others`` on ``key`` (None when none of them has that number); with
    ``per_run`` (each run's rows by :func:`row_key`) the margin widens to two standard errors where larger."""
    scored = [r for r in others if r.get(key) is not None]
    if not scored or ours.get(key) is None:
        return None
    best = max(scored, key=lambda r: r[key])
    difference = ours[key] - best[key]
    if per_run is None:
        return {"verdict": verdict(difference, margin), "difference": difference, "margin": margin,
                "against": _describe(best)}
    differences = [rows[row_key(ours)][key] - rows[row_key(best)][key] for rows in per_run]
    error = standard_error(differences)
    widened = margin if error is None else max(margin, 2.0 * error)
    return {"verdict": verdict(difference, widened), "difference": difference, "margin": widened,
            "against": _describe(best), "differences": differences, "standard_error": error}


def claims(rows: Sequence[Mapping[str, Any]], margin: float,
           per_run: Sequence[Sequence[Mapping[str, Any]]] | None = None) -> dict[str, Any] | None:
    """Where tauJp task arithmetic at alpha = 1 stands, on absolute and normalized accuracy, against the best
    baseline (pretrained, and every method over vectors fine-tuned without the penalty, at its tuned
    coefficient) and, apart, against the best tauJp variant (any method over penalized vectors, taujp's own
    or taujp-nonlinear's, at its tuned coefficient): a variant is the method itself in another form, so
    being behind one is no loss to a baseline. Differences within ``margin`` are ties.

    Avalanche's strategies (rows of ``editkit bench --strategies``) are judged apart, in three groups: the
    rehearsal-free ones (Naive, EWC, LwF, SI: tauJp keeps no labelled example either), the rehearsal ones
    (Replay, A-GEM keep labelled examples of past tasks) and joint training (every task at once: an upper bound),
    on ACC and BWT under each protocol (:data:`CONTINUAL`).

    per_run: each run's rows, when ``rows`` are their means over seeds or task orders (see the module docstring).
    """
    ours = next((r for r in rows if r["method"] == "task-arithmetic" and r["mode"] == Mode.TAUJP
                 and r["coefficient"] == "1.0"), None)
    tuned = [r for r in rows if r["method"] in MERGE_METHODS and r["coefficient"] == "tuned"]
    baselines = [r for r in rows if r["method"] == "pretrained"] + [r for r in tuned if not Mode(r["mode"]).penalized]
    variants = [r for r in tuned if Mode(r["mode"]).penalized]
    if ours is None or not baselines:
        return None
    runs = None if per_run is None else [{row_key(r): r for r in run_rows} for run_rows in per_run]
    groups = {"rehearsal_free": lambda spec: not spec.rehearsal and not spec.joint,
              "rehearsal": lambda spec: spec.rehearsal, "joint": lambda spec: spec.joint}
    strategies = {group: [r for r in rows if r["method"] in STRATEGIES and wanted(STRATEGIES[r["method"]])]
                  for group, wanted in groups.items()}
    return {
        "margin": margin,
        "repeats": None if per_run is None else len(per_run),
        "taujp_alpha1": _describe(ours),
        "vs_baselines": {key: _compare(ours, baselines, key, margin, runs) for key in ACCURACIES},
        "vs_variants": {key: _compare(ours, variants, key, margin, runs) for key in ACCURACIES},
        "vs_strategies": {group: {key: _compare(ours, members, key, margin, runs) for key in CONTINUAL}
                          for group, members in strategies.items() if members},
        "baselines": [_describe(r) for r in baselines],
        "variants": [_describe(r) for r in variants],
    }
