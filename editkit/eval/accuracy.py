"""Accuracy of an edited model, per task, and the paper's summary metrics.

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

from dataclasses import dataclass
from typing import Mapping, Sequence, TypedDict

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from editkit.train.runtime import Runtime, default_runtime
from editkit.core.linearize import build_task_model
from editkit.util.progress import NullProgress, Progress


@dataclass
class EvalTask:
    """What is needed to score one task: its fixed head and a labelled split."""

    name: str
    head: nn.Module
    dataset: Dataset


@torch.no_grad()
def accuracy(model: nn.Module, head: nn.Module, dataset: Dataset, *, batch_size: int = 256, progress_task=None,
             runtime: Runtime | None = None) -> float:
    runtime = runtime or Runtime()
    if runtime.distributed:
        dataset = Subset(dataset, range(runtime.rank, len(dataset), runtime.world_size))
    device, cuda = runtime.device, runtime.device.type == "cuda"
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=runtime.workers, pin_memory=cuda)
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for batch in loader:
        x, y = batch[0].to(device, non_blocking=cuda), batch[1].to(device, non_blocking=cuda)
        with runtime.autocast():
            features = model(x)
        counts[0] += (head(features.float()).argmax(dim=1) == y).sum()
        counts[1] += len(y)
        if progress_task is not None:
            progress_task.advance(1)
    correct, total = runtime.all_reduce_sum(counts).tolist()
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
    runtime: Runtime | None = None,
) -> dict[str, float]:
    """Accuracy on each task of theta_0 + tau (in ``mode``'s model), keyed by task name."""
    runtime = runtime or default_runtime(module)
    model = build_task_model(module, mode).to(runtime.device)
    model.load_task_vector(tau or {})
    model.eval()
    share = runtime.world_size
    batches = sum(-(-(-(-len(t.dataset) // share)) // batch_size) for t in tasks)
    with (progress or NullProgress()).task(description, total=batches) as bar:
        return {t.name: accuracy(model, t.head.to(runtime.device), t.dataset, batch_size=batch_size, progress_task=bar,
                                 runtime=runtime) for t in tasks}


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
