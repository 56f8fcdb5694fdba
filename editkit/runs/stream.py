"""Run a stream: for each experience fine-tune -> bank -> evaluate the merged model.

A classification task's vector is banked with its class prototypes (``editkit.core.prototypes``), computed from
its training inputs under the merged model once it is banked; a resumed run computes them for a vector banked
without them (or with an earlier format of them).

Works on any Avalanche benchmark (``run_benchmark``) and on editkit scenarios
(``run_scenario``). After experience t the bank holds tau_0..tau_t and the merged
model theta_0 + sum_i tau_i (alpha = 1.0, no tuning; in ``sequential`` mode, whose
vectors each start from the previous one, their MagMax merge; or the merge method the scenario's
``[merge]`` or ``editkit stream --merge`` names, over every banked vector) is scored on every task seen
so far. The bank is the source of truth: each step's results are stored in its
entry's metrics, so an interrupted run resumes from the last banked experience (its later
tasks draw the penalty batches an uninterrupted run would);
its provenance records the scenario file and the build options, so ``add`` /
``negate`` / ``bench`` can rebuild the scenario around the vectors later.

Linearized streams score incrementally (``editkit.eval.incremental``): theta_0's features and
each seen task's running tangent sum are cached, so after experience t only the new vector's
tangents are computed; non-linear vectors, scores that are not a function of the features, and
torchrun runs score each model from scratch. The cache stays in memory up to
``$EDITKIT_EVAL_CACHE_MB`` and spills past it into the run directory.

Each task may have its own recipe (per-task ``epochs`` turn into steps from the
size of its train split). Penalty sources are read lazily (only the sampled
unlabeled inputs are loaded). Under torchrun every process trains on its share of
each batch and evaluates a slice of each split; only rank 0 writes the bank and
the report (see ``editkit.train.runtime``) and tells the loggers, if any, each
optimizer step and each finished experience (``editkit.runs.loggers``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, MutableMapping, Sequence

from torch import nn
from torch.utils.data import Dataset

from editkit.integrations.avalanche.benchmark import Experience, experiences, task_experiences
from editkit.models.backbone import Backbone
from editkit.bank.store import Bank
from editkit.merge.continual import StreamMerge, banked_sum, default_merge, starting_vector, stream_merge
from editkit.train.runtime import Runtime, default_runtime, setup, teardown
from editkit.errors import BankError, ConfigError
from editkit.settings import default_bank_dir, default_run_dir, eval_cache_bytes, torchrun_world
from editkit.eval.accuracy import Scorer, addition_summary, evaluate_vector
from editkit.eval.features import EVAL_BATCH_SIZE, task_prototypes
from editkit.eval.incremental import IncrementalScores, cacheable
from editkit.core.modes import Mode
from editkit.util.spill import SpillingTensors
from editkit.eval.scorers import task_scorer
from editkit.util.progress import NullProgress, Progress
from editkit.runs.loggers import RunLogger, open_loggers, parse_loggers
from editkit.runs.records import MergedScores, StepRecord, StreamResult, StreamStepCallback, TrainingCost
from editkit.train.recipe import Recipe, attach_adapter
from editkit.core.adapters import trainable_names
from editkit.core.curvature import Curvature, CurvatureRegularizer, source_curvature
from editkit.core.prototypes import FORMAT as PROTOTYPE_FORMAT, Prototypes
from editkit.core.taujp import Regularizer, UnlabeledSource, unlabeled_source
from editkit.train.loop import fine_tune
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import check_base, refuse_stale, scenario_provenance, staleness
from editkit.scenario.spec import ScenarioSpec

if TYPE_CHECKING:  # annotations only
    from editkit.scenario.build import BuiltScenario

log = logging.getLogger(__name__)


class StreamRunner:
    """State of one stream run: experiences, heads, sources, bank."""

    def __init__(
        self,
        exps: Sequence[Experience],
        backbone: Backbone,
        heads: Mapping[str, nn.Module],
        recipe: Recipe,
        bank: Bank,
        *,
        scenario: str,
        generic: UnlabeledSource | None,
        progress: Progress,
        runtime: Runtime,
        eval_batch_size: int = EVAL_BATCH_SIZE,
        task_recipes: Mapping[str, Recipe] | None = None,
        unlabeled: Mapping[str, Dataset] | None = None,
        provenance: Mapping[str, Any] | None = None,
        logger: RunLogger | None = None,
        spill_dir: Path | None = None,
        merge: StreamMerge | None = None,
        keep_tangents: bool = False,
        curvatures: MutableMapping[tuple, Curvature] | None = None,
    ) -> None:
        self.exps = list(exps)
        self.merge = merge or default_merge(recipe.mode)
        self.backbone = backbone
        self.heads = heads
        self.recipe = recipe
        self.bank = bank
        self.scenario = scenario
        self.generic = generic
        self.progress = progress
        self.eval_batch_size = eval_batch_size
        self.task_recipes = dict(task_recipes or {})
        self.unlabeled = dict(unlabeled or {})
        self.runtime = runtime
        self.provenance = dict(provenance or {})
        self.logger = logger
        self.base = backbone.fingerprint()
        self._sources: dict[int, UnlabeledSource] = {}
        self._curvatures: dict[int | None, Curvature | None] = {}  # by experience; None: the generic source
        self._computed = curvatures if curvatures is not None else {}  # by what a computed one depends on
        self.incremental = self._incremental_scores(spill_dir, keep_tangents)

    def recipe_for(self, t: int) -> Recipe:
        """Experience t's recipe with its number of steps fixed (per-task epochs -> steps, over the labelled rows
        its steps take: fewer where its reg rows take places in the batch)."""
        recipe = self._task_recipe(t)
        # rows a step takes are all its steps depend on: a penalty that draws none resolves as none does
        return recipe.resolved(len(self.exps[t].train), self._penalty(t, recipe) if recipe.penalty == "inputs"
                               else None)

    def _task_recipe(self, t: int) -> Recipe:
        """Experience t's recipe as given (its own, else the stream's); :meth:`recipe_for` fixes its steps, which
        its penalty does not depend on."""
        return self.task_recipes.get(self.exps[t].name, self.recipe)

    # -- sources -------------------------------------------------------------------------------
    def source(self, index: int) -> UnlabeledSource:
        """Unlabeled view of experience ``index``'s train split (inputs only, loaded as sampled)."""
        if index not in self._sources:
            exp = self.exps[index]
            dataset = self.unlabeled.get(exp.name, exp.train)
            self._sources[index] = unlabeled_source(exp.name, dataset, seed=self.recipe.seed + 1 + index,
                                                    collate=self.backbone.batching.collate)
        return self._sources[index]

    def regularizer(self, t: int) -> Regularizer | CurvatureRegularizer | None:
        """Experience t's penalty (None where its recipe has none), warning where it has no source to draw from."""
        regularizer = self._penalty(t, self._task_recipe(t))
        if regularizer is not None and not regularizer.active:
            log.warning("task %s has no %s: its vector is not regularized", self.exps[t].name,
                        "unlabeled source" if regularizer.needs_inputs else "earlier curvature")
        return regularizer

    def _penalty(self, t: int, recipe: Recipe) -> Regularizer | CurvatureRegularizer | None:
        """The penalty ``recipe`` asks for at experience t, over the sources its scope sees there."""
        if not recipe.regularized:
            return None
        others = range(t) if recipe.scope == "seen" else [i for i in range(len(self.exps)) if i != t]
        if recipe.penalty == "kfac":
            generic = [None] if recipe.generic and self.generic is not None else []
            found = [self.curvature(i, recipe) for i in [*others, *generic]]
            return recipe.curvature_regularizer([c for c in found if c is not None])
        sources = [self.source(i) for i in others]
        if recipe.generic and self.generic is not None:
            sources.append(self.generic)
        shard = (self.runtime.rank, self.runtime.world_size) if self.runtime.distributed else None
        return recipe.regularizer(sources, shard=shard)

    def curvature(self, index: int | None, recipe: Recipe) -> Curvature | None:
        """Experience ``index``'s curvature at theta_0 (the generic source's for None): banked beside its vector
        where it is banked (its inputs are not read again), else computed on its inputs (the generic source; the
        tasks after the current one under ``scope = "all"``). None for a banked vector without one (imported):
        the penalty then lacks that task, as a warning says."""
        if index not in self._curvatures:
            name = self.exps[index].name if index is not None else None
            if name is not None and name in self.bank:
                found = self.bank.curvature(name)
                if found is None:
                    log.warning("vector %s was banked without its curvature: later tasks are not penalised on it",
                                name)
                else:
                    found.check_fits({n: p.shape for n, p in self.backbone.module.named_parameters()},
                                     f"the curvature banked with {name}")
                    if found.measure != recipe.penalty_on:
                        raise ConfigError(f"the curvature banked with {name} measures {found.measure}, this recipe's "
                                          f"penalty_on is {recipe.penalty_on}: use another --bank directory")
            else:
                found = self.compute_curvature(index, recipe)
            self._curvatures[index] = found
        return self._curvatures[index]

    def compute_curvature(self, index: int | None, recipe: Recipe) -> Curvature:
        """Experience ``index``'s (or the generic source's) curvature at theta_0 on ``recipe.curvature_examples``
        of its inputs, in their seeded order; one the stream's ``curvatures`` memo holds already (an earlier run
        over the same built scenario computed it: ``--tune``'s trials differ in lr and lambda, not in theta_0 or
        the inputs) is taken from there, the same tensors."""
        source = self.source(index) if index is not None else self.generic
        names = tuple(trainable_names(self.backbone.module))
        key = (self.base, source.name, source.seed, len(source), names, recipe.seed, recipe.curvature_examples,
               recipe.curvature_energy, recipe.penalty_on, str(self.runtime.device))
        if key in self._computed:
            self.progress.note(f"curvature of {source.name} at theta_0: computed by an earlier run, reused")
            return self._computed[key]
        with self.progress.task(f"curvature of {source.name} at theta_0", total=1) as bar:
            curvature = source_curvature(self.backbone.module, source, examples=recipe.curvature_examples,
                                         batching=self.backbone.batching, names=names, seed=recipe.seed,
                                         energy=recipe.curvature_energy, device=self.runtime.device,
                                         measure=recipe.penalty_on, head=self.measure_head(recipe))
            bar.advance(1)
        self._computed[key] = curvature
        return curvature

    def measure_head(self, recipe: Recipe) -> Any:
        """The head a curvature of ``recipe.penalty_on`` measures through: None for the features; for a language
        model's logits or distribution its one head, which every task shares (task i's and task j's curvatures
        must measure one output, or their sum is no penalty)."""
        if recipe.penalty != "kfac" or recipe.penalty_on == "features":
            return None
        heads = {id(h): h for h in self.heads.values()}
        if len(heads) != 1:
            raise ConfigError(f"recipe.penalty kfac with penalty_on = {recipe.penalty_on!r} measures through one head "
                              "every task shares (a language model's); this scenario's tasks have heads of their own")
        return next(iter(heads.values()))

    def skip_draws(self, t: int) -> None:
        """Advance the shared sources past banked experience t's reg draws, as if it had trained here."""
        regularizer = self.regularizer(t)
        if regularizer is not None:
            regularizer.skip(self.recipe_for(t).steps)

    # -- prototypes ----------------------------------------------------------------------------
    def has_classes(self, t: int) -> bool:
        """Whether experience t classifies its inputs into its classes (accuracy of a head over the features):
        the tasks whose classes prototypes stand for; a language model's or a text-to-text task's have none."""
        return self.eval_task(t).scores_features

    def prototypes(self, t: int) -> Prototypes:
        """Banked experience t's class statistics from its training inputs, under the model the stream holds once
        it is added (theta_0 plus the run's merge of the vectors banked up to t) and under theta_0. Taken there,
        not under its vector alone: the later vectors, which the tauJp penalty keeps from moving its inputs'
        features, are all the merged model adds to them."""
        exp = self.exps[t]
        names = [self.exps[i].name for i in range(t + 1)]
        merged = stream_merge(self.bank, names, self.merge)
        return task_prototypes(self.backbone.module, self.bank.get(exp.name).mode, merged, exp.train, exp.num_classes,
                               task=exp.name, seed=self._task_recipe(t).seed, batch_size=self.eval_batch_size,
                               batching=self.backbone.batching, runtime=self.runtime, progress=self.progress)

    def fill_prototypes(self, t: int) -> None:
        """Bank the class statistics of banked experience t where it has none (just trained, or banked before
        they existed) or has them in an earlier format: computed from the banked vectors, nothing is trained
        again."""
        name = self.exps[t].name
        entry = self.bank.get(name)
        if self.runtime.is_main and entry.prototypes.get("format") != PROTOTYPE_FORMAT and self.has_classes(t):
            self.bank.set_prototypes(name, self.prototypes(t))
        self.runtime.barrier()

    # -- evaluation ----------------------------------------------------------------------------
    def eval_task(self, i: int) -> Scorer:
        exp = self.exps[i]
        return task_scorer(exp.name, self.heads[exp.name], exp.test, self.backbone.batching)

    def evaluate(self, tau, indices: Sequence[int], description: str) -> dict[str, float]:
        """Scores of theta_0 + tau in the run's mode; theta_0 itself (``tau`` None) by a plain forward, which
        is f_lin(x; theta_0) too, without a jvp of a zero tangent."""
        mode = self.recipe.mode if tau is not None else "nonlinear"
        return evaluate_vector(self.backbone.module, mode, tau, [self.eval_task(i) for i in indices],
                               batch_size=self.eval_batch_size, progress=self.progress, description=description,
                               runtime=self.runtime)

    def _incremental_scores(self, spill_dir: Path | None, keep_tangents: bool) -> IncrementalScores | None:
        """The cache of a linearized stream's features and tangent sums, or None where scores are computed
        from scratch (see ``editkit.eval.incremental.cacheable``)."""
        try:  # read in every mode, before any training, so a bad value is refused even where it does not apply
            budget = eval_cache_bytes()
        except ValueError as error:
            raise ConfigError(str(error)) from None
        scorers = [self.eval_task(i) for i in range(len(self.exps))]
        if not (self.merge.is_sum and cacheable(scorers, Mode(self.recipe.mode).linearized, self.runtime)):
            return None  # another merge than the sum: its tangents are not the sum of the cached ones
        names = [e.name for e in self.exps]
        return IncrementalScores(
            self.backbone.module, scorers.__getitem__,
            lambda count: stream_merge(self.bank, names[:count], self.merge) if count else None,
            store=SpillingTensors(budget, spill_dir), batch_size=self.eval_batch_size,
            runtime=self.runtime, progress=self.progress, keep_tangents=keep_tangents)

    def vector_scores(self, t: int, tau, beside=None) -> tuple[float, float]:
        """(experience t's fine-tuned model, theta_0) scored on task t. The fine-tuned model is theta_0 + its
        vector, or, fine-tuned beside the earlier vectors' sum (``from_sum``), theta_0 + that sum + its vector:
        where its fine-tuning ended, what the merged model's share of the task is measured against."""
        name = self.exps[t].name
        if self.incremental is not None:
            single, pretrained = self.incremental.add_vector(t, tau)
            return (self.incremental.merged(t)[name] if beside is not None else single), pretrained
        trained = tau if beside is None else {n: beside[n] + v if n in beside else v for n, v in tau.items()}
        single = self.evaluate(trained, [t], f"{name}: single-task")[name]
        return single, self.evaluate(None, [t], f"{name}: pretrained")[name]

    # -- one step ------------------------------------------------------------------------------
    def train(self, t: int) -> StepRecord:
        """Fine-tune experience t, score its vector alone, bank it (rank 0)."""
        exp = self.exps[t]
        head = self.heads[exp.name]
        recipe = self.recipe_for(t)
        with self.progress.task(f"[{t + 1}/{len(self.exps)}] {exp.name} ({recipe.mode})", total=recipe.steps) as bar:
            def on_train_step(step: int, values: dict[str, float]) -> None:
                bar.advance(1, **values)
                if self.logger is not None:
                    self.logger.train_step(exp.name, step, values)

            beside = banked_sum(self.bank, [e.name for e in self.exps[:t]]) if recipe.from_sum else None
            result = fine_tune(self.backbone.module, head, exp.train, recipe, self.regularizer(t),
                               on_step=on_train_step, runtime=self.runtime, batching=self.backbone.batching,
                               start=starting_vector(self.bank, recipe.mode, self.exps[t - 1].name if t else None),
                               beside=beside)
        single, pretrained = self.vector_scores(t, result.task_vector, beside)
        record = StepRecord(step=t, task=exp.name, pretrained=pretrained, single_task=single,
                            cost=TrainingCost.of(result, recipe.steps, len(exp.train), self.runtime))
        if self.runtime.is_main:
            # the data-free penalty banks the task's curvature beside its vector: later tasks read it, not its inputs
            curvature = self.curvature(t, recipe) if recipe.penalty == "kfac" and recipe.regularized else None
            self.bank.append(exp.name, result.task_vector, task=exp.name, mode=recipe.mode, base=self.base,
                             scenario=self.scenario, step=t, recipe=recipe.to_dict(), metrics=record.metrics(),
                             provenance=self.provenance, curvature=curvature)
        self.runtime.barrier()
        # its class statistics next, under the merged model that now holds it: a head over every class seen,
        # which needs no earlier task's data
        self.fill_prototypes(t)
        return record

    def merge_and_evaluate(self, t: int) -> MergedScores:
        """Score theta_0 + the banked tau_0..tau_t merged by the run's merge (the mode's own: their sum, MagMax
        for ``sequential``; or the one the scenario or ``--merge`` names) on tasks 0..t; store the numbers, the
        method and the seconds the merge took in the bank."""
        names = [self.exps[i].name for i in range(t + 1)]
        single = {n: self.bank.get(n).metrics["single_task"] for n in names}
        seconds = None
        if t == 0 and self.merge == default_merge(self.recipe.mode):  # tau_0 alone: the single-task model, scored
            per_task = dict(single)
        elif self.incremental is not None:
            per_task = self.incremental.merged(t)
        else:
            start = time.perf_counter()
            tau = stream_merge(self.bank, names, self.merge)
            seconds = time.perf_counter() - start
            per_task = self.evaluate(tau, range(t + 1), f"merged 0..{t} ({self.merge.method})")
        merged = MergedScores(per_task=per_task, **addition_summary(per_task, single), method=self.merge.method,
                              merge_seconds=seconds)
        self.runtime.barrier()  # every process has read the bank before rank 0 rewrites the manifest
        if self.runtime.is_main:
            self.bank.update_metrics(self.exps[t].name, {"merged": merged})
        self.runtime.barrier()
        return merged

    def resumable(self, t: int) -> StepRecord | None:
        """The banked record of experience t if this run already banked it with the same recipe."""
        name = self.exps[t].name
        if name not in self.bank:
            return None
        entry = self.bank.get(name)
        refuse_stale(self.bank, entry, staleness(entry, self.recipe_for(t), scenario=self.scenario),
                     "use another --bank directory or remove it")
        return StepRecord.from_dict(entry.metrics)

    def run(self, *, resume: bool, on_step: StreamStepCallback | None = None) -> StreamResult:
        self._check_processes()
        for t in range(len(self.exps)):  # before any work: a curvature of logits needs the one head they share
            self.measure_head(self._task_recipe(t))
        held = (self.bank.writer(f"editkit stream --scenario {self.scenario} --mode {self.recipe.mode}")
                if self.runtime.is_main else contextlib.nullcontext())  # the main process is the bank's writer
        with held:
            self._check_bank(resume)
            self.runtime.barrier()  # nobody writes before everyone has checked
            out = StreamResult(self.scenario, self.recipe)
            start = time.perf_counter()
            try:
                self._run_experiences(out, resume, on_step)
            finally:
                if self.incremental is not None:
                    out.tangents = self.incremental.vector_tangents()
                    self.incremental.close()
            out.seconds = time.perf_counter() - start
        return out

    def _run_experiences(self, out: StreamResult, resume: bool, on_step: StreamStepCallback | None) -> None:
        own_merge = default_merge(self.recipe.mode).method  # what banks written before [merge] existed used
        for t in range(len(self.exps)):
            banked = self.resumable(t) if resume else None
            if banked is not None:
                self.skip_draws(t)
                self.fill_prototypes(t)
            record = banked if banked is not None else self.train(t)
            scored_by = None if record.merged is None else record.merged.get("method", own_merge)
            if scored_by != self.merge.method:  # not scored yet, or by another merge than this run's
                record.merged = self.merge_and_evaluate(t)
            record.resumed = banked is not None
            out.steps.append(record)
            if self.logger is not None:
                self.logger.experience(record)
            if on_step is not None:
                on_step(record)

    def _check_processes(self) -> None:
        if not self.runtime.distributed:
            return
        bases = self.runtime.all_gather_object(self.base)
        if len(set(bases)) != 1:
            raise ConfigError(f"the {self.runtime.world_size} processes built different base models "
                              f"({', '.join(b[:19] for b in bases)}); load the same weights on every rank")

    def _check_bank(self, resume: bool) -> None:
        if len(self.bank) and not resume:
            raise BankError(
                f"bank {self.bank.root} already holds {', '.join(self.bank.names())}; pass --resume to continue "
                "that run, or choose another --bank directory"
            )
        check_base(self.bank, self.backbone, self.base)


