"""MkDocs hook: the command-line reference (docs/cli.md) written from the Typer app at build time.

The page holds ``MARKER``; each build replaces it with every command's ``--help``, exactly as a
terminal shows it. The reference then cannot fall behind the code: a command or option that is
added, removed or re-described appears in the next build, and nobody edits the page for it.
"""

from __future__ import annotations

from typing import Iterator

MARKER = "<!-- cli-reference -->"
PAGE = "cli.md"
#: Help is rendered this wide: wide enough for the option columns, narrow enough for a page.
COLUMNS = "100"


def command_paths() -> Iterator[list[str]]:
    """Every command and command group below ``editkit``, depth first, in the order ``--help`` lists them."""
    import typer

    from editkit.cli.app import app

    root = typer.main.get_command(app)

    def walk(group, ctx, path: list[str]) -> Iterator[list[str]]:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            yield [*path, name]
            if hasattr(command, "list_commands"):
                yield from walk(command, command.make_context(name, [], parent=ctx, resilient_parsing=True),
                                [*path, name])

    yield from walk(root, root.make_context("editkit", [], resilient_parsing=True), [])


def help_text(path: list[str]) -> str:
    """``editkit PATH --help`` as printed, trailing blanks stripped."""
    from typer.testing import CliRunner

    from editkit.cli.app import app

    result = CliRunner().invoke(app, [*path, "--help"], prog_name="editkit",
                                env={"COLUMNS": COLUMNS, "NO_COLOR": "1"})
    if result.exit_code != 0:
        raise RuntimeError(f"editkit {' '.join(path)} --help exited {result.exit_code}:\n{result.output}")
    return "\n".join(line.rstrip() for line in result.output.splitlines()).strip("\n")


def reference() -> str:
    """The generated part of the page: ``editkit --help``, then one section per command."""
    sections = [f"## `editkit`\n\n```text\n{help_text([])}\n```"]
    for path in command_paths():
        sections.append(f"## `editkit {' '.join(path)}`\n\n```text\n{help_text(path)}\n```")
    return "\n\n".join(sections)


def on_page_markdown(markdown: str, page, **_) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker {MARKER}: the command-line reference has nowhere to go")
    return markdown.replace(MARKER, reference())
