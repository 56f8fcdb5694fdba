"""Fixed classification heads on top of backbone features.

Heads never train during fine-tuning (the paper keeps CLIP's zero-shot heads
fixed), so every task vector lives purely in the backbone and vectors of
different tasks can be summed. Two kinds:

- ``LinearHead``: logits = W f + b. For non-CLIP backbones it is a logistic
  regression probe fitted on theta_0 features of a few labelled examples per class
  (the analogue of a zero-shot head; weak on purpose, so fine-tuning matters).
- ``ZeroShotHead``: logits = scale * normalize(f) @ T^T, with T the normalized class
  text embeddings (CLIP).

The ``probe`` head kind is registered here; ``zero-shot`` lives with the prompt
templates it needs (``editkit.data.vision8``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from editkit.core.registry import Record
from editkit.models import HEADS


class LinearHead(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach().clone().float())
        self.register_buffer("bias", bias.detach().clone().float())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.weight, self.bias)


class ZeroShotHead(nn.Module):
    def __init__(self, class_embeddings: torch.Tensor, logit_scale: float) -> None:
        super().__init__()
        self.register_buffer("weight", F.normalize(class_embeddings.detach().float(), dim=-1))
        self.logit_scale = float(logit_scale)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.logit_scale * F.normalize(features, dim=-1) @ self.weight.T


def fit_probe(features: torch.Tensor, labels: torch.Tensor, num_classes: int, *, seed: int = 0) -> LinearHead:
    """Logistic-regression probe on theta_0 features (scikit-learn, L2, lbfgs).

    Classes absent from ``labels`` get a row of zeros and a very negative bias, so
    the head's shape always matches the task's label space.
    """
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    x = features.detach().cpu().double().numpy()
    y = labels.detach().cpu().numpy()
    clf = LogisticRegression(max_iter=2000, random_state=seed)
    with threadpool_limits(1):  # tiny problem: BLAS threads only add contention (measured 10x slower)
        clf.fit(x, y)
    weight = np.zeros((num_classes, x.shape[1]))
    bias = np.full(num_classes, -1e4)
    if len(clf.classes_) == 2:  # sklearn stores one row for binary problems
        weight[clf.classes_[1]], bias[clf.classes_[1]] = clf.coef_[0], clf.intercept_[0]
        weight[clf.classes_[0]], bias[clf.classes_[0]] = 0.0, 0.0
    else:
        weight[clf.classes_], bias[clf.classes_] = clf.coef_, clf.intercept_
    return LinearHead(torch.from_numpy(weight).float(), torch.from_numpy(bias).float())


def probe_head(backbone, task, *, shots: int, seed: int) -> LinearHead:
    """:func:`fit_probe` on theta_0 features of ``shots`` train examples per class of ``task``
    (a :class:`~editkit.data.tasks.TaskData`), drawn with ``seed``."""
    targets = getattr(task.train, "targets", None)
    labels = torch.as_tensor(list(targets) if targets is not None else [item[1] for item in task.train])
    generator = torch.Generator().manual_seed(seed)
    chosen = []
    for c in range(task.num_classes):
        members = (labels == c).nonzero().flatten()
        chosen += members[torch.randperm(len(members), generator=generator)[:shots]].tolist()
    inputs = backbone.batching.collate([task.train[i][0] for i in chosen])
    return fit_probe(backbone.features(inputs), labels[chosen], task.num_classes, seed=seed)


def _probe_kind(backbone, task, dataset: str, seed: int, shots: int = 5) -> LinearHead:
    return probe_head(backbone, task, shots=int(shots), seed=seed)


HEADS.register("probe", Record.of(_probe_kind, help={"shots": "labelled train examples per class the probe is fitted on"}))
