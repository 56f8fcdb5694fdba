"""Values that may name a file or folder, or be a name (a model tag, a hub id, a packaged model).

A value in a scenario file such as ``model = "gpt2"`` or ``weights = "resnet18.pth"`` is a path for some
values and a name for others, and only the code that reads it knows which. That code declares its rule
once, as a :data:`PathRule`, and both sides use it: the loader (does this value name a file here?) and the
scenario parser (is this a path to read from the scenario file's folder?). The rule is told whether the
value names something that exists where it is being read from, so a plain word that is a folder beside a
scenario file counts as a path there, as it does in the working directory for the loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

#: ``rule(value, exists) -> bool``: whether ``value`` is a path, ``exists`` saying whether it names a file or
#: folder where it is read from.
PathRule = Callable[[str, bool], bool]


def always_a_path(value: str, exists: bool) -> bool:
    """The rule of a value that is a path whatever it reads like (a data folder, a cache directory)."""
    return True


def written_as_path(value: str) -> bool:
    """Whether ``value`` is written as a path rather than a name: absolute, or starting ``./``, ``../``, ``~``."""
    return value.startswith(("./", "../", "~")) or Path(value).is_absolute()
