"""Scoring an edited model per task, and the paper's summary metrics.

Evaluation goes through a :class:`Scorer`: one task's score of a task model
(theta_0 + tau in its mode). :class:`ClassificationScorer` is accuracy of a fixed
head's argmax over the backbone's features; :class:`TeacherForcedScorer` the
teacher-forced accuracy of a text-to-text task's label tokens. Scorers of generated
text (perplexity, toxicity of samples) plug in beside them: ``evaluate_vector`` needs
only ``name``, ``batches`` and ``score``.

Classification predictions are a function of the features alone (:func:`classify`).
That is the capability ``editkit.eval.sweep`` relies on to evaluate any coefficient
combination of linearized vectors exactly from cached tangents; a scorer without it
is evaluated by running the model.

Summaries:
- absolute accuracy: mean over tasks of the merged model's accuracy;
- normalized accuracy: mean over tasks of merged / single-task accuracy, where
  single-task means the task's own vector alone, fine-tuned in the same mode;
- negation: target accuracy (lower is better) and control accuracy on the other
  tasks, compared with theta_0's control accuracy.

Linear and tauJp vectors are evaluated in the linearized model (one jvp per
forward); non-linear vectors in f(x; theta_0 + tau). With a
:class:`~editkit.train.runtime.Runtime` evaluation runs on its device (bf16 autocast
on CUDA) and, under torchrun, each process scores a slice of each split and the
counts are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Protocol, Sequence, TypedDict

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from editkit.core.batching import IGNORE_INDEX, Batching, TensorBatching, labelled_collate
from editkit.train.runtime import Runtime, default_runtime
from editkit.core.linearize import build_task_model
from editkit.util.progress import NullProgress, Progress


class Scorer(Protocol):
    """One task's score of an edited model (higher or lower is better as the summary says)."""

    name: str

    def batches(self, batch_size: int, world_size: int) -> int:
        """How many batches :meth:`score` runs in one process (for progress)."""

    def score(self, model: nn.Module, *, batch_size: int, runtime: Runtime, progress_task=None) -> float:
        """The score of ``model`` (a task model of theta_0 + tau), identical in every process."""


