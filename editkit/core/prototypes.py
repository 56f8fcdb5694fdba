"""Class statistics: a head shared by every class seen, built from each task's own training inputs alone.

A task banks, per class, the mean of its training inputs' L2-normalized features, and the within-class scatter of
those features (the sum over its inputs of (z - its class mean)(z - its class mean)^T). An input is classified
among every class of the tasks listed, without the task id, by a shared-covariance (linear discriminant) head:
the listed tasks' scatters pooled into one covariance, shrunk towards a multiple of the identity, and each class
scored by z . S^-1 mu_c - mu_c . S^-1 mu_c / 2 (streaming LDA, Hayes & Kanan 2020; RanPAC's ridge head is the same
family). Why this head:

- It is built from statistics alone: a merged model classifies among every seen class without any earlier task's
  data, and pooling scatters is a sum (order-free, constant in the number of inputs).
- Whitening by the pooled covariance is what a nearest-class-mean head lacks: on a frozen backbone the features
  of different classes overlap along high-variance directions, and the discriminant discounts them (on split-mnist
  theta_0's own statistics classify 72.8% by cosine to the means, 91-94% by this head).
- Normalizing each feature before the statistics keeps one task's larger norms from taking every input.
- The shrinkage is strong (:data:`~editkit.settings.CLASS_HEAD_SHRINKAGE`): an earlier task's means were
  computed before the later vectors were added, and whatever those vectors still move on its inputs is amplified
  by a weakly shrunk inverse along the low-variance directions. Shrinkage 1 is the Euclidean nearest-mean head.

Two sets are kept per task, from the same inputs: ``merged``, the features of the model the stream holds once the
task is added (theta_0 plus the stream's merge of every vector so far: what a merged model is scored against,
and what the tauJp penalty keeps valid as later vectors are added), and ``pretrained``, the features of theta_0
(the frozen backbone's own head, for the pretrained model's row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from editkit.errors import ConfigError

FORMAT = "prototypes-2"
#: The two sets a task's statistics hold, both over the same training inputs.
KINDS = ("merged", "pretrained")


@dataclass(frozen=True)
class Prototypes:
    """One task's class statistics: per kind (:data:`KINDS`) the (classes, features) fp32 means of the normalized
    features of its training inputs and their (features, features) within-class scatter, and how many inputs of
    each class they cover."""

    merged: torch.Tensor
    pretrained: torch.Tensor
    merged_scatter: torch.Tensor
    pretrained_scatter: torch.Tensor
    counts: torch.Tensor

    def __post_init__(self) -> None:
        shapes = {kind: tuple(getattr(self, kind).shape) for kind in KINDS}
        width = shapes["merged"][-1]
        scatters = {kind: tuple(self.scatter(kind).shape) for kind in KINDS}
        if (len(set(shapes.values())) != 1 or len(shapes["merged"]) != 2 or self.counts.dim() != 1
                or len(self.counts) != shapes["merged"][0] or set(scatters.values()) != {(width, width)}):
            raise ConfigError(f"prototypes of shapes {shapes}, scatters {scatters} and counts of shape "
                              f"{tuple(self.counts.shape)}: both sets must be (classes, features) with a (features, "
                              "features) scatter each, and one count per class")

    @property
    def classes(self) -> int:
        return len(self.counts)

    @property
    def examples(self) -> int:
        """The training inputs the statistics cover."""
        return int(self.counts.sum())

    def means(self, kind: str) -> torch.Tensor:
        return getattr(self, _kind(kind))

    def scatter(self, kind: str) -> torch.Tensor:
        return getattr(self, _kind(kind) + "_scatter")

    def describe(self) -> dict[str, Any]:
        """What a manifest entry says of them (and what a bank checks the file against)."""
        return {"format": FORMAT, "classes": self.classes, "features": int(self.merged.shape[1]),
                "examples": self.examples}

    # -- files: tensors plus a header, so a bank stores them as safetensors
    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).contiguous() for name in _TENSORS}

    @staticmethod
    def header() -> dict[str, str]:
        return {"format": FORMAT}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> Prototypes:
        """Read back :meth:`to_tensors` / :meth:`header`; refuses another format, or missing or misshapen
        tensors, by name (ConfigError)."""
        if header.get("format") != FORMAT:
            raise ConfigError(f"prototype format {header.get('format')!r} is not {FORMAT!r}")
        missing = [key for key in _TENSORS if key not in tensors]
        if missing:
            raise ConfigError(f"prototypes lack tensor(s) {', '.join(missing)}")
        return cls(**{key: tensors[key] for key in _TENSORS})


_TENSORS = ("merged", "pretrained", "merged_scatter", "pretrained_scatter", "counts")


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise ConfigError(f"unknown prototype set {kind!r}; expected one of {', '.join(KINDS)}")
    return kind


def class_statistics(features: torch.Tensor, labels: torch.Tensor,
                     counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class, the mean of the L2-normalized ``features`` of its inputs (``counts`` of them), and the
    within-class scatter of those normalized features: (classes, features) and (features, features), fp32. A class
    without an input keeps a zero row, which :class:`ClassHead` never chooses."""
    normalized = F.normalize(features.float(), dim=1)
    sums = torch.zeros(len(counts), normalized.shape[1]).index_add_(0, labels, normalized)
    means = sums / counts.clamp(min=1).unsqueeze(1)
    centred = (normalized - means[labels]).double()  # a sum of many outer products: accumulated in fp64
    return means, (centred.T @ centred).float()


