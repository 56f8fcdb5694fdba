"""Reduced offline-vision scenario files: the real backbone, heads and packaged datasets, small splits.

End-to-end tests of ``editkit stream`` / ``editkit bench`` run whole streams on them in seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

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
