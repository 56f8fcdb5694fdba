"""The merged model theta_0 + sum of the banked task vectors (alpha = 1) as an Avalanche metric.

Avalanche's own accuracy scores the strategy's current model, theta_0 + tau of the last
experience. What task arithmetic promises is the *merged* model: after experience t,
theta_0 + tau_0 + ... + tau_t on every task seen so far. :class:`MergedAccuracy` scores it
whenever the strategy evaluates a stream after training (``strategy.eval(test_stream)``),
with the scorers ``editkit stream`` uses (:func:`editkit.eval.accuracy.evaluate_vector`), and
emits Avalanche ``MetricValue`` s, so every logger (text, interactive, TensorBoard, W&B)
shows them:

- ``MergedAcc_Exp/eval_phase/<stream>/Task<t>/Exp<e>``: merged accuracy on an experience
  whose vector is banked; ``MergedNormAcc_Exp/...``: the same over that vector's single-task
  accuracy (its vector alone), as the bank records it;
- ``MergedAcc_Stream/eval_phase/<stream>`` and ``MergedNormAcc_Stream/...``: their means over
  the evaluated experiences (:func:`editkit.eval.accuracy.addition_summary`).

The single-task and pretrained accuracies of a vector are scored the first time its
experience is evaluated and written into its bank entry; the merged numbers of a stream
that covers every banked vector go into the last vector's entry, as ``editkit stream``
stores them. Evaluations that run during training (Avalanche's periodic evaluation) are
left alone: the merged model is scored in its own task model, never in the strategy's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from editkit.bank.store import Bank, VectorEntry
from editkit.eval.accuracy import AdditionSummary, addition_summary, evaluate_vector
from editkit.eval.scorers import task_scorer
from editkit.merge.continual import banked_sum, stream_merge
from editkit.train.runtime import Runtime
from editkit._compat import quiet_avalanche_import

with quiet_avalanche_import():
    from avalanche.distributed import DistributedHelper
    from avalanche.evaluation import PluginMetric
    from avalanche.evaluation.metric_results import MetricValue
    from avalanche.evaluation.metric_utils import get_metric_name


class MergedAccuracy(PluginMetric[AdditionSummary]):
    """Accuracy of theta_0 + sum of every banked vector on each evaluated experience, absolute
    and normalized, per experience and over the stream (see the module docstring).

    The strategy's model must be a :class:`~editkit.integrations.avalanche.multitask.MultiHeadTaskModel`
    (its backbone is theta_0, its heads score each task); a vector belongs to the experience
    whose index its bank entry records as ``step``.
    """

    def __init__(self, bank: Bank | str | Path) -> None:
        super().__init__()
        self.bank = bank if isinstance(bank, Bank) else Bank(bank)
        self.per_task: dict[str, float] = {}
        self.single_task: dict[str, float] = {}
        self._entries: dict[int, VectorEntry] = {}
        self._merged: tuple[tuple[str, ...], dict[str, torch.Tensor]] | None = None
        self._last: AdditionSummary | None = None
        self._training = False

    def reset(self) -> None:
        self.per_task, self.single_task = {}, {}

    def result(self) -> AdditionSummary | None:
        """The last evaluated stream's absolute and normalized merged accuracy."""
        return self._last

    def before_training(self, strategy) -> None:
        self._training = True

    def after_training(self, strategy) -> None:
        self._training = False

    def before_eval(self, strategy) -> None:
        """Only evaluations outside ``strategy.train`` are scored (the strategy's own flag reads
        "evaluating" inside periodic evaluation too)."""
        self.reset()
        active = not self._training and self.bank.exists() and len(self.bank) > 0
        self._entries = {e.step: e for e in self.bank.entries()} if active else {}

    def after_eval_exp(self, strategy) -> list[MetricValue] | None:
        exp = strategy.experience
        entry = self._entries.get(exp.current_experience)
        if entry is None:
            return None
        model = strategy.model
        scorer = task_scorer(entry.name, model.head(exp.task_label), strategy.adapted_dataset, model.backbone.batching)

        def score(tau: dict[str, torch.Tensor] | None) -> float:
            return evaluate_vector(model.backbone.module, entry.mode, tau, [scorer], batch_size=strategy.eval_mb_size,
                                   runtime=Runtime(device=strategy.device))[entry.name]

        single = self._single_task(entry, score)
        merged = single if len(self._entries) == 1 else score(self._merged_vector())  # one vector: it is the merge
        self.per_task[entry.name], self.single_task[entry.name] = merged, single
        x = strategy.clock.train_iterations
        return [MetricValue(self, get_metric_name("MergedAcc_Exp", strategy, add_experience=True), merged, x),
                MetricValue(self, get_metric_name("MergedNormAcc_Exp", strategy, add_experience=True),
                            merged / single if single > 0 else 0.0, x)]

    def after_eval(self, strategy) -> list[MetricValue] | None:
        if not self.per_task:
            return None
        self._last = addition_summary(self.per_task, self.single_task)
        banked = sorted(self._entries.values(), key=lambda e: e.step)
        if set(self.per_task) == {e.name for e in banked} and DistributedHelper.is_main_process:
            self.bank.update_metrics(banked[-1].name, {"merged": {"per_task": dict(self.per_task), **self._last}})
        x = strategy.clock.train_iterations
        return [MetricValue(self, get_metric_name("MergedAcc_Stream", strategy, add_task=False),
                            self._last["absolute"], x),
                MetricValue(self, get_metric_name("MergedNormAcc_Stream", strategy, add_task=False),
                            self._last["normalized"], x)]

    def _merged_vector(self) -> dict[str, torch.Tensor]:
        """Every banked vector merged as a stream merges them (their sum at alpha = 1; MagMax for ``sequential``
        vectors), once per bank state."""
        key = tuple(f"{e.name}:{e.checksum}" for e in self._entries.values())
        if self._merged is None or self._merged[0] != key:
            self._merged = key, stream_merge(self.bank, [e.name for e in self._entries.values()])
        return self._merged[1]

    def _single_task(self, entry: VectorEntry, score: Callable[[dict[str, torch.Tensor] | None], float]) -> float:
        """The accuracy of the model the vector's fine-tuning ended at (the vector alone, or fine-tuned beside the
        earlier ones, ``from_sum``, their sum with it), from its bank entry; scored (with theta_0's) and recorded if
        missing."""
        if "single_task" in entry.metrics:
            return entry.metrics["single_task"]
        ended = ([e.name for e in sorted(self._entries.values(), key=lambda e: e.step) if e.step <= entry.step]
                 if entry.recipe.get("from_sum") else [entry.name])
        scores = {"single_task": score(banked_sum(self.bank, ended)), "pretrained": score(None)}
        if DistributedHelper.is_main_process:
            self._entries[entry.step] = self.bank.update_metrics(entry.name, scores)
        return scores["single_task"]

    def __str__(self) -> str:
        return "MergedAcc"
