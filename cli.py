"""The face of the ``editkit`` command: ``python cli.py stream`` runs the same Typer app as ``editkit stream``.

The app lives in ``editkit.cli`` so an installed wheel needs no top-level ``cli`` module.
"""

from editkit.cli import app, run

if __name__ == "__main__":
    run()
