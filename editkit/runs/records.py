"""The records a run produces, typed: what a stream step and a whole stream hold.

``report.json`` is these records written out; keeping them here (not in the
runner) lets reports and plots read them without importing the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from editkit.train.recipe import Recipe


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
