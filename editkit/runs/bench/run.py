"""``editkit bench``: the paper's tables and figures for any scenario.

For each mode (nonlinear, linear, taujp by default; taujp-nonlinear on request) the
scenario's stream is run through ``editkit.runs.stream.run_scenario(resume=True)``, so
vectors already in the bank ``<bank-root>/<scenario>-<mode>`` with the same recipe are
reused, not retrained (every bank is checked against the scenario's tasks, base model,
recipes and parameter shapes before any training starts). Then, on the banked vectors:

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

Everything lands in ``<run-dir>/report.json`` and PNGs, written only at the end
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
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypedDict

import numpy as np
import torch
from torch import nn

from editkit.bank.store import Bank, _short
from editkit.merge.coefficients import NEGATION_RETAIN, PAPER_GRID_POINTS, alpha_grid, search_alpha
from editkit.eval.accuracy import AdditionSummary, addition_summary
from editkit.eval.features import EVAL_BATCH_SIZE
from editkit.settings import default_bank_dir, default_run_dir, torchrun_world, BANKS_DIR, DEFAULT_SCENARIO
from editkit.train.runtime import Runtime, setup
from editkit.integrations.avalanche.strategies import STRATEGIES
from editkit.runs.bench.claims import claims
from editkit.runs.bench.matrices import method_matrices
from editkit.runs.bench.strategies import run_strategies, strategy_sections
from editkit.runs.bench.sections import FIRST_REPEAT_ONLY, diagnostic_sections, negation_section
from editkit.runs.bench.repeats import aggregate, order_repeats, repeat_bank_root, repeat_count, seed_repeats
from editkit.runs.edit import CONTROLS
from editkit.runs.loggers import LOGGERS, parse_loggers
from editkit.runs.records import StepRecord, StreamResult
from editkit.runs.report import jsonable, write_json
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec
from editkit.errors import BankError, ConfigError, check_choices, IncompatibleVectorsError
from editkit.util.fields import choice
from editkit.util.memory import PeakRSS
from editkit.merge import MERGE_METHODS, LazyVectors, method_options
from editkit.merge.ties import TIES_DEFAULT_K
from editkit.util.progress import NullProgress, Progress
from editkit.core.adapters import ADAPTERS
from editkit.core.modes import PAPER_MODES, Mode
from editkit.train.recipe import PENALTIES, Recipe, describe_differences, label_parts
from editkit.eval.sweep import SPLITS, ModeEvaluator, SharedModels, TaskSplits

if TYPE_CHECKING:  # annotations only
    from editkit.scenario.build import BuiltScenario

log = logging.getLogger(__name__)

METHODS = tuple(MERGE_METHODS)  # every registered merge method
#: How tables name each row's method: the merge methods' labels and the two reference rows.
METHOD_LABELS = {"pretrained": "pretrained", **{m: MERGE_METHODS.label(m) for m in METHODS}, "single-task": "single-task",
                 **{s: STRATEGIES.label(s) for s in STRATEGIES}}
DEFAULT_NEGATION_GRID = 11  # 0, 0.1, ..., 1: non-linear negation costs tasks x grid forwards of every validation split
DEFAULT_XI_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0)
DEFAULT_XI_SAMPLES = 250
RSS_METRIC = "bench_peak_rss_bytes"


# --- configuration ----------------------------------------------------------------------------


def parse_names(value: str | Sequence[str], known: Sequence[str], what: str) -> tuple[str, ...]:
    """``"a,b"`` or ``["a", "b"]`` -> ``("a", "b")``, refusing unknown, repeated or no names."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else [str(n).strip() for n in value]
    names = [n for n in names if n]
    if not names:
        raise ConfigError(f"no {what} given; choose from {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown {what} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"a {what[:-1] if what.endswith('s') else what} is named twice in {names}")
    return tuple(names)


@dataclass
class BenchConfig:
    """What ``editkit bench`` runs.

    Each field's ``metadata["help"]`` is its one description (the CLI's options are
    generated from it; ``"cli": False`` marks fields only the Python API sets).
    Explicit ``alphas`` / ``negation_alphas`` override the grids.
    """

    scenario: str = field(default=DEFAULT_SCENARIO, metadata={
        "help": "Scenario name (see `editkit scenarios`) or a .toml file."})
    modes: Sequence[str] = field(default=PAPER_MODES, metadata={
        "help": f"Comma-separated modes to fine-tune and compare (any of {', '.join(Mode)})."})
    methods: Sequence[str] = field(default=METHODS, metadata={
        "help": "Merging methods besides pretrained and single-task."})
    strategies: Sequence[str] = field(default=(), metadata={
        "help": f"Comma-separated Avalanche strategies to run through the same stream beside the modes (any of "
                f"{', '.join(STRATEGIES)}): plain fine-tuning of the same backbone and heads with the recipe's "
                "optimizer, batch and steps, scored after each experience (task- and class-incremental). Default: none."})
    strategy_params: Sequence[str] = field(default=(), metadata={
        "help": "Comma-separated STRATEGY.OPTION=VALUE over a strategy's defaults (e.g. ewc.ewc_lambda=100)."})
    adapters: Sequence[str] | None = field(default=None, metadata={
        "help": f"Comma-separated adapters to compare ({', '.join(ADAPTERS)}): every mode's stream runs once per "
                "adapter, on its own copy of theta_0, and the tables show rows <mode> and <mode>-lora side by side "
                "(adapter streams take the --lora-* fields, --lora-lr their learning rate). Default: the recipe's "
                "adapter (--adapter) alone."})
    penalties: Sequence[str] | None = field(default=None, metadata={
        "help": f"Comma-separated penalties to compare ({', '.join(PENALTIES)}): every penalized mode's stream runs "
                "once per penalty, and the tables show rows <mode> (inputs: the seen tasks' unlabeled inputs) and "
                "<mode>-kfac (their banked curvature, no input) side by side; other modes run once. Default: the "
                "recipe's penalty (--penalty) alone."})
    bank_root: Path = field(default=BANKS_DIR, metadata={
        "help": "Banks live in <bank-root>/<scenario>-<mode>; complete ones with the same recipe are reused, "
                "partial ones resumed."})
    run_dir: Path | None = field(default=None, metadata={
        "help": "Where report.json and the PNGs go (default runs/<scenario>-bench)."})
    log: Sequence[str] = field(default=(), metadata={
        "help": f"Comma-separated loggers ({', '.join(LOGGERS)}) writing each training step's losses, penalty, "
                "lr and gradient norm and each experience's scores into the run directory as the stream goes "
                "(bench: one subdirectory per mode). Default: none."})
    recipe: Mapping[str, Any] = field(default_factory=dict, metadata={
        "cli": False, "help": "Recipe fields replaced for every mode's stream (None values keep the scenario's)."})
    grid: int = field(default=PAPER_GRID_POINTS, metadata={
        "help": "Coefficient grid: N points over [0, 1], searched on validation (the paper's 21)."})
    alphas: Sequence[float] | None = field(default=None, metadata={
        "cli": False, "help": "Explicit addition / TIES coefficients to search (replaces the grid)."})
    negation_grid: int = field(default=DEFAULT_NEGATION_GRID, metadata={
        "help": "Negation coefficient grid: N points over [0, --negation-max] (coarser by default: with non-linear "
                "vectors each point costs a pass over every validation split per task)."})
    negation_alphas: Sequence[float] | None = field(default=None, metadata={
        "cli": False, "help": "Explicit negation coefficients to search (replaces the negation grid)."})
    negation_max: float = field(default=1.0, metadata={
        "help": "Top of the negation grid (try 2 when the tuned alpha lands on 1: vectors that barely touch other "
                "tasks, as tauJp's, can often be negated further before the control drops)."})
    ties_k: float = field(default=TIES_DEFAULT_K, metadata={
        "help": "TIES-merging: fraction of each vector's entries kept (top-k by magnitude)."})
    negation_retain: float = field(default=NEGATION_RETAIN, metadata={
        "help": "Negation: control accuracy to keep, as a fraction of the pretrained model's, when tuning alpha."})
    claim_margin: float = field(default=0.005, metadata={
        "help": "Accuracy difference (a fraction: 0.005 is 0.5 points) within which the report calls tauJp and "
                "the best baseline or variant tied rather than ahead or behind: one seed has no spread of its own "
                "to tell smaller differences from noise; over --seeds or --orders the margin is at least two "
                "standard errors of the difference."})
    matrices: bool = field(default=False, metadata={
        "help": "Also score every merge method after each step (its merge of the vectors so far, coefficient 1, "
                "on the seen tasks' test splits): accuracy matrix, BWT and forgetting rows <mode>/<method>. Costs "
                "one merge per method and step, and in linearized modes a jvp over the seen test inputs each."})
    seeds: int = field(default=1, metadata={
        "help": "Run every stream with N seeds (the recipe's seed, +1, ...; each seed's report in "
                "<run-dir>/seed-<s>/, its banks beside the first seed's in <bank-root>/seed-<s>/) and report "
                "every row as mean ± std over them."})
    orders: int = field(default=1, metadata={
        "help": "Run every stream over N task orders (the scenario's, then seeded permutations; each order's "
                "report in <run-dir>/order-<k>/, its banks in <bank-root>/order-<k>/) and report every row as "
                "mean ± std over them (OPCM's protocol)."})
    xi_pair: Sequence[str] | None = field(default=None, metadata={
        "help": "Task pair 'a,b' for the disentanglement error (default: the first two tasks)."})
    control: str = choice("auto", CONTROLS, "Negation control set: auto (ImageNet validation when the scenario "
                          "asks for it and a local copy is found, else the other tasks) | tasks | imagenet.")
    control_data: Path | None = field(default=None, metadata={
        "help": "Local ImageNet validation copy (default $EDITKIT_IMAGENET, else <data root>/imagenet)."})
    xi_grid: Sequence[float] = field(default=DEFAULT_XI_GRID, metadata={
        "cli": False, "help": "Coefficients of each vector on the disentanglement grid."})
    xi_samples: int = field(default=DEFAULT_XI_SAMPLES, metadata={
        "help": "Test inputs per task for the disentanglement error."})
    batch_size: int = field(default=EVAL_BATCH_SIZE, metadata={"cli": False, "help": "Evaluation batch size."})
    build: BuildOptions = field(default_factory=BuildOptions, metadata={
        "cli": False, "help": "Backbone and data options laid over the scenario file's."})

    def validated(self) -> "BenchConfig":
        """A copy with names parsed and every value checked (raises ConfigError)."""
        modes = parse_names(self.modes, tuple(Mode), "modes")
        methods = parse_names(self.methods, METHODS, "methods")
        strategies = parse_names(self.strategies, STRATEGIES.names(), "strategies") if self.strategies else ()
        params = self.strategy_params.split(",") if isinstance(self.strategy_params, str) else list(self.strategy_params)
        unasked = sorted(set(STRATEGIES.parse_params([p for p in params if p.strip()])) - set(strategies))
        if unasked:
            raise ConfigError(f"--strategy-params sets options of {', '.join(unasked)}, which --strategies does not run")
        recipe = {k: v for k, v in self.recipe.items() if v is not None}
        if "mode" in recipe:
            raise ConfigError("bench runs every mode it is given: choose them with modes (--modes), not recipe.mode")
        adapters = None if self.adapters is None else parse_names(self.adapters, ADAPTERS, "adapters")
        if adapters is not None and "adapter" in recipe:
            raise ConfigError("give the adapters to compare (--adapters) or one adapter for every stream (--adapter), "
                              "not both")
        penalties = None if self.penalties is None else parse_names(self.penalties, PENALTIES, "penalties")
        if penalties is not None and "penalty" in recipe:
            raise ConfigError("give the penalties to compare (--penalties) or one penalty for every stream "
                              "(--penalty), not both")
        Recipe().with_overrides(**recipe)  # unknown fields and bad values are refused here, by name
        if self.alphas is not None:
            alphas = [float(a) for a in self.alphas]
            if not alphas:
                raise ConfigError("the alpha grid is empty; give at least one coefficient")
            if any(not math.isfinite(a) for a in alphas):
                raise ConfigError(f"alpha grid values must be finite, got {alphas}")
        else:
            alphas = alpha_grid(int(self.grid))
        if self.negation_alphas is not None:
            negation_alphas = [float(a) for a in self.negation_alphas]
            if not negation_alphas or any(not math.isfinite(a) for a in negation_alphas):
                raise ConfigError(f"the negation alpha grid must be non-empty and finite, got {negation_alphas}")
        else:
            negation_alphas = alpha_grid(int(self.negation_grid), float(self.negation_max))
        if not 0.0 < self.ties_k <= 1.0:
            raise ConfigError(f"TIES top-k fraction must be in (0, 1], got {self.ties_k}")
        if not 0.0 <= self.negation_retain <= 1.0:
            raise ConfigError(f"negation control retention must be in [0, 1], got {self.negation_retain}")
        if not 0.0 <= self.claim_margin < 1.0:
            raise ConfigError(f"the claim margin is an accuracy difference in [0, 1), got {self.claim_margin}")
        seeds, orders = repeat_count(self.seeds, "--seeds", "seeds"), repeat_count(self.orders, "--orders", "task orders")
        if seeds > 1 and orders > 1:
            raise ConfigError("give --seeds or --orders, not both: a bench repeats over one of them")
        if not list(self.xi_grid):
            raise ConfigError("the xi grid is empty")
        if self.xi_samples < 1 or self.batch_size < 1:
            raise ConfigError("xi_samples and batch_size must be >= 1")
        check_choices(self, "bench")
        pair = None
        if self.xi_pair is not None:
            pair = tuple(n.strip() for n in (self.xi_pair.split(",") if isinstance(self.xi_pair, str) else self.xi_pair))
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ConfigError(f"--xi-pair needs two different task names 'a,b', got {self.xi_pair!r}")
        return replace(
            self, modes=modes, methods=methods, strategies=strategies,
            strategy_params=tuple(p.strip() for p in params if p.strip()), adapters=adapters, penalties=penalties,
            log=parse_loggers(self.log),
            bank_root=Path(self.bank_root),
            run_dir=Path(self.run_dir) if self.run_dir is not None else None, recipe=recipe,
            grid=len(alphas), alphas=tuple(alphas), negation_grid=len(negation_alphas),
            negation_alphas=tuple(negation_alphas), negation_max=max(negation_alphas), ties_k=float(self.ties_k),
            negation_retain=float(self.negation_retain), claim_margin=float(self.claim_margin), xi_pair=pair,
            xi_grid=tuple(float(a) for a in self.xi_grid), xi_samples=int(self.xi_samples),
            batch_size=int(self.batch_size), seeds=seeds, orders=orders,
        )

    def variants(self, base: Recipe) -> dict[str, dict[str, Any]]:
        """The streams to run over a scenario whose recipe is ``base``, keyed by their label (the mode, plus
        ``-kfac`` with the data-free penalty and ``-lora`` with an adapter: their report keys and default bank
        names), each with the recipe fields it overrides; adapter-major, so a table's full rows and adapter rows
        form two blocks. Call on a validated config."""
        adapters = self.adapters if self.adapters is not None else (None,)
        variants = {}
        for adapter in adapters:
            for mode in self.modes:
                penalties = self.penalties if self.penalties is not None and Mode(mode).penalized else (None,)
                for penalty in penalties:
                    overrides = {**self.recipe, "mode": mode, **({"adapter": adapter} if adapter else {}),
                                 **({"penalty": penalty} if penalty else {})}
                    variants[base.with_overrides(**overrides).label] = overrides
        return variants

    def run_directory(self, base: Recipe, scenario: str) -> Path:
        """``run_dir``, else ``runs/<scenario>-bench``: ``-bench-lora`` for adapter streams, ``-bench-lora-full``
        when they are compared with full ones (``base``: the scenario's recipe)."""
        if self.run_dir is not None:
            return self.run_dir
        adapters = {base.with_overrides(**overrides).adapter for overrides in self.variants(base).values()}
        suffix = "-" + "-".join(sorted(adapters - {"none"})) + ("-full" if "none" in adapters else "")
        return default_run_dir(scenario, "bench" + (suffix if adapters != {"none"} else ""))


# --- report rows --------------------------------------------------------------------------------


class AdditionRow(TypedDict, total=False):
    """One row of the task-addition table (``report["addition"]["rows"]``); the ``val_*`` keys are
    the same summary on the validation splits (absent where there is nothing to tune)."""

    method: str  # pretrained | task-arithmetic | ties | single-task
    label: str
    mode: str | None
    variant: str | None  # the stream the vectors come from: the mode, or <mode>-lora for adapter vectors
    coefficient: str | None  # "1.0" | "tuned" | None
    alpha: float | None
    per_task: dict[str, float]
    absolute: float
    normalized: float | None
    class_incremental: float  # mean over tasks of their accuracy among every task's classes, no task id
    class_incremental_per_task: dict[str, float]
    val_absolute: float
    val_normalized: float | None


class StreamSection(TypedDict):
    """``report["streams"][mode]``: where the mode's vectors came from and the stream's numbers."""

    bank: str
    seconds: float
    trained: list[str]
    steps: list[dict[str, Any]]  # StepRecord fields: step, task, resumed, single_task, pretrained, merged


class CostSection(TypedDict):
    """``report["cost"][mode]``: fine-tuning (from the bank's per-step records) and merging cost."""

    finetune_seconds: float
    steps: int
    seconds_per_step: float | None  # finetune_seconds / steps: warm-up and slow spells included
    setup_seconds: float | None  # before the first steps and in the warm-up steps, summed over tasks
    steady_seconds_per_step: float | None  # each task's median step after warm-up, weighted by its steps
    steady_over_linear: float | None  # that step over the linear stream's of the same adapter (None without one)
    peak_rss_bytes: int | None
    peak_rss_mib: float | None
    merge_seconds: float
    ties_seconds: float | None
    method_seconds: dict[str, float]  # each merge method's time to build its vectors (the streamed sum: merge_seconds)
    total_seconds: float
    trained_now: list[str]
    reused: list[str]


def _class_incremental(per_task: Mapping[str, float]) -> dict[str, Any]:
    """A row's class-incremental numbers: each task's accuracy among every task's classes, and their mean."""
    return {"class_incremental": float(np.mean(list(per_task.values()))),
            "class_incremental_per_task": dict(per_task)}


def _row(method: str, ev: ModeEvaluator | None, coefficient: str | None, alpha: float | None,
         per_task: Mapping[str, float], single: Mapping[str, float] | None, **extra: Any) -> AdditionRow:
    return {"method": method, "label": METHOD_LABELS[method], "mode": ev.mode if ev else None,
            "variant": ev.label if ev else None, "coefficient": coefficient, "alpha": alpha,
            "per_task": dict(per_task), **addition_summary(per_task, single), **extra}


# --- the bench --------------------------------------------------------------------------------


@dataclass
class BenchResult:
    report: dict[str, Any]
    run_dir: Path

    @property
    def report_path(self) -> Path:
        return self.run_dir / "report.json"


@dataclass
class _ModeState:
    label: str  # the mode, plus -lora for an adapter stream (BenchConfig.variants)
    recipe: Recipe  # the scenario's [recipe] with this bench's overrides
    overrides: dict[str, Any]  # those overrides, as the stream takes them
    bank: Bank
    task_recipes: dict[str, dict[str, Any]] = field(default_factory=dict)  # resolved, as the bank records them
    stream: StreamResult | None = None
    stream_seconds: float = 0.0
    trained: list[str] = field(default_factory=list)


def check_bank(bank: Bank, *, scenario: str, tasks: Sequence[str], mode: str, recipes: Mapping[str, Mapping[str, Any]],
               base: str, backbone: str, shapes: Mapping[str, tuple[int, ...]] | None = None,
               spec: ScenarioSpec | None = None, build: BuildOptions | None = None) -> None:
    """Refuse a bank this bench cannot reuse or extend: other base, tasks, mode, scenario or recipe
    (``recipes``: each task's resolved recipe, as the stream records it), other task options than ``spec``'s with
    ``build`` (where the bank recorded them), or (given the backbone's parameter ``shapes``) vectors whose tensors
    do not fit the backbone."""
    if not bank.exists() or not len(bank):
        return
    if bank.base != base:
        raise IncompatibleVectorsError(
            f"bank {bank.root} holds vectors fine-tuned from base {_short(bank.base)}, not from scenario "
            f"{scenario!r}'s {backbone} ({_short(base)}); pass another --bank-root or remove that bank"
        )
    for entry in bank.entries():
        where = f"bank {bank.root} holds vector {entry.name!r}"
        if entry.name not in tasks or entry.task != entry.name:
            raise BankError(f"{where} for task {entry.task!r}, which is not a task of scenario {scenario!r} "
                            f"({', '.join(tasks)}); pass another --bank-root or remove it")
        if entry.mode != mode:
            raise BankError(f"{where} of mode {entry.mode!r}, expected {mode!r}; pass another --bank-root")
        if entry.scenario != scenario:
            raise BankError(f"{where} from scenario {entry.scenario!r}, not {scenario!r}; pass another --bank-root")
        wanted = dict(recipes[entry.name])
        if detail := describe_differences(entry.recipe, wanted):
            raise BankError(f"{where} fine-tuned with another recipe ({detail}); use the same recipe options "
                            "(--steps, --seed...) or another --bank-root")
        from editkit.runs.stream import task_option_differences  # imported where used, as the stream is here

        if spec is not None and (detail := task_option_differences(entry, spec, build or BuildOptions())):
            raise BankError(f"{where} fine-tuned on other data ({detail}); pass another --bank-root, or remove it "
                            f"(editkit bank remove {entry.name} --bank {bank.root})")
        if shapes is not None:
            _check_layout(bank, entry, shapes, backbone)


def _check_layout(bank: Bank, entry, shapes: Mapping[str, tuple[int, ...]], backbone: str) -> None:
    """The vector's tensor names and shapes (read from the file header only) fit the backbone."""
    stored = bank.shapes(entry.name)
    unknown = sorted(set(stored) - set(shapes))
    wrong = sorted(k for k in set(stored) & set(shapes) if stored[k] != tuple(shapes[k]))
    if unknown or wrong:
        detail = (f"parameters the backbone lacks: {unknown[:3]}" if unknown else
                  f"shape of {wrong[0]!r} is {stored[wrong[0]]}, the backbone's {tuple(shapes[wrong[0]])}")
        raise IncompatibleVectorsError(f"bank {bank.root}: vector {entry.name!r} does not fit {backbone} ({detail})")


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
    if config.seeds > 1 or config.orders > 1:
        return _run_repeats(config, spec, runtime, progress)
    return _bench_once(config, spec, runtime, progress)


def _bench_once(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime, progress: Progress, *,
                extras: bool = True) -> BenchResult:
    """One bench of ``spec`` (its tasks in the order it lists them), with a validated ``config``; without
    ``extras``, no negation and no diagnostics (a repeat whose report only the repeated one reads)."""
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
    require_scenario(spec, config.build)

    timings: dict[str, Any] = {}
    t0 = time.perf_counter()
    built, arms, bases = _build_checked(config, spec, states, runtime, progress)
    control = _control_task(built, config)
    timings["build_seconds"] = time.perf_counter() - t0

    _run_streams(config, spec, states, progress, runtime, run_dir, arms)
    timings["stream_seconds"] = {m: s.stream_seconds for m, s in states.items()}
    t0 = time.perf_counter()
    per_task = task_recipes(spec, **config.recipe)
    strategies = strategy_sections(run_strategies(
        config.strategies, STRATEGIES.parse_params(config.strategy_params), built,
        [per_task[n].resolved(len(built.task(n).train)) for n in tasks], runtime=runtime, progress=progress), tasks)
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
        mode_results[label] = _evaluate_mode(ev, config, tasks, pretrained_all, control, progress)
        if extras:
            negation[label] = negation_section(ev, tasks, pretrained_all, control.name if control else None, progress,
                                               alphas=config.negation_alphas, retain=config.negation_retain)
        timings.setdefault("evaluation_seconds", {})[label] = time.perf_counter() - t0

    t0 = time.perf_counter()
    sections = ({"negation": negation, **diagnostic_sections(evaluators, mode_results, tasks, pair, progress,
                                                             xi_grid=config.xi_grid, xi_samples=config.xi_samples)}
                if extras else {})
    timings["diagnostics_seconds"] = time.perf_counter() - t0

    report = _report(spec, built, config, states, tasks, pretrained, mode_results, sections, strategies, run_dir)
    if not extras:
        report["left_out"] = {"sections": list(FIRST_REPEAT_ONLY),
                              "why": "a repeat after the first: the repeated report reads none of them"}
    report["torch_threads"] = torch.get_num_threads()
    report["runtime"] = runtime.describe()  # with the threads, what the numbers depend on beyond the seed
    timings["total_seconds"] = time.perf_counter() - started
    report["timings"] = timings
    _write_outputs(report, run_dir)
    log.info("bench %s done in %.0f s; report %s", spec.name, timings["total_seconds"], run_dir / "report.json")
    return BenchResult(report, run_dir)


def _mode_states(config: BenchConfig, spec: ScenarioSpec) -> tuple[dict[str, _ModeState], Path]:
    """Each stream's state (its recipe and bank) and the run directory, refused by name where a path is a file."""
    states = {label: _ModeState(label, spec.recipe.with_overrides(**overrides), overrides,
                                Bank(default_bank_dir(spec.name, label, root=config.bank_root)))
              for label, overrides in config.variants(spec.recipe).items()}
    run_dir = config.run_directory(spec.recipe, spec.name)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} exists and is not a directory")
    for state in states.values():
        if state.bank.root.exists() and not state.bank.root.is_dir():
            raise ConfigError(f"bank path {state.bank.root} exists and is not a directory")
    return states, run_dir


