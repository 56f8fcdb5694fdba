"""Run a stream: for each experience fine-tune -> bank -> evaluate the merged model.

Works on any Avalanche benchmark (``run_benchmark``) and on editkit scenarios
(``run_scenario``). After experience t the bank holds tau_0..tau_t and the merged
model theta_0 + sum_i tau_i (alpha = 1.0, no tuning) is scored on every task seen
so far. The bank is the source of truth: each step's results are stored in its
entry's metrics, so an interrupted run resumes from the last banked experience.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from torch import nn

from .avalanche_bridge import Experience, experiences
from .backbones.base import Backbone
from .bank import Bank
from .errors import BankError, ConfigError
from .evaluate import EvalTask, addition_summary, evaluate_vector
from .progress import NullProgress, Progress
from .recipe import Recipe
from .taujp import Regularizer, UnlabeledSource
from .train import fine_tune

log = logging.getLogger(__name__)

HeadFactory = Callable[[Experience], nn.Module]
StepCallback = Callable[[dict[str, Any]], None]


@dataclass
class StreamResult:
    """Per-step results and the final merged model's numbers."""

    scenario: str
    recipe: Recipe
    steps: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def final(self) -> dict[str, Any]:
        last = self.steps[-1]
        return {
            "alpha": 1.0,
            "per_task": last["merged"]["per_task"],
            "absolute": last["merged"]["absolute"],
            "normalized": last["merged"]["normalized"],
            "single_task": {s["task"]: s["single_task"] for s in self.steps},
            "pretrained": {s["task"]: s["pretrained"] for s in self.steps},
        }


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
        eval_batch_size: int = 256,
        scenario_file: str | None = None,
    ) -> None:
        self.exps = list(exps)
        self.backbone = backbone
        self.heads = heads
        self.recipe = recipe
        self.bank = bank
        self.scenario = scenario
        self.generic = generic
        self.progress = progress
        self.eval_batch_size = eval_batch_size
        self.scenario_file = scenario_file
        self.base = backbone.fingerprint()
        self._sources: dict[int, UnlabeledSource] = {}

    # -- sources -------------------------------------------------------------------------------
    def source(self, index: int) -> UnlabeledSource:
        """Unlabeled view of experience ``index``'s train split (inputs only)."""
        if index not in self._sources:
            exp = self.exps[index]
            self._sources[index] = UnlabeledSource.from_dataset(exp.name, exp.train, seed=self.recipe.seed + 1 + index)
        return self._sources[index]

    def regularizer(self, t: int) -> Regularizer | None:
        if not self.recipe.regularized:
            return None
        others = range(t) if self.recipe.scope == "seen" else [i for i in range(len(self.exps)) if i != t]
        sources = [self.source(i) for i in others]
        if self.recipe.generic and self.generic is not None:
            sources.append(self.generic)
        if not sources:
            log.warning("task %s has no unlabeled source: its vector is not regularized", self.exps[t].name)
        return Regularizer(sources, lam=self.recipe.lam, schedule=self.recipe.schedule,
                           batch_size=self.recipe.reg_batch_size, squared=self.recipe.squared)

    # -- evaluation ----------------------------------------------------------------------------
    def eval_task(self, i: int) -> EvalTask:
        exp = self.exps[i]
        return EvalTask(exp.name, self.heads[exp.name], exp.test)

    def evaluate(self, tau, indices: Sequence[int], description: str) -> dict[str, float]:
        return evaluate_vector(self.backbone.module, self.recipe.mode, tau, [self.eval_task(i) for i in indices],
                               batch_size=self.eval_batch_size, progress=self.progress, description=description)

    # -- one step ------------------------------------------------------------------------------
    def train(self, t: int) -> dict[str, Any]:
        """Fine-tune experience t, score its vector alone, bank it."""
        exp = self.exps[t]
        head = self.heads[exp.name]
        with self.progress.task(f"[{t + 1}/{len(self.exps)}] {exp.name} ({self.recipe.mode})", total=self.recipe.steps) as bar:
            result = fine_tune(self.backbone.module, head, exp.train, self.recipe, self.regularizer(t),
                               on_step=lambda step, rec: bar.advance(1, **rec))
        single = self.evaluate(result.task_vector, [t], f"{exp.name}: single-task")[exp.name]
        pretrained = self.evaluate(None, [t], f"{exp.name}: pretrained")[exp.name]
        metrics = {"step": t, "task": exp.name, "pretrained": pretrained, "single_task": single,
                   "train_seconds": result.seconds, "seconds_per_step": result.seconds_per_step,
                   "scenario_file": self.scenario_file}
        self.bank.append(exp.name, result.task_vector, task=exp.name, mode=self.recipe.mode, base=self.base,
                         scenario=self.scenario, step=t, recipe=self.recipe.to_dict(), metrics=metrics)
        return metrics

    def merge_and_evaluate(self, t: int) -> dict[str, Any]:
        """Score theta_0 + sum of banked tau_0..tau_t on tasks 0..t; store the numbers in the bank."""
        names = [self.exps[i].name for i in range(t + 1)]
        tau = self.bank.merge({n: 1.0 for n in names}, base=self.base)
        per_task = self.evaluate(tau, range(t + 1), f"merged 0..{t}")
        single = {n: self.bank.get(n).metrics["single_task"] for n in names}
        merged = {"per_task": per_task, **addition_summary(per_task, single)}
        self.bank.update_metrics(self.exps[t].name, {"merged": merged})
        return merged

    def resumable(self, t: int) -> dict[str, Any] | None:
        """Banked metrics of experience t if this run already banked it with the same recipe."""
        name = self.exps[t].name
        if name not in self.bank:
            return None
        entry = self.bank.get(name)
        if entry.scenario != self.scenario or entry.recipe != self.recipe.to_dict():
            raise BankError(
                f"bank {self.bank.root} holds a vector {name!r} from another run (scenario {entry.scenario!r}, "
                f"mode {entry.mode!r}); use another --bank directory or remove it"
            )
        return dict(entry.metrics)

    def run(self, *, resume: bool, on_step: StepCallback | None = None) -> StreamResult:
        self._check_bank(resume)
        out = StreamResult(self.scenario, self.recipe)
        start = time.perf_counter()
        for t in range(len(self.exps)):
            banked = self.resumable(t) if resume else None
            metrics = banked if banked is not None else self.train(t)
            if "merged" not in metrics:
                metrics["merged"] = self.merge_and_evaluate(t)
            metrics["resumed"] = banked is not None
            out.steps.append(metrics)
            if on_step is not None:
                on_step(metrics)
        out.seconds = time.perf_counter() - start
        return out

    def _check_bank(self, resume: bool) -> None:
        if len(self.bank) and not resume:
            raise BankError(
                f"bank {self.bank.root} already holds {', '.join(self.bank.names())}; pass --resume to continue "
                "that run, or choose another --bank directory"
            )
        if self.bank.base is not None and self.bank.base != self.base:
            raise BankError(f"bank {self.bank.root} was built on another base model than {self.backbone.name}")


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
    on_step: StepCallback | None = None,
    scenario_file: str | None = None,
) -> StreamResult:
    """Fine-tune, bank and evaluate each experience in order (see module docstring).

    ``scenario_file`` is recorded in the bank so ``add`` / ``negate`` can rebuild the tasks later.
    """
    names = [e.name for e in exps]
    if len(set(names)) != len(names):
        raise ConfigError(f"experience names must be unique, got {names}")
    missing = [n for n in names if n not in heads]
    if missing:
        raise ConfigError(f"no head for task(s) {missing}")
    bank = bank if isinstance(bank, Bank) else Bank(bank)
    runner = StreamRunner(exps, backbone, heads, recipe, bank, scenario=scenario, generic=generic,
                          progress=progress or NullProgress(), scenario_file=scenario_file)
    return runner.run(resume=resume, on_step=on_step)


