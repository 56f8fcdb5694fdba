"""Accuracy of an edited model, per task, and the paper's summary metrics.

- absolute accuracy: mean over tasks of the merged model's accuracy;
- normalized accuracy: mean over tasks of merged / single-task accuracy, where
  single-task means the task's own vector alone, fine-tuned in the same mode;
- negation: target accuracy (lower is better) and control accuracy on the other
  tasks, compared with theta_0's control accuracy.

Linear and tauJp vectors are evaluated in the linearized model (one jvp per
forward); non-linear vectors in f(x; theta_0 + tau).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .linearize import build_task_model
from .progress import NullProgress, Progress


@dataclass
class EvalTask:
    """What is needed to score one task: its fixed head and a labelled split."""

    name: str
    head: nn.Module
    dataset: Dataset


@torch.no_grad()
def accuracy(model: nn.Module, head: nn.Module, dataset: Dataset, *, batch_size: int = 256, progress_task=None) -> float:
    correct = total = 0
    for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False):
        x, y = batch[0], batch[1]
        correct += (head(model(x)).argmax(dim=1) == y).sum().item()
        total += len(y)
        if progress_task is not None:
            progress_task.advance(1)
    return correct / max(1, total)


def evaluate_vector(
    module: nn.Module,
    mode: str,
    tau: Mapping[str, torch.Tensor] | None,
    tasks: Sequence[EvalTask],
    *,
    batch_size: int = 256,
    progress: Progress | None = None,
    description: str = "evaluating",
) -> dict[str, float]:
    """Accuracy on each task of theta_0 + tau (in ``mode``'s model), keyed by task name."""
    model = build_task_model(module, mode)
    model.load_task_vector(tau or {})
    model.eval()
    batches = sum(-(-len(t.dataset) // batch_size) for t in tasks)
    with (progress or NullProgress()).task(description, total=batches) as bar:
        return {t.name: accuracy(model, t.head, t.dataset, batch_size=batch_size, progress_task=bar) for t in tasks}


def addition_summary(per_task: Mapping[str, float], single_task: Mapping[str, float]) -> dict[str, float]:
    """``absolute`` = mean accuracy; ``normalized`` = mean of per-task accuracy / single-task accuracy."""
    names = list(per_task)
    return {
        "absolute": float(np.mean([per_task[n] for n in names])),
        "normalized": float(np.mean([per_task[n] / single_task[n] if single_task[n] > 0 else 0.0 for n in names])),
    }


def negation_summary(target: str, per_task: Mapping[str, float], pretrained: Mapping[str, float]) -> dict[str, float]:
    """Target accuracy (lower is better) and mean control accuracy, with theta_0's for reference."""
    controls = [n for n in per_task if n != target]
    summary = {"target": per_task[target], "target_pretrained": pretrained[target]}
    if controls:
        control = float(np.mean([per_task[n] for n in controls]))
        control_0 = float(np.mean([pretrained[n] for n in controls]))
        summary.update(control=control, control_pretrained=control_0, control_retained=control / control_0 if control_0 else 0.0)
    return summary
