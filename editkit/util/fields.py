"""Text fields with a fixed set of values, declared the same way in every settings dataclass.

A settings dataclass (the recipe, the bench configuration) documents each field in
``metadata["help"]``; a text field that takes one of a few values lists them in
``metadata["choices"]``, where the command line reads them to offer and check the
values, and :func:`editkit.errors.check_choices` refuses any other value that comes
from elsewhere (scenario files, the Python API).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def choice(default: str, choices: Sequence[str], help: str) -> Any:
    """A dataclass field taking one of ``choices`` (``default`` among them), described by ``help``."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices), "help": help})