def classify(head: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """Predicted classes: the argmax of a fixed head's logits over the backbone's features."""
    return head(features).argmax(dim=1)


@dataclass
class SplitScorer:
    """A score summed over the batches of one split under the task's fixed head.

    Subclasses say what a batch adds (:meth:`tally`: two numbers, such as correct and
    total) and how the sums become the score (:meth:`finish`). Under torchrun each
    process takes every ``world_size``-th example and the sums are added over processes.

    batching: how the split's inputs are collated and passed to the model (the backbone's).
    """

    name: str
    head: nn.Module
    dataset: Dataset
    batching: Batching = field(repr=False, default_factory=TensorBatching)
    #: The score is a function of the backbone's features alone, batch by batch through :meth:`tally`, so
    #: features computed once (theta_0's plus cached tangents) score any linearized vector exactly.
    scores_features: ClassVar[bool] = False

    def batches(self, batch_size: int, world_size: int) -> int:
        per_process = -(-len(self.dataset) // world_size)  # ceiling division: rank 0 holds the most
        return -(-per_process // batch_size)

    def tally(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """What one batch adds to the split's two sums."""
        raise NotImplementedError

    def finish(self, first: float, second: float) -> float:
        """The score from the split's two sums."""
        raise NotImplementedError

    @torch.no_grad()
    def score(self, model: nn.Module, *, batch_size: int = 256, runtime: Runtime | None = None,
              progress_task=None) -> float:
        runtime = runtime or Runtime()
        dataset = self.dataset
        if runtime.distributed:
            dataset = Subset(dataset, range(runtime.rank, len(dataset), runtime.world_size))
        device, cuda = runtime.device, runtime.device.type == "cuda"
        head = self.head.to(device)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=runtime.workers,
                            pin_memory=cuda, collate_fn=labelled_collate(self.batching))
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=cuda), y.to(device, non_blocking=cuda)
            with runtime.autocast():
                features = self.batching.run(model, x)
            totals += self.tally(head(features.float()), y).double()
            if progress_task is not None:
                progress_task.advance(1)
        return self.finish(*runtime.all_reduce_sum(totals).tolist())


class ClassificationScorer(SplitScorer):
    """Accuracy on a labelled split: the argmax of the head's logits against the labels."""

    scores_features: ClassVar[bool] = True

    def tally(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.stack([(logits.argmax(dim=1) == labels).sum(), torch.tensor(len(labels), device=labels.device)])

    def finish(self, correct: float, total: float) -> float:
        return correct / max(1, total)


def label_tokens_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example, whether the argmax of the logits ``(N, L, V)`` equals the label token ``(N, L)`` at every
    label position (positions labelled ``IGNORE_INDEX`` are padding and always agree)."""
    agree = (logits.argmax(dim=-1) == labels) | (labels == IGNORE_INDEX)
    return agree.all(dim=1)


class TeacherForcedScorer(ClassificationScorer):
    """Teacher-forced accuracy of a text-to-text task, as the authors score T5: the decoder reads the target
    shifted right, and an example counts when every target token is the argmax (:func:`label_tokens_correct`).

    No text is generated: a wrong first token cannot derail the later ones, so the score is a function
    of one forward pass, like a classifier's accuracy. Its features are per-token decoder outputs, whose
    vocabulary logits are far too large to cache, so it is not scored from cached features.
    """

    scores_features: ClassVar[bool] = False

    def tally(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.stack([label_tokens_correct(logits, labels).sum(), torch.tensor(len(labels), device=labels.device)])


def evaluate_vector(
    module: nn.Module,
    mode: str,
    tau: Mapping[str, torch.Tensor] | None,
    tasks: Sequence[Scorer],
    *,
    batch_size: int = 256,
    progress: Progress | None = None,
    description: str = "evaluating",
    runtime: Runtime | None = None,
    vector_mode: str | None = None,
) -> dict[str, float]:
    """Score on each task of theta_0 + tau (in ``mode``'s model, over tau's parameters: a plain-LoRA merge is weight
    updates, not factors), keyed by task name; ``vector_mode``: tau's mode when it is not ``mode`` (a linearized
    vector scored as the ordinary model at its weights)."""
    runtime = runtime or default_runtime(module)
    model = runtime.place(build_task_model(module, mode, names=list(tau) if tau else None, vector_mode=vector_mode))
    model.load_task_vector(tau or {})
    model.eval()
    batches = sum(t.batches(batch_size, runtime.world_size) for t in tasks)
    with (progress or NullProgress()).task(description, total=batches) as bar:
        return {t.name: t.score(model, batch_size=batch_size, runtime=runtime, progress_task=bar) for t in tasks}


class AdditionSummary(TypedDict):
    """The paper's two task-addition numbers; ``normalized`` is None when there are no single-task references."""

    absolute: float
    normalized: float | None


def addition_summary(per_task: Mapping[str, float], single_task: Mapping[str, float] | None) -> AdditionSummary:
    """``absolute`` = mean accuracy; ``normalized`` = mean of per-task accuracy / single-task accuracy
    (a task whose single-task accuracy is 0 counts 0), or None when ``single_task`` is None."""
    names = list(per_task)
    absolute = float(np.mean([per_task[n] for n in names]))
    if single_task is None:
        return {"absolute": absolute, "normalized": None}
    normalized = float(np.mean([per_task[n] / single_task[n] if single_task[n] > 0 else 0.0 for n in names]))
    return {"absolute": absolute, "normalized": normalized}


def negation_summary(target: str, per_task: Mapping[str, float], pretrained: Mapping[str, float]) -> dict[str, float]:
    """Target accuracy (lower is better) and mean control accuracy, with theta_0's for reference."""
    controls = [n for n in per_task if n != target]
    summary = {"target": per_task[target], "target_pretrained": pretrained[target]}
    if controls:
        control = float(np.mean([per_task[n] for n in controls]))
        control_0 = float(np.mean([pretrained[n] for n in controls]))
        summary.update(control=control, control_pretrained=control_0, control_retained=control / control_0 if control_0 else 0.0)
    return summary
