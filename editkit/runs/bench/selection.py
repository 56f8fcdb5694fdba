"""``editkit bench --tune N``: every row's learning rate and own coefficient chosen alike, on validation data.

A table that puts tauJp beside the continual-learning strategies compares methods, not defaults, only when each
row was selected the same way. The protocol is A-GEM's (Chaudhry et al., 2019): hyperparameters are chosen on the
first ``N`` experiences of the stream, on their validation splits alone, and the whole stream then runs once with
the choice. Every row gets the same number of trials (:data:`TRIALS`):

- a row with a coefficient of its own (tauJp's ``lam``, EWC's ``ewc_lambda``, SI's ``si_lambda``, LwF's
  ``alpha``) tries its learning rate times 1/3, 1, 3 and its coefficient times 0.1, 1, 10 (3 x 3);
- a row without one (linear and non-linear task arithmetic, Naive, Replay, A-GEM, joint) tries nine learning
  rates over the same span, evenly spaced in log scale.

A trial's score is the mean over the bench's protocols of the row's accuracy on the first ``N`` tasks' validation
splits (task-incremental: each task's head; class-incremental: among their classes) after the ``N``-th experience:
for a stream, the merged model at coefficient 1; for a strategy, its model (a run under each protocol). One choice
serves both protocols, for every row alike. The best trial wins (ties: the first in grid order, the defaults' own
values sit in the middle of each axis). Trials' banks live under ``<bank-root>/tune/`` and are reused by a
re-run; the tuned streams bank under ``<bank-root>/tuned/``, so untuned banks stay as they were. A trial is a
function of its row and index alone (:class:`StreamTrials`, :func:`strategy_trial`), so ``--ray`` runs each as a unit
of its own and gathers the scores as one process does. A strategy has no bank, so its trial's score is kept
under the same root (:mod:`editkit.runs.bench.strategy_records`, with everything the run depended on) and read
back by a re-run that asks for the same trial: a bench refused after its trials (a stale tuned bank) repeats none
of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from editkit.bank.store import Bank
from editkit.errors import ConfigError
from editkit.runs.bench.strategy_records import StrategyRecord, recorded, strategy_key
from editkit.settings import default_bank_dir
from editkit.util.progress import Progress

#: Trials every row gets.
TRIALS = 9
#: A coefficient's factors (its row's learning rate takes :data:`LR_FACTORS` beside them).
COEFFICIENT_FACTORS = (0.1, 1.0, 10.0)
LR_FACTORS = (1 / 3, 1.0, 3.0)


@dataclass(frozen=True)
class Trial:
    """One point of a row's grid: the learning rate, and the row's own coefficient (None: it has none)."""

    lr: float
    coefficient: float | None = None


def trial_grid(lr: float, coefficient: float | None) -> list[Trial]:
    """The :data:`TRIALS` points a row tries around its defaults (see the module docstring)."""
    if coefficient is None:
        return [Trial(float(lr * f)) for f in np.geomspace(LR_FACTORS[0], LR_FACTORS[-1], TRIALS)]
    return [Trial(lr * a, coefficient * b) for a, b in itertools.product(LR_FACTORS, COEFFICIENT_FACTORS)]


def check_tune(experiences: int, tasks: int) -> None:
    """``--tune N`` needs N experiences to learn and one at least left to be scored on the whole stream."""
    if not 0 < experiences < tasks:
        raise ConfigError(f"--tune {experiences}: selection runs on the first N experiences of the stream's {tasks}; "
                          f"give 1 to {tasks - 1} (A-GEM's protocol uses the first few)")


def choose(scores: Sequence[float]) -> int:
    """The best trial's index: the highest score, the first of equal ones."""
    return int(np.argmax(np.asarray(scores, dtype=float)))


def selection_entry(grid: Sequence[Trial], scores: Sequence[float], coefficient: str | None) -> dict[str, Any]:
    """A row's part of ``report["selection"]``: what it tried, each trial's score and what it chose."""
    best = choose(scores)
    return {"coefficient": coefficient, "trials": [dataclasses.asdict(t) for t in grid], "scores": list(scores),
            "chosen": dataclasses.asdict(grid[best])}


