"""Coefficient grids and the paper's rules for choosing a coefficient on validation.

Addition: the alpha with the best validation score (ties: the smallest alpha).
Negation: the alpha with the lowest validation target accuracy among those keeping
control accuracy >= ``retain`` x theta_0's (ties: higher control, then smaller alpha).
Shared by ``editkit negate --tune-alpha`` and ``editkit bench``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

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
    floor = retain * control_0 - 1e-12
    feasible = [i for i in range(len(alphas)) if controls[i] >= floor]
    if not feasible:
        return None
    return min(feasible, key=lambda i: (targets[i], -controls[i], alphas[i]))
