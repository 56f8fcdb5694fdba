"""Avalanche's own continual-learning strategies on a scenario's stream, for the bench to put beside tauJp.

Each strategy is Avalanche's class with its own plugins (``avalanche.training.Naive``, ``EWC``, ``LwF``,
``SynapticIntelligence``, ``Replay``, ``AGEM``, ``JointTraining``): nothing here re-implements one. What editkit
fixes is everything the modes fix, so a row differs from a mode's by the strategy alone:

- the model: theta_0's backbone in plain (``nonlinear``) form, with the scenario's fixed heads, one per task
  label (:class:`~editkit.integrations.avalanche.multitask.MultiHeadTaskModel`); the backbone is shared and
  never changed, each strategy trains its own copy of theta;
- per experience, the recipe's optimizer (AdamW, lr, weight decay, warmup + cosine, gradient clipping), fresh
  for each experience as a mode's is, the recipe's batch size and exactly its number of steps
  (:class:`StepBudget`); Avalanche's own data loaders draw the batches (Replay's mix in its buffer);
- the runtime: the device, the precision (``--precision bf16``: every forward of the strategy's model under
  bf16 autocast, as a mode's step runs) and the weights' layout (``--channels-last``);
- evaluation after each experience on the test split of every task seen, task-incremental (each task's
  head: the accuracy matrix of :mod:`editkit.eval.continual`) and class-incremental (among every seen task's
  classes, :func:`~editkit.eval.accuracy.correct_among`). ``joint`` trains once on every
  task together, ``steps`` times the number of tasks, and has a last row only.

Strategies carry on from the weights the previous experience left, as ``sequential`` does: that is what
they are. Default options come from ContinualAI's continual-learning-baselines (Avalanche's reproductions)
where it has the strategy, else Avalanche's defaults; each :class:`Strategy` record says which.
Avalanche is imported only when a strategy runs (seconds).

The strategies are the registry :data:`STRATEGIES`, so a package adds one through the ``editkit.extensions`` entry
points as it adds a merge method, and its options are set in the registries' one grammar
(``--strategy-params ewc.ewc_lambda=100``, typed by each option's default).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from editkit.core.registry import Option, Record, Registry


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

    def buffer_size(self, options: Mapping[str, Any], tasks: int) -> int:
        """Examples the strategy keeps: Replay's memory, A-GEM's patterns of every past experience."""
        if "mem_size" in options:
            return int(options["mem_size"])
        if "patterns_per_exp" in options:
            return int(options["patterns_per_exp"]) * max(0, tasks - 1)
        return 0


STRATEGIES: Registry[Strategy] = Registry("strategy", Strategy)
"""Strategy name (``--strategies``) -> its :class:`Strategy`; an extension may register a plain
:class:`~editkit.core.registry.Record`, a strategy that keeps no example and is continual."""


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


def _avalanche(name: str, defaults: Mapping[str, Any] | None = None, *,
               defaults_from: str = "Avalanche's defaults", **facts: Any) -> Strategy:
    """Avalanche's strategy class ``name`` with ``defaults`` as the options editkit gives it."""
    options = tuple(Option(key, value) for key, value in (defaults or {}).items())
    return Strategy(avalanche_class(name), options=options, label=name, defaults_from=defaults_from, **facts)


_BASELINES = "continual-learning-baselines"
STRATEGIES.register("naive", _avalanche("Naive"))
STRATEGIES.register("ewc", _avalanche("EWC", {"ewc_lambda": 1.0, "mode": "separate"},
                                      defaults_from=f"{_BASELINES} (permuted_mnist/ewc.py)",
                                      reference_url="https://arxiv.org/abs/1612.00796"))
STRATEGIES.register("lwf", _avalanche("LwF", {"alpha": 1.0, "temperature": 1.0},
                                      defaults_from=f"{_BASELINES} (split_mnist/lwf.py)",
                                      reference_url="https://arxiv.org/abs/1606.09282"))
STRATEGIES.register("si", _avalanche("SynapticIntelligence", {"si_lambda": 1.0, "eps": 0.001},
                                     defaults_from=f"{_BASELINES} (split_mnist/synaptic_intelligence.py)",
                                     reference_url="https://arxiv.org/abs/1703.04200",
                                     during=copying_synaptic_intelligence))
STRATEGIES.register("replay", _avalanche("Replay", {"mem_size": 200}, rehearsal=True))
STRATEGIES.register("agem", _avalanche("AGEM", {"patterns_per_exp": 250, "sample_size": 256},
                                       defaults_from=f"{_BASELINES} (permuted_mnist/agem.py)", rehearsal=True,
                                       reference_url="https://arxiv.org/abs/1812.00420"))
STRATEGIES.register("joint", _avalanche("JointTraining", joint=True))