def _note(progress: Progress, row: str, index: int, trial: Trial, coefficient: str | None, score: float,
          recorded: bool = False) -> None:
    """One line per trial, as it ends: selection runs for a while before the first table."""
    tried = f"lr {trial.lr:.3g}" + (f" {coefficient} {trial.coefficient:.3g}" if coefficient else "")
    kept = " (recorded by an earlier run)" if recorded else ""
    progress.note(f"tune {row}: trial {index + 1}/{TRIALS} {tried}: {100 * score:.1f}% on validation{kept}")


def mean_accuracy(per_task: Mapping[str, float]) -> float:
    return float(np.mean(list(per_task.values())))


# --------------------------------------------------------------------------- streams


def stream_grid(state) -> tuple[list[Trial], str | None]:
    """A stream's (a mode's, :class:`~editkit.runs.bench.report.ModeState`) trials and the name of its coefficient
    (``lam`` where its mode is penalised)."""
    coefficient = "lam" if state.recipe.mode.penalized else None
    return trial_grid(state.recipe.lr, state.recipe.lam if coefficient else None), coefficient


class StreamTrials:
    """What a stream's trials share on the first ``experiences`` tasks of ``built`` (its adapter's arm): theta_0
    placed once, the validation splits' features, the heads and the data-free penalty's curvatures at theta_0;
    :meth:`score` runs one trial."""

    def __init__(self, config, spec, built, state, *, runtime, progress: Progress, protocols: Sequence[str],
                 experiences: int) -> None:
        from editkit.eval.sweep import SharedModels, TaskSplits

        self.config, self.state, self.runtime, self.progress = config, state, runtime, progress
        self.protocols = protocols
        self.first = spec.task_names[:experiences]
        self.part = dataclasses.replace(spec, tasks=spec.tasks[:experiences])
        self.arm = dataclasses.replace(built, spec=self.part, tasks=[built.task(n) for n in self.first])
        module = runtime.place(self.arm.backbone.module)
        self.data = TaskSplits(module, self.arm.tasks, batch_size=config.batch_size, xi_samples=1, progress=progress,
                               runtime=runtime, batching=self.arm.backbone.batching)
        self.heads = {n: self.arm.heads[n].eval() for n in self.first}
        self.models, self.base = SharedModels.of(module), self.arm.backbone.fingerprint()
        self.curvatures: dict = {}  # --penalty kfac's at theta_0: the trials' lr and lambda do not change them

    def score(self, index: int, trial: Trial, coefficient: str | None) -> float:
        """Trial ``index``: fine-tune the first tasks into its own bank (reused by a re-run) and score the merged
        model at coefficient 1 on their validation splits, the mean over the protocols."""
        from editkit.eval.sweep import ModeEvaluator
        from editkit.runs.stream import run_scenario

        state = self.state
        overrides = {**state.overrides, "lr": trial.lr, **({"lam": trial.coefficient} if coefficient else {})}
        bank = default_bank_dir(self.part.name, state.label,
                                root=Path(self.config.bank_root) / "tune" / f"trial-{index}")
        with tempfile.TemporaryDirectory(prefix="editkit-tune-") as scratch:
            run_scenario(self.part, bank=bank, run_dir=scratch, resume=True, progress=self.progress,
                         build=self.config.build, runtime=self.runtime, built=self.arm, curvatures=self.curvatures,
                         **overrides)
        ev = ModeEvaluator(state.recipe.mode.value, Bank(bank), {n: n for n in self.first}, self.data, self.heads,
                           self.base, self.models, label=state.label)
        if ev.linearized:
            ev.compute_tangents(self.first, splits=("val",))
        merged = {n: 1.0 for n in self.first}
        score = float(np.mean([_protocol_score(ev, merged, self.first, p) for p in self.protocols]))
        _note(self.progress, state.label, index, trial, coefficient, score)
        return score


