"""Diagnostics of task-vector interference: the tauJp matrix, correlations, weight disentanglement.

- **tauJp matrix** (the paper's Fig. 1): ``M[a][b]`` = mean over inputs x of task b
  of ``|| J_theta0 f(x) . tau_a ||`` (L2 norm of the backbone-feature tangent).
  The diagonal is how much a vector moves its own task's features; the
  off-diagonal is interference, which tauJp fine-tuning penalises.
- **correlation**: Pearson (and Spearman) correlation between off-diagonal tauJp
  and normalized accuracy of the merged model, across pairs and methods.
- **weight-disentanglement error** (Ortiz-Jimenez et al., 2023, Eq. 5)::

      xi(a1, a2) = sum_t E_{x in D_t} [ dist( f(x; theta_0 + a_t tau_t),
                                              f(x; theta_0 + a1 tau_1 + a2 tau_2) ) ]

  with ``dist`` = prediction disagreement (argmax of task t's head differs). It is
  0 when each vector acts only on its own task's inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from editkit.core.linearize import LinearizedModel, build_task_model
from editkit.util.progress import NullProgress, Progress

Vector = Mapping[str, torch.Tensor]


# --- tauJp ------------------------------------------------------------------------------------


@torch.no_grad()
def tangent_features(model: LinearizedModel, inputs: torch.Tensor, *, batch_size: int = 256, bar=None) -> torch.Tensor:
    """``J_theta0 f(x) . tau`` for every row of ``inputs``; tau is the vector loaded into ``model``."""
    out = []
    for i in range(0, len(inputs), batch_size):
        out.append(model.tangent(inputs[i : i + batch_size]))
        if bar is not None:
            bar.advance(1)
    return torch.cat(out) if out else torch.empty(0)


def tangent_norms(tangents: torch.Tensor) -> torch.Tensor:
    """Per-example L2 norm of the tangent (the penalty's quantity, before the batch mean)."""
    return torch.linalg.vector_norm(tangents.flatten(1), dim=1)


def taujp_matrix(
    module: nn.Module,
    vectors: Sequence[Vector],
    inputs: Sequence[torch.Tensor],
    *,
    batch_size: int = 256,
    progress: Progress | None = None,
) -> np.ndarray:
    """``M[a][b]`` = mean over ``inputs[b]`` of ``|| J_theta0 f(x) . vectors[a] ||`` (one jvp per input and vector)."""
    model = build_task_model(module, "linear")
    assert isinstance(model, LinearizedModel)
    model.eval()
    matrix = np.zeros((len(vectors), len(inputs)))
    batches = sum(math.ceil(len(x) / batch_size) for x in inputs) * len(vectors)
    with (progress or NullProgress()).task("tauJp matrix", total=batches) as bar:
        for a, tau in enumerate(vectors):
            model.load_task_vector(tau)
            for b, x in enumerate(inputs):
                norms = tangent_norms(tangent_features(model, x, batch_size=batch_size, bar=bar))
                matrix[a, b] = float(norms.double().mean()) if len(norms) else float("nan")
    return matrix


def off_diagonal(matrix: np.ndarray) -> np.ndarray:
    """The off-diagonal entries of a square matrix, row by row."""
    matrix = np.asarray(matrix)
    return matrix[~np.eye(len(matrix), dtype=bool)]


def pair_interference(matrix: np.ndarray, a: int, b: int) -> float:
    """Symmetrised off-diagonal tauJp of a pair: (M[a][b] + M[b][a]) / 2."""
    return float((matrix[a][b] + matrix[b][a]) / 2)


def correlation(x: Sequence[float], y: Sequence[float]) -> dict[str, float | int | None]:
    """Pearson r and Spearman rho (with p-values) between ``x`` and ``y``; None where undefined.

    Undefined when fewer than 3 points or when either side is constant.
    """
    from scipy import stats

    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    out: dict[str, float | int | None] = {"n": int(len(xs)), "pearson": None, "pearson_p": None,
                                           "spearman": None, "spearman_p": None}
    if len(xs) != len(ys):
        raise ValueError(f"correlation needs paired values, got {len(xs)} and {len(ys)}")
    if len(xs) < 3 or np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return out
    pearson = stats.pearsonr(xs, ys)
    spearman = stats.spearmanr(xs, ys)
    out.update(pearson=float(pearson.statistic), pearson_p=float(pearson.pvalue),
               spearman=_finite(spearman.statistic), spearman_p=_finite(spearman.pvalue))
    return out


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


# --- weight disentanglement -------------------------------------------------------------------

Predictor = Callable[[int, float, float], torch.Tensor]


@dataclass
class DisentanglementError:
    """xi on a grid: ``total[i][j]`` = xi(grid[i], grid[j]); ``terms[t]`` = task t's summand."""

    grid: list[float]
    total: np.ndarray
    terms: tuple[np.ndarray, np.ndarray]

    def to_dict(self) -> dict:
        return {"grid": list(self.grid), "xi": self.total.tolist(),
                "terms": [self.terms[0].tolist(), self.terms[1].tolist()]}


def disentanglement_error(predict: Predictor, grid: Sequence[float], *,
                          on_cell: Callable[[], None] | None = None) -> DisentanglementError:
    """xi(a1, a2) for every pair of grid values (rows a1, columns a2).

    ``predict(t, a1, a2)`` returns the predicted labels on task t's inputs (t = 0 or 1)
    of the model theta_0 + a1 tau_1 + a2 tau_2 under task t's head. Calls are memoised,
    so each distinct model is evaluated once per task. ``on_cell`` is called after each grid cell.
    """
    grid = [float(a) for a in grid]
    if not grid:
        from editkit.errors import ConfigError

        raise ConfigError("the disentanglement grid is empty")
    cache: dict[tuple[int, float, float], torch.Tensor] = {}

    def pred(t: int, a1: float, a2: float) -> torch.Tensor:
        key = (t, a1, a2)
        if key not in cache:
            cache[key] = predict(t, a1, a2)
        return cache[key]

    terms = (np.zeros((len(grid), len(grid))), np.zeros((len(grid), len(grid))))
    for i, a1 in enumerate(grid):
        for j, a2 in enumerate(grid):
            merged0, merged1 = pred(0, a1, a2), pred(1, a1, a2)
            terms[0][i, j] = _disagreement(pred(0, a1, 0.0), merged0)
            terms[1][i, j] = _disagreement(pred(1, 0.0, a2), merged1)
            if on_cell is not None:
                on_cell()
    return DisentanglementError(grid, terms[0] + terms[1], terms)


def _disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    if len(a) != len(b):
        raise ValueError("predictions of different lengths")
    return float((a != b).double().mean()) if len(a) else 0.0
