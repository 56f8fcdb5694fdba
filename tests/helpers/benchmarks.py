"""The scripts under ``benchmarks/`` (not a package) loaded as modules, so tests call their functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