def _build_checked(config: BenchConfig, spec: ScenarioSpec, states: Mapping[str, _ModeState], runtime: Runtime,
                   progress: Progress) -> tuple[BuiltScenario, dict[str, BuiltScenario], dict[str, str]]:
    """(the built scenario, its arm per adapter, each arm's base fingerprint), with every stream's bank checked
    against them and each state's per-task recipes set: every refusal happens before any training."""
    from editkit.scenario.spec import task_recipes
    from editkit.scenario.build import build_scenario

    tasks = spec.task_names
    seed = next(iter(states.values())).recipe.seed
    built = build_scenario(spec, seed=seed, progress=progress, build=config.build, device=str(runtime.device),
                           precision=runtime.precision)
    _refuse_unswept_heads(spec.name, built.heads)
    arms = _arms(spec, built, states)
    bases = {adapter: arm.backbone.fingerprint() for adapter, arm in arms.items()}
    for state in states.values():
        arm = arms[state.recipe.adapter]
        per_task = task_recipes(spec, **state.overrides)
        state.task_recipes = {n: per_task[n].resolved(len(built.task(n).train)).to_dict() for n in tasks}
        shapes = {n: tuple(p.shape) for n, p in arm.backbone.module.named_parameters()}
        check_bank(state.bank, scenario=spec.name, tasks=tasks, mode=state.recipe.mode, recipes=state.task_recipes,
                   base=bases[state.recipe.adapter], backbone=built.backbone.name, shapes=shapes, spec=spec,
                   build=config.build)
    return built, arms, bases


