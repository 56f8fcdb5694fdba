"""A four-task stream of a tiny float64 MLP with BatchNorm and fixed linear heads: a whole run in a second.

Tests of the stream's own logic (incremental scores, resume) run it; the tasks are shifted Gaussian blobs.
"""

from __future__ import annotations

import torch
from torch import nn

from editkit.data.tasks import TensorTaskDataset
from editkit.integrations.avalanche.benchmark import Experience
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.runs.stream import run_stream
from editkit.train.recipe import Recipe

from helpers import models

NAMES = ("a", "b", "c", "d")


def network() -> nn.Module:
    return models.mlp(4, 12, 6, batchnorm=True, seed=0).double()


def data() -> tuple[dict[str, TensorTaskDataset], dict[str, LinearHead]]:
    g = torch.Generator().manual_seed(1)
    sets, heads = {}, {}
    for i, name in enumerate(NAMES):
        x = torch.randn(50, 4, generator=g, dtype=torch.float64) + 0.3 * i
        sets[name] = TensorTaskDataset(x, (x[:, i % 4] > 0.3 * i).long() + (x[:, (i + 1) % 4] > 0).long())
        heads[name] = LinearHead(torch.randn(3, 6, generator=g), torch.zeros(3))
    return sets, heads


def experiences(names=NAMES) -> list[Experience]:
    sets, _ = data()
    return [Experience(i, n, i, sets[n], sets[n], None, 3) for i, n in enumerate(names)]


def stream(bank, mode="taujp", names=NAMES, recipe_fields=None, **kwargs):
    fields = dict(mode=mode, steps=3, batch_size=10, lr=5e-2, warmup=0, generic=False, reg_batch=4)
    recipe = Recipe(**{**fields, **(recipe_fields or {})})
    return run_stream(experiences(names), Backbone("mlp", network(), 6), data()[1], recipe, bank, scenario="tiny",
                      **kwargs)
