"""tauJp inside a stock Avalanche strategy: ``plugins=[TauJpPlugin(bank="banks/mine")]``.

The strategy's model must be a :class:`~editkit.integrations.avalanche.multitask.MultiHeadTaskModel`
(theta_0's backbone and fixed per-task heads). For each training experience the plugin:

1. resets theta to theta_0 (in ``sequential`` mode to the previous experience's banked weights,
   :func:`editkit.merge.continual.starting_vector`; with ``from_sum`` to theta_0 plus the earlier
   experiences' banked vectors, :func:`editkit.merge.continual.banked_sum`) and the task model to the
   recipe's mode (``taujp``, ``linear``, ``nonlinear``, ``taujp-nonlinear`` or ``sequential``), and gives
   the strategy a fresh AdamW on theta with the recipe's schedule (:func:`editkit.train.loop.optimizer_for`) and
   gradient clipping: optimizer state never carries over from one experience to the next;
2. replaces the strategy's dataloader, for this experience, by editkit's own batches
   (:func:`editkit.train.loop.labelled_batches`: the recipe's seed, batch size and number of
   steps, in one "epoch"), so the strategy takes exactly the optimizer steps
   ``editkit stream`` takes and a vector banked here equals one banked there;
3. at each training forward hands the model the step's reg batches, drawn from unlabeled
   inputs of the earlier experiences (and the generic source), and the model runs the loop's
   own step (:meth:`editkit.train.loop.StepComputer.features`: in the linearized modes the task
   batch and the reg batches go through one jvp; in ``taujp-nonlinear`` the task batch takes the
   plain forward and the reg batches a jvp); the plugin adds lambda * penalty to the strategy's
   loss before the backward pass;
4. after the experience appends tau = theta - theta_0 to the bank (main process only) with
   its scenario, step and recipe, then the experience's class prototypes under the merged model of the vectors
   banked so far (what a head shared by every class seen reads, :mod:`editkit.core.prototypes`: as
   ``editkit stream`` banks them), and keeps up to
   ``mem_size`` of the experience's inputs,
   never its labels, as a penalty source for the experiences after it. With the data-free
   penalty (``penalty="kfac"``) it keeps no input: it banks the experience's curvature at
   theta_0 beside its vector, and later experiences are penalised by the banked curvatures.

Settings: a :class:`~editkit.train.recipe.Recipe` (``recipe=``) with any of its fields given
as keywords on top (``lam=0.1, schedule="cyclic", mode="linear"``...); the recipe, not the
strategy, decides steps, batch size, lr, weight decay, warmup, clipping and seed (the
strategy's optimizer and ``train_epochs`` are set aside during each experience and restored
after it; its ``train_mb_size`` is not used for training). Merged-model metrics
(:class:`~editkit.integrations.avalanche.metrics.MergedAccuracy`) are added to the
strategy's evaluator, so every Avalanche logger reports them.

Not supported, refused at construction: ``scope="all"`` (a plugin sees each experience
when it is trained, never the later ones) and ``accumulation > 1`` (Avalanche takes one
optimizer step per batch).
"""

from __future__ import annotations

import logging
import time
from itertools import islice
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Dataset

from editkit.bank.store import Bank
from editkit.core.batching import Batching
from editkit.core.adapters import trainable_names
from editkit.core.curvature import Curvature, CurvatureRegularizer, source_curvature
from editkit.core.taujp import Regularizer, UnlabeledSource, input_accessor, unlabeled_source
from editkit.core.prototypes import Prototypes
from editkit.errors import ConfigError
from editkit.eval.features import EVAL_BATCH_SIZE, task_prototypes
from editkit.merge.continual import banked_sum, starting_vector, stream_merge
from editkit.train.loop import StepComputer, clip_gradients, labelled_batches, optimizer_for, reg_batch_stream
from editkit.train.recipe import Recipe, attach_adapter
from editkit.train.runtime import Runtime
from editkit.util.progress import NullProgress
from editkit._compat import quiet_avalanche_import
from editkit.integrations.avalanche.metrics import MergedAccuracy
from editkit.integrations.avalanche.multitask import MultiHeadTaskModel

with quiet_avalanche_import():
    from avalanche.core import SupervisedPlugin
    from avalanche.distributed import DistributedHelper

log = logging.getLogger(__name__)


