"""Fine-tune one task: non-linear, linearized, or linearized + tauJp.

One loop serves all three modes. In ``taujp`` mode the unlabeled reg batches are
concatenated to the labelled batch so one jvp call yields both the task's logits
and the penalty's tangents: with BatchNorm frozen the examples do not interact,
and one call of 32 + 4 examples is much cheaper than two calls of 32 and 4.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler

from .linearize import LinearizedModel, build_task_model
from .recipe import Recipe
from .taujp import Regularizer

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict[str, float]], None]


@dataclass
class FineTuneResult:
    """The task vector and what it cost."""

    task_vector: dict[str, torch.Tensor]
    seconds: float
    steps: int
    history: list[dict[str, float]] = field(default_factory=list)

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(1, self.steps)


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1, then cosine decay to 0 (as the official code)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def labelled_batches(dataset: Dataset, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless seeded shuffled batches of (inputs, labels); extra item fields (task labels) are dropped."""
    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(dataset, generator=generator)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=len(dataset) >= batch_size)
    while True:
        for batch in loader:
            yield batch[0], batch[1]


class StepComputer:
    """Forward pass and loss of one micro-batch for a given mode."""

    def __init__(self, model: nn.Module, head: nn.Module, regularizer: Regularizer | None) -> None:
        self.model = model
        self.head = head
        self.regularizer = regularizer if regularizer is not None and regularizer.active else None

    def loss(
        self, x: torch.Tensor, y: torch.Tensor, reg_batches: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """(cross-entropy, lambda * penalty or None, scalar stats) for one micro-batch."""
        if reg_batches and self.regularizer is not None and isinstance(self.model, LinearizedModel):
            primal, tangent = self.model.primal_and_tangent(torch.cat([x, *reg_batches]))
            n = len(x)
            features = primal[:n] + tangent[:n]
            reg_tangents = torch.split(tangent[n:], [len(b) for b in reg_batches])
            reg = self.regularizer.loss(reg_tangents)
        else:
            features = self.model(x)
            reg = None
        ce = F.cross_entropy(self.head(features), y)
        stats = {"ce": ce.item(), "penalty": reg.item() / self.regularizer.lam if reg is not None else 0.0}
        return ce, reg, stats


def fine_tune(
    module: nn.Module,
    head: nn.Module,
    train: Dataset,
    recipe: Recipe,
    regularizer: Regularizer | None = None,
    *,
    on_step: StepCallback | None = None,
) -> FineTuneResult:
    """Fine-tune ``module`` (theta_0, left untouched) on ``train`` with ``head`` fixed.

    Returns tau = theta_ft - theta_0 over the module's parameters. The regularizer is
    used only in ``taujp`` mode. The module's values never change, but it is switched
    to eval mode with gradients off (it is theta_0, shared by every task model).
    """
    torch.manual_seed(recipe.seed)
    model = build_task_model(module, recipe.mode)
    head.eval().requires_grad_(False)
    computer = StepComputer(model, head, regularizer if recipe.mode == "taujp" else None)
    params = list(model.theta)
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(recipe.warmup_steps, recipe.steps))
    batches = labelled_batches(train, recipe.batch_size, recipe.seed)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    for step in range(recipe.steps):
        optimizer.zero_grad(set_to_none=True)
        reg_batches = computer.regularizer.batches(step) if computer.regularizer else []
        totals = {"ce": 0.0, "penalty": 0.0}
        for micro in range(recipe.accumulation):
            x, y = next(batches)
            ce, reg, stats = computer.loss(x, y, reg_batches if micro == 0 else [])
            # CE is averaged over micro-batches; the penalty is computed once per step at full weight.
            (ce / recipe.accumulation + (reg if reg is not None else 0.0)).backward()
            totals["ce"] += stats["ce"] / recipe.accumulation
            totals["penalty"] += stats["penalty"]
        grad_norm = nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], recipe.grad_clip)
        lr = schedule.get_last_lr()[0]
        optimizer.step()
        schedule.step()
        record = {**totals, "grad_norm": float(grad_norm), "lr": lr}
        history.append(record)
        if on_step is not None:
            on_step(step, record)
    seconds = time.perf_counter() - start
    log.info("fine-tuned %d steps in %.1fs (%s)", recipe.steps, seconds, recipe.mode)
    return FineTuneResult(model.task_vector(), seconds, recipe.steps, history)
