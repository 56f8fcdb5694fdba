"""Avalanche's own continual-learning strategies on a scenario's stream, for the bench to put beside tauJp.

Each strategy is Avalanche's class with its own plugins (``avalanche.training.Naive``, ``EWC``, ``LwF``,
``SynapticIntelligence``, ``Replay``, ``AGEM``, ``JointTraining``): nothing here re-implements one. What editkit
fixes is everything the modes fix, so a row differs from a mode's by the strategy alone:

- per experience, the recipe's optimizer (AdamW, lr, weight decay, warmup + cosine, gradient clipping), fresh
  for each experience as a mode's is, the recipe's batch size and exactly its number of steps
  (:class:`StepBudget`); Avalanche's own data loaders draw the batches (Replay's mix in its buffer);
- the runtime: the device, the precision (``--precision bf16``: every forward of the strategy's model under
  bf16 autocast, as a mode's step runs) and the weights' layout (``--channels-last``);
- the backbone: theta_0's, in plain (``nonlinear``) form; theta_0 is shared and never changed, each strategy
  trains its own copy of theta.

A run follows one of the two protocols of :data:`~editkit.eval.continual.PROTOCOLS`:

- ``task`` (task-incremental): the scenario's fixed heads, one per task label
  (:class:`~editkit.integrations.avalanche.multitask.MultiHeadTaskModel`), each experience's task label its
  index; scored after each experience on every seen task's test split under the task's own head;
- ``class`` (class-incremental, as the field and Avalanche's SplitMNIST examples run it): no task id at
  training or test time (every experience's task label 0), labels global (each task's offset by the classes of
  the tasks before it, :func:`~editkit.integrations.avalanche.benchmark.class_offsets`), and one head over
  every class seen, Avalanche's ``IncrementalClassifier``, growing with the classes
  (:class:`~editkit.integrations.avalanche.classifier.ClassIncrementalModel`), trained with the backbone under
  cross-entropy; scored after each experience on every seen task's test split by the argmax over every class
  seen so far against the global label. A stream whose tasks have no classes (a causal-LM stream) is refused
  (:func:`check_protocol`).

``joint`` trains once on every task together (global labels in the class protocol), ``steps`` times the number
of tasks, and has a last row only. Strategies carry on from the weights the previous experience left, as
``sequential`` does: that is what they are. Default options come from ContinualAI's continual-learning-baselines
(Avalanche's reproductions) where it has the strategy, else Avalanche's defaults; each :class:`Strategy` record
says which, and how to read what the strategy keeps of earlier tasks from its state after the run
(:attr:`Strategy.kept`). Avalanche is imported only when a strategy runs (seconds).

The strategies are the registry :data:`STRATEGIES`, so a package adds one through the ``editkit.extensions`` entry
points as it adds a merge method, and its options are set in the registries' one grammar
(``--strategy-params ewc.ewc_lambda=100``, typed by each option's default).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Sequence, TypedDict

import torch

from editkit.core.registry import Option, Record, Registry
from editkit.errors import ConfigError
from editkit.eval.continual import PROTOCOLS
from editkit.util.memory import nbytes


class Kept(TypedDict):
    """What a strategy holds of earlier tasks after its run: ``what`` in a few words, how many ``items`` of it
    (examples, model copies, experiences' weights) and their ``bytes``."""

    what: str
    items: int
    bytes: int


def nothing_kept(strategy) -> Kept:
    """A strategy that keeps nothing of earlier tasks (Naive, and an extension's by default)."""
    return {"what": "nothing", "items": 0, "bytes": 0}


@dataclass(frozen=True)
class Strategy(Record):
    """A continual-learning strategy: ``build(**fixed, **options)`` returns an Avalanche ``SupervisedTemplate``,
    ``fixed`` being what editkit sets for every strategy alike (``model``, ``optimizer``, ``criterion``,
    ``train_mb_size``, ``train_epochs``, ``eval_mb_size``, ``device``, ``plugins``, ``evaluator``, ``eval_every``)
    and ``options`` the strategy's own. ``label`` is its class name, as tables show it."""

    defaults_from: str = ""  # where the options' defaults come from, for the report (empty: the record's own)
    rehearsal: bool = False  # keeps examples of past tasks (its buffer is part of its cost)
    joint: bool = False  # trains on every task at once: an upper bound, not a continual strategy
    #: What the strategy's run is wrapped in (a mend of Avalanche's code, given back when the run ends).
    during: Callable[[], ContextManager[None]] = contextlib.nullcontext
    #: What the strategy keeps of earlier tasks, read from the strategy object (Avalanche's) after its run.
    kept: Callable[[Any], Kept] = nothing_kept
    #: The option that weighs what the strategy keeps against the new task (EWC's and SI's lambda, LwF's alpha):
    #: the one ``editkit bench --tune`` selects beside the learning rate. Empty: none.
    coefficient: str = ""


STRATEGIES: Registry[Strategy] = Registry("strategy", Strategy)
"""Strategy name (``--strategies``) -> its :class:`Strategy`; an extension may register a plain
:class:`~editkit.core.registry.Record`, a strategy that keeps nothing and is continual."""


def _plugin(strategy, name: str):
    """The strategy's plugin of Avalanche's class ``avalanche.training.plugins.<name>``."""
    from editkit._compat import quiet_avalanche_import

    with quiet_avalanche_import():
        from avalanche.training import plugins

    kind = getattr(plugins, name)
    return next(p for p in strategy.plugins if isinstance(p, kind))


def _examples(datasets: Iterable) -> Kept:
    """Labelled examples kept in Avalanche datasets (items ``(input, label, task label)``): how many, and the bytes
    of their inputs and labels. Avalanche's buffers index into the stream's datasets; the bytes are what keeping
    the examples themselves takes."""
    items = [d[i] for d in datasets for i in range(len(d))]
    return {"what": f"{len(items)} labelled examples", "items": len(items),
            "bytes": sum(nbytes(item[:2]) for item in items)}


def replay_kept(strategy) -> Kept:
    """Replay's storage policy's buffer: labelled examples of every experience so far."""
    return _examples([_plugin(strategy, "ReplayPlugin").storage_policy.buffer])


def agem_kept(strategy) -> Kept:
    """A-GEM's memory: ``patterns_per_exp`` labelled examples of each experience trained on."""
    return _examples(_plugin(strategy, "AGEMPlugin").buffers)


def joint_kept(strategy) -> Kept:
    """Joint training keeps every training example of every task: the experiences it was trained on."""
    return _examples(e.dataset for e in strategy._experiences)


def lwf_kept(strategy) -> Kept:
    """LwF's teacher: a copy of the model after the last experience (its parameters and buffers)."""
    teacher = _plugin(strategy, "LwFPlugin").lwf.prev_model
    if teacher is None:
        return nothing_kept(strategy)
    return {"what": "a model copy", "items": 1,
            "bytes": nbytes([*teacher.parameters(), *teacher.buffers()])}


def ewc_kept(strategy) -> Kept:
    """EWC's saved weights and importances: one pair per experience in mode ``separate``, the last in ``online``
    (unless Avalanche's ``keep_importance_data``)."""
    plugin = _plugin(strategy, "EWCPlugin")
    saved = [*plugin.saved_params.values(), *plugin.importances.values()]
    return {"what": "weights + importances per past experience", "items": len(plugin.saved_params),
            "bytes": nbytes([p.data for params in saved for p in params.values()])}


def si_kept(strategy) -> Kept:
    """SI's running state: the weights and importances of its penalty (``ewc_data``) and the per-step weights,
    gradients and path integrals it accumulates them from (``syn_data``), one set over every experience."""
    plugin = _plugin(strategy, "SynapticIntelligencePlugin")
    tables = [*plugin.ewc_data, *plugin.syn_data.values()]
    return {"what": "weights + importances + path integrals", "items": 1,
            "bytes": nbytes([p.data for table in tables for p in table.values()])}


def avalanche_class(name: str) -> Callable[..., Any]:
    """A ``build`` that makes Avalanche's ``avalanche.training.<name>``, importing Avalanche only when it runs."""

    def build(**arguments: Any) -> Any:
        from editkit._compat import quiet_avalanche_import

        with quiet_avalanche_import():
            import avalanche.training

        return getattr(avalanche.training, name)(**arguments)

    return build


@contextlib.contextmanager
def copying_synaptic_intelligence() -> Iterator[None]:
    """Make Avalanche's SI keep copies of the weights, not views of them, until the run ends.

    ``SynapticIntelligencePlugin.extract_weights`` stores ``param.detach().cpu().flatten()``: on a GPU ``.cpu()``
    copies, but on a CPU it is the parameter itself, so the weights SI records before and after each step are one
    live tensor, their difference is zero, every importance is zero and the SI penalty is nothing, whatever its
    lambda (avalanche-lib 0.6.0). Storing a copy is what the method needs and what it gets on a GPU; the rest of
    the plugin is Avalanche's own. The plugin calls the method through its class, so the class's is replaced (a
    subclass would not be called), and given back when the run ends: the process's Avalanche is its own again.
    """
    from editkit._compat import quiet_avalanche_import

    with quiet_avalanche_import():
        from avalanche.training.plugins import SynapticIntelligencePlugin as plugin

    @torch.no_grad()
    def extract_weights(model, target, excluded_parameters) -> None:
        for name, param in plugin.allowed_parameters(model, excluded_parameters):
            target[name].data = param.detach().flatten().to("cpu", copy=True)

    avalanche_own = plugin.__dict__["extract_weights"]
    plugin.extract_weights = staticmethod(extract_weights)
    try:
        yield
    finally:
        plugin.extract_weights = avalanche_own


@contextlib.contextmanager
def agem_on_any_layout() -> Iterator[None]:
    """Let Avalanche's A-GEM read gradients of weights in any memory layout until the run ends.

    ``AGEMPlugin`` flattens every gradient with ``p.grad.view(-1)`` (avalanche-lib 0.6.0), and a gradient takes its
    weight's strides: under ``--channels-last`` a convolution's gradient cannot be viewed flat, and the run stopped
    at the first reference gradient. While the plugin reads them (its reference gradient's backward, its
    projection) each such gradient is made contiguous, so it flattens in the weight's logical order as in the
    default layout; after the projection it is laid out as its weight again, as the optimizer takes it. A
    contiguous gradient is left as it is, so the default layout runs Avalanche's code untouched. The class's methods
    are replaced (the plugin is built by Avalanche's ``AGEM``) and given back when the run ends.
    """
    from editkit._compat import quiet_avalanche_import

    with quiet_avalanche_import():
        from avalanche.training.plugins import AGEMPlugin as plugin

    own_reference, own_projection = plugin.__dict__["before_training_iteration"], plugin.__dict__["after_backward"]

    def before_training_iteration(self, strategy, **kwargs) -> None:
        hooks = [p.register_post_accumulate_grad_hook(_flattenable) for p in strategy.model.parameters()
                 if p.requires_grad]
        try:
            own_reference(self, strategy, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()

    def after_backward(self, strategy, **kwargs) -> None:
        params = [p for p in strategy.model.parameters() if p.grad is not None]
        for p in params:
            _flattenable(p)
        own_projection(self, strategy, **kwargs)
        for p in params:  # the optimizer's fused kernels take a gradient laid out as its weight
            if p.grad.stride() != p.stride():
                p.grad = torch.empty_like(p).copy_(p.grad)

    plugin.before_training_iteration, plugin.after_backward = before_training_iteration, after_backward
    try:
        yield
    finally:
        plugin.before_training_iteration, plugin.after_backward = own_reference, own_projection


def _flattenable(param: torch.Tensor) -> None:
    """A post-accumulate hook: the parameter's gradient in the default layout (contiguous ones are kept)."""
    if not param.grad.is_contiguous():
        param.grad = param.grad.contiguous()


def _avalanche(name: str, defaults: Mapping[str, Any] | None = None, *,
               defaults_from: str = "Avalanche's defaults", **facts: Any) -> Strategy:
    """Avalanche's strategy class ``name`` with ``defaults`` as the options editkit gives it."""
    options = tuple(Option(key, value) for key, value in (defaults or {}).items())
    return Strategy(avalanche_class(name), options=options, label=name, defaults_from=defaults_from, **facts)


_BASELINES = "continual-learning-baselines"
STRATEGIES.register("naive", _avalanche("Naive"))
STRATEGIES.register("ewc", _avalanche("EWC", {"ewc_lambda": 1.0, "mode": "separate"},
                                      defaults_from=f"{_BASELINES} (permuted_mnist/ewc.py)",
                                      reference_url="https://arxiv.org/abs/1612.00796", kept=ewc_kept,
                                     coefficient="ewc_lambda"))
STRATEGIES.register("lwf", _avalanche("LwF", {"alpha": 1.0, "temperature": 1.0},
                                      defaults_from=f"{_BASELINES} (split_mnist/lwf.py)",
                                      reference_url="https://arxiv.org/abs/1606.09282", kept=lwf_kept,
                                     coefficient="alpha"))
STRATEGIES.register("si", _avalanche("SynapticIntelligence", {"si_lambda": 1.0, "eps": 0.001},
                                     defaults_from=f"{_BASELINES} (split_mnist/synaptic_intelligence.py)",
                                     reference_url="https://arxiv.org/abs/1703.04200",
                                     during=copying_synaptic_intelligence, kept=si_kept,
                                     coefficient="si_lambda"))
STRATEGIES.register("replay", _avalanche("Replay", {"mem_size": 200}, rehearsal=True, kept=replay_kept))
STRATEGIES.register("agem", _avalanche("AGEM", {"patterns_per_exp": 250, "sample_size": 256},
                                       defaults_from=f"{_BASELINES} (permuted_mnist/agem.py)", rehearsal=True,
                                       reference_url="https://arxiv.org/abs/1812.00420", during=agem_on_any_layout,
                                       kept=agem_kept))
STRATEGIES.register("joint", _avalanche("JointTraining", joint=True, kept=joint_kept))


@dataclass
class StrategyResult:
    """What one strategy did to a stream under one protocol: each experience's scores (task -> accuracy, the
    tasks seen so far; ``joint``: one row, after training on all), its cost, its options and what it kept."""

    name: str
    protocol: str  # one of PROTOCOLS: the rows are scored as it scores (own heads, or among every seen class)
    rows: list[dict[str, float]]
    options: dict[str, Any]
    train_seconds: float
    steps: int  # training iterations, as Avalanche's own clock counts them
    peak_rss_bytes: int | None
    kept: Kept  # what it holds of earlier tasks after the run (Strategy.kept)
    recorded: str | None = None  # read back from this record, not trained here: seconds and memory are its run's


def check_protocol(tasks: Sequence, protocol: str) -> None:
    """Refuse, in one line and before any work, a protocol a stream of ``tasks`` (its
    :class:`~editkit.data.tasks.TaskData`, in stream order) cannot run: an unknown one, or ``class`` over a task
    without classes (a language-modelling task: no labels to make global)."""
    if protocol not in PROTOCOLS:
        raise ConfigError(f"unknown protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    unlabelled = [t.name for t in tasks if not t.num_classes]
    if protocol == "class" and unlabelled:
        raise ConfigError(f"the class-incremental protocol needs classification tasks; task {unlabelled[0]!r} has "
                          "no classes (a language-modelling task)")


def run_strategy(name: str, built, recipes: Sequence, *, options: Mapping[str, Any] | None = None, runtime=None,
                 progress=None, protocol: str = "task", split: str = "test") -> StrategyResult:
    """Train Avalanche's strategy ``name`` through ``built``'s stream (an
    :class:`~editkit.scenario.build.BuiltScenario`) under ``protocol`` with each task's resolved recipe
    (``recipes``, in stream order: its steps; the first one's optimizer settings, batch and seed), scoring every
    seen task after each experience on its ``split`` (``val``: what a selection of its options may read; see the
    module docstring)."""
    from editkit._compat import quiet_avalanche_import
    from editkit.integrations.avalanche.benchmark import benchmark_from_tasks
    from editkit.integrations.avalanche.plugin import StepBudget
    from editkit.train.runtime import Runtime
    from editkit.util.progress import NullProgress

    with quiet_avalanche_import():
        from avalanche.training.plugins import EvaluationPlugin

    tasks = list(built.tasks)
    check_protocol(tasks, protocol)
    spec, runtime, progress = STRATEGIES[name], runtime or Runtime(), progress or NullProgress()
    chosen = STRATEGIES.options(name, options or {})
    recipe = recipes[0]
    steps = [sum(r.steps for r in recipes)] if spec.joint else [r.steps for r in recipes]
    benchmark = benchmark_from_tasks(tasks, built.backbone.batching, class_incremental=protocol == "class")
    budget = StepBudget(recipe, steps=steps)
    with _quiet_strategy(), _seeded(recipe.seed), spec.during():
        model = runtime.place(_model(built, tasks, protocol))  # seeded: the class protocol's head starts random
        model.forward_context = runtime.autocast  # its forwards in the precision editkit's modes train in
        strategy = spec.build(
            # a placeholder: StepBudget gives each experience a fresh optimizer with the recipe's schedule
            model=model, optimizer=torch.optim.AdamW(model.theta, lr=recipe.lr),
            criterion=torch.nn.CrossEntropyLoss(), train_mb_size=recipe.batch_size,
            train_epochs=max(steps) + 1,  # every epoch takes a step at least: the budget ends each experience
            eval_mb_size=256, device=runtime.device, plugins=[budget], evaluator=EvaluationPlugin(), eval_every=-1,
            **chosen)
        rows, peak = _train(strategy, budget, tasks, benchmark, spec.joint, progress, f"{name} ({protocol})",
                            lambda seen: _scores(model, built, seen, runtime, protocol, split))
    return StrategyResult(name, protocol, rows, chosen, budget.seconds, strategy.clock.train_iterations, peak,
                          spec.kept(strategy))


def _model(built, tasks: Sequence, protocol: str) -> torch.nn.Module:
    """The model a strategy trains under ``protocol``: theta_0's plain backbone with the scenario's fixed head per
    task label (``task``), or under Avalanche's growing classifier (``class``)."""
    if protocol == "class":
        from editkit.integrations.avalanche.classifier import ClassIncrementalModel

        return ClassIncrementalModel(built.backbone)
    from editkit.integrations.avalanche.multitask import MultiHeadTaskModel

    return MultiHeadTaskModel(built.backbone, [built.heads[t.name] for t in tasks], mode="nonlinear")


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed every global generator Avalanche draws from with the recipe's seed, and give each back as it was.

    Its loaders shuffle with torch's generator; A-GEM picks the patterns it keeps (as Avalanche's random exemplar
    selection does) with Python's ``random.shuffle``, so with Python's generator unseeded two runs of one command
    kept different memories and scored differently. numpy's is the third that Avalanche's own ``RNGManager`` seeds.
    """
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


#: Warnings Avalanche gives that say nothing to an editkit user: editkit scores the model itself (no Avalanche
#: logger), Replay calls its own storage policy's deprecated method, and EWC's and SI's saved tensors grow with the
#: class protocol's head through an indexing torch deprecates (Avalanche's ``ParamData.expand``).
_AVALANCHE_NOISE = ("No loggers specified", "Call to deprecated function update",
                    "Using a non-tuple sequence for multidimensional indexing")


@contextlib.contextmanager
def _quiet_strategy() -> Iterator[None]:
    """Run a strategy without :data:`_AVALANCHE_NOISE`; every other warning is shown as usual. Recorded, not
    filtered: Avalanche's deprecation decorator resets the filters around its own warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if not str(w.message).startswith(_AVALANCHE_NOISE):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _train(strategy, budget, tasks: Sequence, benchmark, joint: bool, progress, name: str, scores):
    """(each experience's scores, the peak RSS of it all): ``train`` per experience, or once over the stream."""
    from editkit.util.memory import PeakRSS

    rows: list[dict[str, float]] = []
    with PeakRSS() as rss:
        experiences = [benchmark.train_stream] if joint else list(benchmark.train_stream)
        for index, experience in enumerate(experiences):
            seen = tasks if joint else tasks[: index + 1]
            with progress.task(f"{name}: {'every task' if joint else seen[-1].name}", total=budget.steps[index]) as bar:
                budget.bar = bar
                strategy.train(experience, eval_streams=[])
            rows.append(scores(seen))
        return rows, rss.window()


def _scores(model, built, seen: Sequence, runtime, protocol: str, split: str) -> dict[str, float]:
    """The strategy's model's accuracy on each seen task's ``split``: ``task``, the argmax of the task's own
    head; ``class``, the argmax of the one classifier, over every class seen so far, against the global label
    (the task's label offset by the classes of the tasks before it)."""
    from editkit.eval.accuracy import classify
    from editkit.eval.features import outputs_over
    from editkit.integrations.avalanche.benchmark import class_offsets

    model.eval()
    among = protocol == "class"
    features_of, offsets = (model.features, class_offsets(seen)) if among else (model.task_model, [0] * len(seen))
    scores = {}
    with torch.no_grad():
        for index, task in enumerate(seen):
            labels: list[torch.Tensor] = []
            features = outputs_over(features_of, getattr(task, split), batch_size=256, batching=built.backbone.batching,
                                    runtime=runtime, labels=labels)
            head = model.classifier if among else model.head(index)
            predicted = classify(head, features.to(runtime.device)).cpu()
            scores[task.name] = float((predicted == torch.cat(labels).long() + offsets[index]).double().mean())
    return scores