class UnlabeledBuffer:
    """Inputs of past experiences, at most ``mem_size`` each (None: all), never their labels.

    Inputs are read through :func:`editkit.core.taujp.input_accessor` (element 0 of an item
    is taken and the rest dropped at once) and stored as one batch per experience. Each
    experience becomes an :class:`~editkit.core.taujp.UnlabeledSource` seeded
    ``seed + 1 + index``, as ``editkit stream`` seeds the source of experience ``index``;
    with ``mem_size=None`` it therefore draws the very batches ``editkit stream`` draws.
    """

    def __init__(self, batching: Batching, *, mem_size: int | None = None, seed: int = 0) -> None:
        if mem_size is not None and mem_size < 1:
            raise ConfigError(f"mem_size must be >= 1 (or None to keep every input), got {mem_size}")
        self.batching = batching
        self.mem_size = mem_size
        self.seed = seed
        self.sources: list[UnlabeledSource] = []

    def add(self, name: str, dataset: Dataset, index: int) -> UnlabeledSource:
        """Keep the inputs of experience ``index`` (a seeded sample of ``mem_size`` of them)."""
        chosen = range(len(dataset))
        if self.mem_size is not None and self.mem_size < len(dataset):
            generator = torch.Generator().manual_seed(self.seed + 1 + index)
            chosen = torch.randperm(len(dataset), generator=generator)[: self.mem_size].tolist()
        get = input_accessor(dataset)
        source = UnlabeledSource(name, self.batching.collate([get(i) for i in chosen]), seed=self.seed + 1 + index)
        self.sources.append(source)
        return source


class StepBatches:
    """One experience's training batches for an Avalanche strategy: ``steps`` of editkit's
    seeded batches, each with its task labels appended (what Avalanche's forward passes on)."""

    def __init__(self, batches: Iterator[tuple[Any, torch.Tensor]], steps: int, task_label: int) -> None:
        self.batches = batches
        self.steps = steps
        self.task_label = task_label

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor, torch.Tensor]]:
        for x, y in islice(self.batches, self.steps):
            yield x, y, torch.full((len(y),), self.task_label, dtype=torch.long)


