"""How run results reach people: ``report.json``, PNG plots, and numbers as percentages.

Every report (stream, bench, ``add`` / ``negate --json``) is written by
:func:`write_json`, every figure drawn by :func:`pyplot`'s headless backend, and
every accuracy shown in a table goes through :func:`pct`, so the same number
reads the same everywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from editkit.util.atomic import atomic_write_text

if TYPE_CHECKING:  # a stream's records import torch; the CLI's tables read pct from here without it
    from editkit.runs.records import StreamResult


def write_json(path: Path, data: dict[str, Any]) -> Path:
    """Write JSON atomically, so a report is never half-written."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def jsonable(value: Any) -> Any:
    """``value`` in plain JSON types (numpy scalars unwrapped, paths as strings); NaN and inf
    become None, because JSON has no spelling for them and readers should see "no number"."""
    import numpy as np  # here, not above: the CLI's tables read pct from this module, and need no numpy

    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, Path):
        return str(value)
    return value


def pct(value: float | None) -> str:
    """An accuracy in [0, 1] as a percentage with one decimal (``0.7953`` -> ``"79.5"``); None -> ``"—"``."""
    return "—" if value is None else f"{100 * value:.1f}"


def pyplot():
    """matplotlib's pyplot on the headless Agg backend (runs write PNGs; they never open windows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: Version of the stream report's layout. 2: the steps no longer repeat ``scenario_file`` and ``build``
#: (where a vector came from is its bank entry's ``provenance``); every other key is as in version 1.
STREAM_REPORT_VERSION = 2


def stream_report(result: StreamResult, *, backbone: str, bank: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``report.json`` of a stream (layout :data:`STREAM_REPORT_VERSION`)."""
    return {
        "version": STREAM_REPORT_VERSION,
        "scenario": result.scenario,
        "mode": result.recipe.mode,
        "recipe": result.recipe.to_dict(),
        "backbone": backbone,
        "bank": str(bank),
        "seconds": result.seconds,
        "steps": [step.to_dict() for step in result.steps],
        "final": result.final,
        **(extra or {}),
    }


def plot_stream(result: StreamResult, path: Path) -> Path:
    """Merged accuracy after each step (absolute, normalized) and each task's accuracy."""
    plt = pyplot()
    steps = list(range(1, len(result.steps) + 1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(steps, [s.merged["absolute"] for s in result.steps], marker="o", label="absolute")
    left.plot(steps, [s.merged["normalized"] for s in result.steps], marker="s", label="normalized")
    left.set(title=f"{result.scenario} ({result.recipe.mode}): merged model, alpha = 1", xlabel="tasks seen",
             ylabel="accuracy", ylim=(0, 1.05), xticks=steps)
    left.legend()
    for s0 in result.steps:
        xs = [i + 1 for i, s in enumerate(result.steps) if s0.task in s.merged["per_task"]]
        right.plot(xs, [result.steps[x - 1].merged["per_task"][s0.task] for x in xs], marker="o", label=s0.task)
        right.axhline(s0.single_task, linestyle=":", linewidth=0.8, color=right.lines[-1].get_color())
    right.set(title="per task (dotted: single-task)", xlabel="tasks seen", ylabel="accuracy", ylim=(0, 1.05), xticks=steps)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