def run_stream(
    exps: Sequence[Experience],
    backbone: Backbone,
    heads: Mapping[str, nn.Module],
    recipe: Recipe,
    bank: Bank | str | Path,
    *,
    scenario: str,
    generic: UnlabeledSource | None = None,
    resume: bool = False,
    progress: Progress | None = None,
    on_step: StreamStepCallback | None = None,
    task_recipes: Mapping[str, Recipe] | None = None,
    unlabeled: Mapping[str, Dataset] | None = None,
    runtime: Runtime | None = None,
    provenance: Mapping[str, Any] | None = None,
    logger: RunLogger | None = None,
    spill_dir: str | Path | None = None,
    merge: StreamMerge | None = None,
    keep_tangents: bool = False,
    curvatures: MutableMapping[tuple, Curvature] | None = None,
) -> StreamResult:
    """Fine-tune, bank and evaluate each experience in order (see module docstring).

    provenance: recorded with every banked vector (:func:`run_scenario` records the
        scenario file and the build options, so ``add`` / ``negate`` can rebuild the tasks later).
    task_recipes: per-experience recipes by name (default: ``recipe`` for all).
    unlabeled: inputs-only datasets by experience name for the penalty sources
        (default: the experiences' train splits, read lazily, element 0 of each item).
    runtime: device / precision / process group (default: one process on the backbone's device).
        Under data parallelism ``progress``, ``on_step`` and ``logger`` are used on rank 0 only.
    logger: told every optimizer step and every finished experience (``editkit.runs.loggers``;
        :func:`~editkit.runs.loggers.open_loggers` builds one from names).
    spill_dir: where a linearized stream's evaluation cache spills past ``$EDITKIT_EVAL_CACHE_MB``
        (default: a temporary directory, made only if it spills); removed when the run ends.
    merge: how the banked vectors are merged before each experience's merged model is scored (default:
        the mode's own, :func:`~editkit.merge.continual.default_merge`).
    keep_tangents: keep the tangents a linearized stream's scoring computed of each vector it trained on the
        test inputs (:attr:`StreamResult.tangents`), for a caller that scores the vectors again.
    curvatures: a memo of the curvatures at theta_0 that ``--penalty kfac`` computes, shared by runs over the same
        backbone, experiences and generic source (keyed by theta_0's fingerprint, the source's name, seed and
        size, and the recipe fields a curvature depends on): each is computed once, as ``--tune``'s trials do.
    """
    names = [e.name for e in exps]
    if len(set(names)) != len(names):
        raise ConfigError(f"experience names must be unique, got {names}")
    missing = [n for n in names if n not in heads]
    if missing:
        raise ConfigError(f"no head for task(s) {missing}")
    bank = bank if isinstance(bank, Bank) else Bank(bank)
    attach_adapter(backbone.module, [recipe, *(task_recipes or {}).values()])
    runtime = runtime or default_runtime(backbone.module)
    if not runtime.is_main:
        progress, on_step, logger = None, None, None
    runner = StreamRunner(exps, backbone, heads, recipe, bank, scenario=scenario, generic=generic,
                          progress=progress or NullProgress(), runtime=runtime, task_recipes=task_recipes,
                          unlabeled=unlabeled, provenance=provenance, logger=logger,
                          spill_dir=Path(spill_dir) if spill_dir is not None else None, merge=merge,
                          keep_tangents=keep_tangents, curvatures=curvatures)
    return runner.run(resume=resume, on_step=on_step)


