"""The ``editkit`` command run in-process, and the check that it refused in one line."""

from __future__ import annotations

from typer.testing import CliRunner

from editkit.cli import app

runner = CliRunner()


def invoke(*args):
    """``editkit ARGS`` through Typer's runner; each argument (paths, numbers) passed as its ``str``."""
    return runner.invoke(app, [str(a) for a in args])


def one_line_refusal(result, match: str, *, exit_code: int | None = 1) -> None:
    """``result`` failed with ``exit_code`` (any non-zero status when None) and printed one non-blank line,
    which (whitespace collapsed) holds ``match``."""
    if exit_code is None:
        assert result.exit_code != 0, result.output
    else:
        assert result.exit_code == exit_code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and match in " ".join(result.output.split()), result.output
