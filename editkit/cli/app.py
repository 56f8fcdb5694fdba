"""The ``editkit`` command: a thin Typer layer over the Python API.

Every command's logic lives in the library (``editkit.runs.stream``, ``editkit.runs.edit``,
``editkit.bank.store``); the command layer parses options, builds the one ``Runtime`` and
``BuildOptions`` a command runs with, draws rich output and turns ``EditkitError``
into one red line and a non-zero exit.

This module declares every command, and holds those that only read files (``init``, ``scenarios``,
``bank list``, ``show``, ``remove``, ``verify``). The commands that compute are declared here by name and
help alone and live in :mod:`editkit.cli.compute`: their options are generated from settings dataclasses
and merge methods that import torch, which ``editkit --help``, ``editkit scenarios`` and ``editkit bank
list`` do not need (importing torch alone takes seconds). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from typer.core import TyperCommand

from editkit.cli.options import BankOption

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Continual model editing: linearized fine-tuning "
                  "with tauJp, a persistent task-vector bank, task arithmetic.")
bank_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain a task-vector bank.")
app.add_typer(bank_app, name="bank")


def friendly_errors(fn: Callable) -> Callable:
    """Expected failures (EditkitError) become one red line and exit code 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from editkit.cli.console import err_console
        from editkit.errors import EditkitError

        try:
            return fn(*args, **kwargs)
        except EditkitError as exc:
            err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper


class Computing(TyperCommand):
    """A command declared here by its name and help whose options and code are the function of the same name
    in :mod:`editkit.cli.compute`, imported the first time click reads the command's parameters or callback
    (to parse a command line, show the command's own help, or run it). Listing the commands reads only
    names and help, so it imports nothing of ``compute``."""

    def __init__(self, *args: Any, callback: Callable, **kwargs: Any) -> None:
        self.declared = callback.__name__  # Typer's wrapper keeps the declaring function's name
        super().__init__(*args, callback=callback, **kwargs)

    @functools.cached_property
    def implementation(self) -> TyperCommand:
        from editkit.cli import compute

        single = typer.Typer()
        single.command(self.name)(friendly_errors(getattr(compute, self.declared)))
        return typer.main.get_command(single)

    # click's constructor stores the declaration's parameters (none) and callback; reads get the implementation's
    params = property(lambda self: self.implementation.params, lambda self, declared: None)
    callback = property(lambda self: self.implementation.callback, lambda self, declared: None)


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log library messages.")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# --- the commands that compute: their names and help; their options and code are in editkit.cli.compute


@app.command(cls=Computing)
def stream() -> None:
    """Fine-tune each task of a scenario in turn, bank its vector, evaluate the merged model at alpha = 1.

    Data-parallel on N GPUs: torchrun --nproc_per_node N -m editkit stream ... (rank 0 writes the bank and reports).
    """


@app.command(cls=Computing)
def add() -> None:
    """theta_0 + the vectors merged (default: alpha * sum(tau)): accuracy on each added vector's task."""


@app.command(cls=Computing)
def negate() -> None:
    """theta_0 - alpha * tau: forget a task. Vision: target and control accuracy. Language: control and target
    perplexity and the toxicity of sampled continuations, over an alpha grid."""


@app.command(cls=Computing)
def predict() -> None:
    """An exported model's predicted class (and its probability) for each input and task: image files or folders,
    or texts (a .txt file, one per line; a .csv / .jsonl column). Needs only the directory --out wrote."""


@app.command(cls=Computing)
def generate() -> None:
    """theta_0's and the edited model's continuations of prompts side by side, with their toxicity scores."""


