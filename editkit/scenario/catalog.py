"""Where scenario files are and what a listing reads of them, without checking or building anything.

Checking a scenario (:func:`editkit.scenario.spec.load_scenario`) asks the registries of backbones, heads
and data sources, which import torch; ``editkit scenarios`` lists the files as written, so it answers
at once.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from editkit.errors import ConfigError
from editkit.settings import extra_scenario_dirs

#: The built-in scenario files: the top-level ``scenarios/`` folder, installed as the package ``editkit.scenarios``.
SCENARIO_DIR = Path(str(resources.files("editkit.scenarios")))


def known_scenarios() -> dict[str, Path]:
    """Scenario name -> file, from ``$EDITKIT_SCENARIOS`` first, then the built-in directory."""
    found: dict[str, Path] = {}
    for directory in extra_scenario_dirs() + [SCENARIO_DIR]:
        for path in sorted(directory.glob("*.toml")):
            found.setdefault(path.stem, path)
    return found


def scenario_file(name_or_path: str | Path) -> Path:
    """A scenario's file: ``name_or_path`` itself when it is a ``.toml`` file, else the known scenario of that name."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        return path
    known = known_scenarios()
    if str(name_or_path) not in known:
        raise ConfigError(f"unknown scenario {str(name_or_path)!r}; known scenarios: {', '.join(sorted(known)) or 'none'}")
    return known[str(name_or_path)]


def read_scenario(path: Path) -> dict[str, Any]:
    """A scenario file's tables as written (refused, by file, when it is not TOML)."""
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"scenario file {path} is not valid TOML: {exc}") from exc
