"""Progress reporting without printing from library code.

Library functions accept a ``Progress`` and call ``progress.task(...)``; the
default does nothing. The CLI (and notebooks, examples) pass ``RichProgress``
from ``editkit.cli.console`` to get live bars.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Protocol


class ProgressTask(Protocol):
    def advance(self, n: int = 1, **fields: float) -> None: ...


class Progress(Protocol):
    def task(self, description: str, total: int) -> contextlib.AbstractContextManager[ProgressTask]: ...

    def note(self, line: str) -> None:
        """One line of what happened (a distributed unit queued, started, done), beside the bars."""


class _NullTask:
    def advance(self, n: int = 1, **fields: float) -> None:
        return None


class NullProgress:
    """Reports nothing."""

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[ProgressTask]:
        yield _NullTask()

    def note(self, line: str) -> None:
        return None
