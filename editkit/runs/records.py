"""The records a run produces, typed: what a stream step and a whole stream hold.

``report.json`` and the bank's per-vector ``metrics`` are these records written
out; keeping them here (not in the runner) lets reports, plots, the bench and the
CLI read them without importing the runner, and by attribute rather than by
string key. The dictionaries keep exactly the keys they had before the records
were typed, so banks and reports written earlier read the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, NotRequired, TypedDict

from editkit.eval.continual import ContinualMetrics, continual_metrics
from editkit.train.loop import FineTuneResult
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime


class MergedScores(TypedDict):
    """The merged model theta_0 + the vectors banked so far, merged (alpha = 1), on every task seen: by
    ``method`` (absent in banks written before streams could name one: the mode's own), whose merge took
    ``merge_seconds`` (None where the scores came from cached tangents or the single-task model)."""

    per_task: dict[str, float]
    absolute: float
    normalized: float
    method: NotRequired[str]
    merge_seconds: NotRequired[float | None]


@dataclass
class TrainingCost:
    """What fine-tuning one experience cost and where it ran.

    A field is None where it was not recorded (banks written before the timings
    were); ``peak_gpu_bytes`` (CUDA only) and the split of the time (``setup_seconds`` before the first
    step, ``warmup_seconds`` of the first steps, ``steady_seconds_per_step`` the median step after them;
    see ``editkit.train.timing``) are written only when present. ``seconds_per_step`` is
    ``train_seconds / train_steps``: warm-up included, and any slow spell of the machine too.
    """

    train_seconds: float | None = None
    seconds_per_step: float | None = None
    train_steps: int | None = None
    train_size: int | None = None
    runtime: str | None = None
    peak_gpu_bytes: int | None = None
    setup_seconds: float | None = None
    warmup_seconds: float | None = None
    steady_seconds_per_step: float | None = None

    @classmethod
    def of(cls, result: FineTuneResult, steps: int, train_size: int, runtime: Runtime) -> TrainingCost:
        """The cost of one fine-tuning run of ``steps`` steps over ``train_size`` examples."""
        times = result.times
        return cls(train_seconds=result.seconds, seconds_per_step=result.seconds_per_step, train_steps=steps,
                   train_size=train_size, runtime=runtime.describe(), peak_gpu_bytes=result.peak_gpu_bytes,
                   setup_seconds=times.setup if times.steps else None,
                   warmup_seconds=times.warmup if times.steps else None,
                   steady_seconds_per_step=times.steady_per_step)


@dataclass
class StepRecord:
    """One experience of a stream: its fine-tuning, its vector alone, and the merged model after it.

    Written out flat: the scores, then the cost's fields, then ``merged`` (see
    :meth:`metrics`). ``merged`` is None until the merged model is scored; ``resumed``
    says the vector came from the bank rather than from training in this run (it is
    never banked). Where the vector came from (scenario file, build options) is the
    bank entry's provenance, not a metric. ``extra`` holds keys that others add to a
    banked entry's metrics (the bench's peak RSS), kept as they are.
    """

    step: int
    task: str
    pretrained: float
    single_task: float
    cost: TrainingCost = field(default_factory=TrainingCost)
    merged: MergedScores | None = None
    resumed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    _SCORES: ClassVar[tuple[str, ...]] = ("step", "task", "pretrained", "single_task")
    _OPTIONAL: ClassVar[tuple[str, ...]] = ("peak_gpu_bytes", "setup_seconds", "warmup_seconds",
                                            "steady_seconds_per_step", "merged")  # keys written only when set

    def metrics(self) -> dict[str, Any]:
        """What the bank stores in the vector's entry: every key but ``resumed``."""
        flat = {**{k: getattr(self, k) for k in self._SCORES}, **dataclasses.asdict(self.cost), "merged": self.merged}
        return {**{k: v for k, v in flat.items() if not (v is None and k in self._OPTIONAL)}, **self.extra}

    def to_dict(self) -> dict[str, Any]:
        """The step as ``report.json`` lists it: the banked metrics plus ``resumed``."""
        return {**self.metrics(), "resumed": self.resumed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        """Read :meth:`to_dict`'s or :meth:`metrics`'s output (a bank entry's metrics) back."""
        costs = {f.name for f in dataclasses.fields(TrainingCost)}
        own = {*cls._SCORES, "merged", "resumed"}
        return cls(**{k: v for k, v in data.items() if k in own},
                   cost=TrainingCost(**{k: v for k, v in data.items() if k in costs}),
                   extra={k: v for k, v in data.items() if k not in own | costs})


#: Called with each stream step's record as soon as the step is done (the CLI prints it, the bench
#: measures it). Not to be confused with :data:`editkit.train.loop.TrainStepCallback` (one optimizer step).
StreamStepCallback = Callable[[StepRecord], None]


@dataclass
class StreamResult:
    """Per-step records and the final merged model's numbers."""

    scenario: str
    recipe: Recipe
    steps: list[StepRecord] = field(default_factory=list)
    seconds: float = 0.0
    #: ``{vector's task: {task scored: J tau(x) on its test inputs}}`` from a linearized stream's scoring, kept only
    #: when the run was asked to (``keep_tangents``); in no report.
    tangents: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, Any]:
        last = self.steps[-1].merged
        return {
            "alpha": 1.0,
            "per_task": last["per_task"],
            "absolute": last["absolute"],
            "normalized": last["normalized"],
            "single_task": {s.task: s.single_task for s in self.steps},
            "pretrained": {s.task: s.pretrained for s in self.steps},
        }

    @property
    def continual(self) -> ContinualMetrics:
        """The merged model's accuracy matrix over the stream's steps, ACC, BWT and forgetting
        (:mod:`editkit.eval.continual`)."""
        return continual_metrics([s.task for s in self.steps], [s.merged["per_task"] for s in self.steps])