def probe_heads(backbone: Backbone, exps: Sequence[Experience], *, shots: int = 5, seed: int = 0) -> dict[str, nn.Module]:
    """Few-shot linear-probe heads for experiences of any Avalanche benchmark."""
    from editkit.models.heads import probe_head
    from editkit.data.tasks import TaskData

    return {e.name: probe_head(backbone, TaskData(e.name, [str(c) for c in range(e.num_classes)], e.train, e.val, e.test),
                               shots=shots, seed=seed) for e in exps}


def run_benchmark(
    benchmark,
    backbone: Backbone,
    recipe: Recipe,
    bank: Bank | str | Path,
    *,
    names: Sequence[str] | None = None,
    heads: Mapping[str, nn.Module] | None = None,
    scenario: str = "custom",
    generic: UnlabeledSource | None = None,
    resume: bool = False,
    progress: Progress | None = None,
    on_step: StreamStepCallback | None = None,
    logger: RunLogger | None = None,
) -> StreamResult:
    """Run any Avalanche benchmark (train_stream / test_stream with task labels)."""
    exps = experiences(benchmark, names)
    heads = heads if heads is not None else probe_heads(backbone, exps, seed=recipe.seed)
    return run_stream(exps, backbone, heads, recipe, bank, scenario=scenario, generic=generic, resume=resume,
                      progress=progress, on_step=on_step, logger=logger)


