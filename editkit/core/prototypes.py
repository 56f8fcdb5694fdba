"""Class prototypes: a head shared by every class seen, built from each task's own training inputs alone.

A task's prototypes are, per class, the mean of its training inputs' L2-normalized features. An input is
classified among every class of the tasks listed, without the task id, by the highest cosine similarity to a
prototype (the nearest-class-mean head of SimpleCIL, Zhou et al. 2023, with cosine similarity). Why this head:

- Each task's vector is fine-tuned alone, so its features' norms are its own: normalizing each feature before
  averaging, and comparing by cosine, keeps one task's larger norms from taking every input.
- One scale for all classes, as CLIP's zero-shot head has (a temperature times the cosine): the argmax does
  not depend on it, so no scale is fitted or stored.
- The prototypes of a task are computed when it is trained and kept beside its vector, so a merged model
  classifies among every seen class without any earlier task's data.

Two sets are kept per task, from the same inputs: ``tuned``, the features of that task's own fine-tuned model
theta_0 + tau_t (what a merged model's class-incremental accuracy is scored against), and ``pretrained``, the
features of theta_0 (the frozen backbone's own prototype head, for the pretrained model's row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from editkit.errors import ConfigError

FORMAT = "prototypes-1"
#: The two sets a task's prototypes hold, both over the same training inputs.
KINDS = ("tuned", "pretrained")


@dataclass(frozen=True)
class Prototypes:
    """One task's class prototypes: per kind (:data:`KINDS`) the (classes, features) fp32 means of the normalized
    features of its training inputs, and how many inputs of each class they average."""

    tuned: torch.Tensor
    pretrained: torch.Tensor
    counts: torch.Tensor

    def __post_init__(self) -> None:
        shapes = {kind: tuple(getattr(self, kind).shape) for kind in KINDS}
        if (len(set(shapes.values())) != 1 or len(shapes["tuned"]) != 2 or self.counts.dim() != 1
                or len(self.counts) != shapes["tuned"][0]):
            raise ConfigError(f"prototypes of shapes {shapes} with counts of shape {tuple(self.counts.shape)}: "
                              "both sets must be (classes, features), with one count per class")

    @property
    def classes(self) -> int:
        return len(self.counts)

    @property
    def examples(self) -> int:
        """The training inputs the prototypes average."""
        return int(self.counts.sum())

    def means(self, kind: str) -> torch.Tensor:
        if kind not in KINDS:
            raise ConfigError(f"unknown prototype set {kind!r}; expected one of {', '.join(KINDS)}")
        return getattr(self, kind)

    def describe(self) -> dict[str, Any]:
        """What a manifest entry says of them (and what a bank checks the file against)."""
        return {"format": FORMAT, "classes": self.classes, "features": int(self.tuned.shape[1]),
                "examples": self.examples}

    # -- files: tensors plus a header, so a bank stores them as safetensors
    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"tuned": self.tuned.contiguous(), "pretrained": self.pretrained.contiguous(),
                "counts": self.counts.contiguous()}

    @staticmethod
    def header() -> dict[str, str]:
        return {"format": FORMAT}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], header: Mapping[str, str]) -> Prototypes:
        """Read back :meth:`to_tensors` / :meth:`header`; refuses another format, or missing or misshapen
        tensors, by name (ConfigError)."""
        if header.get("format") != FORMAT:
            raise ConfigError(f"prototype format {header.get('format')!r} is not {FORMAT!r}")
        missing = [key for key in (*KINDS, "counts") if key not in tensors]
        if missing:
            raise ConfigError(f"prototypes lack tensor(s) {', '.join(missing)}")
        return cls(tensors["tuned"], tensors["pretrained"], tensors["counts"])


def class_means(features: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per class, the mean of the L2-normalized ``features`` of its inputs (``counts`` of them): (classes,
    features) fp32; a class without an input keeps a zero row, which :func:`task_bests` never chooses."""
    normalized = F.normalize(features.float(), dim=1)
    sums = torch.zeros(len(counts), normalized.shape[1]).index_add_(0, labels, normalized)
    return sums / counts.clamp(min=1).unsqueeze(1)


def class_prototypes(tuned: torch.Tensor, pretrained: torch.Tensor, labels: torch.Tensor, classes: int, *,
                     task: str) -> Prototypes:
    """Task ``task``'s prototypes from its training inputs' features under its fine-tuned model (``tuned``) and
    under theta_0 (``pretrained``), row for row with ``labels``; refuses a label out of range by task and label.
    A class no training input has (a small or skewed split) gets no prototype, a count of 0: its test inputs are
    then always wrong, which the accuracy says, where a refusal here would lose the vector just trained."""
    labels = labels.long()
    outside = labels[(labels < 0) | (labels >= classes)]
    if len(outside):
        raise ConfigError(f"task {task}: label {int(outside[0])} is not one of its {classes} classes")
    counts = torch.bincount(labels, minlength=classes)
    return Prototypes(class_means(tuned, labels, counts), class_means(pretrained, labels, counts), counts)


def task_bests(features: torch.Tensor, means: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per input and listed task (its (classes, features) prototypes in ``means``), the highest cosine similarity
    to one of the task's prototypes and that class: two (inputs, tasks) tensors. Kept per task, so a choice
    among any subset of the tasks (:func:`winners`) needs no feature again."""
    unit = F.normalize(features.float(), dim=1)
    bests = [_similarities(unit, m).max(dim=1) for m in means]
    return torch.stack([b.values for b in bests], dim=1), torch.stack([b.indices for b in bests], dim=1)


def _similarities(unit: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each unit feature to each prototype; -inf to a class without one (a zero row: the
    mean of unit vectors of a class with inputs is never exactly zero), so it cannot win."""
    means = means.float()
    return (unit @ F.normalize(means, dim=1).T).masked_fill(means.norm(dim=1) == 0, float("-inf"))


def winners(values: torch.Tensor, classes: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """The global class index of each input's best (task, class) from :func:`task_bests` over tasks of ``sizes``
    classes: the winning task's offset among them (the classes of the tasks before it) plus its class."""
    offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    task = values.argmax(dim=1)
    return offsets[task] + classes.gather(1, task.unsqueeze(1)).squeeze(1)


def nearest(features: torch.Tensor, means: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each input's class among every class of the listed tasks (their prototypes' means, in order), without
    the task id: the global index (task offset + class) of the prototype of highest cosine similarity."""
    return winners(*task_bests(features, means), [len(m) for m in means])


def capped_rows(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """The rows a task's prototypes average, in order: every input of a class with at most ``per_class`` of them,
    else a choice of ``per_class`` drawn with ``seed`` (the same on every run)."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    chosen = [order[labels[order] == c][:per_class] for c in labels.unique()]
    return torch.cat(chosen).sort().values
