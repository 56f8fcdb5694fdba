"""Settings declared once: CLI options generated from Recipe / BenchConfig / BuildOptions fields,
recipe precedence (scenario < task < command line), build options laid over what a bank recorded."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.cli.options import Fields, with_options
from editkit.errors import ConfigError
from editkit.merge.coefficients import NEGATION_RETAIN, PAPER_GRID_POINTS
from editkit.runs.bench.config import DEFAULT_NEGATION_GRID, BenchConfig
from editkit.scenario.provenance import recorded_build
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import parse_scenario, task_recipes
from editkit.train.recipe import Recipe
from editkit.train.runtime import RuntimeOptions

runner = CliRunner()
RECIPE_FIELDS = [f.name for f in dataclasses.fields(Recipe)]
BUILD_FIELDS = [f.name for f in dataclasses.fields(BuildOptions)]


def command(name: str):
    return typer.main.get_command(app).commands[name]


def options(name: str) -> dict:
    return {p.name: p for p in command(name).params if p.param_type_name == "option"}


def choices(option) -> tuple:
    """The values an option accepts (Typer reads them from a ``Literal``, stripped of ``Optional``)."""
    annotation = option.type_descriptor.annotation
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_args(annotation)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --- generated options ------------------------------------------------------------------------


@pytest.mark.parametrize("name, recipe_fields", [("stream", RECIPE_FIELDS),
                                                 ("bench", [n for n in RECIPE_FIELDS if n != "mode"])])
def test_recipe_options_are_the_recipe_fields_one_to_one(name, recipe_fields):
    opts = options(name)
    assert [n for n in opts if n in RECIPE_FIELDS] == recipe_fields
    for f in dataclasses.fields(Recipe):
        if f.name not in recipe_fields:
            continue
        option = opts[f.name]
        assert option.opts == [flag(f.name)]
        assert option.default is None  # unset keeps the scenario's value
        assert option.help == f.metadata["help"] + " (default: the scenario's)"
        if f.type == "bool":
            assert option.secondary_opts == ["--no-" + f.name.replace("_", "-")]
        if "choices" in f.metadata:
            assert choices(option) == f.metadata["choices"]


def test_every_stream_option_has_help_and_the_readme_spellings_exist():
    opts = options("stream")
    assert all(o.help for o in opts.values())
    spelled = {s for o in opts.values() for s in (*o.opts, *o.secondary_opts)}
    readme = ["--scenario", "--mode", "--schedule", "--scope", "--lam", "--steps", "--generic", "--no-generic",
              "--bank", "--run-dir", "--resume", "--seed", "--data-root", "--batch-size", "--accumulation", "--check"]
    assert set(readme) <= spelled


def test_bench_options_carry_the_config_defaults_and_the_shared_constants():
    opts = options("bench")
    for f in dataclasses.fields(BenchConfig):
        if not f.metadata.get("cli", True):
            assert f.name not in opts or f.name in RECIPE_FIELDS  # bench's --batch-size is the recipe's
            continue
        assert opts[f.name].help == f.metadata["help"]
    assert opts["grid"].default == PAPER_GRID_POINTS == BenchConfig.grid
    assert opts["negation_grid"].default == DEFAULT_NEGATION_GRID == BenchConfig.negation_grid
    assert opts["negation_retain"].default == NEGATION_RETAIN == BenchConfig.negation_retain
    assert opts["modes"].default == "nonlinear,linear,taujp" and opts["methods"].default == (
        "cart,dare,iso-c,iso-cts,magmax,opcm,task-arithmetic,ties,tsv")
    assert choices(opts["control"]) == ("auto", "tasks", "imagenet")
    assert options("negate")["min_control"].default == NEGATION_RETAIN


def test_the_bench_command_takes_its_options_from_the_config_without_importing_the_runner():
    code = ("import sys, editkit.cli.compute; "
            "sys.exit(sorted(m for m in ('editkit.runs.bench.config', 'editkit.runs.bench.run') if m in sys.modules) "
            "!= ['editkit.runs.bench.config'])")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2]).returncode == 0


@pytest.mark.parametrize("name", ["stream", "bench", "add", "negate"])
def test_build_options_are_the_build_option_fields(name):
    opts = options(name)
    for f in dataclasses.fields(BuildOptions):
        assert opts[f.name].default is None and opts[f.name].help.startswith(f.metadata["help"])


@pytest.mark.parametrize("name", ["stream", "bench", "add", "negate"])
def test_runtime_options_are_the_runtime_option_fields(name):
    opts = options(name)
    for f in dataclasses.fields(RuntimeOptions):
        assert opts[f.name].opts == [flag(f.name)]
        assert opts[f.name].default == f.default and opts[f.name].help == f.metadata["help"]


def test_an_option_declared_twice_is_refused():
    def cmd(recipe: dict, seed: int = typer.Option(0)) -> None: ...

    with pytest.raises(TypeError, match="seed"):
        with_options(recipe=Fields(Recipe, keep=True))(cmd)


# --- the command line reaches the library -----------------------------------------------------


@pytest.fixture
def captured(monkeypatch):
    """``run_scenario`` / ``run_bench`` replaced by recorders (nothing is built or trained)."""
    from editkit.runs import stream
    from editkit.runs.bench import run as bench_run

    calls: dict = {}

    def fake_stream(scenario, **kwargs):
        calls["stream"] = {"scenario": scenario, **kwargs}
        raise ConfigError("recorded")

    def fake_bench(config, **kwargs):
        calls["bench"] = {"config": config, **kwargs}
        raise ConfigError("recorded")

    monkeypatch.setattr(stream, "run_scenario", fake_stream)
    monkeypatch.setattr(bench_run, "run_bench", fake_bench)
    return calls


def test_stream_passes_given_recipe_fields_build_options_and_one_runtime(captured, tmp_path):
    result = runner.invoke(app, ["stream", "--steps", "5", "--no-generic", "--scope", "all", "--data-root",
                                 str(tmp_path), "--model", "ViT-B-16", "--device", "cpu", "--precision", "fp32"])
    assert result.exit_code == 1 and "recorded" in result.output
    call = captured["stream"]
    given = {k: v for k, v in call.items() if k in RECIPE_FIELDS and v is not None}
    assert given == {"steps": 5, "generic": False, "scope": "all"}
    assert set(RECIPE_FIELDS) <= set(call)  # every recipe field is passed (unset ones as None)
    assert call["build"] == BuildOptions(model="ViT-B-16", data_root=str(tmp_path))
    runtime = call["runtime"]
    assert str(runtime.device) == "cpu" and runtime.precision == "fp32" and not runtime.distributed


def test_a_value_outside_a_fields_choices_is_refused_by_the_command_line(captured):
    result = runner.invoke(app, ["stream", "--mode", "linaer"])
    assert result.exit_code == 2 and "linaer" in result.output and "stream" not in captured


def test_bench_builds_its_config_from_the_generated_options(captured, tmp_path):
    result = runner.invoke(app, ["bench", "--steps", "3", "--seed", "2", "--grid", "5", "--modes", "linear,taujp",
                                 "--clip-cache", str(tmp_path), "--device", "cpu"])
    assert result.exit_code == 1 and "recorded" in result.output
    config = captured["bench"]["config"]
    assert config.recipe == {"steps": 3, "seed": 2}
    assert config.grid == 5 and config.modes == ("linear", "taujp") and config.negation_grid == DEFAULT_NEGATION_GRID
    assert config.build == BuildOptions(clip_cache=str(tmp_path))
    assert str(captured["bench"]["runtime"].device) == "cpu"


def test_bench_config_refuses_a_recipe_mode_and_unknown_recipe_fields():
    with pytest.raises(ConfigError, match="modes"):
        BenchConfig(recipe={"mode": "linear"}).validated()
    with pytest.raises(ConfigError, match="stepz"):
        BenchConfig(recipe={"stepz": 3}).validated()
    assert BenchConfig(recipe={"steps": 3, "seed": None}).validated().recipe == {"steps": 3}


# --- recipe precedence ------------------------------------------------------------------------


def test_precedence_scenario_then_task_then_command_line():
    spec = parse_scenario({
        "name": "p", "backbone": {"family": "efficientnet-lite0"},
        "tasks": [{"name": "a", "source": "packaged:digits", "epochs": 2},
                  {"name": "b", "source": "packaged:mnist", "recipe": {"lr": 5e-3, "lam": 0.5}}],
        "recipe": {"lr": 1e-3, "steps": 10, "lam": 0.2},
    })
    plain = task_recipes(spec)
    assert (plain["a"].epochs, plain["a"].lr, plain["a"].steps) == (2, 1e-3, 10)  # task epochs over scenario steps
    assert (plain["b"].lr, plain["b"].lam, plain["b"].steps) == (5e-3, 0.5, 10)  # task values over the scenario's
    cli = {name: None for name in RECIPE_FIELDS} | {"steps": 5, "lr": 7e-3}  # as the command passes them
    given = task_recipes(spec, **cli)
    assert (given["a"].steps, given["a"].epochs) == (5, None)  # --steps beats per-task epochs
    assert given["a"].resolved(1000).steps == 5
    assert (given["b"].lr, given["b"].lam) == (7e-3, 0.5)  # the command line beats the task; unset keeps it
    assert spec.recipe.with_overrides(**cli).to_dict() == {**Recipe(lr=7e-3, steps=5, lam=0.2).to_dict()}


# --- build options ------------------------------------------------------------------------------


def test_build_options_set_the_builder_keys_they_name():
    options = BuildOptions(model="ViT-B-16", pretrained="openai", clip_cache="/c", data_root=Path("/d"),
                           hub_cache="/h")
    assert options.backbone() == {"model": "ViT-B-16", "pretrained": "openai", "cache_dir": "/c"}
    assert options.tasks() == {"data_root": "/d", "hub_cache_dir": "/h"}  # a Path is kept as text
    assert BuildOptions().backbone() == {} and BuildOptions().tasks() == {}


def test_build_options_record_existing_paths_absolute_and_read_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    options = BuildOptions(pretrained="openai", data_root="data", clip_cache="missing")
    recorded = options.to_json()
    assert recorded == {"backbone": {"pretrained": "openai", "cache_dir": "missing"},
                        "tasks": {"data_root": str(tmp_path / "data")}}
    assert BuildOptions.from_json(json.loads(json.dumps(recorded))) == dataclasses.replace(
        options, data_root=str(tmp_path / "data"))
    with pytest.raises(ConfigError, match="backbone.image_size"):
        BuildOptions.from_json({"backbone": {"image_size": 64}})


def test_given_options_are_laid_over_the_recorded_ones_field_by_field():
    recorded = BuildOptions(model="ViT-B-32", pretrained="/w.pt", data_root="/old")
    assert BuildOptions(data_root="/new").over(recorded) == BuildOptions(model="ViT-B-32", pretrained="/w.pt",
                                                                          data_root="/new")
    assert BuildOptions().over(recorded) == recorded


@pytest.mark.parametrize("layout", ["provenance", "metrics"])
def test_a_bank_recorded_build_is_merged_under_the_given_options(tmp_path, layout):
    """Banks record build options in each entry's provenance; older banks kept them in metrics."""
    build = {"backbone": {"model": "ViT-B-32", "pretrained": "/w.pt"}, "tasks": {"data_root": "/old"}}
    bank = Bank(tmp_path / "bank")
    record = {"provenance": {"provenance": {"scenario_file": None, "build": build}},
              "metrics": {"metrics": {"scenario_file": None, "build": build}}}[layout]
    bank.append("a", {"w": torch.zeros(2)}, task="a", mode="taujp", base="sha256:" + "0" * 64, **record)
    if layout == "metrics":  # as written before entries had a provenance field
        manifest = json.loads(bank.manifest_path.read_text())
        del manifest["vectors"][0]["provenance"]
        bank.manifest_path.write_text(json.dumps(manifest))
    assert recorded_build(bank, "a") == BuildOptions(model="ViT-B-32", pretrained="/w.pt", data_root="/old")
    assert recorded_build(bank, "a", BuildOptions(data_root="/new", model="ViT-L-14")) == BuildOptions(
        model="ViT-L-14", pretrained="/w.pt", data_root="/new")