def stream_trials(config, spec, built, state, *, runtime, progress: Progress, protocols: Sequence[str],
                  experiences: int) -> dict[str, Any]:
    """A stream's trials, one after another in this process: each fine-tunes the first ``experiences`` tasks into
    its own bank and scores the merged model on their validation splits. Returns its :func:`selection_entry`."""
    grid, coefficient = stream_grid(state)
    trials = StreamTrials(config, spec, built, state, runtime=runtime, progress=progress, protocols=protocols,
                          experiences=experiences)
    return selection_entry(grid, [trials.score(i, t, coefficient) for i, t in enumerate(grid)], coefficient)


def _protocol_score(ev, combo: Mapping[str, float], tasks: Sequence[str], protocol: str) -> float:
    """The merged model's mean validation accuracy on ``tasks`` under ``protocol``."""
    if protocol == "task":
        return mean_accuracy(ev.accuracies(combo, "val", tasks))
    return mean_accuracy(ev.class_incremental_accuracies(combo, "val", tasks, among=tasks))


# --------------------------------------------------------------------------- strategies


def strategy_grid(name: str, recipes: Sequence, options: Mapping[str, Any]) -> tuple[list[Trial], str | None]:
    """A strategy's trials around its learning rate (the first task's recipe's) and its coefficient's value
    (``options``, else its default), and the coefficient's name (None: it has none)."""
    from editkit.integrations.avalanche.strategies import STRATEGIES

    coefficient = STRATEGIES[name].coefficient or None
    value = STRATEGIES.options(name, options)[coefficient] if coefficient else None
    return trial_grid(recipes[0].lr, value), coefficient


def strategy_trial(name: str, built, recipes: Sequence, options: Mapping[str, Any], index: int, *, runtime,
                   progress: Progress, protocols: Sequence[str], experiences: int, record: StrategyRecord) -> float:
    """Trial ``index`` of a strategy on the first ``experiences`` tasks of ``built`` (``recipes``: theirs,
    resolved): a run under every protocol, scored on their validation splits (the mean over the protocols).
    ``record``: where the score is kept, and read back instead of running when it was scored on the same inputs
    (the trial, the recipes, options and protocols, theta_0, the scenario, the threads and the runtime's numerics:
    a row's scores move with the thread count)."""
    from editkit.integrations.avalanche.strategies import STRATEGIES, run_strategy

    grid, coefficient = strategy_grid(name, recipes, options)
    trial = grid[index]
    part = dataclasses.replace(built, tasks=list(built.tasks[:experiences]))
    tried = [r.with_overrides(lr=trial.lr) for r in recipes[:experiences]]
    chosen = {**options, **({coefficient: trial.coefficient} if coefficient else {})}
    key = strategy_key(record, name, part, tried, STRATEGIES.options(name, chosen), protocols, runtime,
                       trial=dataclasses.asdict(trial), experiences=experiences)

    def run() -> float:
        return float(np.mean([mean_accuracy(run_strategy(name, part, tried, options=chosen, runtime=runtime,
                                                         progress=progress, protocol=p, split="val").rows[-1])
                              for p in protocols]))

    score, was_recorded = recorded(record, key, run, encode=float, decode=float)
    _note(progress, name, index, trial, coefficient, score, recorded=was_recorded)
    return score


def strategy_trials(name: str, built, recipes: Sequence, options: Mapping[str, Any], *, runtime, progress: Progress,
                    protocols: Sequence[str], experiences: int, records: Sequence[StrategyRecord]) -> dict[str, Any]:
    """A strategy's trials, one after another in this process (``records``: each trial's, in grid order). Returns
    its :func:`selection_entry`."""
    grid, coefficient = strategy_grid(name, recipes, options)
    return selection_entry(grid, [strategy_trial(name, built, recipes, options, i, runtime=runtime, progress=progress,
                                                 protocols=protocols, experiences=experiences, record=records[i])
                                  for i in range(len(grid))], coefficient)
