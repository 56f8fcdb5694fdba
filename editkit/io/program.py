"""The edited model as a program: ``model.pt2``, which ``torch.export.load`` runs without editkit.

The program is the model that was scored, heads included: its inputs are the backbone's (pixels, or token ids and
mask: :meth:`~editkit.models.backbone.Backbone.program_inputs`), any batch size (and length), and its output is a
dict of every task's logits. For linearized vectors (``linear``, ``taujp``) it computes
f_lin(x) = f(x; theta_0) + J f(x; theta_0) . delta: theta_0 and the combined delta are its tensors and the
Jacobian-vector product is written out as plain operations (:mod:`editkit.core.tangents`), so it costs about as much
as editkit's own linearized forward. For the other modes it is f(x; theta_0 + delta).

Which values stand for theta, theta_0 and delta comes from the task model the scorer itself builds
(:func:`~editkit.core.linearize.build_task_model`), so the program is the scored model by construction, and
:func:`verify` runs it on test examples of every task against editkit's own logits (:func:`expected_logits`, computed
once, which ``model.onnx`` is checked against too) before the export is kept.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils.data import Dataset

from editkit.core.linearize import build_task_model
from editkit.core.modes import Mode
from editkit.core.tangents import LinearizedGraph, core_graph, with_aliases
from editkit.errors import ExportError
from editkit.io.layout import quiet_export
from editkit.merge.arithmetic import TaskVector
from editkit.models.backbone import Backbone, names_in
from editkit.models.inputs import ProgramInputs

log = logging.getLogger(__name__)

#: Examples per task the program is checked on before an export is kept.
VERIFY_EXAMPLES = 32
#: Largest difference from editkit's own logits, relative to their largest magnitude, that an export may show:
#: float rounding of the same operations in another order (measured: ~1e-7); a wrong program is far above it.
VERIFY_TOLERANCE = 1e-4


class TaskHeads(nn.Module):
    """Every task's fixed head over the features: ``{task: logits}``, a program's output."""

    def __init__(self, heads: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.tasks = list(heads)
        self.heads = nn.ModuleList(heads.values())

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        features = features.float()
        return {task: head(features) for task, head in zip(self.tasks, self.heads)}


class EditedModel(nn.Module):
    """The program's module: the edited model's features, then every task's head."""

    def __init__(self, features: nn.Module, heads: TaskHeads) -> None:
        super().__init__()
        self.features = features
        self.heads = heads

    def forward(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.heads(self.features(*inputs))


def _task_model(backbone: Backbone, vector: TaskVector):
    """The task model the scorer builds for ``vector`` (its theta = origin + tau)."""
    model = build_task_model(backbone.module, vector.mode, names=list(vector.tensors), vector_mode=vector.mode)
    model.load_task_vector(vector.tensors)
    return model.eval()


def edited_features(backbone: Backbone, vector: TaskVector) -> tuple[nn.Module, ProgramInputs]:
    """The edited model's features from the program's inputs: a :class:`~editkit.core.tangents.LinearizedGraph` of
    the backbone's whole input module for a linearized vector, else a copy of that module at theta_0 + delta."""
    inputs = backbone.program_inputs()
    model = _task_model(backbone, vector)
    names = names_in(inputs.module, backbone.module)
    theta = {names[n]: p.detach() for n, p in zip(model.names, model.theta)}
    if Mode(vector.mode).linearized:
        theta0 = model.theta0
        delta = {names[n]: p.detach() - theta0[n] for n, p in zip(model.names, model.theta)}
        graph = core_graph(inputs.module, inputs.example, inputs.dynamic)
        return LinearizedGraph(graph, with_aliases(inputs.module, delta)), inputs
    features = copy.deepcopy(inputs.module)
    with torch.no_grad():
        for name, value in with_aliases(features, theta).items():
            features.get_parameter(name).copy_(value)
    return features, inputs


def trace(backbone: Backbone, vector: TaskVector, heads: Mapping[str, nn.Module]
          ) -> tuple[torch.export.ExportedProgram, ProgramInputs]:
    """The program of theta_0 edited by ``vector`` with ``heads`` (see the module docstring)."""
    try:
        with torch.no_grad(), quiet_export():
            features, inputs = edited_features(backbone, vector)
            model = EditedModel(features, TaskHeads(heads))
            return torch.export.export(model, inputs.example, dynamic_shapes=(inputs.dynamic,)), inputs
    except ExportError:  # an op without a tangent rule, a family without program inputs: already one line
        raise
    except Exception as exc:  # torch.export's own errors: which model, in editkit's words; torch's text in the log
        log.info("torch.export failed on %s: %s", backbone.name, exc)
        raise ExportError(f"torch.export could not trace the edited {backbone.name} ({type(exc).__name__}): the "
                          "family's forward is not capturable as a program; nothing was written") from exc


@dataclass(frozen=True)
class Expected:
    """editkit's own scoring of the edited model on the first test examples of each task: the examples as a program
    takes them, and the logits the scorer gives them. Computed once; every written form of the model (the program,
    ``model.onnx``) is checked against it."""

    inputs: dict[str, tuple[torch.Tensor, ...]]
    logits: dict[str, torch.Tensor]


def expected_logits(backbone: Backbone, vector: TaskVector, heads: Mapping[str, nn.Module],
                    tests: Mapping[str, Dataset], examples: int = VERIFY_EXAMPLES) -> Expected:
    """The :class:`Expected` logits of theta_0 edited by ``vector`` on the first ``examples`` of each test split."""
    model = _task_model(backbone, vector)
    inputs, logits = {}, {}
    with torch.no_grad():
        for task, dataset in tests.items():
            indices = list(range(min(examples, len(dataset))))
            batch = backbone.batching.collate([dataset[i][0] for i in indices])
            logits[task] = heads[task](backbone.batching.run(model, batch).float())
            inputs[task] = tuple(backbone.program_batch(dataset, indices))
    return Expected(inputs, logits)


def logit_difference(program: Any, expected: Expected) -> dict[str, Any]:
    """Run ``program`` (any callable of the program's inputs returning ``{task: logits}``) on the expected examples:
    its largest difference from editkit's logits, their largest magnitude, and whether it is within
    :data:`VERIFY_TOLERANCE` of it."""
    worst, scale, count = 0.0, 0.0, 0
    with torch.no_grad():
        for task, want in expected.logits.items():
            got = program(*expected.inputs[task])[task]
            worst = max(worst, float((got - want).abs().max()))
            scale = max(scale, float(want.abs().max()))
            count += len(want)
    return {"examples": count, "max_abs_logit_difference": worst, "largest_abs_logit": scale,
            "within_tolerance": worst <= VERIFY_TOLERANCE * max(scale, 1.0),
            "against": "editkit's own scoring of the same model (first test examples of each task)"}


def verify(program: Any, backbone: Backbone, expected: Expected) -> dict[str, Any]:
    """Refuse (:class:`~editkit.errors.ExportError`) a (loaded) ``program`` whose logits differ from editkit's own by
    more than :data:`VERIFY_TOLERANCE` of their magnitude. Returns what was measured."""
    measured = logit_difference(program, expected)
    if not measured["within_tolerance"]:
        raise ExportError(f"the program of the edited {backbone.name} does not reproduce editkit's scoring: its "
                          f"logits differ by up to {measured['max_abs_logit_difference']:.3g} (largest logit "
                          f"{measured['largest_abs_logit']:.3g}) on {measured['examples']} test examples; nothing was "
                          "written")
    return measured
