"""The fine-tuning recipe: every knob of one task's training, in one dataclass.

Scenario files give a recipe; the CLI and the Python API override single fields.
Defaults are the offline-vision values; vision8 sets the paper's (DESIGN.md §2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError

MODES = ("nonlinear", "linear", "taujp")
SCHEDULES = ("cyclic", "strict")
SCOPES = ("seen", "all")


@dataclass(frozen=True)
class Recipe:
    """How one task is fine-tuned.

    mode: ``nonlinear`` (plain fine-tuning), ``linear`` (linearized model) or
        ``taujp`` (linearized + the tauJp penalty on unlabeled inputs of other tasks).
    warmup: fraction of ``steps`` when < 1, else a number of steps; cosine decay after.
    accumulation: micro-batches per optimizer step (``batch_size`` is per micro-batch).
    reg_batch: unlabeled examples per source per step; ``None`` = batch_size // 8 (>= 1).
    squared: penalise ||J tau||^2 instead of ||J tau|| (the official code uses the norm).
    scope: ``seen`` = penalty sources are tasks earlier in the stream (incremental);
        ``all`` = every other task of the scenario (joint setting).
    generic: also penalise on the scenario's always-available unlabeled source (if it
        has one); it regularises the first task of a stream, which has no earlier task.
    """

    mode: str = "taujp"
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup: float = 0.1
    grad_clip: float = 1.0
    accumulation: int = 1
    lam: float = 0.1
    schedule: str = "cyclic"
    scope: str = "seen"
    reg_batch: int | None = None
    squared: bool = False
    generic: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("scope", self.scope, SCOPES)
        for name in ("steps", "batch_size", "accumulation"):
            if getattr(self, name) < 1:
                raise ConfigError(f"recipe.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.lam < 0 or self.warmup < 0:
            raise ConfigError("recipe: lr must be > 0, lam and warmup >= 0")

    @property
    def reg_batch_size(self) -> int:
        return self.reg_batch if self.reg_batch is not None else max(1, self.batch_size // 8)

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup * self.steps)) if self.warmup < 1 else int(self.warmup)

    @property
    def regularized(self) -> bool:
        return self.mode == "taujp" and self.lam > 0

    def with_overrides(self, **overrides: Any) -> "Recipe":
        """A copy with the given fields replaced; ``None`` values mean "keep"."""
        return from_mapping({k: v for k, v in overrides.items() if v is not None}, base=self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def from_mapping(values: Mapping[str, Any], base: Recipe | None = None) -> Recipe:
    """Build a recipe from a scenario file's table, refusing unknown keys by name."""
    known = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown recipe field(s) {unknown}; known: {sorted(known)}")
    return dataclasses.replace(base or Recipe(), **values)


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"recipe.{field} = {value!r} is not one of {', '.join(choices)}")
