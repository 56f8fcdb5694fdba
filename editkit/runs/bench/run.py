"""``editkit bench``: the paper's tables and figures for any scenario.

For each mode (nonlinear, linear, taujp by default; taujp-nonlinear on request) the
scenario's stream is run through ``editkit.runs.stream.run_scenario(resume=True)``, so
vectors already in the bank ``<bank-root>/<scenario>-<mode>`` with the same recipe are
reused, not retrained (every bank is checked against the scenario's tasks, base model,
recipes and parameter shapes before any training starts: :mod:`editkit.runs.bench.checks`). Then, on the banked vectors:

- **task addition** (paper Table 1): pretrained; task arithmetic per mode at
  alpha = 1 and at alpha tuned on the *validation* splits (grid over [0, 1],
  chosen by absolute validation accuracy); every other registered merge method
  per mode, its merged vector at coefficient 1 and tuned the same way (TIES-merging
  with top-k = 20% or ``ties_k``, DARE, MagMax, OPCM with their defaults); the
  single-task fine-tuned reference;
- **negation**: theta_0 - alpha tau per task, at alpha = 1 and at the alpha
  minimising validation target accuracy with validation control accuracy
  >= 95% of theta_0's (grid of 11 points over [0, 1] by default, ``negation_grid``
  and ``negation_max``:
  with non-linear vectors each point is a pass over every validation split for
  every negated task, the largest cost of the bench);
- **diagnostics**: the tauJp matrix per mode, its correlation with normalized
  accuracy across task pairs and modes, the weight-disentanglement error xi on
  a grid for one task pair;
- **continual**: each stream's accuracy matrix (the merged model after every step on every seen task),
  ACC, BWT and forgetting (:mod:`editkit.eval.continual`); with ``matrices``, every merge method's too
  (:mod:`editkit.runs.bench.matrices`);
- **cost**: fine-tuning time, seconds per step, peak RSS, merging time;
- **claims**: tauJp at alpha = 1 against the best baseline and, apart, the best tauJp variant, each
  ahead, tied or behind by more than ``claim_margin`` (:mod:`editkit.runs.bench.claims`).

``seeds`` > 1 or ``orders`` > 1 runs all of it once per seed or task order and reports each row as
mean ± std, the claims with a margin of at least two standard errors (:mod:`editkit.runs.bench.repeats`).
The repeated report reads the addition rows, continual numbers and costs only, so negation and the
diagnostics run in the first repeat alone (its report is a one-run bench's); the others leave them out
(``left_out`` in their reports): on ``offline-text`` that is about 3.5 of a repeat's 21 minutes.

Everything lands in ``<run-dir>/report.json`` and PNGs (:mod:`editkit.runs.bench.report`), written only at the end
(plots rendered into a temporary directory, moved into place, then the report
written atomically), so a failed run leaves an earlier report untouched.

Exactness and cost (``editkit.eval.sweep``): linearized vectors are combined exactly
from theta_0's features and one cached tangent per vector and input, so every
coefficient, sum, negation and xi grid point comes without another jvp. The tangents a linearized stream
computed to score each vector it trained (the vector on the test splits of the tasks up to its own) are
taken over, not computed again: the same jvp over the same inputs in the same batches (the bench's
``batch_size`` is the stream's, ``EVAL_BATCH_SIZE``, unless set otherwise), so the same numbers.
Non-linear vectors need a real forward per coefficient: the grids are evaluated
on the (small) validation splits only, the test splits at the chosen
coefficients, and xi on the first ``xi_samples`` test inputs of the pair's tasks.
Forward passes and jvps run on the runtime's device (CUDA when available, bf16
autocast there by default), in one process; inputs are read batch by batch and
only one feature or tangent vector per input is kept, on the CPU.

From empty banks, the streams (every mode's training steps plus the stream's own
evaluations) take about half of a bench run, the coefficient search and negation
most of the rest, the diagnostics the least; with the banks already filled only
the last two run. On a machine busy with other jobs ``--threads 1`` can be several
times faster than one thread per core (oversubscribed OpenMP threads spin).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.eval.continual import PROTOCOLS
from editkit.eval.features import EVAL_BATCH_SIZE
from editkit.settings import default_bank_dir, torchrun_world
from editkit.train.runtime import Runtime, setup
from editkit.integrations.avalanche.strategies import STRATEGIES
from editkit.runs.bench.checks import check_bank, refuse_unswept_heads
from editkit.runs.bench.config import BenchConfig
from editkit.runs.bench.addition import evaluate_mode
from editkit.runs.bench.report import RSS_METRIC, ModeState, bench_report, with_strategies, write_outputs
from editkit.runs.bench.strategies import run_strategies, strategy_sections
from editkit.runs.bench.sections import FIRST_REPEAT_ONLY, diagnostic_sections, negation_section
from editkit.runs.bench.cluster import Unit, check_shared, connect, run_units
from editkit.runs.bench.repeats import Repeat, aggregate, order_repeats, repeat_bank_root, seed_repeats
from editkit.runs.bench.strategy_records import StrategyRecord
from editkit.runs.records import StepRecord
from editkit.runs.report import jsonable
from editkit.scenario.spec import ScenarioSpec
from editkit.errors import ConfigError
from editkit.util.memory import PeakRSS
from editkit.util.progress import NullProgress, Progress
from editkit.train.recipe import Recipe
from editkit.eval.sweep import SPLITS, ModeEvaluator, SharedModels, TaskSplits

if TYPE_CHECKING:  # annotations only
    from editkit.scenario.build import BuiltScenario

log = logging.getLogger(__name__)


@dataclass
class BenchResult:
    """What a bench wrote: its report (as in ``report.json``) and where."""

    report: dict[str, Any]
    run_dir: Path

    @property
    def report_path(self) -> Path:
        return self.run_dir / "report.json"


def run_bench(config: BenchConfig, *, runtime: Runtime | None = None, progress: Progress | None = None) -> BenchResult:
    """Run (or reuse) each mode's stream, evaluate, and write ``report.json`` + PNGs (see module docstring).

    runtime: where to run, in one process (default: ``editkit.train.runtime.setup()``'s: CUDA when available).
    """
    from editkit.scenario.spec import load_scenario

    progress = progress or NullProgress()
    config = config.validated()
    if runtime.distributed if runtime is not None else torchrun_world()[1] > 1:
        raise ConfigError("editkit bench runs in one process; start it without torchrun")
    spec = load_scenario(config.scenario)
    runtime = runtime or setup(preferred_precision=spec.precision)
    if config.tune:
        config = _tuned(config, spec, runtime, progress)
    if config.ray is not None:
        return _run_on_cluster(config, spec, runtime, progress)
    if config.seeds > 1 or config.orders > 1:
        return _run_repeats(config, spec, runtime, progress)
    return _bench_once(config, spec, runtime, progress)


@dataclass
class _Done:
    """What a repeat's stream units did before its evaluation (``--ray``): each stream's tasks trained and its
    seconds. The strategies may still run: the driver adds them to the evaluation's report and writes it."""

    streams: dict[str, tuple[list[str], float]]


def _bench_once(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime, progress: Progress, *,
                extras: bool = True, done: _Done | None = None) -> BenchResult:
    """One bench of ``spec`` (its tasks in the order it lists them), with a validated ``config``; without
    ``extras``, no negation and no diagnostics (a repeat whose report only the repeated one reads). ``done``: its
    streams ran as units of their own (their banks filled, the streams here only resume) and its strategies run
    apart: the report comes back without them, unwritten (the caller adds them: :func:`with_strategies`)."""
    from editkit.scenario.spec import task_recipes
    from editkit.scenario.build import require_scenario

    started = time.perf_counter()
    if len(spec.tasks) < 2:
        raise ConfigError(f"scenario {spec.name!r} has {len(spec.tasks)} task; bench merges vectors and needs at least 2")
    tasks = spec.task_names
    pair = tuple(config.xi_pair) if config.xi_pair else (tasks[0], tasks[1])
    unknown = [t for t in pair if t not in tasks]
    if unknown:
        raise ConfigError(f"--xi-pair names unknown task(s) {unknown}; tasks: {', '.join(tasks)}")
    states, run_dir = _mode_states(config, spec)
    protocols = config.protocols_of(spec)
    require_scenario(spec, config.build)

    timings: dict[str, Any] = {}
    t0 = time.perf_counter()
    built, arms, bases = _build_checked(config, spec, states, runtime, progress)
    control = _control_task(built, config)
    timings["build_seconds"] = time.perf_counter() - t0

    _run_streams(config, spec, states, progress, runtime, run_dir, arms)
    if done is not None:
        _adopt_streams(states, done.streams)
    timings["stream_seconds"] = {m: s.stream_seconds for m, s in states.items()}
    t0 = time.perf_counter()
    per_task = task_recipes(spec, **config.recipe)
    later = done is not None  # a cluster's evaluation unit: the driver adds the strategies and writes the report
    strategies = None if later else strategy_sections(_run_strategies(
        config, spec, config.strategies, built, per_task, runtime, progress, protocols), tasks)
    timings["strategy_seconds"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    modules = {adapter: runtime.place(arm.backbone.module) for adapter, arm in arms.items()}
    # theta_0's features are any arm's: an adapter at initialisation (B = 0) adds exactly zero
    data = TaskSplits(next(iter(modules.values())), list(built.tasks) + ([control] if control else []),
                      batch_size=config.batch_size, xi_samples=config.xi_samples, progress=progress, runtime=runtime,
                      batching=built.backbone.batching)
    models = {adapter: SharedModels.of(module) for adapter, module in modules.items()}
    heads = {n: built.heads[n].eval() for n in tasks}
    if control is not None:
        heads[control.name] = control.head.eval()
    pretrained_all = {s: data.pretrained_accuracies(heads, s) for s in SPLITS}  # tasks and control
    pretrained = {s: {t: pretrained_all[s][t] for t in tasks} for s in SPLITS}
    timings["theta0_seconds"] = time.perf_counter() - t0

    evaluators: dict[str, ModeEvaluator] = {}
    mode_results: dict[str, dict[str, Any]] = {}
    negation: dict[str, dict[str, Any]] = {}
    for label, state in states.items():
        t0 = time.perf_counter()
        adapter = state.recipe.adapter
        ev = ModeEvaluator(state.recipe.mode.value, state.bank, {n: n for n in tasks}, data, heads, bases[adapter],
                           models[adapter], label=label)
        ev.adopt_tangents("test", state.stream.tangents)  # what the stream's scoring computed: not computed again
        state.stream.tangents = {}
        evaluators[label] = ev
        mode_results[label] = evaluate_mode(ev, config, tasks, pretrained_all, control, progress, protocols)
        if extras:
            negation[label] = negation_section(ev, tasks, pretrained_all, control.name if control else None, progress,
                                               alphas=config.negation_alphas, retain=config.negation_retain)
        timings.setdefault("evaluation_seconds", {})[label] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sections = ({"negation": negation, **diagnostic_sections(evaluators, mode_results, tasks, pair, progress,
                                                             xi_grid=config.xi_grid, xi_samples=config.xi_samples)}
                if extras else {})
    timings["diagnostics_seconds"] = time.perf_counter() - t0

    report = bench_report(spec, built, config, states, tasks, pretrained, mode_results, sections, strategies, run_dir,
                          protocols)
    if config.selection is not None:
        report["selection"] = jsonable(config.selection)
    if not extras:
        report["left_out"] = {"sections": list(FIRST_REPEAT_ONLY),
                              "why": "a repeat after the first: the repeated report reads none of them"}
    report["torch_threads"] = torch.get_num_threads()
    report["runtime"] = runtime.describe()  # with the threads, what the numbers depend on beyond the seed
    timings["total_seconds"] = time.perf_counter() - started
    report["timings"] = timings
    if later:
        return BenchResult(report, run_dir)
    write_outputs(report, run_dir)
    log.info("bench %s done in %.0f s; report %s", spec.name, timings["total_seconds"], run_dir / "report.json")
    return BenchResult(report, run_dir)


def _mode_states(config: BenchConfig, spec: ScenarioSpec) -> tuple[dict[str, ModeState], Path]:
    """Each stream's state (its recipe and bank) and the run directory, refused by name where a path is a file."""
    states = {label: ModeState(label, spec.recipe.with_overrides(**overrides), overrides,
                                Bank(default_bank_dir(spec.name, label, root=config.bank_root)))
              for label, overrides in config.variants(spec.recipe).items()}
    run_dir = config.run_directory(spec.recipe, spec.name)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} exists and is not a directory")
    for state in states.values():
        if state.bank.root.exists() and not state.bank.root.is_dir():
            raise ConfigError(f"bank path {state.bank.root} exists and is not a directory")
    return states, run_dir


def _build_checked(config: BenchConfig, spec: ScenarioSpec, states: Mapping[str, ModeState], runtime: Runtime,
                   progress: Progress, *, check_banks: bool = True
                   ) -> tuple[BuiltScenario, dict[str, BuiltScenario], dict[str, str]]:
    """(the built scenario, its arm per adapter, each arm's base fingerprint), with every stream's bank checked
    against them (unless not ``check_banks``: selection's trials bank elsewhere) and each state's per-task recipes
    set: every refusal happens before any training."""
    from editkit.scenario.spec import task_recipes
    from editkit.scenario.build import build_scenario

    tasks = spec.task_names
    seed = next(iter(states.values())).recipe.seed
    built = build_scenario(spec, seed=seed, progress=progress, build=config.build, device=str(runtime.device),
                           precision=runtime.precision)
    refuse_unswept_heads(spec.name, built.heads)
    arms = _arms(spec, built, states)
    bases = {adapter: arm.backbone.fingerprint() for adapter, arm in arms.items()}
    for state in states.values():
        arm = arms[state.recipe.adapter]
        per_task = task_recipes(spec, **state.overrides)
        state.task_recipes = {n: per_task[n].resolved(len(built.task(n).train)).to_dict() for n in tasks}
        if not check_banks:
            continue
        shapes = {n: tuple(p.shape) for n, p in arm.backbone.module.named_parameters()}
        check_bank(state.bank, scenario=spec.name, tasks=tasks, mode=state.recipe.mode, recipes=state.task_recipes,
                   base=bases[state.recipe.adapter], backbone=built.backbone.name, shapes=shapes, spec=spec,
                   build=config.build)
    return built, arms, bases


def _repeats(config: BenchConfig, spec: ScenarioSpec) -> tuple[str, list[Repeat], list[tuple[BenchConfig, ScenarioSpec]]]:
    """(what the bench repeats over, its repeats, each one's config and reordered scenario): a bench of one seed and
    one order is one repeat whose config is the bench's own."""
    if config.seeds == 1 and config.orders == 1:
        return "", [], [(config, spec)]
    seed = int(config.recipe.get("seed", spec.recipe.seed))
    over = "seeds" if config.seeds > 1 else "orders"
    repeats = (seed_repeats(seed, config.seeds, spec.task_names) if over == "seeds"
               else order_repeats(spec.task_names, config.orders, seed))
    run_dir = config.run_directory(spec.recipe, spec.name)
    return over, repeats, [(replace(config, seeds=1, orders=1, recipe={**config.recipe, "seed": repeat.seed},
                                    run_dir=run_dir / repeat.name,
                                    bank_root=repeat_bank_root(config.bank_root, repeat, repeats[0])),
                            spec.reordered(repeat.order)) for repeat in repeats]


def _run_repeats(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime, progress: Progress) -> BenchResult:
    """One whole bench per seed or task order (:mod:`editkit.runs.bench.repeats`), then their means and
    spreads; a run that fails stops the bench before the aggregated report is written."""
    over, repeats, ones = _repeats(config, spec)
    results = []
    for repeat, (one, reordered) in zip(repeats, ones):
        log.info("bench %s: %s (%s)", spec.name, repeat.name, ", ".join(repeat.order))
        results.append(_bench_once(one, reordered, runtime, progress, extras=repeat == repeats[0]))
    return _aggregated(config, spec, over, repeats, [r.report for r in results])


def _aggregated(config: BenchConfig, spec: ScenarioSpec, over: str, repeats: Sequence[Repeat],
                reports: Sequence[Mapping[str, Any]]) -> BenchResult:
    """The repeated report: every row's mean and spread over the repeats' reports, written at the end."""
    run_dir = config.run_directory(spec.recipe, spec.name)
    report = jsonable(aggregate(reports, repeats, over, [run_dir / r.name for r in repeats], config.claim_margin))
    report["run_dir"] = str(run_dir)
    write_outputs(report, run_dir)
    return BenchResult(report, run_dir)


# --------------------------------------------------------------------------- selection (--tune)


def _tuned(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime, progress: Progress) -> BenchConfig:
    """``config`` with every row's learning rate and own coefficient chosen on the first ``config.tune``
    experiences' validation splits (:mod:`editkit.runs.bench.selection`), its streams banked under
    ``<bank-root>/tuned``; every refusal a bench makes comes before the first trial."""
    from editkit.runs.bench import selection
    from editkit.scenario.spec import task_recipes

    selection.check_tune(config.tune, len(spec.tasks))
    protocols = config.protocols_of(spec)
    states, _ = _mode_states(config, spec)
    built, arms, _ = _build_checked(config, spec, states, runtime, progress, check_banks=False)
    first = spec.task_names[: config.tune]
    per_task = task_recipes(spec, **config.recipe)
    recipes = [per_task[n].resolved(len(built.task(n).train)) for n in first]
    params = STRATEGIES.parse_params(config.strategy_params)
    if config.ray is not None:
        streams, strategies = _trials_on_cluster(config, spec, states, recipes, params, runtime, progress)
    else:
        streams = {label: selection.stream_trials(config, spec, arms[state.recipe.adapter], state, runtime=runtime,
                                                  progress=progress, protocols=protocols, experiences=config.tune)
                   for label, state in states.items()}
        strategies = {name: selection.strategy_trials(name, built, recipes, params.get(name, {}), runtime=runtime,
                                                      progress=progress, protocols=protocols,
                                                      experiences=config.tune,
                                                      records=[StrategyRecord.trial(config, spec, name, i)
                                                               for i in range(selection.TRIALS)])
                      for name in config.strategies}
    chosen = {**streams, **strategies}
    row_recipes = {label: {k: v for k, v in (("lr", e["chosen"]["lr"]), ("lam", e["chosen"]["coefficient"]))
                           if v is not None} for label, e in streams.items()}
    tuned_params = [p for p in config.strategy_params
                    if not any(p.startswith(f"{name}.{e['coefficient']}=") for name, e in strategies.items())]
    tuned_params += [f"{name}.{e['coefficient']}={e['chosen']['coefficient']!r}" for name, e in strategies.items()
                     if e["coefficient"]]
    record = {"experiences": first, "split": "val", "trials": selection.TRIALS, "protocols": list(protocols),
              "objective": "mean over protocols of the validation accuracy after the last selection experience",
              "rows": chosen}
    return replace(config, row_recipes=row_recipes, strategy_params=tuple(tuned_params),
                   strategy_lr={name: e["chosen"]["lr"] for name, e in strategies.items()},
                   bank_root=Path(config.bank_root) / "tuned", selection=record).validated()


# --------------------------------------------------------------------------- on a cluster (--ray)


def _unit_options(runtime: Runtime) -> dict[str, Any]:
    """What a unit needs to set its runtime up as the driver's (its threads are its CPUs)."""
    return {"device": str(runtime.device), "precision": runtime.precision, "workers": runtime.workers,
            "channels_last": runtime.channels_last}


def _trials_on_cluster(config: BenchConfig, spec: ScenarioSpec, states: Mapping[str, ModeState],
                       recipes: Sequence[Recipe], params: Mapping[str, dict], runtime: Runtime,
                       progress: Progress) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--tune`` with ``--ray``: every row's every trial a unit (it builds the scenario and trains the first
    experiences itself), the scores gathered into each row's selection entry as one process gathers them. Returns
    the streams' entries and the strategies'."""
    from editkit.runs.bench import selection

    progress.note(f"tune {spec.name} on {connect(config.ray)}")
    check_shared([config.bank_root])
    options, gpus = _unit_options(runtime), 1.0 if runtime.device.type == "cuda" else 0.0
    grids = {label: selection.stream_grid(state) for label, state in states.items()}
    grids.update({name: selection.strategy_grid(name, recipes, params.get(name, {})) for name in config.strategies})
    calls = {**{label: _stream_trial_unit for label in states}, **{name: _strategy_trial_unit
                                                                   for name in config.strategies}}
    units = [Unit(f"tune {row} trial {i + 1}", calls[row], (config, spec, row, i, options), config.unit_cpus, gpus)
             for row, (grid, _) in grids.items() for i in range(len(grid))]
    scores = iter(run_units(units, progress))
    entries = {row: selection.selection_entry(grid, [next(scores) for _ in grid], coefficient)
               for row, (grid, coefficient) in grids.items()}
    return ({label: entries[label] for label in states}, {name: entries[name] for name in config.strategies})


def _stream_trial_unit(config: BenchConfig, spec: ScenarioSpec, label: str, index: int, options: dict) -> float:
    """One selection trial of a mode's stream: its validation score."""
    from editkit.runs.bench import selection

    runtime = setup(**options)
    states, _ = _mode_states(config, spec)
    _, arms, _ = _build_checked(config, spec, states, runtime, NullProgress(), check_banks=False)
    state = states[label]
    grid, coefficient = selection.stream_grid(state)
    trials = selection.StreamTrials(config, spec, arms[state.recipe.adapter], state, runtime=runtime,
                                    progress=NullProgress(), protocols=config.protocols_of(spec),
                                    experiences=config.tune)
    return trials.score(index, grid[index], coefficient)


