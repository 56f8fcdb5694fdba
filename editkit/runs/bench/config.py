"""What ``editkit bench`` runs: :class:`BenchConfig`, its checks and the streams and options it implies.

Apart from the runner (:mod:`editkit.runs.bench.run`) so the command line builds its options from these fields,
and refuses a bad value, without importing what runs a bench.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from editkit.core.adapters import ADAPTERS
from editkit.core.modes import PAPER_MODES, Mode
from editkit.errors import ConfigError, check_choices
from editkit.eval.continual import PROTOCOLS
from editkit.eval.features import EVAL_BATCH_SIZE
from editkit.integrations.avalanche.strategies import STRATEGIES
from editkit.merge import MERGE_METHODS, method_options
from editkit.merge.coefficients import NEGATION_RETAIN, PAPER_GRID_POINTS, alpha_grid
from editkit.merge.ties import TIES_DEFAULT_K
from editkit.runs.bench.repeats import repeat_count
from editkit.runs.edit import CONTROLS
from editkit.runs.loggers import LOGGERS, parse_loggers
from editkit.scenario.options import BuildOptions
from editkit.settings import BANKS_DIR, DEFAULT_SCENARIO, default_run_dir
from editkit.train.recipe import PENALTIES, Recipe
from editkit.util.fields import choice

METHODS = tuple(MERGE_METHODS)  # every registered merge method
DEFAULT_NEGATION_GRID = 11  # 0, 0.1, ..., 1: non-linear negation costs tasks x grid forwards of every validation split
DEFAULT_XI_GRID = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0)
DEFAULT_XI_SAMPLES = 250


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
    protocols: Sequence[str] | None = field(default=None, metadata={
        "help": "Comma-separated protocols every row is scored under (any of task, class). task: each input "
                "classified among its own task's classes, the task id given (the scenario's frozen heads). class: "
                "class-incremental as the field runs it, no task id: merged models classify by the class "
                "statistics banked beside each vector (class means and a shared covariance: one discriminant head "
                "over every seen class), strategies train "
                "Avalanche's IncrementalClassifier over global labels (a second run of each). Default: every "
                "protocol the scenario can run (both for classification; a language scenario has neither)."})
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
    ray: str | None = field(default=None, metadata={
        "help": "Run the bench's units (each mode's stream per seed or order, each strategy, each repeat's "
                "evaluation) as tasks of a Ray cluster: 'auto' (the one running here, else a local one) or its "
                "address. Banks and run directory must be on a filesystem every node sees. Needs the ray extra."})
    tune: int = field(default=0, metadata={
        "help": "Choose every row's learning rate and own coefficient (tauJp's lam, EWC's and SI's lambda, LwF's "
                "alpha) on the validation splits of the first N experiences, with the same 9 trials for every row "
                "(A-GEM's protocol), then run the whole stream once with the choice: recorded in report.json "
                "(selection). Trials bank under <bank-root>/tune/, the tuned streams under <bank-root>/tuned/. "
                "0: every row runs its defaults."})
    row_recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, metadata={
        "cli": False, "help": "Recipe fields of one stream, by its label (what --tune chose), over recipe's."})
    strategy_lr: Mapping[str, float] = field(default_factory=dict, metadata={
        "cli": False, "help": "A strategy's learning rate, by its name (what --tune chose), over the recipe's."})
    selection: Mapping[str, Any] | None = field(default=None, metadata={
        "cli": False, "help": "What --tune tried and chose, for the report (set by the bench)."})
    unit_cpus: int = field(default=1, metadata={
        "help": "With --ray: CPUs each unit asks for, its torch threads (the rows equal the plain command's run "
                "with --threads of this number)."})
    batch_size: int = field(default=EVAL_BATCH_SIZE, metadata={"cli": False, "help": "Evaluation batch size."})
    build: BuildOptions = field(default_factory=BuildOptions, metadata={
        "cli": False, "help": "Backbone and data options laid over the scenario file's."})

    def validated(self) -> "BenchConfig":
        """A copy with names parsed and every value checked (raises ConfigError)."""
        modes = parse_names(self.modes, tuple(Mode), "modes")
        methods = parse_names(self.methods, METHODS, "methods")
        strategies, params = self._strategies()
        protocols = (None if self.protocols is None else
                     tuple(p for p in PROTOCOLS if p in parse_names(self.protocols, PROTOCOLS, "protocols")))
        recipe, adapters, penalties = self._recipe()
        alphas, negation_alphas = self._grids()
        self._check_numbers()
        seeds, orders = repeat_count(self.seeds, "--seeds", "seeds"), repeat_count(self.orders, "--orders", "task orders")
        if seeds > 1 and orders > 1:
            raise ConfigError("give --seeds or --orders, not both: a bench repeats over one of them")
        check_choices(self, "bench")
        return replace(
            self, modes=modes, methods=methods, strategies=strategies, strategy_params=params, protocols=protocols,
            adapters=adapters,
            penalties=penalties, log=parse_loggers(self.log), bank_root=Path(self.bank_root),
            run_dir=Path(self.run_dir) if self.run_dir is not None else None, recipe=recipe,
            grid=len(alphas), alphas=tuple(alphas), negation_grid=len(negation_alphas),
            negation_alphas=tuple(negation_alphas), negation_max=max(negation_alphas), ties_k=float(self.ties_k),
            negation_retain=float(self.negation_retain), claim_margin=float(self.claim_margin),
            xi_pair=self._xi_pair(), xi_grid=tuple(float(a) for a in self.xi_grid), xi_samples=int(self.xi_samples),
            batch_size=int(self.batch_size), seeds=seeds, orders=orders, unit_cpus=int(self.unit_cpus),
            tune=int(self.tune),
        )

    def _strategies(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the strategies to run, their ``NAME.key=value`` options), each option checked by its strategy's
        record and refused when its strategy is not run."""
        strategies = parse_names(self.strategies, STRATEGIES.names(), "strategies") if self.strategies else ()
        given = self.strategy_params.split(",") if isinstance(self.strategy_params, str) else self.strategy_params
        params = tuple(p.strip() for p in given if p.strip())
        unasked = sorted(set(STRATEGIES.parse_params(params)) - set(strategies))
        if unasked:
            raise ConfigError(f"--strategy-params sets options of {', '.join(unasked)}, which --strategies does not run")
        return strategies, params

    def _recipe(self) -> tuple[dict[str, Any], tuple[str, ...] | None, tuple[str, ...] | None]:
        """(the recipe fields set, the adapters compared, the penalties compared): a field is set for every stream
        or compared across streams, never both."""
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
        for label, fields in self.row_recipes.items():
            Recipe().with_overrides(**{**recipe, **fields})
        return recipe, adapters, penalties

    def _grids(self) -> tuple[list[float], list[float]]:
        """The addition and negation coefficients searched: the explicit ones, else the grids'."""
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
        return alphas, negation_alphas

    def _check_numbers(self) -> None:
        if not 0.0 < self.ties_k <= 1.0:
            raise ConfigError(f"TIES top-k fraction must be in (0, 1], got {self.ties_k}")
        if not 0.0 <= self.negation_retain <= 1.0:
            raise ConfigError(f"negation control retention must be in [0, 1], got {self.negation_retain}")
        if not 0.0 <= self.claim_margin < 1.0:
            raise ConfigError(f"the claim margin is an accuracy difference in [0, 1), got {self.claim_margin}")
        if not list(self.xi_grid):
            raise ConfigError("the xi grid is empty")
        if self.xi_samples < 1 or self.batch_size < 1:
            raise ConfigError("xi_samples and batch_size must be >= 1")
        if int(self.tune) < 0:
            raise ConfigError(f"--tune is a number of experiences, at least 1 (0: no selection); got {self.tune}")
        if int(self.unit_cpus) < 1:
            raise ConfigError(f"--unit-cpus must be >= 1, got {self.unit_cpus}")

    def _xi_pair(self) -> tuple[str, str] | None:
        if self.xi_pair is None:
            return None
        pair = tuple(n.strip() for n in (self.xi_pair.split(",") if isinstance(self.xi_pair, str) else self.xi_pair))
        if len(pair) != 2 or pair[0] == pair[1]:
            raise ConfigError(f"--xi-pair needs two different task names 'a,b', got {self.xi_pair!r}")
        return pair

    def protocols_of(self, spec) -> tuple[str, ...]:
        """The protocols a bench of ``spec`` scores (call on a validated config): the ones asked for, else every
        one; refused in one line, before any work, for a language scenario, whose scores are perplexities."""
        if not spec.language:
            return tuple(self.protocols or PROTOCOLS)
        if self.protocols:
            raise ConfigError(f"--protocols {','.join(self.protocols)}: scenario {spec.name!r} is a language-model "
                              "scenario, scored by perplexity; task- and class-incremental accuracy are for "
                              "classification scenarios")
        return ()

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
                    label = base.with_overrides(**overrides).label
                    variants[label] = {**overrides, **self.row_recipes.get(label, {})}
        return variants

    def run_directory(self, base: Recipe, scenario: str) -> Path:
        """``run_dir``, else ``runs/<scenario>-bench``: ``-bench-lora`` for adapter streams, ``-bench-lora-full``
        when they are compared with full ones, ``-tuned`` after either with ``--tune`` (``base``: the scenario's
        recipe)."""
        if self.run_dir is not None:
            return self.run_dir
        adapters = {base.with_overrides(**overrides).adapter for overrides in self.variants(base).values()}
        suffix = "-" + "-".join(sorted(adapters - {"none"})) + ("-full" if "none" in adapters else "")
        tuned = "-tuned" if self.tune else ""
        return default_run_dir(scenario, "bench" + (suffix if adapters != {"none"} else "") + tuned)

    def method_options(self, tasks: int) -> dict[str, dict[str, Any]]:
        """Each merge method's options: its defaults for ``tasks`` vectors, with ``ties_k`` as TIES' ``k``."""
        given: Mapping[str, Mapping[str, Any]] = {"ties": {"k": self.ties_k}}
        return {m: method_options(m, given.get(m, {}), tasks=tasks) for m in METHODS}
