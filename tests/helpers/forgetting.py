"""A stream that sequential training forgets, under either protocol, small enough for a test to run every strategy.

Three tasks of two classes over 8 inputs. Inputs 0-2 say the task (input ``t`` raised by 3 in task ``t``), so
one classifier over all six classes can tell them apart (the class protocol has something to learn); inputs 3-7
carry the class, along a direction shared by every task plus one of the task's own. The fixed heads read the
first two of the backbone's four features along directions 120 degrees apart, so under the task protocol each
task asks the shared features for something the others contradict: training the next task moves them away from
the last one's, and rehearsal, distillation or a penalty has something to hold.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from editkit.core.batching import TensorBatching
from editkit.data.tasks import tensor_task
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.train.recipe import Recipe

from helpers.models import mlp

D_IN, FEATURES, HIDDEN = 8, 4, 16
TASKS = 3


def _head(t: int) -> LinearHead:
    """Task ``t``'s head: its two classes on either side of the direction ``2 pi t / 3`` of features 0-1."""
    direction = torch.zeros(FEATURES)
    direction[0], direction[1] = math.cos(2 * math.pi * t / TASKS), math.sin(2 * math.pi * t / TASKS)
    return LinearHead(torch.stack([-direction, direction]), torch.zeros(2))


def forgetful_stream(train: int = 80, test: int = 60) -> SimpleNamespace:
    """A built scenario's three parts (tasks, heads by task name, an MLP backbone), seeded (see the module
    docstring)."""
    generator = torch.Generator().manual_seed(0)
    directions = [torch.nn.functional.normalize(torch.randn(D_IN - TASKS, generator=generator), dim=0)
                  for _ in range(TASKS)]
    tasks = []
    for t in range(TASKS):
        def split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.randint(0, 2, (n,), generator=generator)
            x = torch.randn(n, D_IN, generator=generator)
            x[:, t] += 3.0
            x[:, TASKS:] += (2 * y[:, None] - 1).float() * (directions[0] + directions[t])
            return x, y
        (xtr, ytr), (xte, yte) = split(train), split(test)
        tasks.append(tensor_task(f"t{t}", ["0", "1"], xtr, ytr, xte, yte))
    heads = {task.name: _head(t) for t, task in enumerate(tasks)}
    backbone = Backbone("mlp", mlp(D_IN, HIDDEN, FEATURES, seed=1), FEATURES, batching=TensorBatching())
    return SimpleNamespace(tasks=tasks, heads=heads, backbone=backbone)


def forgetful_recipes(steps: int = 30) -> list[Recipe]:
    """Each task's recipe: ``steps`` plain fine-tuning steps of 16 examples at lr 0.05, seeded."""
    return [Recipe(mode="nonlinear", steps=steps, batch_size=16, lr=0.05, warmup=0, seed=3)] * TASKS