@dataclass
class StrategyResult:
    """What one strategy did to a stream: each experience's scores (task -> accuracy, the tasks seen so far;
    ``joint``: one row, after training on all), task- and class-incremental, its cost and its options."""

    name: str
    rows: list[dict[str, float]]
    class_rows: list[dict[str, float]]  # the same, class-incremental: among every seen task's classes, no task id
    options: dict[str, Any]
    train_seconds: float
    steps: int  # training iterations, as Avalanche's own clock counts them
    peak_rss_bytes: int | None
    buffer_size: int  # examples it may keep (Replay's memory, A-GEM's patterns of the past experiences)


def run_strategy(name: str, built, recipes: Sequence, *, options: Mapping[str, Any] | None = None, runtime=None,
                 progress=None) -> StrategyResult:
    """Train Avalanche's strategy ``name`` through ``built``'s stream (an
    :class:`~editkit.scenario.build.BuiltScenario`) with each task's resolved recipe (``recipes``, in stream
    order: its steps; the first one's optimizer settings and batch), scoring every seen task after each
    experience (see the module docstring)."""
    from editkit._compat import quiet_avalanche_import
    from editkit.integrations.avalanche.benchmark import benchmark_from_tasks
    from editkit.integrations.avalanche.multitask import MultiHeadTaskModel
    from editkit.integrations.avalanche.plugin import StepBudget
    from editkit.train.runtime import Runtime
    from editkit.util.progress import NullProgress

    with quiet_avalanche_import():
        from avalanche.training.plugins import EvaluationPlugin

    spec, runtime, progress = STRATEGIES[name], runtime or Runtime(), progress or NullProgress()
    chosen = STRATEGIES.options(name, options or {})
    tasks, recipe = list(built.tasks), recipes[0]
    steps = [sum(r.steps for r in recipes)] if spec.joint else [r.steps for r in recipes]
    model = runtime.place(MultiHeadTaskModel(built.backbone, [built.heads[t.name] for t in tasks], mode="nonlinear"))
    model.forward_context = runtime.autocast  # its forwards in the precision editkit's modes train in
    benchmark = benchmark_from_tasks(tasks, built.backbone.batching)
    budget = StepBudget(recipe, steps=steps)
    with _quiet_strategy(), _seeded(recipe.seed), spec.during():
        strategy = spec.build(
            # a placeholder: StepBudget gives each experience a fresh optimizer with the recipe's schedule
            model=model, optimizer=torch.optim.AdamW(list(model.task_model.theta), lr=recipe.lr),
            criterion=torch.nn.CrossEntropyLoss(), train_mb_size=recipe.batch_size,
            train_epochs=max(steps) + 1,  # every epoch takes a step at least: the budget ends each experience
            eval_mb_size=256, device=runtime.device, plugins=[budget], evaluator=EvaluationPlugin(), eval_every=-1,
            **chosen)
        scored, peak = _train(strategy, budget, tasks, benchmark, spec.joint, progress, name,
                              lambda seen: _scores(model, built, seen, runtime))
    return StrategyResult(name, [own for own, _ in scored], [among for _, among in scored], chosen, budget.seconds,
                          strategy.clock.train_iterations, peak, spec.buffer_size(chosen, len(tasks)))


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
#: logger), and Replay calls its own storage policy's deprecated method.
_AVALANCHE_NOISE = ("No loggers specified", "Call to deprecated function update")


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
    """(each experience's (task-, class-incremental) scores, the peak RSS of it all): ``train`` per experience, or
    once over the stream."""
    from editkit.util.memory import PeakRSS

    rows: list[tuple[dict[str, float], dict[str, float]]] = []
    with PeakRSS() as rss:
        experiences = [benchmark.train_stream] if joint else list(benchmark.train_stream)
        for index, experience in enumerate(experiences):
            seen = tasks if joint else tasks[: index + 1]
            with progress.task(f"{name}: {'every task' if joint else seen[-1].name}", total=budget.steps[index]) as bar:
                budget.bar = bar
                strategy.train(experience, eval_streams=[])
            rows.append(scores(seen))
        return rows, rss.window()


def _scores(model, built, seen: Sequence, runtime) -> tuple[dict[str, float], dict[str, float]]:
    """The strategy's model on each seen task's test split: (task-incremental accuracy, under the task's own
    head; class-incremental accuracy, among every seen task's classes without the task id)."""
    import torch

    from editkit.eval.accuracy import classify, correct_among
    from editkit.eval.features import outputs_over

    model.eval()
    heads = [built.heads[t.name] for t in seen]
    own, among = {}, {}
    with torch.no_grad():
        for index, task in enumerate(seen):
            labels: list[torch.Tensor] = []
            features = outputs_over(model.task_model, task.test, batch_size=256, batching=built.backbone.batching,
                                    runtime=runtime, labels=labels)
            y = torch.cat(labels).long()
            own[task.name] = float((classify(heads[index], features) == y).double().mean())
            among[task.name] = float(correct_among(heads, index, features, y).double().mean())
    return own, among