def _strategy_trial_unit(config: BenchConfig, spec: ScenarioSpec, name: str, index: int, options: dict) -> float:
    """One selection trial of a strategy: its validation score."""
    from editkit.runs.bench import selection

    runtime = setup(**options)
    built, per_task = _strategy_scenario(config, spec, runtime)
    recipes = [per_task[n].resolved(len(built.task(n).train)) for n in spec.task_names[: config.tune]]
    options_of = STRATEGIES.parse_params(config.strategy_params).get(name, {})
    return selection.strategy_trial(name, built, recipes, options_of, index, runtime=runtime, progress=NullProgress(),
                                    protocols=config.protocols_of(spec), experiences=config.tune,
                                    record=StrategyRecord.trial(config, spec, name, index))


def _run_on_cluster(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime, progress: Progress) -> BenchResult:
    """The bench's grid as Ray tasks (:mod:`editkit.runs.bench.cluster`): every repeat's streams and strategies
    at once, each repeat's evaluation as soon as its streams have filled their banks (beside the strategies still
    running); then each report completed with its strategies and assembled as one process does."""
    joined = connect(config.ray)
    over, repeats, ones = _repeats(config, spec)
    for one, reordered in ones:  # every refusal a one-process bench makes, before any unit starts
        _bench_checks(one, reordered, runtime)
    check_shared([config.bank_root, config.run_directory(spec.recipe, spec.name)])
    progress.note(f"bench {spec.name} on {joined}: {len(ones)} repeat(s)")
    options, gpus = _unit_options(runtime), 1.0 if runtime.device.type == "cuda" else 0.0
    prefix = [f"{r.name}/" for r in repeats] or [""]
    labels = [list(config.variants(reordered.recipe)) for _, reordered in ones]
    protocols = [p for p in PROTOCOLS if p in config.protocols_of(spec)] if config.strategies else []
    units = [Unit(f"{p}{label} stream", _stream_unit, (one, reordered, label, options), config.unit_cpus, gpus)
             for p, (one, reordered), modes in zip(prefix, ones, labels) for label in modes]
    first_stream = [sum(map(len, labels[:i])) for i in range(len(ones))]
    units += [Unit(f"{p}{name} ({protocol})", _strategy_unit, (one, reordered, name, protocol, options),
                   config.unit_cpus, gpus)
              for p, (one, reordered) in zip(prefix, ones) for name in config.strategies for protocol in protocols]
    # a repeat's evaluation needs its streams' banks only: it starts when they are done, beside the strategies
    units += [Unit(f"{p}evaluation", _evaluation_unit, (one, reordered, i == 0, modes, options), config.unit_cpus,
                   gpus, needs=tuple(range(first, first + len(modes))))
              for i, (p, (one, reordered), modes, first) in enumerate(zip(prefix, ones, labels, first_stream))]
    results = run_units(units, progress)
    strategies = iter(results[sum(map(len, labels)):])
    per_repeat = [{name: {protocol: next(strategies) for protocol in protocols} for name in config.strategies}
                  for _ in ones]
    reports = []
    for evaluated, ran, (_, reordered) in zip(results[-len(ones):], per_repeat, ones):
        report = with_strategies(evaluated, strategy_sections(ran, reordered.task_names), config.claim_margin)
        write_outputs(report, Path(report["run_dir"]))
        reports.append(report)
    if not repeats:
        return BenchResult(reports[0], config.run_directory(spec.recipe, spec.name))
    return _aggregated(config, spec, over, repeats, reports)


