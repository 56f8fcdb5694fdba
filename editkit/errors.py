"""Errors a user can act on, and the check that refuses a setting outside its declared choices.

Every failure editkit expects (bad input, missing data, a damaged bank) is an
``EditkitError``; the CLI prints its message as one red line and exits non-zero.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class EditkitError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class ConfigError(EditkitError):
    """A scenario, recipe or command-line value is invalid or unknown."""


class MissingResourceError(EditkitError):
    """Weights or data are not available offline; the message says how to get them."""


class DataError(EditkitError):
    """A user's data cannot make a task: a missing file or column, an unreadable image, too few classes."""


class BankError(EditkitError):
    """The task-vector bank refused an operation (missing name, damaged file, ...)."""


class IncompatibleVectorsError(BankError):
    """Vectors cannot be combined: different base models or different modes."""


class CorruptVectorError(BankError):
    """A stored vector is truncated, unreadable or fails its checksum."""


class ExportError(EditkitError):
    """An edited model cannot be written or read as a program: an op without a tangent rule, a program that does
    not reproduce the model it was written from, a directory that is not an export."""


def check_choices(settings: Any, what: str) -> None:
    """Refuse a settings dataclass whose field holds a value outside its ``metadata["choices"]``.

    The command line checks these values itself; this catches those from scenario files
    and the Python API, naming the field as ``<what>.<field>``.
    """
    for f in dataclasses.fields(settings):
        choices = f.metadata.get("choices")
        value = getattr(settings, f.name)
        if choices is not None and value not in choices:
            raise ConfigError(f"{what}.{f.name} = {value!r} is not one of {', '.join(choices)}")
