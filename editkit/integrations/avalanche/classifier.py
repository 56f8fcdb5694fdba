"""The class-incremental model of Avalanche's strategies: theta_0's plain backbone under Avalanche's own
``IncrementalClassifier``, one head over every class seen so far, no task id.

This is the field's class-incremental learner, as Avalanche's SplitMNIST class-incremental examples build it: a
feature extractor and ``avalanche.models.IncrementalClassifier(in_features)`` with Avalanche's defaults
(``initial_out_features=2``, ``masking=True``, ``mask_value=-1000``). Before each experience Avalanche's model
adaptation grows the classifier's linear layer to ``max(label seen) + 1`` outputs, copying the old rows (the new
ones take ``nn.Linear``'s fresh initialisation), and marks the experience's classes active. With masking, an
output whose class no training experience has shown yet (an ``initial_out_features`` unit beyond the first
task's classes) is set to -1000, so it can neither win the argmax nor take probability; once every unit's class
has been trained on, which global labels make so after each experience, nothing is masked. The strategy trains
the backbone's copy of theta and the classifier together, under the scenario's fixed heads' recipe.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from editkit._compat import quiet_avalanche_import
from editkit.core.linearize import build_task_model
from editkit.core.modes import Mode
from editkit.models.backbone import Backbone

with quiet_avalanche_import():
    from avalanche.models import IncrementalClassifier


class ClassIncrementalModel(nn.Module):
    """theta_0's backbone as a plain (``nonlinear``) task model, its features through Avalanche's
    ``IncrementalClassifier`` (see the module docstring).

    backbone: the editkit backbone (its module is theta_0, frozen in place; its batching says how inputs are
        batched and called); the strategy trains a copy of its weights, ``features.theta``.
    """

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone
        self.features = build_task_model(backbone.module, Mode.NONLINEAR)
        self.classifier = IncrementalClassifier(backbone.feature_dim)
        #: Entered around every forward: a runtime's ``autocast`` (bf16) makes the strategy's forwards run in
        #: the precision editkit's own training runs in.
        self.forward_context: Callable[[], ContextManager] = contextlib.nullcontext

    @property
    def theta(self) -> list[nn.Parameter]:
        """What the strategy trains (what :class:`~editkit.integrations.avalanche.plugin.StepBudget`'s optimizer
        and clipping take): the backbone's weights and the classifier's, as the classifier is now (it is replaced
        when it grows, so this is read again for each experience)."""
        return [*self.features.theta, *self.classifier.parameters()]

    def forward(self, x: Any) -> torch.Tensor:
        """Logits over every class seen so far (fp32 whatever the :attr:`forward_context`: the strategy's loss is
        computed outside the forward, where autocast no longer runs it in fp32 as it does editkit's own loss)."""
        with self.forward_context():
            return self.classifier(self.backbone.batching.run(self.features, x)).float()
