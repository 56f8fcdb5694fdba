"""The ``editkit`` command: a thin Typer layer over the library."""

from editkit.cli.app import app, run

__all__ = ["app", "run"]
