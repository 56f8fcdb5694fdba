"""The commands that compute: stream, add, negate, generate, bank import and bench.

Each function here is the command of the same name that :mod:`editkit.cli.app` declares with its help.
Their options are generated from the settings dataclasses (recipe, bench, build, runtime, language
negation) and list the registered merge methods, which import torch; so ``app`` imports this module only
when one of these commands parses its arguments, shows its help or runs, and ``editkit --help``,
``editkit scenarios`` and ``editkit bank list`` answer without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

import typer

from editkit.cli.options import DEFAULT_BANK, BankOption, Fields, option_for, with_options
from editkit.merge import MERGE_METHODS
from editkit.merge.coefficients import NEGATION_RETAIN
from editkit.runs.bench.config import BenchConfig
from editkit.scenario.options import BuildOptions
from editkit.eval.lm_negation import LanguageNegation
from editkit.settings import default_bank_dir, default_run_dir
from editkit.train.recipe import Recipe
from editkit.train.runtime import RuntimeOptions

ScenarioOption = option_for(BenchConfig, "scenario")
ControlOption = option_for(BenchConfig, "control")
ControlDataOption = option_for(BenchConfig, "control_data")
#: ``--force`` of the commands whose ``--out`` writes an edited model.
ForceOption = typer.Option(False, "--force", help="--out may replace an existing file or a non-empty directory.")

#: Option groups: recipe fields (the commands that run streams) and build options, unset keeps the value below;
#: the runtime options every computing command takes.
RUNTIME = Fields(RuntimeOptions)
KEEP_SCENARIO = "(default: the scenario's)"
LANGUAGE_RECIPE = "Language scenarios, when the vector is fine-tuned first (default: the scenario's)."
RECIPE = Fields(Recipe, keep=True, keep_help=KEEP_SCENARIO)
BUILD = Fields(BuildOptions, keep=True, keep_help=KEEP_SCENARIO)
REBUILD = Fields(BuildOptions, keep=True, keep_help="(default: what the stream was given, else the scenario's)")
LANGUAGE = Fields(LanguageNegation, keep=True, keep_help="(language vectors; default: the scenario's [negation])")
#: Title of the scores of the ordinary model at a linearized vector's weights (beside the program, in --out).
WEIGHTS_TITLE = "the same, as the ordinary network at these weights (--out writes them beside the model)"
OutOption = typer.Option(None, help="Write the edited model into this directory: model.pt2 (the model that was "
                         "scored, every task's head included, a torch.export program: torch.export.load runs it "
                         "without editkit), the weights theta_0 + delta in the family's own format (a Hugging Face "
                         "directory, an open_clip checkpoint, a torchvision or EfficientNet state dict) with "
                         "heads.safetensors, editkit.json and a model card; with --tau-only: the vector itself.")
TauOnlyOption = typer.Option(False, "--tau-only", help="--out writes the combined task vector (safetensors), not a "
                             "model.")


@with_options(recipe=RECIPE, build=BUILD, runtime_options=RUNTIME)
def stream(
    recipe: dict,
    build: dict,
    runtime_options: dict,
    scenario: str = ScenarioOption,
    check: bool = typer.Option(False, "--check", help="Only check that weights and data are available, then exit."),
    bank: Optional[Path] = typer.Option(None, help="Bank directory (default banks/<scenario>-<mode>)."),
    run_dir: Optional[Path] = typer.Option(None, help="Run directory for report.json and plots (default runs/<scenario>-<mode>)."),
    resume: bool = typer.Option(False, help="Continue from the last banked experience."),
    log: str = option_for(BenchConfig, "log"),
    merge: Optional[str] = typer.Option(None, help=f"Merge method the merged model is built with after each "
                                        f"experience, over every banked vector: {', '.join(MERGE_METHODS)} "
                                        "(default: the scenario's [merge], else the mode's own: the sum; MagMax "
                                        "for sequential)."),
    merge_param: Optional[list[str]] = typer.Option(None, "--merge-param", help="Option of the --merge method, "
                                                    "key=value (repeatable)."),
) -> None:
    from editkit.cli.console import RichProgress, console, pct, step_table
    from editkit.errors import ConfigError
    from editkit.merge.continual import StreamMerge, default_merge
    from editkit.runs.records import StepRecord
    from editkit.runs.stream import process_runtime, run_scenario

    if merge_param and merge is None:
        raise ConfigError("--merge-param needs --merge METHOD")
    chosen = StreamMerge.of(merge, merge_param or ()) if merge is not None else None
    options = BuildOptions(**build)
    if check:
        _check_scenario(scenario, options)
        return
    from editkit.scenario.spec import load_scenario

    progress = RichProgress()
    singles: dict[str, float] = {}
    spec = load_scenario(scenario)
    language = spec.language  # scores are perplexities, not accuracies

    def show(step: StepRecord) -> None:
        singles[step.task] = step.single_task
        console.print(step_table(step, singles, perplexity=language))

    with process_runtime(**runtime_options, scenario=spec) as runtime:
        result, report = run_scenario(scenario, bank=bank, run_dir=run_dir, resume=resume, progress=progress,
                                      on_step=show, build=options, runtime=runtime, loggers=log, merge=chosen,
                                      **recipe)
    if report is None:  # a torchrun process other than rank 0
        return
    final = report["final"]
    scores = (f"mean test perplexity {final['absolute']:.1f}" if language else
              f"absolute {pct(final['absolute'])}  normalized {pct(final['normalized'])}")
    method = report["merge"]["method"]
    merged_by = "" if method == default_merge(report["mode"]).method else f", {method}"  # named only when chosen
    console.print(f"[bold]final merged model (alpha = 1.0, {report['mode']}, scope {report['recipe']['scope']}"
                  f"{merged_by}):"
                  f"[/bold] {scores}  ({result.seconds:.0f} s)")
    if "continual" in report and report["continual"]["bwt"] is not None:
        continual = report["continual"]
        console.print(f"continual: ACC {pct(continual['acc'])}  BWT {100 * continual['bwt']:+.1f}  forgetting "
                      f"{100 * continual['forgetting']:.1f} (points, the merged model after each step)")
    console.print(f"bank: {report['bank']}   report: {Path(report['plots'][0]).parent / 'report.json'}")


def _check_scenario(scenario: str, build: BuildOptions) -> None:
    from editkit.cli.console import console
    from editkit.scenario.spec import load_scenario
    from editkit.scenario.build import require_scenario

    spec = load_scenario(scenario)
    require_scenario(spec, build)
    console.print(f"[green]ok[/green]: weights and data of scenario {spec.name} ({len(spec.tasks)} tasks) are available")


@with_options(build=REBUILD, runtime_options=RUNTIME)
def add(
    build: dict,
    runtime_options: dict,
    names: Optional[list[str]] = typer.Argument(None, help="Vectors to add (default: --all)."),
    all_: bool = typer.Option(False, "--all", help="Add every vector in the bank."),
    alpha: str = typer.Option("1.0", help="Scaling coefficient: one for all vectors, or one per vector ('0.5,1,0.8')."),
    method: str = typer.Option("task-arithmetic", help=f"Merge method: {', '.join(MERGE_METHODS)} (each merges the "
                               "vectors scaled by their alphas)."),
    param: Optional[list[str]] = typer.Option(None, "--param", help="A merge-method option as key=value, repeatable "
                                              "(" + "; ".join(f"{m}: {', '.join(MERGE_METHODS[m].option_names)}"
                                                              for m in MERGE_METHODS if MERGE_METHODS[m].options)
                                              + ")."),
    bank: Path = BankOption,
    out: Optional[Path] = OutOption,
    tau_only: bool = TauOnlyOption,
    force: bool = ForceOption,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the numbers as JSON."),
) -> None:
    from editkit.cli.console import RichProgress, accuracy_table, console

    from editkit.runs.edit import add as add_vectors
    from editkit.bank.store import open_bank
    from editkit.runs.stream import process_runtime
    from editkit.errors import ConfigError

    writes_model = _check_out(out, tau_only, force)  # refused before the bank is read
    store = open_bank(bank)
    if all_ and names:
        raise ConfigError("give vector names or --all, not both")
    selection = store.names() if all_ or not names else names
    try:
        alphas = [float(a) for a in alpha.split(",")]
    except ValueError:
        raise ConfigError(f"--alpha must be a number or comma-separated numbers, got {alpha!r}") from None
    with process_runtime(**runtime_options) as runtime:
        result = add_vectors(store, selection, alphas[0] if len(alphas) == 1 else alphas, method=method,
                             params=param or [], progress=RichProgress(), build=BuildOptions(**build),
                             runtime=runtime, weights_scores=writes_model)
    r = result.report
    title = f"add {', '.join(selection)} (alpha {alpha}, {r['mode']}, {method}"
    title += "".join(f", {k}={v}" for k, v in r["options"].items()) + ")"
    console.print(accuracy_table(title, r["per_task"],
                                 single=r["single_task"], summary={"absolute": r["absolute"], "normalized": r["normalized"]}))
    if "weights" in r:  # linearized vectors: what the written weights score, beside f_lin's
        w = r["weights"]
        console.print(accuracy_table(WEIGHTS_TITLE, w["per_task"], single=r["single_task"],
                                     summary={"absolute": w["absolute"], "normalized": w["normalized"]}))
    if writes_model:
        _export(result, store, out, method=method, force=force, build=BuildOptions(**build))
    _save_outputs(result, out if tau_only else None, json_path, force=force)


@with_options(build=REBUILD, runtime_options=RUNTIME, language=LANGUAGE)
def negate(
    build: dict,
    runtime_options: dict,
    language: dict,
    name: str = typer.Argument(..., help="Vector to negate (a language scenario's name, e.g. toxic, names its task "
                               "and its bank: the vector is fine-tuned first when the bank lacks it)."),
    alpha: Optional[float] = typer.Option(None, help="Scaling coefficient: theta_0 - alpha * tau (default: 1 for "
                                          "vision vectors; chosen on validation for language vectors)."),
    tune_alpha: bool = typer.Option(False, "--tune-alpha", help="Choose alpha on validation. Vision: grid 0, 0.05, "
                                    "..., 1, lowest target accuracy keeping control >= --min-control x pretrained; "
                                    "language: the --rule over --alphas."),
    min_control: float = typer.Option(NEGATION_RETAIN, help="Vision, with --tune-alpha: control accuracy to keep, "
                                      "as a fraction of the pretrained model's."),
    control: str = ControlOption,
    control_data: Optional[Path] = ControlDataOption,
    bank: Optional[Path] = typer.Option(None, "--bank", help="Bank directory (default: a language scenario's "
                                        f"banks/<scenario>-<mode>, else {DEFAULT_BANK})."),
    mode: Optional[str] = option_for(Recipe, "mode"),
    steps: Optional[int] = typer.Option(None, help="Language scenarios: optimizer steps when the vector is "
                                        "fine-tuned first (default: the scenario's)."),
    penalty: Optional[str] = option_for(Recipe, "penalty", keep_help=LANGUAGE_RECIPE),
    lam: Optional[float] = option_for(Recipe, "lam", keep_help=LANGUAGE_RECIPE),
    run_dir: Optional[Path] = typer.Option(None, help="Language vectors: directory of report.json and the plot "
                                           "(default runs/negate-<name>-<mode>[-kfac])."),
    out: Optional[Path] = typer.Option(None, help="Write the negated model theta_0 - alpha tau into this directory: "
                                       "model.pt2 (the scored model with every scored task's head, a torch.export "
                                       "program), the weights in the family's own format, editkit.json and a model "
                                       "card; a language model: its Hugging Face directory (what the continuations "
                                       "were sampled from) with the card; with --tau-only: the negated vector."),
    tau_only: bool = TauOnlyOption,
    force: bool = ForceOption,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the numbers as JSON."),
) -> None:
    from editkit.bank.store import Bank
    from editkit.errors import ConfigError
    from editkit.runs.negate_lm import is_language_vector, language_scenario

    spec = language_scenario(name)  # with or without --bank: a bank lacking the vector gets it fine-tuned first
    mode = mode or (spec.recipe.mode if spec is not None else None)
    fields = {"mode": mode, "steps": steps, "penalty": penalty, "lam": lam}  # a language vector fine-tuned first
    if spec is not None:  # its bank and run directory named as a stream names them (-kfac: the data-free penalty)
        label = spec.recipe.with_overrides(**fields).label
        bank, run_dir = bank or default_bank_dir(spec.name, label), run_dir or default_run_dir(f"negate-{name}", label)
    elif penalty is not None or lam is not None:
        raise ConfigError("--penalty and --lam shape a language scenario's vector when it is fine-tuned first; "
                          f"{name!r} names no language scenario")
    bank = bank or DEFAULT_BANK
    writes_model = _check_out(out, tau_only, force)  # refused before anything is fine-tuned or scored
    if spec is not None or is_language_vector(Bank(bank), name):
        if tau_only:
            raise ConfigError("--tau-only: a language vector's negation is written as its model (--out), and the "
                              "vector is in the bank")
        _negate_language(name, spec, bank, alpha=None if tune_alpha else alpha, recipe=fields,
                         run_dir=run_dir, json_path=json_path, language=language, build=BuildOptions(**build),
                         runtime_options=runtime_options, out=out, force=force)
        return
    _negate_vision(name, bank, 1.0 if alpha is None else alpha, tune_alpha=tune_alpha, min_control=min_control,
                   control=control, control_data=control_data, out=out, writes_model=writes_model, force=force,
                   json_path=json_path, build=BuildOptions(**build), runtime_options=runtime_options)


def predict(
    inputs: list[Path] = typer.Argument(..., help="Image files or folders of them (image models); a .txt file (one "
                                        "input per line), or a .csv / .jsonl file (its --column) (text models)."),
    model: Path = typer.Option(..., "--model", help="A directory editkit add / negate --out wrote."),
    task: Optional[list[str]] = typer.Option(None, "--task", help="Only this task (repeatable; default: every task "
                                             "the model does)."),
    column: str = typer.Option("text", help="The column of a .csv / .jsonl file that holds the texts."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the predictions as JSON."),
    runtime: Literal["torch", "onnx"] = typer.Option("torch", "--runtime", help="torch: the program (model.pt2); "
                                                     "onnx: model.onnx in ONNX Runtime (editkit's onnx extra)."),
) -> None:
    from editkit.cli.console import RichProgress, console, prediction_table
    from editkit.runs.predict import predict as predict_inputs
    from editkit.runs.report import write_json

    predictions = predict_inputs(model, inputs, tasks=task, column=column, runtime=runtime, progress=RichProgress())
    console.print(prediction_table(f"{model}: {len(predictions)} predictions", predictions))
    if json_path is not None:
        write_json(json_path, [p.to_json() for p in predictions])
        console.print(f"predictions written to {json_path}")


def generate(
    name: Optional[str] = typer.Argument(None, help="Bank vector of a causal LM (a language scenario's name, e.g. "
                                         "toxic, names its bank too); or give --model."),
    alpha: float = typer.Option(1.0, help="The edited model is theta_0 + alpha * tau: --alpha -1 is theta_0 - tau "
                                "(with --negate, theta_0 - alpha * tau)."),
    negate: bool = typer.Option(False, "--negate", help="Subtract: theta_0 - alpha * tau, as editkit negate "
                                "(--negate --alpha 2 is --alpha -2)."),
    bank: Optional[Path] = typer.Option(None, "--bank", help="Bank directory (default: a language scenario's "
                                        "banks/<scenario>-<mode>)."),
    mode: Optional[str] = option_for(Recipe, "mode"),
    model: Optional[Path] = typer.Option(None, "--model", help="An exported model directory (editkit negate / add "
                                         "--out) instead of a bank vector."),
    base: Optional[str] = typer.Option(None, "--base", help="With --model: the model theta_0 is (default: the "
                                       "base its editkit.json names)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="A prompt, repeatable."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="Prompts, one per line."),
    prompts: int = typer.Option(5, "--prompts", help="Without --prompt / --prompts-file: the first N held-out test "
                                "prompts of the scenario's negation prompts corpus."),
    samples_per_prompt: int = typer.Option(1, help="Continuations sampled per prompt and model."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens per continuation (default: the scenario's)."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed (default: the scenario's); both models sample "
                                       "sample i with the same random stream."),
    scorer: Optional[str] = typer.Option(None, help="Toxicity scorer (default: the scenario's negation scorer)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the continuations and scores as JSON."),
) -> None:
    from editkit.cli.console import RichProgress, console, generation_table
    from editkit.errors import ConfigError
    from editkit.bank.store import Bank
    from editkit.runs.generate import from_bank, from_directory, generate as generate_text, read_prompts
    from editkit.runs.negate_lm import check_fresh, language_scenario
    from editkit.runs.report import write_json

    if (name is None) == (model is None):
        raise ConfigError("name a bank vector or give --model DIR (one of them)")
    if base is not None and model is None:
        raise ConfigError("--base goes with --model: a bank vector's theta_0 is its bank's base model")
    given = read_prompts(prompt, prompts_file)
    if model is not None:
        models = from_directory(model, base=base)
    else:
        spec = language_scenario(name)
        if bank is None:
            bank = (default_bank_dir(spec.name, mode or spec.recipe.mode) if spec is not None else DEFAULT_BANK)
        if spec is not None and name in (store := Bank(bank)).names():  # the scenario's vector: as it trains it now
            check_fresh(store, name, spec, mode=mode)
        models = from_bank(bank, name, -alpha if negate else alpha)
    result = generate_text(models, given, scorer=scorer, count=prompts, samples_per_prompt=samples_per_prompt,
                           max_new_tokens=max_new_tokens, seed=seed, progress=RichProgress())
    console.print(generation_table(result))
    if json_path is not None:
        write_json(json_path, result)
        console.print(f"continuations written to {json_path}")


def _negate_vision(name: str, bank: Path, alpha: float, *, tune_alpha: bool, min_control: float, control: str,
                   control_data: Optional[Path], out: Optional[Path], writes_model: bool, force: bool,
                   json_path: Optional[Path], build: BuildOptions, runtime_options: dict) -> None:
    """A vector scored by accuracy; ``--out`` writes the negated model (``writes_model``), else the negated vector."""
    from editkit.cli.console import RichProgress, accuracy_table, console
    from editkit.runs.edit import negate as negate_vector
    from editkit.bank.store import open_bank
    from editkit.runs.stream import process_runtime

    store = open_bank(bank)
    with process_runtime(**runtime_options) as runtime:
        result = negate_vector(store, name, alpha, progress=RichProgress(), control=control, control_data=control_data,
                               tune_alpha=tune_alpha, min_control=min_control, build=build, runtime=runtime,
                               weights_scores=writes_model)
    r = result.report
    summary_keys = ("target", "control", "control_pretrained")
    used = r.get("alpha", alpha)
    title = f"negate {name} (alpha {used:g}{', tuned on validation' if tune_alpha else ''}, {r['mode']})"
    console.print(accuracy_table(title, r["per_task"], pretrained=r["pretrained"],
                                 summary={k: r[k] for k in summary_keys if k in r}))
    if "weights" in r:  # linearized vectors: what the written weights score, beside f_lin's
        w = r["weights"]
        console.print(accuracy_table(WEIGHTS_TITLE, w["per_task"], pretrained=r["pretrained"],
                                     summary={k: w[k] for k in summary_keys if k in w}))
    if "control_set" in r:
        console.print(f"control set: {r['control_set']}")
    if writes_model:
        _export(result, store, out, force=force, build=build)
    _save_outputs(result, None if writes_model else out, json_path, force=force)


def _negate_language(name: str, spec, bank: Path, *, alpha: Optional[float], recipe: dict,
                     run_dir: Optional[Path], json_path: Optional[Path], language: dict,
                     build: BuildOptions, runtime_options: dict, out: Optional[Path] = None,
                     force: bool = False) -> None:
    from editkit.bank.store import open_bank
    from editkit.cli.console import RichProgress, console, language_negation_table
    from editkit.runs.negate_lm import negate_language, negate_scenario, plot_negation
    from editkit.runs.report import write_json
    from editkit.runs.stream import process_runtime

    progress = RichProgress()
    with process_runtime(**runtime_options, scenario=spec) as runtime:
        if spec is not None:
            report = negate_scenario(spec, name, bank, alpha=alpha, settings=language, progress=progress,
                                     build=build, runtime=runtime, **recipe)
        else:
            report = negate_language(open_bank(bank), name, alpha=alpha, settings=language, progress=progress,
                                     build=build, runtime=runtime)
    out_dir = run_dir or default_run_dir(f"negate-{name}", report["mode"])
    report["plots"] = [str(plot_negation([report], out_dir / "negation.png"))]
    report["bank"] = str(bank)
    write_json(out_dir / "report.json", report)
    console.print(language_negation_table(report))
    console.print(f"bank: {bank}   report: {out_dir / 'report.json'}   plot: {report['plots'][0]}")
    if out is not None:
        from editkit.runs.export import export_negation

        export_negation(open_bank(bank), name, out, alpha=report["alpha"], report=report, force=force, build=build,
                        progress=progress)
        report["export"] = str(out)
        write_json(out_dir / "report.json", report)
        console.print(f"model theta_0 - {report['alpha']:g} tau (the weights the continuations were sampled from; "
                      f"model card inside) written to {out}")
    if json_path is not None:
        write_json(json_path, report)


def _check_out(out: Optional[Path], tau_only: bool, force: bool) -> bool:
    """Whether ``--out`` writes a model (not ``--tau-only``'s vector); a target it may not write to is refused now,
    before any work."""
    from editkit.errors import ConfigError
    from editkit.io.targets import check_file_target, check_target

    if tau_only and out is None:
        raise ConfigError("--tau-only says what --out writes: give --out too")
    if out is not None:
        (check_file_target if tau_only else check_target)(out, force=force)
    return out is not None and not tau_only


def _export(result, store, out: Path, *, force: bool, build: BuildOptions, method: str = "task-arithmetic") -> None:
    """Write the scored model into ``out`` and say what is there."""
    import json

    from rich.markup import escape

    from editkit.cli.console import RichProgress, console
    from editkit.io.layout import MANIFEST_FILE
    from editkit.runs.export import export_edit

    written = export_edit(result, store, out, method=method, force=force, build=build, progress=RichProgress())
    onnx = json.loads((written / MANIFEST_FILE).read_text(encoding="utf-8")).get("onnx") or {}
    console.print(f"model written to {written}: model.pt2 (the scored model, every task's head; torch.export.load "
                  f"runs it){', model.onnx (ONNX Runtime runs it)' if 'file' in onnx else ''}, its weights in the "
                  f"family's own format, editkit.json, README.md  (editkit predict --model {written} INPUTS)")
    if "skipped" in onnx:
        console.print(f"[yellow]{escape(onnx['skipped'])}[/yellow]", highlight=False, soft_wrap=True)


def _save_outputs(result, out: Optional[Path], json_path: Optional[Path], *, force: bool) -> None:
    from editkit.cli.console import console
    from editkit.io.tau import write_tau
    from editkit.runs.report import write_json

    if out is not None:
        write_tau(result.vector.tensors, out, mode=result.mode, coefficients=result.coefficients, force=force)
        console.print(f"task vector written to {out}")
    if json_path is not None:
        write_json(json_path, result.report)
        console.print(f"numbers written to {json_path}")


@with_options(build=BUILD)
def bank_import(
    build: dict,
    name: str = typer.Option(..., "--name", help="Name of the new vector."),
    finetuned: Optional[Path] = typer.Option(None, "--finetuned", help="The fine-tuned checkpoint: an open_clip or "
                                             "Hugging Face CLIP checkpoint, or a state dict of the backbone module "
                                             "(safetensors or torch file)."),
    peft: Optional[Path] = typer.Option(None, "--peft", help="Instead of --finetuned: a PEFT LoRA adapter directory "
                                        "(adapter_config.json + adapter_model.safetensors), banked as a plain-LoRA "
                                        "adapter vector."),
    base: Optional[Path] = typer.Option(None, "--base", help="The checkpoint it was fine-tuned from (default: the "
                                        "scenario backbone's weights); it must hold the backbone's values."),
    task: Optional[str] = typer.Option(None, "--task", help="The scenario task the vector is for (default: --name)."),
    scenario: str = ScenarioOption,
    bank: Optional[Path] = typer.Option(None, "--bank", help="Bank directory (default banks/<scenario>-imported: "
                                        "a stream's bank holds only vectors of its own recipe, so `stream` and "
                                        "`bench` would refuse an imported one there)."),
) -> None:
    from editkit.cli.console import console
    from editkit.errors import ConfigError
    from editkit.io.checkpoints import IMPORTED, import_checkpoint
    from editkit.scenario.spec import load_scenario

    if (finetuned is None) == (peft is None):
        raise ConfigError("give the fine-tuned model: --finetuned CHECKPOINT or --peft ADAPTER_DIR (one of them)")
    bank = bank or default_bank_dir(load_scenario(scenario).name, IMPORTED)
    if peft is not None:
        from editkit.io.peft import import_peft_adapter

        if base is not None:
            raise ConfigError("--base is for --finetuned checkpoints: a PEFT adapter is its own difference")
        entry = import_peft_adapter(bank, scenario, name, peft, task=task, build=BuildOptions(**build))
        console.print(f"imported PEFT adapter {entry.name} (task {entry.task}, rank {entry.recipe['lora_rank']}, "
                      f"|dW| = {entry.metrics['tau_norm']:.4g}) into {bank}")
        console.print(_WITHOUT_CURVATURE)
        return
    entry = import_checkpoint(bank, scenario, name, finetuned, base=base, task=task, build=BuildOptions(**build))
    imported = entry.provenance["imported"]
    console.print(f"imported {entry.name} (task {entry.task}, {imported['finetuned']['layout']} layout, "
                  f"|tau| = {entry.metrics['tau_norm']:.4g}) into {bank}")
    if imported["not_held"]:
        console.print(f"not in that layout, left at theta_0 (tau = 0): {', '.join(imported['not_held'])}")
    console.print(_WITHOUT_CURVATURE)


#: What an imported vector lacks: its task's curvature, which only its training data could give.
_WITHOUT_CURVATURE = ("banked without its task's curvature (its training inputs are not here): a later stream with "
                      "--penalty kfac will not penalise drift on this task")


@with_options(settings=Fields(BenchConfig), recipe=dataclasses.replace(RECIPE, exclude=("mode",)),  # modes: --modes
              build=BUILD, runtime_options=RUNTIME)
def bench(
    settings: dict,
    recipe: dict,
    build: dict,
    runtime_options: dict,
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (default: torch's)."),
) -> None:
    import time

    from editkit.errors import ConfigError
    from editkit.runs.bench.run import run_bench
    from editkit.runs.bench.tables import (addition_table, claims_table, continual_table, cost_table, kept_table,
                                           negation_table, repeat_cost_table, strategy_cost_table, taujp_table,
                                           xi_table)
    from editkit.cli.console import RichProgress, console
    from editkit.runs.stream import process_runtime

    if threads is not None:
        import torch

        torch.set_num_threads(max(1, threads))
    start = time.perf_counter()
    config = BenchConfig(**settings, recipe=recipe, build=BuildOptions(**build)).validated()
    from editkit.scenario.spec import load_scenario

    spec = load_scenario(config.scenario)
    config.protocols_of(spec)  # a protocol the scenario cannot run: refused before any work
    if spec.negation is not None:
        if config.seeds > 1 or config.orders > 1 or config.strategies:
            raise ConfigError(f"--seeds, --orders and --strategies are for classification scenarios; {spec.name!r} is "
                              "a language negation scenario, whose bench runs once (--seed) over its modes")
        _bench_language(spec, config, runtime_options)
        return
    with process_runtime(**runtime_options, scenario=spec) as runtime:
        result = run_bench(config, runtime=runtime, progress=RichProgress())
    report = result.report
    if "repeats" in report:
        for build in (addition_table, continual_table, kept_table, repeat_cost_table):
            console.print(build(report))
    else:
        for build in (addition_table, continual_table, kept_table, negation_table, taujp_table, xi_table, cost_table,
                      strategy_cost_table):
            if (table := build(report)) is not None:
                console.print(table)
        corr = report["taujp"]["correlation"]
        console.print(f"[bold]τJp ↔ normalized accuracy:[/bold] pearson r = "
                      f"{'n/a' if corr['pearson'] is None else format(corr['pearson'], '.3f')}, spearman ρ = "
                      f"{'n/a' if corr['spearman'] is None else format(corr['spearman'], '.3f')} over {corr['n']} "
                      "task pairs × modes")
    claims = claims_table(report)
    if claims is not None:
        console.print(claims)
    if "repeats" in report:
        for run in report["repeats"]["runs"]:
            console.print(f"{run['name']} (seed {run['seed']}; {', '.join(run['order'])}): {run['run_dir']}")
        console.print(f"negation and the τJp / ξ diagnostics: {report['repeats']['runs'][0]['name']}'s report alone "
                      "(the repeated report reads neither)")
        console.print(f"{time.perf_counter() - start:.0f} s")
    else:
        trained = {m: len(c["trained_now"]) for m, c in report["cost"].items()}
        console.print(f"vectors trained now: {', '.join(f'{m} {n}' for m, n in trained.items())}  "
                      f"(others reused from {config.bank_root})   {time.perf_counter() - start:.0f} s")
    console.print(f"report: {result.report_path}   plots: {', '.join(report['plots'].values())}")


def _bench_language(spec, config: BenchConfig, runtime_options: dict) -> None:
    """A language scenario's bench: the modes' negations side by side (``editkit.runs.bench.language``)."""
    from editkit.cli.console import RichProgress, console, language_bench_table, language_negation_table
    from editkit.runs.bench.language import run_language_bench
    from editkit.runs.stream import process_runtime

    with process_runtime(**runtime_options, scenario=spec) as runtime:
        report, path = run_language_bench(spec, variants=config.variants(spec.recipe), bank_root=config.bank_root,
                                          run_dir=config.run_directory(spec.recipe, spec.name), build=config.build, runtime=runtime,
                                          progress=RichProgress(), loggers=config.log)
    for mode_report in report["modes"].values():
        console.print(language_negation_table(mode_report))
    console.print(language_bench_table(report))
    console.print(f"{report['seconds']:.0f} s   report: {path}   plot: {report['plots']['negation']}")