def _bench_checks(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime) -> None:
    """What :func:`_bench_once` refuses before training, for one repeat (its banks and scenario)."""
    from editkit.scenario.build import require_scenario

    states, _ = _mode_states(config, spec)
    require_scenario(spec, config.build)
    _build_checked(config, spec, states, runtime, NullProgress())


def _stream_unit(config: BenchConfig, spec: ScenarioSpec, label: str, options: dict) -> tuple[list[str], float]:
    """One mode's stream of one repeat, as :func:`_run_streams` runs it: (the tasks it trained, its seconds). A
    re-run (its worker died) resumes from the vectors its bank already holds."""
    runtime = setup(**options)
    states, run_dir = _mode_states(config, spec)
    states = {label: states[label]}
    _, arms, _ = _build_checked(config, spec, states, runtime, NullProgress())
    _run_streams(config, spec, states, NullProgress(), runtime, run_dir, arms)
    return states[label].trained, states[label].stream_seconds


def _strategy_unit(config: BenchConfig, spec: ScenarioSpec, name: str, protocol: str, options: dict) -> Any:
    """One strategy's run over one repeat's stream under one protocol (its result, as the report reads it): a
    unit a protocol, so a strategy's two runs (A-GEM's are the longest) share the cluster's CPUs instead of
    running one after the other in one unit."""
    runtime = setup(**options)
    built, per_task = _strategy_scenario(config, spec, runtime)
    return _run_strategies(config, spec, [name], built, per_task, runtime, NullProgress(), (protocol,))[name][protocol]


