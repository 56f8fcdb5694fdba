"""Class prototypes by hand: the cosine argmax input by input, and a tiny bank whose vectors carry prototypes.

The hand versions loop in Python over inputs, tasks and classes with ``math``, so they share no code (and no
vectorised shortcut) with ``editkit.core.prototypes``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

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


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(u, v))
    return dot / (math.sqrt(sum(x * x for x in u)) * math.sqrt(sum(y * y for y in v)))


def nearest_by_hand(features: torch.Tensor, means: Sequence[torch.Tensor]) -> list[int]:
    """Each input's global class (the classes of the tasks before the winner, plus its class) of highest cosine."""
    out = []
    for x in features.tolist():
        scored = [(cosine(x, prototype), offset + c)
                  for offset, task in zip([sum(len(m) for m in means[:k]) for k in range(len(means))], means)
                  for c, prototype in enumerate(task.tolist())]
        out.append(max(scored)[1])
    return out


def random_prototypes(classes: int, dim: int, seed: int) -> Prototypes:
    """Prototypes of no model: what an evaluator is checked against needs only to be distinct per set."""
    g = torch.Generator().manual_seed(seed)
    return Prototypes(torch.randn(classes, dim, generator=g), torch.randn(classes, dim, generator=g),
                      torch.randint(1, 9, (classes,), generator=g))


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
