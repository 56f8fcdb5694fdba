"""Reduced offline-vision scenario files: the real backbone, heads and packaged datasets, small splits.

End-to-end tests of ``editkit stream`` / ``editkit bench`` run whole streams on them in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

#: Task name -> packaged dataset (``packaged:<dataset>``).
DATASETS = {"digits": "digits", "mnist": "mnist", "fashion": "fashion-mnist"}


def write_scenario(directory: Path, tasks: Sequence[str] = ("digits", "mnist"), name: str = "bench-mini", *,
                   train_size: int = 120, test_size: int = 50) -> Path:
    """``<directory>/<name>.toml``: ``tasks`` of offline-vision with ``train_size`` / ``test_size`` examples."""
    lines = [f'name = "{name}"', 'description = "reduced offline-vision for tests"',
             "[backbone]", 'family = "efficientnet-lite0"', "image_size = 32",
             "[heads]", 'kind = "probe"', "shots = 5", "[generic]", 'kind = "natural-crops"', "size = 64"]
    for task in tasks:
        lines += ["[[tasks]]", f'name = "{task}"', f'source = "packaged:{DATASETS[task]}"',
                  f"train_size = {train_size}", f"test_size = {test_size}"]
    lines += ["[recipe]", 'mode = "taujp"', "steps = 100", "batch_size = 16", "lr = 1e-4", "reg_batch = 4"]
    path = directory / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_toml(data: dict[str, Any], path: Path) -> Path:
    """A scenario dict (as ``tomllib`` reads it) written back as TOML: top-level values, tables, then
    ``[[tasks]]`` entries. Values are written as JSON, which TOML reads the same for strings, numbers,
    booleans and flat lists."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    for table, values in data.items():
        if isinstance(values, dict):
            lines += [f"[{table}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    for task in data.get("tasks", []):
        lines += ["[[tasks]]"] + [f"{k} = {json.dumps(v)}" for k, v in task.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_refused_before_work(output: str, scenario: str, starts: Sequence[str], workdir: Path) -> None:
    """``output`` is the offline refusal of ``scenario``: its header, then one line per missing piece, each
    starting with the matching entry of ``starts``; and ``workdir`` holds no bank or run directory."""
    header, *lines = output.splitlines()
    assert header == (f"error: scenario '{scenario}' cannot start: {len(starts)} missing pieces (nothing was trained, "
                      "no bank was written)")
    assert len(lines) == len(starts)
    for line, start in zip(lines, starts):
        assert line.startswith(f"  - {start}"), line
    assert not (workdir / "banks").exists() and not (workdir / "runs").exists()