class TauJpPlugin(SupervisedPlugin):
    """Fine-tuning in the recipe's mode (default: linearized, with the tauJp penalty), one banked task vector
    per experience.

    recipe: the base recipe (default: :class:`~editkit.train.recipe.Recipe`'s defaults);
        ``recipe_fields`` replace single fields (``lam``, ``schedule``, ``scope``,
        ``reg_batch``, ``mode``, ``steps``, ``lr``...; unknown names are refused).
    bank: where the vectors go (a directory or a :class:`~editkit.bank.store.Bank`).
    names: vector names by experience index (default ``task<i>``).
    scenario: recorded with every vector, with ``provenance``.
    generic: an always-available unlabeled source (an :class:`UnlabeledSource`, or a
        dataset whose items' element 0 is read), used when ``recipe.generic`` is on.
    mem_size: inputs kept per past experience for the penalty (None: all).
    merged_metrics: add :class:`MergedAccuracy` to the strategy's evaluator.
    """

    def __init__(
        self,
        recipe: Recipe | None = None,
        *,
        bank: Bank | str | Path,
        names: Sequence[str] | None = None,
        scenario: str = "avalanche",
        generic: UnlabeledSource | Dataset | None = None,
        mem_size: int | None = None,
        merged_metrics: bool = True,
        provenance: Mapping[str, Any] | None = None,
        **recipe_fields: Any,
    ) -> None:
        super().__init__()
        self.recipe = (recipe or Recipe()).with_overrides(**recipe_fields)
        if self.recipe.scope != "seen":
            raise ConfigError("TauJpPlugin supports scope 'seen' only: a strategy shows it each experience when it "
                              "is trained, never the later ones")
        if self.recipe.accumulation != 1:
            raise ConfigError("TauJpPlugin needs accumulation = 1: Avalanche takes one optimizer step per batch")
        if self.recipe.penalty == "kfac" and self.recipe.penalty_on != "features":
            raise ConfigError(f"TauJpPlugin: penalty kfac measures a classifier's features; penalty_on = "
                              f"{self.recipe.penalty_on!r} is a language model's (editkit stream)")
        self.bank = bank if isinstance(bank, Bank) else Bank(bank)
        self.names = list(names) if names is not None else None
        self.scenario = scenario
        self.generic = generic
        self.mem_size = mem_size
        self.merged_metrics = merged_metrics
        self.provenance = dict(provenance or {})
        self.buffer: UnlabeledBuffer | None = None
        self._generic_source: UnlabeledSource | None = None
        self._generic_curvature: Curvature | None = None
        # one experience's training state, set in before_training_exp
        self._recipe: Recipe | None = None
        self._reg_stream: Iterator[list[Any]] | None = None
        self._schedule: torch.optim.lr_scheduler.LambdaLR | None = None
        self._saved: dict[str, Any] = {}
        self._train_seconds = 0.0
        self._started = 0.0

    def name_of(self, index: int) -> str:
        return self.names[index] if self.names is not None else f"task{index}"

    # -- per training call ---------------------------------------------------------------------
    def before_training(self, strategy, **kwargs) -> None:
        model = self._model(strategy)
        model.set_mode(self.recipe.mode)
        if attach_adapter(model.backbone.module, [self.recipe]) is not None and model.base != model.backbone.fingerprint():
            model.rebuild()  # the adapter is now part of theta_0, and theta is its factors
        if self.buffer is None:
            self.buffer = UnlabeledBuffer(model.backbone.batching, mem_size=self.mem_size, seed=self.recipe.seed)
        if self.merged_metrics and not any(isinstance(m, MergedAccuracy) for m in strategy.evaluator.metrics):
            strategy.evaluator.metrics.append(MergedAccuracy(self.bank))

    # -- per experience ------------------------------------------------------------------------
    def before_training_exp(self, strategy, **kwargs) -> None:
        model = self._model(strategy)
        exp = strategy.experience
        dataset = strategy.adapted_dataset
        index = exp.current_experience  # theta = theta_0, or the previous experience's weights in sequential mode
        regularizer = self._regularizer(index, self.recipe, model, strategy.device)
        recipe = self.recipe.resolved(len(dataset), regularizer)
        start = starting_vector(self.bank, recipe.mode, self.name_of(index - 1) if index else None)
        beside = banked_sum(self.bank, [self.name_of(i) for i in range(index)]) if recipe.from_sum else None
        model.task_model.load_task_vector(start or {}, beside=beside)
        head = model.head(exp.task_label)
        model.step = StepComputer(model.task_model, head, regularizer, model.backbone.batching)
        if model.step.regularizer is not None:  # encode ahead what the reg draws will read, as a stream's run does
            model.step.regularizer.prepare(recipe.steps)
        self._reg_stream = reg_batch_stream(model.step.regularizer, recipe.steps)
        optimizer, self._schedule = optimizer_for(list(model.task_model.theta), recipe)
        self._saved = {"optimizer": strategy.optimizer, "train_epochs": strategy.train_epochs}
        strategy.optimizer, strategy.train_epochs = optimizer, 1
        batches = labelled_batches(dataset, recipe.labelled_rows(model.step.regularizer), recipe.seed,
                                   runtime=Runtime(device=strategy.device), batching=model.backbone.batching)
        strategy.dataloader = StepBatches(batches, recipe.steps, exp.task_label)
        self._recipe = recipe
        self._train_seconds = 0.0

    def before_training_epoch(self, strategy, **kwargs) -> None:
        """The experience's one epoch starts: timed like ``fine_tune``, batch loading included."""
        self._started = time.perf_counter()

    def before_forward(self, strategy, **kwargs) -> None:
        """A training forward only (evaluation has its own callbacks): the step's reg batches."""
        self._model(strategy).reg_batches = [b.to(strategy.device) for b in next(self._reg_stream)]

    def before_backward(self, strategy, **kwargs) -> None:
        model = self._model(strategy)
        if model.penalty is not None:
            strategy.loss = strategy.loss + model.penalty
            model.penalty = None

    def before_update(self, strategy, **kwargs) -> None:
        params = [p for p in self._model(strategy).task_model.theta if p.grad is not None]
        clip_gradients(params, self._recipe.grad_clip)

    def after_update(self, strategy, **kwargs) -> None:
        self._schedule.step()

    def after_training_epoch(self, strategy, **kwargs) -> None:
        self._train_seconds = time.perf_counter() - self._started

    def after_training_exp(self, strategy, **kwargs) -> None:
        model = self._model(strategy)
        exp, recipe = strategy.experience, self._recipe
        index, name = exp.current_experience, self.name_of(exp.current_experience)
        self._reg_stream.close()
        model.step = None
        strategy.optimizer, strategy.train_epochs = self._saved["optimizer"], self._saved["train_epochs"]
        tau = {n: v.cpu() for n, v in model.task_model.task_vector().items()}
        if DistributedHelper.is_main_process:
            metrics = {"step": index, "task": name, "train_seconds": self._train_seconds,
                       "seconds_per_step": self._train_seconds / recipe.steps, "train_steps": recipe.steps,
                       "train_size": len(strategy.adapted_dataset)}
            curvature = None
            if recipe.penalty == "kfac" and recipe.regularized:  # the source editkit stream draws it from
                source = unlabeled_source(name, strategy.adapted_dataset, seed=recipe.seed + 1 + index,
                                          collate=self.buffer.batching.collate)
                curvature = self._curvature(model, source, recipe, strategy.device)
            self.bank.append(name, tau, task=name, mode=recipe.mode, base=model.base, scenario=self.scenario,
                             step=index, recipe=recipe.to_dict(), metrics=metrics, provenance=self.provenance,
                             curvature=curvature)
            self.bank.set_prototypes(name, self._prototypes(model, exp, strategy))
        if recipe.penalty == "inputs":
            self.buffer.add(name, strategy.adapted_dataset, index)

    # -- helpers -------------------------------------------------------------------------------
    def _regularizer(self, index: int, recipe: Recipe, model: MultiHeadTaskModel,
                     device: Any) -> Regularizer | CurvatureRegularizer | None:
        """The penalty of experience ``index``: the earlier experiences' buffers, then the generic source; or, with
        the data-free penalty, their banked curvatures and the generic source's."""
        if not recipe.regularized:
            return None
        if recipe.penalty == "kfac":
            found = [self.bank.curvature(self.name_of(i)) for i in range(index)]
            if recipe.generic and self.generic is not None:
                if self._generic_curvature is None:
                    self._generic_curvature = self._curvature(model, self._generic(recipe), recipe, device)
                found.append(self._generic_curvature)
            return recipe.curvature_regularizer([c for c in found if c is not None])
        sources = list(self.buffer.sources)
        if recipe.generic and self.generic is not None:
            sources.append(self._generic(recipe))
        if not sources:
            log.warning("experience %d has no unlabeled source: its vector is not regularized", index)
        return recipe.regularizer(sources)

    @staticmethod
    def _curvature(model: MultiHeadTaskModel, source: UnlabeledSource, recipe: Recipe, device: Any) -> Curvature:
        """A source's curvature at theta_0, as ``editkit stream`` computes it."""
        module = model.backbone.module
        return source_curvature(module, source, examples=recipe.curvature_examples, batching=model.backbone.batching,
                                names=trainable_names(module), seed=recipe.seed, energy=recipe.curvature_energy,
                                device=device)

    def _prototypes(self, model: MultiHeadTaskModel, exp, strategy) -> Prototypes:
        """The banked experience's class statistics under the merged model of every vector banked so far and
        under theta_0, from its training inputs as ``editkit stream`` computes them (the same cap per class,
        drawn with the recipe's seed); its classes are its head's rows."""
        index = exp.current_experience
        merged = stream_merge(self.bank, [self.name_of(i) for i in range(index + 1)])
        return task_prototypes(model.backbone.module, self._recipe.mode, merged, strategy.adapted_dataset,
                               model.head(exp.task_label).weight.shape[0], task=self.name_of(index),
                               seed=self._recipe.seed, batch_size=EVAL_BATCH_SIZE, batching=model.backbone.batching,
                               runtime=Runtime(device=strategy.device), progress=NullProgress())

    def _generic(self, recipe: Recipe) -> UnlabeledSource:
        if self._generic_source is None:
            generic = self.generic
            self._generic_source = generic if isinstance(generic, UnlabeledSource) else unlabeled_source(
                "generic", generic, seed=recipe.seed, collate=self.buffer.batching.collate)
        return self._generic_source

    @staticmethod
    def _model(strategy) -> MultiHeadTaskModel:
        if not isinstance(strategy.model, MultiHeadTaskModel):
            raise ConfigError("TauJpPlugin trains a MultiHeadTaskModel (editkit.integrations.avalanche.multitask); "
                              f"the strategy's model is a {type(strategy.model).__name__}")
        return strategy.model