@app.command()
@friendly_errors
def init(
    data: Path = typer.Argument(..., help="Your data: an image folder (train/<class>/*), a table with text and "
                                "label columns (.csv, .jsonl, .parquet, a save_to_disk folder), a text file (.txt, "
                                "one document per line), or a folder of several (one task each)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Scenario file to write (default: <name>.toml here)."),
    name: Optional[str] = typer.Option(None, "--name", help="Scenario name (default: the data's file or folder "
                                       "name)."),
    model: Optional[str] = typer.Option(None, "--model", help="Text backbones: a Hugging Face model id (local "
                                        "cache) or checkpoint directory instead of the embedded one."),
    force: bool = typer.Option(False, "--force", help="Replace an existing scenario file."),
) -> None:
    """Write a commented scenario file for your data (backbone by modality, every option at its default);
    run it with editkit stream --scenario FILE."""
    from editkit.cli.console import console
    from editkit.runs.new_scenario import TEMPLATES, new_scenario

    path, tasks = new_scenario(data, out, name=name, model=model, force=force)
    console.print(f"wrote {path}: {len(tasks)} task(s) of {tasks[0].modality} "
                  f"({', '.join(t.name for t in tasks)}), from the scenario {TEMPLATES[tasks[0].modality]}")
    console.print(f"check it: editkit stream --scenario {path} --check   run it: editkit stream --scenario {path}")


@app.command()
@friendly_errors
def scenarios() -> None:
    """List the known scenarios, as their files are written (editkit stream --scenario NAME --check checks one)."""
    from rich.table import Table

    from editkit.cli.console import console
    from editkit.scenario.catalog import known_scenarios, read_scenario

    table = Table(title="scenarios")
    for column in ("name", "tasks", "backbone", "description"):
        table.add_column(column)
    for name, path in known_scenarios().items():
        data = read_scenario(path)
        tasks = ", ".join(str(task.get("name")) for task in data.get("tasks", []))
        table.add_row(name, tasks, str(data.get("backbone", {}).get("family")), data.get("description", ""))
    console.print(table)


@bank_app.command("list")
@friendly_errors
def bank_list(bank: Path = BankOption) -> None:
    """One row per vector: name, task, mode (and its LoRA adapter's rank), step, single-task accuracy, the curvature
    banked beside it (``--penalty kfac``), created."""
    from rich.table import Table

    from editkit.cli.console import console, curvature_summary, pct
    from editkit.bank.store import open_bank

    store = open_bank(bank)
    table = Table(title=f"{bank}  (base {str(store.base)[:19]}…)")
    for column in ("name", "task", "mode", "scenario", "step", "single-task", "curvature", "created"):
        table.add_column(column)
    for e in store.entries():
        mode = e.mode if e.adapter is None else f"{e.mode}, lora r{e.adapter.rank}"
        table.add_row(e.name, e.task, mode, str(e.scenario), str(e.step), pct(e.metrics.get("single_task")),
                      curvature_summary(e.curvature), e.created)
    console.print(table)


@bank_app.command("show")
@friendly_errors
def bank_show(name: str, bank: Path = BankOption) -> None:
    """Everything the manifest records about one vector (its curvature's layers, bytes and examples included)."""
    import json

    from editkit.cli.console import console
    from editkit.bank.store import open_bank

    console.print_json(json.dumps(open_bank(bank).get(name).to_json()))


@bank_app.command("remove")
@friendly_errors
def bank_remove(name: str, bank: Path = BankOption) -> None:
    """Remove one vector (manifest first, then its file)."""
    from editkit.cli.console import console
    from editkit.bank.store import open_bank

    open_bank(bank).remove(name)
    console.print(f"removed {name} from {bank}")


@bank_app.command("verify")
@friendly_errors
def bank_verify(bank: Path = BankOption) -> None:
    """Check every file's checksum and the manifest; exit 1 if anything is wrong."""
    from editkit.cli.console import console, err_console
    from editkit.bank.store import open_bank

    store = open_bank(bank)
    problems = store.verify()
    for problem in problems:
        err_console.print(f"[red]problem:[/red] {problem}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(1)
    console.print(f"[green]ok[/green]: {len(store)} vectors verified in {bank}")


@bank_app.command("import", cls=Computing)
def bank_import() -> None:
    """Bank tau = theta_ft - theta_0 from a checkpoint fine-tuned elsewhere, or a PEFT LoRA adapter, as a non-linear
    vector."""


@app.command(cls=Computing)
def bench() -> None:
    """The paper's tables and figures: task addition, negation, tauJp diagnostics, cost — for every mode."""


if __name__ == "__main__":
    app()


def run() -> None:
    """Console-script entry point (``editkit``), also behind ``python -m editkit`` and ``python cli.py``."""
    app(prog_name="editkit")