def probe_heads(backbone: Backbone, exps: Sequence[Experience], *, shots: int = 5, seed: int = 0) -> dict[str, nn.Module]:
    """Few-shot linear-probe heads for experiences of any Avalanche benchmark."""
    from .scenario import probe_head
    from .tasks import TaskData

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
    on_step: StepCallback | None = None,
) -> StreamResult:
    """Run any Avalanche benchmark (train_stream / test_stream with task labels)."""
    exps = experiences(benchmark, names)
    heads = heads if heads is not None else probe_heads(backbone, exps, seed=recipe.seed)
    return run_stream(exps, backbone, heads, recipe, bank, scenario=scenario, generic=generic, resume=resume,
                      progress=progress, on_step=on_step)


def default_bank_dir(scenario: str, mode: str) -> Path:
    return Path("banks") / f"{scenario}-{mode}"


def default_run_dir(scenario: str, mode: str) -> Path:
    return Path("runs") / f"{scenario}-{mode}"


def run_scenario(
    scenario: str | Path,
    *,
    bank: str | Path | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    progress: Progress | None = None,
    on_step: StepCallback | None = None,
    **overrides: Any,
) -> tuple[StreamResult, dict[str, Any]]:
    """Run a scenario file end to end and write ``report.json`` + ``stream.png`` into the run directory.

    ``overrides`` replace recipe fields (``mode="linear"``, ``steps=20``, ``scope="all"``...).
    Returns the result and the report dictionary.
    """
    from .report import plot_stream, stream_report, write_json
    from .scenario import build_scenario, load_scenario

    spec = load_scenario(scenario)
    recipe = spec.recipe.with_overrides(**overrides)
    bank_dir = Path(bank) if bank is not None else default_bank_dir(spec.name, recipe.mode)
    out_dir = Path(run_dir) if run_dir is not None else default_run_dir(spec.name, recipe.mode)
    built = build_scenario(spec, seed=recipe.seed, progress=progress)
    exps = experiences(built.benchmark(), built.task_names)
    result = run_stream(exps, built.backbone, built.heads, recipe, bank_dir, scenario=spec.name, generic=built.generic,
                        resume=resume, progress=progress, on_step=on_step,
                        scenario_file=str(spec.path.resolve()) if spec.path else None)
    plot = plot_stream(result, out_dir / "stream.png")
    report = stream_report(result, backbone=built.backbone.name, bank=bank_dir, extra={"plots": [str(plot)]})
    write_json(out_dir / "report.json", report)
    return result, report
