"""The ``editkit`` command run in-process, and the check that it refused in one line."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from editkit.cli import app

runner = CliRunner()

#: The line a finished progress task leaves off a terminal (``editkit.cli.console.RichProgress``): what ran
#: before a refusal, as a log shows it.
FINISHED_TASK = re.compile(r".+: \d+/\d+ in \d+\.\d s")


def invoke(*args):
    """``editkit ARGS`` through Typer's runner; each argument (paths, numbers) passed as its ``str``."""
    return runner.invoke(app, [str(a) for a in args])


def one_line_refusal(result, match: str, *, exit_code: int | None = 1) -> None:
    """``result`` failed with ``exit_code`` (any non-zero status when None) and said why in one non-blank line
    on stderr, which (whitespace collapsed) holds ``match``; stdout holds at most the lines of the tasks
    that finished before it."""
    if exit_code is None:
        assert result.exit_code != 0, result.output
    else:
        assert result.exit_code == exit_code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and match in " ".join(result.stderr.split()), result.output
    assert all(FINISHED_TASK.fullmatch(line) for line in result.stdout.splitlines() if line.strip()), result.output