def class_prototypes(merged: torch.Tensor, pretrained: torch.Tensor, labels: torch.Tensor, classes: int, *,
                     task: str) -> Prototypes:
    """Task ``task``'s statistics from its training inputs' features under the stream's merged model (``merged``)
    and under theta_0 (``pretrained``), row for row with ``labels``; refuses a label out of range by task and
    label. A class no training input has (a small or skewed split) gets no mean, a count of 0: its test inputs are
    then always wrong, which the accuracy says, where a refusal here would lose the vector just trained."""
    labels = labels.long()
    outside = labels[(labels < 0) | (labels >= classes)]
    if len(outside):
        raise ConfigError(f"task {task}: label {int(outside[0])} is not one of its {classes} classes")
    counts = torch.bincount(labels, minlength=classes)
    merged_means, merged_scatter = class_statistics(merged, labels, counts)
    pretrained_means, pretrained_scatter = class_statistics(pretrained, labels, counts)
    return Prototypes(merged_means, pretrained_means, merged_scatter, pretrained_scatter, counts)


@dataclass(frozen=True)
class ClassHead:
    """A linear head over every class of the tasks it was built from, in their order: class c of task k is
    index (the classes of the tasks before k) + c. ``weights`` (classes, features) and ``bias`` (classes; -inf
    for a class without a training input, so it never wins) score the L2-normalized features."""

    weights: torch.Tensor
    bias: torch.Tensor

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        """Each input's class: the global index of its highest score."""
        return (F.normalize(features.float(), dim=1) @ self.weights.T + self.bias).argmax(dim=1)


def class_head(tasks: Sequence[Prototypes], kind: str, shrinkage: float) -> ClassHead:
    """The shared-covariance head over ``tasks``' classes from their ``kind`` statistics: the pooled within-class
    covariance S (their scatters' sum over their inputs' count), shrunk to (1 - shrinkage) S + shrinkage
    (tr S / d) I, solved in fp64. With no spread to pool (one input a class) S is the identity."""
    means = torch.cat([t.means(kind) for t in tasks]).double()
    counts = torch.cat([t.counts for t in tasks])
    pooled = sum(t.scatter(kind).double() for t in tasks) / max(int(counts.sum()), 1)
    width = means.shape[1]
    spread = float(pooled.trace()) / width
    identity = torch.eye(width, dtype=torch.float64)
    covariance = (1 - shrinkage) * pooled + shrinkage * spread * identity if spread > 0 else identity
    weights = torch.linalg.solve(covariance, means.T).T
    bias = (-0.5 * (weights * means).sum(dim=1)).masked_fill(counts == 0, float("-inf"))
    return ClassHead(weights.float(), bias.float())


def capped_rows(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """The rows a task's prototypes average, in order: every input of a class with at most ``per_class`` of them,
    else a choice of ``per_class`` drawn with ``seed`` (the same on every run)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    chosen = [order[labels[order] == c][:per_class] for c in labels.unique()]
    return torch.cat(chosen).sort().values
