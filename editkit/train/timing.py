"""Where a fine-tuning run's time goes: setup, warm-up, steady steps, and the parts of a step.

A run's total seconds mix three things of different nature: setup before the first step (the task model,
the optimizer, the data loader), the first steps (the allocator growing, kernels chosen, a lazily encoded
source's first items) and the steady steps that repeat. A ratio of two modes' totals can be dominated by
the first two, which is why :class:`StepClock` keeps each step's own duration and a run reports the
median of its steady steps beside its setup and warm-up seconds.

With ``parts=True`` the clock also splits each step into :data:`PARTS`. On a GPU the work of a step is
queued asynchronously, so a part's wall time is the host's, not the device's, unless the device is
synchronized at each boundary: the clock does that, which is why parts are a profiling option and off
in ordinary runs (where a step never waits for the device; see ``editkit.train.loop.LaggedStats``).
:func:`profiled` turns it on for every run inside a block, however the runs are started (a stream's,
the bench's), and collects their times.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

import torch

#: The parts of one optimizer step, in the order the loop runs them.
PARTS = ("task_batch", "reg_batch", "forward", "backward", "optimizer", "host")

#: Steps at the start of a run that are not steady: the first pays one-off costs (first calls of kernels,
#: the allocator's growth), the second the first optimizer state in use. Measured on offline-vision and
#: offline-text, the third step is within a few percent of the median.
WARMUP_STEPS = 2


@dataclass
class StepTimes:
    """Seconds of a run: ``setup`` before the first step, each step's ``steps``, and per part their sums
    over the steady steps (empty unless the clock timed parts)."""

    setup: float = 0.0
    steps: list[float] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def warmup(self) -> float:
        """Seconds of the first :data:`WARMUP_STEPS` steps."""
        return sum(self.steps[:WARMUP_STEPS])

    @property
    def steady(self) -> list[float]:
        """The steps after warm-up (every step when a run has no more than the warm-up)."""
        return self.steps[WARMUP_STEPS:] or self.steps

    @property
    def steady_per_step(self) -> float | None:
        """Median seconds of a steady step: what one more step costs (None without steps)."""
        return statistics.median(self.steady) if self.steps else None

    def parts_per_step(self) -> dict[str, float]:
        """Mean seconds of each part over the steady steps."""
        count = len(self.steady)
        return {part: seconds / count for part, seconds in self.parts.items()}


_PROFILED: ContextVar[list[StepTimes] | None] = ContextVar("editkit_profiled_runs", default=None)


@contextlib.contextmanager
def profiled() -> Iterator[list[StepTimes]]:
    """Time the parts of every step of the runs started inside the block, and collect each run's
    :class:`StepTimes` in the list it yields, in the order the runs started. A benchmark of whole streams
    uses it: the stream's own loop, sources and schedule run as a user's do, with their times recorded."""
    runs: list[StepTimes] = []
    token = _PROFILED.set(runs)
    try:
        yield runs
    finally:
        _PROFILED.reset(token)


class StepClock:
    """Times a run's setup and steps (one ``perf_counter`` read per step) and, with ``parts``, each part.

    Use: :meth:`begin_steps` after setup, :meth:`lap` after each part of a step (a no-op without ``parts``),
    :meth:`end_step` after each step. ``device``: where the step runs; a CUDA device is synchronized at
    each lap (with ``parts`` only). Inside :func:`profiled` parts are timed and the times collected."""

    def __init__(self, *, parts: bool = False, device: torch.device | None = None) -> None:
        self.times = StepTimes()
        collected = _PROFILED.get()
        if collected is not None:
            collected.append(self.times)
            parts = True
        self._parts = parts
        self._sync = parts and device is not None and device.type == "cuda"
        self._created = self._last = time.perf_counter()
        self._step_start = self._last
        self._step_parts: dict[str, float] = {}

    def begin_steps(self) -> None:
        """Setup is over: the first step starts now."""
        self._last = self._step_start = time.perf_counter()
        self.times.setup = self._last - self._created

    def lap(self, part: str) -> None:
        """``part`` of the current step has just ended (it accumulates over micro-batches)."""
        if not self._parts:
            return
        if self._sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._step_parts[part] = self._step_parts.get(part, 0.0) + now - self._last
        self._last = now

    def end_step(self) -> None:
        """The current step has ended; the time since the last lap is the step's host work."""
        self.lap("host")
        now = time.perf_counter()
        self.times.steps.append(now - self._step_start)
        if len(self.times.steps) > WARMUP_STEPS:
            for part, seconds in self._step_parts.items():
                self.times.parts[part] = self.times.parts.get(part, 0.0) + seconds
        self._step_parts = {}
        self._last = self._step_start = now
