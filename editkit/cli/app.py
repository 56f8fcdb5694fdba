"""The ``editkit`` command: a thin Typer layer over the Python API.

Every command's logic lives in the library (``editkit.runs.stream``, ``editkit.runs.edit``,
``editkit.bank.store``); this file parses options, draws rich output and turns
``EditkitError`` into one red line and a non-zero exit. Heavy imports happen
inside commands so ``editkit --help`` stays fast.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Continual model editing: linearized fine-tuning "
                  "with tauJp, a persistent task-vector bank, task arithmetic.")
bank_app = typer.Typer(no_args_is_help=True, help="Inspect and maintain a task-vector bank.")
app.add_typer(bank_app, name="bank")

DEFAULT_BANK = Path("banks/offline-vision-taujp")
BankOption = typer.Option(DEFAULT_BANK, "--bank", help="Bank directory.")
DeviceOption = typer.Option(None, "--device", help="cpu | cuda | cuda:N (default: CUDA when available; under torchrun "
                            "the local rank's GPU).")
PrecisionOption = typer.Option(None, "--precision", help="auto | bf16 | fp32 (auto: bf16 autocast on CUDA).")
ControlOption = typer.Option("auto", "--control", help="Negation control set: auto (ImageNet validation when the "
                             "scenario asks for it and a local copy is found, else the other tasks) | tasks | imagenet.")
ControlDataOption = typer.Option(None, "--control-data", help="Local ImageNet validation copy (default "
                                 "$EDITKIT_IMAGENET, else <data root>/imagenet).")
WorkersOption = typer.Option(None, "--workers", help="DataLoader workers per process (default: 0 on CPU, up to 8 on GPU).")


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


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log library messages.")) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


def _overrides(model: str | None, pretrained: str | None, clip_cache: Path | None,
               data_root: Path | None) -> tuple[dict, dict]:
    """``--model/--pretrained/--clip-cache`` as [backbone] options and ``--data-root`` as task options
    (None values keep the scenario's)."""
    backbone = {"model": model, "pretrained": pretrained, "cache_dir": str(clip_cache) if clip_cache else None}
    return backbone, {"data_root": str(data_root) if data_root else None}


@app.command()
@friendly_errors
def stream(
    scenario: str = typer.Option("offline-vision", help="Scenario name (see `editkit scenarios`) or a .toml file."),
    mode: Optional[str] = typer.Option(None, help="taujp | linear | nonlinear (default: the scenario's)."),
    schedule: Optional[str] = typer.Option(None, help="tauJp schedule: cyclic | strict."),
    scope: Optional[str] = typer.Option(None, help="Penalty sources: seen (incremental) | all (joint)."),
    lam: Optional[float] = typer.Option(None, help="tauJp weight lambda."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps per task (replaces the scenario's epochs)."),
    epochs: Optional[float] = typer.Option(None, help="Epochs per task, turned into steps from each train split's size "
                                           "(replaces the scenario's steps and per-task epochs)."),
    batch_size: Optional[int] = typer.Option(None, help="Global micro-batch (split over torchrun processes)."),
    accumulation: Optional[int] = typer.Option(None, help="Micro-batches per optimizer step (examples per step = "
                                               "batch-size x accumulation)."),
    lr: Optional[float] = typer.Option(None, help="Peak learning rate (AdamW)."),
    weight_decay: Optional[float] = typer.Option(None, help="AdamW weight decay."),
    warmup: Optional[float] = typer.Option(None, help="Warmup: a fraction of the steps if < 1, else a number of steps."),
    grad_clip: Optional[float] = typer.Option(None, help="Gradient-norm clip."),
    reg_batch: Optional[int] = typer.Option(None, help="Unlabeled examples per penalty source per step."),
    squared: Optional[bool] = typer.Option(None, "--squared/--no-squared", help="Penalise ||J tau||^2 instead of ||J tau||."),
    generic: Optional[bool] = typer.Option(None, "--generic/--no-generic", help="Use the scenario's generic unlabeled source."),
    model: Optional[str] = typer.Option(None, help="Backbone model (CLIP: an open_clip name such as ViT-B-32, ViT-B-16, "
                                        "ViT-L-14, or a config .json)."),
    pretrained: Optional[str] = typer.Option(None, help="Backbone weights (CLIP: an open_clip tag such as openai, a "
                                             "checkpoint file or directory, or 'random')."),
    clip_cache: Optional[Path] = typer.Option(None, help="Cache directory for CLIP weights (default $EDITKIT_CLIP_CACHE, "
                                              "else open_clip's / Hugging Face's)."),
    data_root: Optional[Path] = typer.Option(None, help="Directory holding the datasets (default $EDITKIT_DATA); see "
                                             "docs/vision8.md for the layouts."),
    device: Optional[str] = DeviceOption,
    precision: Optional[str] = PrecisionOption,
    workers: Optional[int] = WorkersOption,
    check: bool = typer.Option(False, "--check", help="Only check that weights and data are available, then exit."),
    bank: Optional[Path] = typer.Option(None, help="Bank directory (default banks/<scenario>-<mode>)."),
    run_dir: Optional[Path] = typer.Option(None, help="Run directory for report.json and plots (default runs/<scenario>-<mode>)."),
    resume: bool = typer.Option(False, help="Continue from the last banked experience."),
    seed: Optional[int] = typer.Option(None, help="Random seed."),
) -> None:
    """Fine-tune each task of a scenario in turn, bank its vector, evaluate the merged model at alpha = 1.

    Data-parallel on N GPUs: torchrun --nproc_per_node N -m editkit stream ... (rank 0 writes the bank and reports).
    """
    from editkit.cli.console import RichProgress, console, pct, step_table
    from editkit.runs.records import StepRecord
    from editkit.runs.stream import run_scenario

    backbone_overrides, task_overrides = _overrides(model, pretrained, clip_cache, data_root)
    if check:
        _check_scenario(scenario, backbone_overrides, task_overrides)
        return
    progress = RichProgress()
    singles: dict[str, float] = {}

    def show(step: StepRecord) -> None:
        singles[step.task] = step.single_task
        console.print(step_table(step, singles))

    result, report = run_scenario(
        scenario, bank=bank, run_dir=run_dir, resume=resume, progress=progress, on_step=show,
        backbone_overrides=backbone_overrides, task_overrides=task_overrides, device=device, precision=precision,
        workers=workers, mode=mode, schedule=schedule, scope=scope, lam=lam, steps=steps, epochs=epochs,
        batch_size=batch_size, accumulation=accumulation, lr=lr, weight_decay=weight_decay, warmup=warmup,
        grad_clip=grad_clip, reg_batch=reg_batch, squared=squared, generic=generic, seed=seed)
    if report is None:  # a torchrun process other than rank 0
        return
    final = report["final"]
    console.print(
        f"[bold]final merged model (alpha = 1.0, {report['mode']}, scope {report['recipe']['scope']}):[/bold] "
        f"absolute {pct(final['absolute'])}  normalized {pct(final['normalized'])}  "
        f"({result.seconds:.0f} s)"
    )
    console.print(f"bank: {report['bank']}   report: {Path(report['plots'][0]).parent / 'report.json'}")


def _check_scenario(scenario: str, backbone_overrides: dict, task_overrides: dict) -> None:
    from editkit.cli.console import console
    from editkit.errors import MissingResourceError
    from editkit.scenario.spec import load_scenario
    from editkit.scenario.build import check_scenario
    from editkit.runs.stream import missing_message

    spec = load_scenario(scenario)
    problems = check_scenario(spec, backbone_overrides=backbone_overrides, task_overrides=task_overrides)
    if problems:
        raise MissingResourceError(missing_message(spec.name, problems))
    console.print(f"[green]ok[/green]: weights and data of scenario {spec.name} ({len(spec.tasks)} tasks) are available")


@app.command()
@friendly_errors
def add(
    names: Optional[list[str]] = typer.Argument(None, help="Vectors to add (default: --all)."),
    all_: bool = typer.Option(False, "--all", help="Add every vector in the bank."),
    alpha: str = typer.Option("1.0", help="Scaling coefficient: one for all vectors, or one per vector ('0.5,1,0.8')."),
    data_root: Optional[Path] = typer.Option(None, help="Data root (default: what the stream was given, else $EDITKIT_DATA)."),
    device: Optional[str] = DeviceOption,
    precision: Optional[str] = PrecisionOption,
    workers: Optional[int] = WorkersOption,
    bank: Path = BankOption,
    out: Optional[Path] = typer.Option(None, help="Save the summed task vector as safetensors."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the numbers as JSON."),
) -> None:
    """theta_0 + alpha * sum(tau): accuracy on each added vector's task."""
    from editkit.cli.console import RichProgress, accuracy_table, console
    from editkit.train.runtime import setup
    from editkit.runs.edit import add as add_vectors
    from editkit.runs.edit import open_bank
    from editkit.errors import ConfigError

    store = open_bank(bank)
    if all_ and names:
        raise ConfigError("give vector names or --all, not both")
    selection = store.names() if all_ or not names else names
    try:
        alphas = [float(a) for a in alpha.split(",")]
    except ValueError:
        raise ConfigError(f"--alpha must be a number or comma-separated numbers, got {alpha!r}") from None
    result = add_vectors(store, selection, alphas[0] if len(alphas) == 1 else alphas, progress=RichProgress(),
                         task_overrides={"data_root": str(data_root) if data_root is not None else None},
                         runtime=setup(device, precision, workers))
    r = result.report
    console.print(accuracy_table(f"add {', '.join(selection)} (alpha {alpha}, {r['mode']})", r["per_task"],
                                 single=r["single_task"], summary={"absolute": r["absolute"], "normalized": r["normalized"]}))
    _save_outputs(result, out, json_path)


@app.command()
@friendly_errors
def negate(
    name: str = typer.Argument(..., help="Vector to negate."),
    alpha: float = typer.Option(1.0, help="Scaling coefficient: theta_0 - alpha * tau."),
    tune_alpha: bool = typer.Option(False, "--tune-alpha", help="Choose alpha on validation (grid 0, 0.05, ..., 1): "
                                    "lowest target accuracy keeping control >= --min-control x pretrained control."),
    min_control: float = typer.Option(0.95, help="With --tune-alpha: control accuracy to keep, as a fraction of the "
                                      "pretrained model's."),
    control: str = ControlOption,
    control_data: Optional[Path] = ControlDataOption,
    data_root: Optional[Path] = typer.Option(None, help="Data root (default: what the stream was given, else $EDITKIT_DATA)."),
    model: Optional[str] = typer.Option(None, help="Backbone model (default: what the stream used)."),
    pretrained: Optional[str] = typer.Option(None, help="Backbone weights (default: what the stream used)."),
    device: Optional[str] = DeviceOption,
    precision: Optional[str] = PrecisionOption,
    workers: Optional[int] = WorkersOption,
    bank: Path = BankOption,
    out: Optional[Path] = typer.Option(None, help="Save the negated task vector as safetensors."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the numbers as JSON."),
) -> None:
    """theta_0 - alpha * tau: forget a task; target accuracy (lower is better) and control accuracy."""
    from editkit.cli.console import RichProgress, accuracy_table, console
    from editkit.train.runtime import setup
    from editkit.runs.edit import negate as negate_vector
    from editkit.runs.edit import open_bank

    store = open_bank(bank)
    runtime = setup(device, precision, workers)
    result = negate_vector(store, name, alpha, progress=RichProgress(), control=control, control_data=control_data,
                           tune_alpha=tune_alpha, min_control=min_control,
                           backbone_overrides={"model": model, "pretrained": pretrained},
                           task_overrides={"data_root": str(data_root) if data_root is not None else None},
                           runtime=runtime)
    r = result.report
    summary = {k: r[k] for k in ("target", "control", "control_pretrained") if k in r}
    used = r.get("alpha", alpha)
    title = f"negate {name} (alpha {used:g}{', tuned on validation' if tune_alpha else ''}, {r['mode']})"
    console.print(accuracy_table(title, r["per_task"], pretrained=r["pretrained"], summary=summary))
    if "control_set" in r:
        console.print(f"control set: {r['control_set']}")
    _save_outputs(result, out, json_path)


def _save_outputs(result, out: Optional[Path], json_path: Optional[Path]) -> None:
    from safetensors.torch import save_file

    from editkit.util.atomic import atomic_path
    from editkit.cli.console import console
    from editkit.runs.report import write_json

    if out is not None:
        with atomic_path(out) as tmp:
            save_file({k: v.contiguous() for k, v in result.vector.tensors.items()}, str(tmp),
                      metadata={"mode": result.mode, "coefficients": str(result.coefficients)})
        console.print(f"task vector written to {out}")
    if json_path is not None:
        write_json(json_path, result.report)
        console.print(f"numbers written to {json_path}")


@app.command()
@friendly_errors
def scenarios() -> None:
    """List the known scenarios."""
    from rich.table import Table

    from editkit.cli.console import console
    from editkit.scenario.spec import known_scenarios, load_scenario

    table = Table(title="scenarios")
    for column in ("name", "tasks", "backbone", "description"):
        table.add_column(column)
    for name, path in known_scenarios().items():
        spec = load_scenario(path)
        table.add_row(name, ", ".join(spec.task_names), str(spec.backbone.get("family")), spec.description)
    console.print(table)


@bank_app.command("list")
@friendly_errors
def bank_list(bank: Path = BankOption) -> None:
    """One row per vector: name, task, mode, step, single-task accuracy, created."""
    from rich.table import Table

    from editkit.cli.console import console, pct
    from editkit.runs.edit import open_bank

    store = open_bank(bank)
    table = Table(title=f"{bank}  (base {str(store.base)[:19]}…)")
    for column in ("name", "task", "mode", "scenario", "step", "single-task", "created"):
        table.add_column(column)
    for e in store.entries():
        table.add_row(e.name, e.task, e.mode, str(e.scenario), str(e.step), pct(e.metrics.get("single_task")), e.created)
    console.print(table)


@bank_app.command("show")
@friendly_errors
def bank_show(name: str, bank: Path = BankOption) -> None:
    """Everything the manifest records about one vector."""
    import json

    from editkit.cli.console import console
    from editkit.runs.edit import open_bank

    console.print_json(json.dumps(open_bank(bank).get(name).to_json()))


@bank_app.command("remove")
@friendly_errors
def bank_remove(name: str, bank: Path = BankOption) -> None:
    """Remove one vector (manifest first, then its file)."""
    from editkit.cli.console import console
    from editkit.runs.edit import open_bank

    open_bank(bank).remove(name)
    console.print(f"removed {name} from {bank}")


@bank_app.command("verify")
@friendly_errors
def bank_verify(bank: Path = BankOption) -> None:
    """Check every file's checksum and the manifest; exit 1 if anything is wrong."""
    from editkit.cli.console import console, err_console
    from editkit.runs.edit import open_bank

    store = open_bank(bank)
    problems = store.verify()
    for problem in problems:
        err_console.print(f"[red]problem:[/red] {problem}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(1)
    console.print(f"[green]ok[/green]: {len(store)} vectors verified in {bank}")


@app.command()
@friendly_errors
def bench(
    scenario: str = typer.Option("offline-vision", help="Scenario name (see `editkit scenarios`) or a .toml file."),
    modes: str = typer.Option("nonlinear,linear,taujp", help="Comma-separated modes to fine-tune and compare."),
    methods: str = typer.Option("task-arithmetic,ties", help="Merging methods besides pretrained and single-task."),
    bank_root: Path = typer.Option(Path("banks"), help="Banks live in <bank-root>/<scenario>-<mode>; complete ones "
                                   "with the same recipe are reused, partial ones resumed."),
    run_dir: Optional[Path] = typer.Option(None, help="Where report.json and the PNGs go (default runs/<scenario>-bench)."),
    steps: Optional[int] = typer.Option(None, help="Optimizer steps per task (default: the scenario's)."),
    grid: int = typer.Option(21, help="Coefficient grid: N points over [0, 1], searched on validation."),
    negation_grid: int = typer.Option(11, help="Negation coefficient grid: N points over [0, --negation-max] (coarser "
                                      "by default: each point costs a pass over every validation split per task)."),
    negation_max: float = typer.Option(1.0, help="Top of the negation grid (try 2 when the tuned alpha lands on 1)."),
    seed: Optional[int] = typer.Option(None, help="Random seed (default: the scenario's)."),
    xi_pair: Optional[str] = typer.Option(None, help="Task pair 'a,b' for the disentanglement error (default: first two)."),
    xi_samples: int = typer.Option(250, help="Test inputs per task for the disentanglement error."),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's)."),
    device: Optional[str] = DeviceOption,
    precision: Optional[str] = PrecisionOption,
    workers: Optional[int] = WorkersOption,
    control: str = ControlOption,
    control_data: Optional[Path] = ControlDataOption,
    model: Optional[str] = typer.Option(None, help="Backbone model (as for `editkit stream`)."),
    pretrained: Optional[str] = typer.Option(None, help="Backbone weights (as for `editkit stream`)."),
    clip_cache: Optional[Path] = typer.Option(None, help="Cache directory for CLIP weights (as for `editkit stream`)."),
    data_root: Optional[Path] = typer.Option(None, help="Directory holding the datasets (default $EDITKIT_DATA)."),
) -> None:
    """The paper's tables and figures: task addition, negation, tauJp diagnostics, cost — for every mode."""
    import time

    from editkit.runs.bench.run import BenchConfig, run_bench
    from editkit.runs.bench.tables import addition_table, claim_line, cost_table, negation_table, taujp_table, xi_table
    from editkit.cli.console import RichProgress, console

    if threads is not None:
        import torch

        torch.set_num_threads(max(1, threads))
    start = time.perf_counter()
    backbone_overrides, task_overrides = _overrides(model, pretrained, clip_cache, data_root)
    config = BenchConfig(scenario=scenario, modes=modes, methods=methods, bank_root=bank_root, run_dir=run_dir,
                         steps=steps, seed=seed, grid=grid, negation_grid=negation_grid,
                         negation_max=negation_max, xi_pair=xi_pair, xi_samples=xi_samples, device=device,
                         precision=precision, workers=workers, control=control, control_data=control_data,
                         backbone_overrides=backbone_overrides, task_overrides=task_overrides)
    result = run_bench(config, progress=RichProgress())
    report = result.report
    for build in (addition_table, negation_table, taujp_table, xi_table, cost_table):
        table = build(report)
        width = console.measure(table, options=console.options.update(max_width=1000)).maximum
        if console.is_terminal or width <= console.width:
            console.print(table)
        else:  # a pipe or a file: keep every row on one line (a terminal wraps tables itself)
            from rich.console import Console

            Console(file=console.file, width=width, color_system=console.color_system).print(table)
    corr = report["taujp"]["correlation"]
    console.print(f"[bold]τJp ↔ normalized accuracy:[/bold] pearson r = "
                  f"{'n/a' if corr['pearson'] is None else format(corr['pearson'], '.3f')}, spearman ρ = "
                  f"{'n/a' if corr['spearman'] is None else format(corr['spearman'], '.3f')} over {corr['n']} task pairs × modes")
    line = claim_line(report)
    if line:
        console.print(line, style="bold", markup=False)
    trained = {m: len(c["trained_now"]) for m, c in report["cost"].items()}
    console.print(f"vectors trained now: {', '.join(f'{m} {n}' for m, n in trained.items())}  "
                  f"(others reused from {bank_root})   {time.perf_counter() - start:.0f} s")
    console.print(f"report: {result.report_path}   plots: {', '.join(report['plots'].values())}")


if __name__ == "__main__":
    app()


def run() -> None:
    """Console-script entry point (``editkit``), also behind ``python -m editkit`` and ``python cli.py``."""
    app(prog_name="editkit")