def _run_repeats(config: BenchConfig, spec: ScenarioSpec, runtime: Runtime, progress: Progress) -> BenchResult:
    """One whole bench per seed or task order (:mod:`editkit.runs.bench.repeats`), then their means and
    spreads; a run that fails stops the bench before the aggregated report is written."""
    seed = int(config.recipe.get("seed", spec.recipe.seed))
    over = "seeds" if config.seeds > 1 else "orders"
    repeats = (seed_repeats(seed, config.seeds, spec.task_names) if over == "seeds"
               else order_repeats(spec.task_names, config.orders, seed))
    run_dir = config.run_directory(spec.recipe, spec.name)
    runs = [run_dir / repeat.name for repeat in repeats]
    results = []
    for repeat, run in zip(repeats, runs):
        log.info("bench %s: %s (%s)", spec.name, repeat.name, ", ".join(repeat.order))
        one = replace(config, seeds=1, orders=1, recipe={**config.recipe, "seed": repeat.seed}, run_dir=run,
                      bank_root=repeat_bank_root(config.bank_root, repeat, repeats[0]))
        results.append(_bench_once(one, spec.reordered(repeat.order), runtime, progress, extras=repeat == repeats[0]))
    report = jsonable(aggregate([r.report for r in results], repeats, over, runs, config.claim_margin))
    report["run_dir"] = str(run_dir)
    _write_outputs(report, run_dir)
    return BenchResult(report, run_dir)


