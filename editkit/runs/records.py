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
from typing import Any, Callable, ClassVar, Mapping, TypedDict

from editkit.train.recipe import Recipe


class MergedScores(TypedDict):
    """The merged model theta_0 + sum of the vectors banked so far (alpha = 1) on every task seen."""

    per_task: dict[str, float]
    absolute: float
    normalized: float


@dataclass
class StepRecord:
    """One experience of a stream: its fine-tuning, its vector alone, and the merged model after it.

    ``merged`` is None until the merged model is scored; ``resumed`` says the vector
    came from the bank rather than from training in this run (it is never banked).
    ``peak_gpu_bytes`` (CUDA only) is written only when present. Where the vector came
    from (scenario file, build options) is the bank entry's provenance, not a metric. ``extra`` holds keys that others
    add to a banked entry's metrics (the bench's peak RSS), kept as they are.
    """

    step: int
    task: str
    pretrained: float
    single_task: float
    train_seconds: float | None = None
    seconds_per_step: float | None = None
    train_steps: int | None = None
    train_size: int | None = None
    runtime: str | None = None
    peak_gpu_bytes: int | None = None
    merged: MergedScores | None = None
    resumed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    _OPTIONAL: ClassVar[tuple[str, ...]] = ("peak_gpu_bytes", "merged")  # keys written only when set

    def metrics(self) -> dict[str, Any]:
        """What the bank stores in the vector's entry: every key but ``resumed``."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("resumed", "extra"):
                continue
            value = getattr(self, f.name)
            if value is None and f.name in self._OPTIONAL:
                continue
            out[f.name] = value
        return {**out, **self.extra}

    def to_dict(self) -> dict[str, Any]:
        """The step as ``report.json`` lists it: the banked metrics plus ``resumed``."""
        return {**self.metrics(), "resumed": self.resumed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        """Read :meth:`to_dict`'s or :meth:`metrics`'s output (a bank entry's metrics) back."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})


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
