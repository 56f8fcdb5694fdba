"""Errors a user can act on.

Every failure editkit expects (bad input, missing data, a damaged bank) is an
``EditkitError``; the CLI prints its message as one red line and exits non-zero.
Anything else is a bug and keeps its traceback.
"""


class EditkitError(Exception):
    """Base class: the message says what is wrong and what to do about it."""


class ConfigError(EditkitError):
    """A scenario, recipe or command-line value is invalid or unknown."""


class MissingResourceError(EditkitError):
    """Weights or data are not available offline; the message says how to get them."""


class BankError(EditkitError):
    """The task-vector bank refused an operation (missing name, damaged file, ...)."""


class IncompatibleVectorsError(BankError):
    """Vectors cannot be combined: different base models or different modes."""


class CorruptVectorError(BankError):
    """A stored vector is truncated, unreadable or fails its checksum."""