def _strategy_scenario(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime):
    """A strategy unit's scenario, built as the driver builds it, and every task's recipe."""
    from editkit.scenario.build import build_scenario
    from editkit.scenario.spec import task_recipes

    built = build_scenario(spec, seed=spec.recipe.with_overrides(**config.recipe).seed, build=config.build,
                           device=str(runtime.device), precision=runtime.precision)
    return built, task_recipes(spec, **config.recipe)


def _run_strategies(config: BenchConfig, spec: ScenarioSpec, names: Sequence[str], built,
                    per_task: Mapping[str, Recipe], runtime: Runtime, progress: Progress,
                    protocols: Sequence[str]) -> dict:
    """Each strategy's runs under ``protocols``, over every task's resolved recipe at the strategy's own learning
    rate where ``--tune`` chose one; a run recorded under the bank root for the same inputs is read back."""
    params = STRATEGIES.parse_params(config.strategy_params)
    recipes = [per_task[n].resolved(len(built.task(n).train)) for n in spec.task_names]

    def record(strategy: str, protocol: str) -> StrategyRecord:
        return StrategyRecord.run(config, spec, strategy, protocol)

    return {name: run_strategies([name], params, built,
                                 [r.with_overrides(lr=config.strategy_lr[name]) if name in config.strategy_lr else r
                                  for r in recipes], runtime=runtime, progress=progress, protocols=protocols,
                                 records=record)[name]
            for name in names}


