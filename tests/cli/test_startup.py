"""A CLI that answers at once: ``editkit --help``, ``editkit scenarios`` and ``editkit bank list`` import
no torch (nor transformers, open_clip, avalanche), which only the commands that compute need. Each runs in
a new process, which then reports the modules it imported; how fast they answer is measured by
``benchmarks/cli_startup.py``, not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import typer

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.cli.app import Computing

HEAVY = ("torch", "transformers", "open_clip", "avalanche", "torchvision", "numpy")

#: Runs ``editkit ARGS`` in this process, then prints the heavy modules it imported as the last line.
RUNNER = f"""
import json, sys
from editkit.cli import run
sys.argv[0] = "editkit"
try:
    run()
except SystemExit:
    pass
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))))
"""


def editkit(*args: str) -> tuple[str, list[str]]:
    """``editkit ARGS`` in a new process writing to a pipe (``COLUMNS`` unset): its output, and the heavy packages
    it imported. Run under the ``offline`` fixture, which points ``$EDITKIT_SCENARIOS`` at this checkout."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-c", RUNNER, *args], capture_output=True, text=True, env=env, check=True)
    *output, imported = done.stdout.splitlines()
    return "\n".join(output), json.loads(imported)


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    bank = Bank(tmp_path_factory.mktemp("startup") / "bank")
    bank.append("digits", {"w": torch.ones(3)}, task="digits", mode="taujp", base="sha256:0", scenario="offline-vision")
    return bank.root


@pytest.mark.parametrize("args", [["--help"], ["scenarios"], ["bank", "list"], ["bank", "--help"]])
def test_commands_that_only_read_import_no_torch(args, bank, offline):
    output, imported = editkit(*args, *(["--bank", str(bank)] if args == ["bank", "list"] else []))
    assert imported == [], (args, imported)
    assert output.strip()


def test_the_listings_name_the_commands_and_the_scenarios(offline):
    help_text, _ = editkit("--help")
    for name in ("stream", "add", "negate", "generate", "bench", "scenarios", "bank"):
        assert name in help_text
    listing, _ = editkit("scenarios")
    assert "offline-vision" in listing and "digits" in listing and "…" not in listing  # a pipe: full width


def test_bank_list_reads_the_manifest(bank, offline):
    output, _ = editkit("bank", "list", "--bank", str(bank))
    assert "digits" in output and "taujp" in output and "offline-vision" in output


def test_every_computing_command_finds_its_implementation():
    group = typer.main.get_command(app)
    computing = [c for c in (*group.commands.values(), *group.commands["bank"].commands.values())
                 if isinstance(c, Computing)]
    assert sorted(c.name for c in computing) == ["add", "bench", "generate", "import", "negate", "predict", "stream"]
    for command in computing:
        assert command.params and command.callback is command.implementation.callback
        assert command.help and not command.implementation.help  # the help is declared once, with the name