def run_scenario(
    scenario: str | Path | ScenarioSpec,
    *,
    bank: str | Path | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    progress: Progress | None = None,
    on_step: StreamStepCallback | None = None,
    build: BuildOptions | None = None,
    runtime: Runtime | None = None,
    loggers: str | Sequence[str] = (),
    log_dir: str | Path | None = None,
    built: BuiltScenario | None = None,
    merge: StreamMerge | None = None,
    keep_tangents: bool = False,
    curvatures: MutableMapping[tuple, Curvature] | None = None,
    **overrides: Any,
) -> tuple[StreamResult, dict[str, Any] | None]:
    """Run a scenario (a name, a file, or a parsed spec) end to end and write ``report.json`` + ``stream.png`` into
    the run directory.

    ``overrides`` replace recipe fields (``mode="linear"``, ``steps=20``, ``epochs=2``,
    ``scope="all"``...) for every task, above the scenario's per-task values; ``None`` keeps.
    ``build`` lays backbone / data options (``model``, ``pretrained``, ``data_root``...) over
    the scenario file's.

    Before anything is built the scenario's registered checks run: missing weights
    or data raise :class:`MissingResourceError` with one line per missing piece, and
    neither the bank nor the run directory is created.

    loggers: by name (``"tensorboard,csv"``, see ``editkit.runs.loggers``), refused by name
    before anything is built when unknown; they write into ``log_dir`` (default: the run
    directory) as the run goes, on the main process only, and are closed when it ends.

    runtime: where to run (default: :func:`process_runtime`'s, held for this run). Returns
    the result and the report dictionary (the report is None on ranks other than 0).

    merge: how the stream merges its vectors before scoring them (default: the scenario's ``[merge]``, else
    the mode's own); recorded in the report.

    built: the scenario already built from the same file, seed and ``build`` options, reused
    instead of building it again: ``editkit bench`` runs one stream per mode over it, so every
    text's frozen-prefix states are computed once. Its generic source restarts from its seed.

    keep_tangents: see :func:`run_stream` (the bench scores the vectors again over the same test splits).

    curvatures: see :func:`run_stream`; meant with ``built`` (runs over one built scenario).
    """
    from editkit.runs.report import plot_stream, stream_report, write_json
    from editkit.scenario.spec import load_scenario, task_recipes
    from editkit.scenario.build import build_scenario, require_scenario

    loggers = parse_loggers(loggers)
    spec = load_scenario(scenario)
    recipe = spec.recipe.with_overrides(**overrides)
    if overrides.get("lr") is not None and recipe.adapter != "none" and recipe.lora_lr is not None:
        log.warning("lr %g is not used: adapter runs train at lora_lr (%g here); give that instead", recipe.lr,
                    recipe.lora_lr)
    recipes = task_recipes(spec, **overrides)
    merge = merge or spec.merge or default_merge(recipe.mode)
    bank_dir = Path(bank) if bank is not None else default_bank_dir(spec.name, recipe.label)
    out_dir = Path(run_dir) if run_dir is not None else default_run_dir(spec.name, recipe.label)
    build = build or BuildOptions()
    require_scenario(spec, build)
    with contextlib.ExitStack() as held:
        if runtime is None:
            runtime = held.enter_context(process_runtime(scenario=spec))
        if not runtime.is_main:
            progress, on_step = None, None
        if built is None:
            built = build_scenario(spec, seed=recipe.seed, progress=progress, build=build, device=str(runtime.device),
                                   precision=runtime.precision)
        elif built.generic is not None:
            built.generic.restart()
        runtime.place(built.backbone.module)
        exps = task_experiences(built.tasks)
        provenance = {**scenario_provenance(spec, build), "precision": runtime.precision}
        logger = held.enter_context(open_loggers(loggers if runtime.is_main else (),
                                                 Path(log_dir) if log_dir is not None else out_dir, spec.task_names))
        result = run_stream(exps, built.backbone, built.heads, recipe, bank_dir, scenario=spec.name,
                            generic=built.generic, resume=resume, progress=progress, on_step=on_step,
                            task_recipes=recipes, unlabeled={t.name: t.train for t in built.tasks}, runtime=runtime,
                            provenance=provenance, logger=logger, spill_dir=out_dir, merge=merge,
                            keep_tangents=keep_tangents, curvatures=curvatures)
        report = None
        if runtime.is_main:
            plot = plot_stream(result, out_dir / "stream.png")
            accuracies = spec.heads.get("kind") != "lm"  # a language model's scores are perplexities
            report = stream_report(result, backbone=built.backbone.name, bank=bank_dir,
                                   extra={"plots": [str(plot)], "runtime": runtime.describe(),
                                          "merge": merge.to_dict(),
                                          **({"continual": result.continual} if accuracies else {})})
            write_json(out_dir / "report.json", report)
            if logger is not None:
                logger.report(report)
        runtime.barrier()
        return result, report


@contextlib.contextmanager
def process_runtime(device: str | None = None, precision: str | None = None,
                    workers: int | None = None, channels_last: bool = False,
                    scenario: ScenarioSpec | None = None) -> Iterator[Runtime]:
    """This process's :class:`Runtime` (``editkit.train.runtime.setup``), held for a block; ``auto`` precision is
    ``scenario``'s own when it names one.

    Under torchrun it joins the process group, unless one is joined already, and leaves
    it at the end. Avalanche refuses to be imported by a non-main process of an
    initialized process group (it creates loggers at import time), so it is imported
    before joining.
    """
    joins = not _group_initialized() and torchrun_world()[1] > 1
    if joins:
        from editkit.integrations.avalanche.benchmark import import_avalanche

        import_avalanche()
    runtime = setup(device, precision, workers, channels_last,
                    preferred_precision=scenario.precision if scenario is not None else None)
    try:
        yield runtime
    finally:
        if joins:
            teardown()


def _group_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