def _evaluation_unit(config: BenchConfig, spec: ScenarioSpec, extras: bool, labels: Sequence[str], options: dict,
                     *streams: tuple[list[str], float]) -> dict[str, Any]:
    """One repeat's evaluation over the banks its stream units filled (``streams``: their results, in ``labels``'
    order): its report without the strategies, which the driver adds and writes."""
    done = _Done(dict(zip(labels, streams)))
    return _bench_once(config, spec, setup(**options), NullProgress(), extras=extras, done=done).report


def _adopt_streams(states: Mapping[str, ModeState], streams: Mapping[str, tuple[list[str], float]]) -> None:
    """What each stream unit did, as if this process had run the stream: the tasks it trained (not "reused"),
    its seconds."""
    for label, (trained, seconds) in streams.items():
        state = states[label]
        state.trained, state.stream_seconds = list(trained), seconds
        for step in state.stream.steps:
            step.resumed = step.task not in trained


def _arms(spec, built: BuiltScenario, states: Mapping[str, ModeState]) -> dict[str, BuiltScenario]:
    """:func:`adapter_arms` for the bench's streams: every task recipe of each adapter's streams."""
    from editkit.scenario.build import adapter_arms
    from editkit.scenario.spec import task_recipes

    recipes: dict[str, list[Recipe]] = {}
    for state in states.values():
        recipes.setdefault(state.recipe.adapter, []).extend(task_recipes(spec, **state.overrides).values())
    return adapter_arms(built, recipes)


