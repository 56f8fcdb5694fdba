"""Coefficient grids and the paper's rules for choosing a coefficient on validation.

Addition: the alpha with the best validation score (ties: the smallest alpha).
Negation: the alpha with the lowest validation target accuracy among those keeping
control accuracy >= ``retain`` x theta_0's (ties: higher control, then smaller alpha).
Negation of a language task: the alpha with the highest validation target perplexity
among those keeping control perplexity within a bound of theta_0's (ties: lower control,
then smaller alpha); the bound is relative (``(1 + tol)`` x theta_0's) or absolute
(theta_0's + a margin, Ilharco et al.'s +0.5). It is the accuracy rule on negated
perplexities: a higher perplexity is a lower score.
Shared by ``editkit negate --tune-alpha`` and ``editkit bench``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from editkit.core.registry import Record, Registry
from editkit.errors import ConfigError

PAPER_GRID_POINTS = 21  # linspace(0, 1, 21)
NEGATION_RETAIN = 0.95


def alpha_grid(points: int, top: float = 1.0) -> list[float]:
    """``linspace(0, top, points)`` as floats (the paper's grid for 21 points and top 1)."""
    if points < 1:
        raise ConfigError(f"the alpha grid is empty (--grid {points}); use at least 2 points, e.g. --grid 21")
    if points < 2:
        raise ConfigError("an alpha grid needs at least 2 points (0 and the top); e.g. --grid 21 or --grid 11")
    if not (math.isfinite(top) and top > 0):
        raise ConfigError(f"the top of an alpha grid must be a positive number, got {top}")
    return [float(a) for a in np.linspace(0.0, top, points)]


def select_alpha(alphas: Sequence[float], scores: Sequence[float]) -> int:
    """Index of the best score (the smallest alpha among equal bests)."""
    if not alphas or len(alphas) != len(scores):
        raise ConfigError("coefficient search needs one score per alpha on a non-empty grid")
    return int(np.argmax(np.asarray(scores, dtype=float)))


def search_alpha(alphas: Sequence[float], score: Callable[[float], float]) -> tuple[float, list[float]]:
    """Evaluate ``score`` on the grid; (the arg-max alpha, every score)."""
    scores = [float(score(a)) for a in alphas]
    return float(alphas[select_alpha(alphas, scores)]), scores


def select_negation_alpha(alphas: Sequence[float], targets: Sequence[float], controls: Sequence[float],
                          control_0: float, retain: float = NEGATION_RETAIN) -> int | None:
    """Index minimising target accuracy subject to control >= retain * control_0.

    Ties go to the higher control accuracy, then to the smaller alpha. None when no
    alpha keeps the control (alpha = 0 always does, when it is on the grid).
    """
    return _least_target(range(len(alphas)), alphas, targets, controls, retain * control_0 - 1e-12)


def _least_target(indices: Sequence[int], alphas: Sequence[float], targets: Sequence[float],
                  controls: Sequence[float], floor: float) -> int | None:
    """Among ``indices`` with control >= floor, the one with the lowest target (then higher control, smaller alpha)."""
    feasible = [i for i in indices if controls[i] >= floor]
    if not feasible:
        return None
    return min(feasible, key=lambda i: (targets[i], -controls[i], alphas[i]))


@dataclass(frozen=True)
class PerplexityBound(Record):
    """A rule for how much control perplexity a negation may cost: ``build(theta_0's ppl, margin)`` is the bound,
    ``margin`` its default margin, ``help`` the rule in words."""

    margin: float = 0.0
    help: str = ""


#: The control-perplexity rules by name (``--rule``, ``--margin`` of ``editkit negate``): a registry, as merge methods
#: are, so an extension may add one.
PERPLEXITY_RULES: Registry[PerplexityBound] = Registry("alpha rule", PerplexityBound)
PERPLEXITY_RULES.register("relative", PerplexityBound(
    lambda ppl_0, tol: (1.0 + tol) * ppl_0, margin=0.05,
    help="control perplexity <= (1 + margin) x the pretrained model's"))
PERPLEXITY_RULES.register("absolute", PerplexityBound(
    lambda ppl_0, slack: ppl_0 + slack, margin=0.5,
    help="control perplexity <= the pretrained model's + margin (Ilharco et al.: +0.5)"))
DEFAULT_PERPLEXITY_RULE = "relative"


@dataclass(frozen=True)
class PerplexityNegationChoice:
    """The chosen alpha of a language negation, and whether it kept the control-perplexity rule.

    ``met`` False means no alpha > 0 kept control perplexity <= ``bound``; ``alpha`` is then
    the alpha > 0 tried with the lowest control perplexity, so the caller can report both.
    """

    alpha: float
    met: bool
    bound: float
    rule: str
    margin: float


def select_perplexity_negation_alpha(rows: Sequence[tuple[float, float, float]], control_ppl_0: float, *,
                                     rule: str = DEFAULT_PERPLEXITY_RULE,
                                     margin: float | None = None) -> PerplexityNegationChoice:
    """Choose alpha from validation rows ``(alpha, control_ppl, target_ppl)`` of theta_0 - alpha tau.

    The largest target perplexity (the strongest removal of the negated task) among the
    alphas > 0 whose control perplexity stays within ``rule``'s bound of ``control_ppl_0``
    (``margin`` defaults to the rule's). alpha = 0 is theta_0 itself: it never counts as
    meeting the rule, whatever the grid holds.
    """
    spec = PERPLEXITY_RULES[rule]  # an unknown rule is refused, naming the known ones
    margin = spec.margin if margin is None else float(margin)
    if not (math.isfinite(margin) and margin >= 0):
        raise ConfigError(f"the margin of the {rule} alpha rule must be a non-negative number, got {margin}")
    alphas = [float(a) for a, _, _ in rows]
    controls = [-float(c) for _, c, _ in rows]  # negated: the accuracy rule keeps high controls, low targets
    targets = [-float(t) for _, _, t in rows]
    tried = [i for i, a in enumerate(alphas) if a > 0]
    if not tried:
        raise ConfigError("choosing a negation alpha needs at least one alpha > 0 on the grid")
    bound = spec.build(control_ppl_0, margin)
    chosen = _least_target(tried, alphas, targets, controls, -bound * (1 + 1e-12))  # the bound's float rounding
    if chosen is not None:
        return PerplexityNegationChoice(alphas[chosen], True, bound, rule, margin)
    closest = min(tried, key=lambda i: (-controls[i], alphas[i]))  # the lowest control perplexity tried
    return PerplexityNegationChoice(alphas[closest], False, bound, rule, margin)