def _arms(spec, built: BuiltScenario, states: Mapping[str, _ModeState]) -> dict[str, BuiltScenario]:
    """:func:`adapter_arms` for the bench's streams: every task recipe of each adapter's streams."""
    from editkit.scenario.build import adapter_arms
    from editkit.scenario.spec import task_recipes

    recipes: dict[str, list[Recipe]] = {}
    for state in states.values():
        recipes.setdefault(state.recipe.adapter, []).extend(task_recipes(spec, **state.overrides).values())
    return adapter_arms(built, recipes)


def _run_streams(config: BenchConfig, spec: ScenarioSpec, states: Mapping[str, _ModeState], progress: Progress,
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
            def on_step(record: StepRecord, state: _ModeState = state, rss: PeakRSS = rss) -> None:
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


def _single_task(ev: ModeEvaluator, tasks: Sequence[str], split: str) -> dict[str, float]:
    return {t: ev.accuracies({t: 1.0}, split, [t])[t] for t in tasks}


def _evaluate_mode(ev: ModeEvaluator, config: BenchConfig, tasks: Sequence[str],
                   pretrained: Mapping[str, Mapping[str, float]], control: _ControlTask | None,
                   progress: Progress) -> dict[str, Any]:
    mode, alphas = ev.label, list(config.alphas)
    if ev.linearized:
        with progress.task(f"{mode}: tangents J·tau (one jvp per input)", total=ev.tangent_batches(tasks)) as bar:
            ev.compute_tangents(tasks, bar=bar)
    out: dict[str, Any] = {"alpha_search": {}, "rows": [], "merge_seconds": None, "method_seconds": {}}
    single = {s: _single_task(ev, tasks, s) for s in SPLITS}
    out["single"] = single

    def addition(method: str, combo_of: Callable[[float], dict[str, float]]) -> None:
        summaries: list[AdditionSummary] = []

        def validation_absolute(a: float) -> float:
            summaries.append(addition_summary(ev.accuracies(combo_of(a), "val", tasks), single["val"]))
            bar.advance(1)
            return summaries[-1]["absolute"]

        with progress.task(f"{mode}: {METHOD_LABELS[method]} — coefficient search on validation", total=len(alphas)) as bar:
            chosen, val_abs = search_alpha(alphas, validation_absolute)
        val_norm = [s["normalized"] for s in summaries]
        out["alpha_search"][method] = {"alphas": alphas, "val_absolute": val_abs, "val_normalized": val_norm,
                                       "chosen": chosen}
        for coefficient, a in (("1.0", 1.0), ("tuned", chosen)):
            per_task = ev.accuracies(combo_of(a), "test", tasks)
            val = addition_summary(ev.accuracies(combo_of(a), "val", tasks), single["val"])
            out["rows"].append(_row(method, ev, coefficient, a, per_task, single["test"],
                                    val_absolute=val["absolute"], val_normalized=val["normalized"],
                                    **_class_incremental(ev.class_incremental_accuracies(combo_of(a), "test", tasks))))

    for method in (m for m in METHODS if m in config.methods):  # registry order, whatever order they were named in
        start = time.perf_counter()
        merged = MERGE_METHODS[method].build(LazyVectors(tasks, ev.vector),
                                             **_method_options(config, len(tasks))[method])
        built = [name for name in merged if name not in tasks]  # vectors the method made (TIES...: its merged one)
        for name in built:
            ev.add_vector(name, merged[name])
        out["method_seconds"][method] = time.perf_counter() - start
        if built and ev.linearized:
            with progress.task(f"{mode}: tangents of the {METHOD_LABELS[method]} vector",
                               total=ev.tangent_batches(built)) as bar:
                ev.compute_tangents(built, bar=bar)
        names = built or list(tasks)
        addition(method, lambda a, names=names: {n: a for n in names})
    out["continual"] = method_matrices(ev, [m for m in METHODS if m in config.methods], tasks, out["rows"],
                                       lambda t: _method_options(config, t), progress) if config.matrices else {}
    alone = {t: ev.class_incremental_accuracies({t: 1.0}, "test", [t])[t] for t in tasks}
    out["rows"].append(_row("single-task", ev, None, 1.0, single["test"], single["test"],
                            val_absolute=addition_summary(single["val"], None)["absolute"], **_class_incremental(alone)))
    out["pretrained_class_incremental"] = ev.class_incremental_accuracies({}, "test", tasks)

    # merging time: the bank's streamed sum of every vector (median of 3)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ev.bank.merge({t: 1.0 for t in tasks}, base=ev.base)
        times.append(time.perf_counter() - start)
    out["merge_seconds"] = float(np.median(times))
    return out


def _method_options(config: BenchConfig, tasks: int) -> dict[str, dict[str, Any]]:
    """Each merge method's options: its defaults for ``tasks`` vectors, with ``--ties-k`` as TIES' ``k``."""
    given = {"ties": {"k": config.ties_k}}
    return {m: method_options(m, given.get(m, {}), tasks=tasks) for m in METHODS}


def _cost(state: _ModeState, result: Mapping[str, Any], tasks: Sequence[str]) -> CostSection:
    entries = {e.name: e for e in state.bank.entries()}
    metrics = [entries[t].metrics for t in tasks]
    finetune = float(sum(m.get("train_seconds", 0.0) for m in metrics))
    steps = int(sum(entries[t].metrics.get("train_steps", entries[t].recipe.get("steps", 0)) for t in tasks))
    rss = [m[RSS_METRIC] for m in metrics if isinstance(m.get(RSS_METRIC), (int, float))]
    merge = result["merge_seconds"]
    timed = steps and all(m.get("steady_seconds_per_step") is not None for m in metrics)  # banks before: None
    return {
        "finetune_seconds": finetune,
        "steps": steps,
        "seconds_per_step": finetune / steps if steps else None,
        "setup_seconds": sum(m["setup_seconds"] + m["warmup_seconds"] for m in metrics) if timed else None,
        "steady_seconds_per_step": (sum(m["steady_seconds_per_step"] * m["train_steps"] for m in metrics) / steps
                                    if timed else None),
        "peak_rss_bytes": int(max(rss)) if rss else None,
        "peak_rss_mib": max(rss) / 2**20 if rss else None,
        "merge_seconds": merge,
        "ties_seconds": result["method_seconds"].get("ties"),  # the report's key since its first version
        "method_seconds": dict(result["method_seconds"]),
        "total_seconds": finetune + merge,
        "trained_now": list(state.trained),
        "reused": [t for t in tasks if t not in state.trained],
    }


def with_step_ratios(cost: dict[str, CostSection]) -> dict[str, CostSection]:
    """Each stream's steady step over the linear stream's of the same adapter (``taujp-lora`` against
    ``linear-lora``): what a mode's step costs against the linearized step, without one-off work."""
    for label, section in cost.items():
        adapter = label_parts(label)[1]
        linear = cost.get("linear" if adapter == "none" else f"linear-{adapter}", {}).get("steady_seconds_per_step")
        steady = section["steady_seconds_per_step"]
        section["steady_over_linear"] = steady / linear if steady and linear else None
    return cost


def _refuse_unswept_heads(scenario: str, heads: Mapping[str, nn.Module]) -> None:
    """The coefficient sweeps score a class head's argmax over features; a head with an objective of its own
    (text-to-text) is scored by running the model, which ``editkit stream`` and ``editkit add`` do."""
    other = sorted({h.objective for h in heads.values() if getattr(h, "objective", None) is not None})
    if other:
        raise ConfigError(f"editkit bench sweeps classification heads; the heads of {scenario!r} are {', '.join(other)}: "
                          f"score its vectors with editkit stream and editkit add")


def _report(spec, built, config: BenchConfig, states: Mapping[str, _ModeState], tasks: Sequence[str],
            pretrained: Mapping[str, Mapping[str, float]], results: Mapping[str, dict[str, Any]],
            sections: Mapping[str, Any], strategies: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    theta0 = next(iter(results.values()))["pretrained_class_incremental"]
    rows = [_row("pretrained", None, None, None, pretrained["test"], None,
                 val_absolute=addition_summary(pretrained["val"], None)["absolute"], **_class_incremental(theta0))]
    for mode in states:
        rows += results[mode]["rows"]
    rows += strategies["rows"]
    streams: dict[str, StreamSection] = {}
    for mode, state in states.items():
        streams[mode] = {
            "bank": str(state.bank.root),
            "seconds": state.stream_seconds,
            "trained": list(state.trained),
            "steps": [{"step": s.step, "task": s.task, "resumed": s.resumed, "single_task": s.single_task,
                       "pretrained": s.pretrained, "merged": dict(s.merged)} for s in state.stream.steps],
        }
    return jsonable({
        "scenario": spec.name,
        "scenario_file": str(spec.path) if spec.path else None,
        "backbone": built.backbone.name,
        "tasks": list(tasks),
        "modes": list(states),
        "methods": list(config.methods),
        "recipes": {m: s.recipe.to_dict() for m, s in states.items()},
        "task_recipes": {m: s.task_recipes for m, s in states.items()},
        "grid": list(config.alphas),
        "negation_grid": list(config.negation_alphas),
        "ties_k": config.ties_k,
        "method_options": {m: options for m, options in _method_options(config, len(tasks)).items()
                           if m in config.methods},
        # the order the vectors were merged in, which the merged vector of these methods depends on
        "order": {m: list(tasks) for m in config.methods if MERGE_METHODS[m].order_dependent},
        "method_references": {m: MERGE_METHODS[m].reference_url for m in config.methods},
        "run_dir": str(run_dir),
        "addition": {"split": "test", "tuned_on": "val", "columns": list(tasks) + ["absolute", "normalized"], "rows": rows},
        "alpha_search": {m: results[m]["alpha_search"] for m in states},
        "single_task": {m: results[m]["single"] for m in states},
        "pretrained": dict(pretrained),
        **sections,  # negation, taujp, xi (none in a repeat after the first)
        "streams": streams,
        # the continual-learning field's numbers of each stream's merged model after every step
        "continual": {**{mode: state.stream.continual for mode, state in states.items()},
                      **{f"{mode}/{method}": numbers for mode in states
                         for method, numbers in results[mode]["continual"].items()},
                      **strategies["continual"]},
        "strategies": strategies["strategies"],
        "strategy_cost": strategies["strategy_cost"],
        "cost": with_step_ratios({m: _cost(states[m], results[m], tasks) for m in states}),
        "claims": claims(rows, config.claim_margin),
    })


def _write_outputs(report: dict[str, Any], run_dir: Path) -> None:
    """PNGs rendered into a temporary sibling directory, moved into place, then report.json (atomic)."""
    from editkit.runs.bench.plots import render_all

    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=run_dir, prefix=".bench-"))
    try:
        plots = render_all(report, tmp)
        report["plots"] = plots
        for name in plots.values():
            os.replace(tmp / name, run_dir / name)
        write_json(run_dir / "report.json", report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
