"""Class statistics by hand: the shared-covariance head input by input, and a tiny bank whose vectors carry them.

The hand versions loop in Python over inputs, tasks and classes, with numpy's fp64 solve for the covariance, so
they share no code (and no vectorised shortcut) with ``editkit.core.prototypes``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from editkit.bank.store import Bank
from editkit.core.prototypes import Prototypes
from editkit.data.tasks import TaskData, TensorTaskDataset
from editkit.eval.sweep import ModeEvaluator, SharedModels, TaskSplits
from editkit.models.backbone import state_fingerprint
from editkit.models.heads import LinearHead
from editkit.util.progress import NullProgress

from helpers import models

#: The tiny stream's tasks and their classes (different counts, so a task's offset is not a multiple of one).
CLASSES = {"a": 2, "b": 3}


def unit(x: Sequence[float]) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    return v / math.sqrt(float(v @ v))


def statistics_by_hand(features: torch.Tensor, labels: torch.Tensor, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class the mean of the unit features, and the sum over inputs of (z - its class mean)(z - its class
    mean)^T, one input at a time."""
    zs = [unit(x) for x in features.tolist()]
    ys = labels.tolist()
    means = [sum((z for z, y in zip(zs, ys) if y == c), np.zeros(len(zs[0]))) / max(ys.count(c), 1)
             for c in range(classes)]
    scatter = sum(np.outer(z - means[y], z - means[y]) for z, y in zip(zs, ys))
    return torch.tensor(np.stack(means), dtype=torch.float32), torch.tensor(scatter, dtype=torch.float32)


def head_by_hand(features: torch.Tensor, tasks: Sequence[Prototypes], kind: str, shrinkage: float) -> list[int]:
    """Each input's global class (the classes of the tasks before the winner, plus its class) of highest
    discriminant z . C^-1 mu - mu . C^-1 mu / 2, C the tasks' pooled scatter over their inputs, shrunk."""
    pooled = sum(t.scatter(kind).double().numpy() for t in tasks) / sum(t.examples for t in tasks)
    width = pooled.shape[0]
    covariance = (1 - shrinkage) * pooled + shrinkage * np.trace(pooled) / width * np.eye(width)
    classes = [(mu, count) for t in tasks for mu, count in zip(t.means(kind).double().numpy(), t.counts.tolist())]
    out = []
    for x in features.tolist():
        z = unit(x)
        scores = [(float(z @ np.linalg.solve(covariance, mu) - mu @ np.linalg.solve(covariance, mu) / 2), index)
                  for index, (mu, count) in enumerate(classes) if count > 0]
        out.append(max(scores)[1])
    return out


def random_prototypes(classes: int, dim: int, seed: int) -> Prototypes:
    """Prototypes of no model: means, positive definite scatters and counts distinct per seed and set."""
    g = torch.Generator().manual_seed(seed)

    def scatter() -> torch.Tensor:
        a = torch.randn(dim, 2 * dim, generator=g)
        return a @ a.T

    return Prototypes(torch.randn(classes, dim, generator=g), torch.randn(classes, dim, generator=g), scatter(),
                      scatter(), torch.randint(1, 9, (classes,), generator=g))


def evaluator_setup(root: Path, mode: str, *, prototypes: bool = True):
    """(module, tasks, vectors, banked prototypes by task, evaluator) of two tasks, each vector banked with
    random prototypes (or none)."""
    module = models.mlp(6, 8, 5, seed=0)
    g = torch.Generator().manual_seed(3)
    tasks, heads = [], {}
    for name, classes in CLASSES.items():
        def split(n: int, classes: int = classes) -> TensorTaskDataset:
            return TensorTaskDataset(torch.randn(n, 6, generator=g), torch.randint(0, classes, (n,), generator=g))

        tasks.append(TaskData(name, [str(c) for c in range(classes)], split(20), split(9), split(30)))
        heads[name] = LinearHead(torch.randn(classes, 5, generator=g), torch.zeros(classes))
    base = state_fingerprint(module.state_dict())
    bank = Bank(root / f"bank-{mode}")
    vectors, banked = {}, {}
    for seed, name in enumerate(CLASSES):
        vectors[name] = {n: 0.5 * torch.randn(p.shape, generator=g) for n, p in module.named_parameters()}
        banked[name] = random_prototypes(CLASSES[name], 5, seed) if prototypes else None
        bank.append(name, vectors[name], task=name, mode=mode, base=base, scenario="tiny", prototypes=banked[name])
    data = TaskSplits(module, tasks, batch_size=4, xi_samples=5, progress=NullProgress())
    ev = ModeEvaluator(mode, bank, {n: n for n in CLASSES}, data, heads, base, SharedModels.of(module))
    return module, tasks, vectors, banked, ev


def features_at(module: torch.nn.Module, tau: dict[str, torch.Tensor], x: torch.Tensor, *,
                linearized: bool) -> torch.Tensor:
    """The features of theta_0 + ``tau`` computed here, not by editkit's task models: f(x; theta_0 + tau) by a
    functional call, or f(x; theta_0) + J tau by ``torch.func.jvp``."""
    from torch.func import functional_call, jvp

    theta0 = {n: p.detach() for n, p in module.named_parameters()}
    if not linearized:
        with torch.no_grad():
            return functional_call(module, {n: p + tau[n].to(p) for n, p in theta0.items()}, (x,))
    names = list(theta0)

    def f(*params: torch.Tensor) -> torch.Tensor:
        return functional_call(module, dict(zip(names, params)), (x,))

    primal, tangent = jvp(f, tuple(theta0[n] for n in names), tuple(tau[n].to(theta0[n]) for n in names))
    return (primal + tangent).detach()