def _run_streams(config: BenchConfig, spec: ScenarioSpec, states: Mapping[str, ModeState], progress: Progress,
                 runtime: Runtime, run_dir: Path, arms: Mapping[str, BuiltScenario]) -> None:
    """Each stream through ``run_scenario(resume=True)``, exactly as ``editkit stream`` runs it:
    banked experiences with the same recipe are reused, missing ones trained. Every stream runs over
    the bench's own built scenario of its adapter (the frozen-prefix states of a text are computed once). The
    stream's own report goes to a temporary directory (this bench writes its report only at the end); its
    loggers, if any, write into ``<run_dir>/<label>/`` as it goes."""
    from editkit.runs.stream import run_scenario

    for state in states.values():
        start = time.perf_counter()
        with PeakRSS() as rss, tempfile.TemporaryDirectory(prefix="editkit-bench-stream-") as scratch:
            def on_step(record: StepRecord, state: ModeState = state, rss: PeakRSS = rss) -> None:
                peak = rss.window()
                if not record.resumed:
                    state.trained.append(record.task)
                    state.bank.update_metrics(record.task, {RSS_METRIC: peak})
                    record.extra[RSS_METRIC] = peak

            state.stream, _ = run_scenario(spec, bank=state.bank.root, run_dir=scratch, resume=True,
                                           progress=progress, on_step=on_step, build=config.build, runtime=runtime,
                                           loggers=config.log, log_dir=run_dir / state.label,
                                           built=arms[state.recipe.adapter], **state.overrides,
                                           keep_tangents=config.batch_size == EVAL_BATCH_SIZE)  # same batches
        state.stream_seconds = time.perf_counter() - start
        log.info("%s stream: %d trained, %d reused (%.0f s)", state.label, len(state.trained),
                 len(state.stream.steps) - len(state.trained), state.stream_seconds)


@dataclass
class _ControlTask:
    """ImageNet validation as the negation control: ``val`` tunes alpha, ``test`` reports."""

    name: str
    head: nn.Module
    val: Any
    test: Any


def _control_task(built, config: BenchConfig) -> _ControlTask | None:
    """The ImageNet control when asked for (or, with ``auto``, when the scenario names it and a local copy
    exists); None: control accuracy is the mean over the other tasks."""
    from editkit.runs.edit import imagenet_control

    found = imagenet_control(built, config.control, config.control_data, config.build, tune_alpha=True)
    if found is None:
        return None
    report_split, tune_split = found
    return _ControlTask(report_split.name, report_split.head, tune_split.dataset, report_split.dataset)
