"""The fine-tuning recipe: every knob of one task's training, in one dataclass.

Scenario files give a recipe; the CLI and the Python API override single fields.
Defaults are the offline-vision values; the vision8 scenario sets the paper's.

Length of training: ``steps`` optimizer steps, or, when ``epochs`` is set, as many
steps as that many passes over the task's train split take
(``ceil(epochs * ceil(train_size / (batch_size * accumulation)))``, see
:meth:`Recipe.resolved`). A mapping (scenario table, per-task option, CLI
overrides) that gives ``steps`` without ``epochs`` means steps: it clears an
``epochs`` inherited from a lower level, so ``--steps 5`` overrides per-task epochs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from editkit.core.modes import Mode
from editkit.errors import ConfigError

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
    epochs: when set, ``steps`` is derived from the train split's size (see
        :meth:`resolved`); None (the default) means ``steps`` as given.
    """

    mode: Mode = Mode.TAUJP
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
    epochs: float | None = None

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, tuple(Mode))
        object.__setattr__(self, "mode", Mode(self.mode))  # frozen; a str enum, so to_dict() keeps the string
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("scope", self.scope, SCOPES)
        for name in ("steps", "batch_size", "accumulation"):
            if getattr(self, name) < 1:
                raise ConfigError(f"recipe.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.lam < 0 or self.warmup < 0:
            raise ConfigError("recipe: lr must be > 0, lam and warmup >= 0")
        if self.epochs is not None and not self.epochs > 0:
            raise ConfigError(f"recipe.epochs must be > 0 (or unset), got {self.epochs}")
        if self.reg_batch is not None and self.reg_batch < 1:
            raise ConfigError(f"recipe.reg_batch must be >= 1 (or unset), got {self.reg_batch}")

    @property
    def reg_batch_size(self) -> int:
        return self.reg_batch if self.reg_batch is not None else max(1, self.batch_size // 8)

    @property
    def warmup_steps(self) -> int:
        return int(round(self.warmup * self.steps)) if self.warmup < 1 else int(self.warmup)

    @property
    def regularized(self) -> bool:
        return self.mode.penalized and self.lam > 0

    @property
    def examples_per_step(self) -> int:
        """Labelled examples per optimizer step (all micro-batches, all processes)."""
        return self.batch_size * self.accumulation

    def steps_per_epoch(self, train_size: int) -> int:
        """Optimizer steps of one pass over ``train_size`` examples (the last one partial)."""
        return max(1, math.ceil(train_size / self.examples_per_step))

    def resolved(self, train_size: int) -> "Recipe":
        """The recipe with ``steps`` fixed for a train split of ``train_size`` examples.

        Without ``epochs`` this is the recipe itself. With it, ``steps`` =
        ``ceil(epochs * steps_per_epoch(train_size))`` (``epochs`` is kept as a record).
        """
        if self.epochs is None:
            return self
        steps = max(1, math.ceil(self.epochs * self.steps_per_epoch(train_size) - 1e-9))
        return dataclasses.replace(self, steps=steps)

    def with_overrides(self, **overrides: Any) -> "Recipe":
        """A copy with the given fields replaced; ``None`` values mean "keep".

        ``steps`` given without ``epochs`` clears this recipe's ``epochs``.
        """
        return from_mapping({k: v for k, v in overrides.items() if v is not None}, base=self)

    def to_dict(self) -> dict[str, Any]:
        """All fields; ``epochs`` only when set (banks written before it existed compare equal)."""
        values = dataclasses.asdict(self)
        if values["epochs"] is None:
            del values["epochs"]
        return values


def from_mapping(values: Mapping[str, Any], base: Recipe | None = None) -> Recipe:
    """Build a recipe from a scenario file's table, refusing unknown keys by name."""
    known = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown recipe field(s) {unknown}; known: {sorted(known)}")
    values = dict(values)
    if values.get("steps") is not None and values.get("epochs") is not None:
        raise ConfigError(f"give steps or epochs, not both (got steps = {values['steps']}, epochs = {values['epochs']})")
    if "steps" in values and "epochs" not in values:
        values["epochs"] = None  # steps given here beat epochs inherited from the base
    return dataclasses.replace(base or Recipe(), **values)


def _check_choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"recipe.{field} = {value!r} is not one of {', '.join(choices)}")