class StepBudget(SupervisedPlugin):
    """The recipe's training of each experience inside any Avalanche strategy
    (:mod:`editkit.integrations.avalanche.strategies`): a fresh AdamW with the recipe's lr, weight decay and
    warmup + cosine schedule, its gradient clipping, and exactly ``steps[i]`` optimizer steps in the i-th call
    to ``train`` (training stops at the budget, whatever the epochs). Times the steps; ``bar``, when set,
    advances with them."""

    def __init__(self, recipe: Recipe, *, steps: Sequence[int]) -> None:
        super().__init__()
        self.recipe = recipe
        self.steps = list(steps)
        self.seconds = 0.0
        self.bar = None
        self._call, self._count, self._budget, self._started = 0, 0, 0, 0.0
        self._schedule: torch.optim.lr_scheduler.LambdaLR | None = None

    def before_training_exp(self, strategy, **kwargs) -> None:
        self._budget = self.steps[self._call]
        recipe = self.recipe.with_overrides(steps=self._budget, epochs=None)
        strategy.optimizer, self._schedule = optimizer_for(strategy.model.theta, recipe)
        self._count = 0
        self._started = time.perf_counter()

    def before_update(self, strategy, **kwargs) -> None:
        clip_gradients([p for p in strategy.model.theta if p.grad is not None], self.recipe.grad_clip)

    def after_update(self, strategy, **kwargs) -> None:
        self._schedule.step()
        self._count += 1
        if self.bar is not None:
            self.bar.advance(1)
        if self._count >= self._budget:
            strategy.stop_training()

    def after_training_exp(self, strategy, **kwargs) -> None:
        self.seconds += time.perf_counter() - self._started
        self._call += 1
