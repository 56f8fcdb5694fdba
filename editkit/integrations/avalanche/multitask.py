"""An Avalanche multi-task model: one backbone fine-tuned around theta_0, one fixed head per task label.

Avalanche strategies call a :class:`~avalanche.models.MultiTaskModule` with each batch's
task labels. Its default ``forward`` writes each task's logits into a zero tensor as wide
as the widest head: a padded column then holds logit 0, and against heads whose logits
are all negative (few-shot probes often are) that 0 wins the argmax, so a correct
prediction is scored as a class the task does not have. :class:`MultiHeadTaskModel`
returns each task's logits as its head gives them: a batch of one task (every batch of a
task-incremental stream) gets exactly its head's columns, and rows of a mixed batch are
padded with ``-inf``, a column that can neither win the argmax nor take probability.

Heads are frozen ``nn.Module`` s mapping the backbone's features ``(N, D)`` to logits
``(N, C_t)``, keyed by task label (or listed in task-label order). Bring your own:

- a probe: :func:`editkit.models.heads.fit_probe` (features and labels -> a frozen
  logistic-regression head) or :func:`editkit.models.heads.probe_head` (few-shot, on an
  editkit task), as the offline-vision scenario does;
- zero-shot: :class:`editkit.models.heads.ZeroShotHead` from class-name embeddings
  (:mod:`editkit.models.clip` builds them for CLIP backbones);
- any linear layer you trained yourself, passed frozen.

The backbone is theta_0, in the task model of a mode (:func:`editkit.core.linearize.build_task_model`):
linearized for ``linear`` / ``taujp``, plain for ``nonlinear`` / ``taujp-nonlinear``; its BatchNorm statistics stay
theta_0's whatever ``train()`` Avalanche calls. :class:`~editkit.integrations.avalanche.plugin.TauJpPlugin`
chooses the mode and drives training through :attr:`MultiHeadTaskModel.step`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch import nn

from editkit.core.linearize import build_task_model
from editkit.core.modes import Mode
from editkit.models.backbone import Backbone
from editkit.train.loop import StepComputer
from editkit._compat import quiet_avalanche_import

with quiet_avalanche_import():
    from avalanche.models import MultiTaskModule


class _LastFeatures:
    """The backbone's features of the last batch, given again while the batch, theta and grad mode are the ones
    they were computed with.

    LwF runs the strategy's forward of a batch, then asks for every head's logits on that same batch
    (Avalanche's ``_lwf_penalty``: "we need to call forward again"): the second pass of the backbone would
    compute the same features. Reusing them puts both losses on one graph, so the gradient is the same sum
    (in another order of floating-point additions). theta's version counters change with every optimizer step
    and every in-place write, so features of older weights are never given. A deep copy (LwF keeps one of the
    model) starts empty: a tensor inside a graph cannot be copied.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._features: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "_LastFeatures":
        return _LastFeatures()

    def get(self, x: Any, theta: Sequence[torch.Tensor], compute) -> torch.Tensor:
        """The features of ``x``: remembered if ``x`` is the last batch's object and nothing moved, else ``compute(x)``."""
        key = (torch.is_grad_enabled(), tuple(p._version for p in theta))
        if self._key is not None and self._key[0] is x and self._key[1:] == key:
            return self._features
        self._key, self._features = None, None  # the old graph goes before the new one is built
        features = compute(x)
        self._key, self._features = (x, *key), features
        return features


class MultiHeadTaskModel(MultiTaskModule):
    """theta_0's backbone as a task model with fixed per-task heads, returning unpadded logits.

    backbone: the editkit backbone (its module is theta_0 and is frozen in place; its
        batching says how inputs are batched and called).
    heads: frozen heads by task label (a sequence: heads in task-label order).
    mode: the task model's mode until a plugin sets another (:meth:`set_mode`).
    """

    def __init__(self, backbone: Backbone, heads: Mapping[int, nn.Module] | Sequence[nn.Module],
                 mode: str = Mode.LINEAR) -> None:
        super().__init__()
        self.backbone = backbone
        items = heads.items() if isinstance(heads, Mapping) else enumerate(heads)
        self.heads = nn.ModuleDict({str(int(label)): head.eval().requires_grad_(False) for label, head in items})
        self.base = backbone.fingerprint()
        self.task_model = build_task_model(backbone.module, mode)
        self.mode = Mode(mode)
        #: Set by the plugin for one experience: training forwards then run its step (the task batch
        #: and the reg batches: one jvp in the linearized modes; in ``taujp-nonlinear`` the plain
        #: forward and a jvp of the reg batches), and :attr:`penalty` holds the step's lambda * penalty.
        self.step: StepComputer | None = None
        self.reg_batches: list[Any] = []
        self.penalty: torch.Tensor | None = None
        #: Entered around every forward: a runtime's ``autocast`` (bf16) makes the strategy's forwards run in
        #: the precision editkit's own training runs in.
        self.forward_context: Callable[[], ContextManager] = contextlib.nullcontext
        self._last = _LastFeatures()

    @property
    def theta(self) -> list[nn.Parameter]:
        """What a strategy trains: the task model's copy of the backbone's weights (the heads are fixed)."""
        return list(self.task_model.theta)

    def set_mode(self, mode: str) -> None:
        """Train and evaluate in ``mode``; the task model is rebuilt around theta_0 only when the mode
        changes between linearized and plain (``taujp`` and ``linear`` share one linearized model)."""
        rebuild = Mode(mode).linearized != self.mode.linearized
        self.mode = Mode(mode)
        if rebuild:
            self.rebuild()

    def rebuild(self) -> None:
        """Build the task model around theta_0 again, as it is now (a LoRA adapter attached to the backbone
        changes which parameters theta covers, and the base fingerprint)."""
        device = self.task_model.theta[0].device
        self.base = self.backbone.fingerprint()
        self.task_model = build_task_model(self.backbone.module, self.mode).to(device)

    def adaptation(self, experience) -> None:
        """The heads are fixed, so nothing grows; only the task labels trained on are recorded
        (Avalanche's version also reads the experience's classes, which not every benchmark has)."""
        if self.training:
            self.known_train_tasks_labels |= set(experience.task_labels)

    def head(self, task_label: int) -> nn.Module:
        key = str(int(task_label))
        if key not in self.heads:
            raise KeyError(f"no head for task label {task_label} (heads: {', '.join(self.heads)})")
        return self.heads[key]

    def forward(self, x: Any, task_labels: torch.Tensor | int | None) -> torch.Tensor | dict[int, torch.Tensor]:
        """Each example's logits under its task's head, unpadded (see the module docstring); with no task labels,
        Avalanche's contract: every task trained so far, ``{task label: logits}`` (LwF distils through it).

        Logits come back fp32 whatever the :attr:`forward_context`: the strategy's loss is computed outside the
        forward, where autocast no longer runs it in fp32 as it does editkit's own loss."""
        with self.forward_context():
            out = self._forward(x, task_labels)
        return {t: logits.float() for t, logits in out.items()} if isinstance(out, dict) else out.float()

    def _forward(self, x: Any, task_labels: torch.Tensor | int | None) -> torch.Tensor | dict[int, torch.Tensor]:
        if task_labels is None:
            return self.forward_all_tasks(x)
        labels = torch.as_tensor(task_labels).reshape(-1).unique().tolist()
        if len(labels) == 1:
            return self.forward_single_task(x, labels[0])
        # x may be a batch of texts (a SequenceBatch: rows by mask, no .device); labels come on the inputs' device
        task_labels = torch.as_tensor(task_labels)
        if self.training and self.step is not None:  # a plugin's step: one head per step, as it checks
            outputs = {t: self.forward_single_task(x[task_labels == t], t) for t in labels}
        else:  # Replay's and A-GEM's batches of every task: one pass of the backbone, each head on its rows
            features = self._features(x)
            outputs = {t: self.head(t)(features[task_labels == t]) for t in labels}
        width = max(o.shape[1] for o in outputs.values())
        some = next(iter(outputs.values()))
        out = torch.full((len(x), width), float("-inf"), device=some.device, dtype=some.dtype)
        for t, logits in outputs.items():
            out[task_labels == t, : logits.shape[1]] = logits
        return out

    def forward_all_tasks(self, x: Any) -> dict[int, torch.Tensor]:
        """``{task label: logits}`` for every task trained so far, from one pass of the backbone: the heads share
        its features (Avalanche's version runs the whole model once per task); LwF's second ask of a step's batch reuses
        the strategy's forward of it."""
        if self.training and self.step is not None:  # a plugin's step: one head per step, as it checks
            return super().forward_all_tasks(x)
        features = self._features(x)
        return {t: self.head(t)(features) for t in sorted(self.known_train_tasks_labels)}

    def _features(self, x: Any) -> torch.Tensor:
        """The task model's features of a batch, fp32 (no-op in fp32; leaves bf16 autocast); a batch asked for again
        before theta moves is not run again (:class:`_LastFeatures`)."""
        return self._last.get(x, self.task_model.theta,
                              lambda batch: self.backbone.batching.run(self.task_model, batch).float())

    def forward_single_task(self, x: Any, task_label: int) -> torch.Tensor:
        head = self.head(task_label)
        if self.training and self.step is not None:
            if self.step.head is not head:
                raise ValueError(f"a batch of task {task_label} reached the step of another task")
            features, penalty = self.step.features(x, self.reg_batches)
            if penalty is not None:  # a second training forward of the step must not drop the penalty
                self.penalty = penalty
            self.reg_batches = []
            return head(features.float())  # no-op in fp32; leaves bf16 autocast
        return head(self._features(x))
