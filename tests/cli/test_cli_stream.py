"""End to end through the `editkit` CLI on a reduced offline-vision scenario.

The scenario is the real one (EfficientNet-Lite0 with its pip-shipped ImageNet
weights, the four packaged datasets) with fewer steps and smaller splits, so the
whole path runs: scenario -> Avalanche stream -> fine-tune -> bank -> merge ->
evaluate -> report.json / PNG, plus add / negate / bank commands and the refusals.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

from editkit.cli import app
from editkit.bank.store import Bank
from editkit.scenario.spec import SCENARIO_DIR

pytestmark = pytest.mark.slow  # every test here trains real streams through the CLI
runner = CliRunner()
STEPS = 3


def reduced_scenario(tmp: Path) -> Path:
    """offline-vision with small splits (keeps every task, the backbone and the heads)."""
    data = tomllib.loads((SCENARIO_DIR / "offline-vision.toml").read_text())
    lines = ['name = "offline-vision-mini"', 'description = "reduced offline-vision for tests"',
             "[backbone]", 'family = "efficientnet-lite0"', "image_size = 32",
             "[heads]", 'kind = "probe"', "shots = 5", "[generic]", 'kind = "natural-crops"', "size = 64"]
    for task in data["tasks"]:
        lines += ["[[tasks]]", f'name = "{task["name"]}"', f'source = "{task["source"]}"', "train_size = 300", "test_size = 120"]
    lines += ["[recipe]"] + [f"{k} = {json.dumps(v)}" for k, v in data["recipe"].items()]
    path = tmp / "offline-vision-mini.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def invoke(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    return result


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    return reduced_scenario(tmp_path_factory.mktemp("scenario"))


@pytest.fixture(scope="module")
def seen_run(tmp_path_factory, scenario):
    root = tmp_path_factory.mktemp("seen")
    result = invoke("stream", "--scenario", scenario, "--steps", STEPS, "--bank", root / "bank", "--run-dir", root / "run")
    assert result.exit_code == 0, result.output
    return root, result


def check_report(report: dict, scope: str) -> None:
    assert report["version"] == 2 and report["scenario"] == "offline-vision-mini"
    assert not any({"scenario_file", "build"} & set(step) for step in report["steps"])  # now the bank's provenance
    assert report["mode"] == "taujp" and report["recipe"]["scope"] == scope and report["recipe"]["steps"] == STEPS
    tasks = ["mnist", "digits", "fashion", "animal"]
    assert [s["task"] for s in report["steps"]] == tasks
    for i, step in enumerate(report["steps"]):
        assert list(step["merged"]["per_task"]) == tasks[: i + 1]
    final = report["final"]
    assert final["alpha"] == 1.0
    assert set(final["per_task"]) == set(final["single_task"]) == set(tasks)
    for value in [*final["per_task"].values(), *final["single_task"].values()]:
        assert 0.0 <= value <= 1.0
    # The summary numbers are what their definitions say.
    assert final["absolute"] == pytest.approx(sum(final["per_task"].values()) / 4)
    ratios = [final["per_task"][t] / final["single_task"][t] for t in tasks]
    assert final["normalized"] == pytest.approx(sum(ratios) / 4)
    # The continual-learning numbers: row t of the matrix is the merged model after step t, BWT by its definition.
    merged = [step["merged"]["per_task"] for step in report["steps"]]
    continual = report["continual"]
    assert continual["matrix"] == [[row.get(t) for t in tasks] for row in merged]
    assert continual["acc"] == pytest.approx(final["absolute"])
    assert continual["bwt"] == pytest.approx(sum(merged[3][t] - merged[i][t] for i, t in enumerate(tasks[:3])) / 3)


def test_stream_seen_scope_writes_report_bank_and_plot(seen_run):
    root, result = seen_run
    report = json.loads((root / "run" / "report.json").read_text())
    check_report(report, "seen")
    assert "final merged model" in result.output and "after animal" in result.output
    assert f"BWT {100 * report['continual']['bwt']:+.1f}" in result.output
    for plot in report["plots"]:
        with Image.open(plot) as image:
            assert image.format == "PNG" and image.size[0] > 100
    bank = Bank(root / "bank")
    assert bank.names() == ["mnist", "digits", "fashion", "animal"]
    assert bank.verify() == []
    # The banked vectors are what the merged model used: their sum, evaluated again, gives the same accuracy.
    assert all(e.mode == "taujp" and e.scenario == "offline-vision-mini" for e in bank.entries())


def test_stream_all_scope(tmp_path, scenario):
    result = invoke("stream", "--scenario", scenario, "--steps", 2, "--scope", "all", "--bank", tmp_path / "bank",
                    "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    check_report({**report, "recipe": {**report["recipe"], "steps": STEPS}}, "all")


def test_a_data_free_stream_banks_each_tasks_curvature_and_the_bank_commands_show_it(tmp_path, scenario):
    """--penalty kfac on the real backbone (convolutions, depthwise convolutions, batch norms): every vector banked
    with its curvature, listed and shown, verified."""
    bank = tmp_path / "bank"
    result = invoke("stream", "--scenario", scenario, "--steps", 2, "--penalty", "kfac", "--curvature-examples", 24,
                    "--bank", bank, "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    listing = invoke("bank", "list", "--bank", bank)
    assert listing.exit_code == 0 and listing.output.count("98 layers") == 4 and "24 ex." in listing.output, \
        listing.output
    shown = json.loads(invoke("bank", "show", "animal", "--bank", bank).output)
    assert shown["curvature"]["examples"] == 24 and shown["curvature"]["kronecker_layers"] == 49
    assert shown["recipe"]["penalty"] == "kfac" and shown["curvature"]["file"] == "animal.curvature.safetensors"
    assert "4 vectors verified" in invoke("bank", "verify", "--bank", bank).output


def test_channels_last_banks_the_default_vectors_up_to_float_rounding(tmp_path, seen_run, scenario):
    result = invoke("stream", "--scenario", scenario, "--steps", STEPS, "--channels-last", "--bank", tmp_path / "bank",
                    "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["runtime"] == "cpu, fp32, channels-last"
    assert json.loads((seen_run[0] / "run" / "report.json").read_text())["runtime"] == "cpu, fp32"
    default, nhwc = Bank(seen_run[0] / "bank"), Bank(tmp_path / "bank")
    for name in default.names():
        expected, got = default.load(name), nhwc.load(name)
        norm = torch.cat([v.flatten() for v in expected.values()]).norm()
        change = torch.cat([(got[k] - v).flatten() for k, v in expected.items()]).norm()
        # AdamW steps an entry by about lr * sign(g) even where g ~ 0, so rounding moves a few entries by up to
        # lr: 1e-4 to 3e-4 of the norm after these 3 steps
        assert change <= 1e-3 * norm


def test_resume_trains_only_what_is_missing(tmp_path, seen_run, scenario):
    root, _ = seen_run
    bank_dir = tmp_path / "bank"
    # A run interrupted after three experiences: copy the first three vectors into a fresh bank.
    source, bank = Bank(root / "bank"), Bank(bank_dir)
    for entry in source.entries()[:3]:
        bank.append(entry.name, source.load(entry.name), task=entry.task, mode=entry.mode, base=entry.base,
                    scenario=entry.scenario, step=entry.step, recipe=entry.recipe, metrics=entry.metrics)
    refused = invoke("stream", "--scenario", scenario, "--steps", STEPS, "--bank", bank_dir, "--run-dir", tmp_path / "run")
    assert refused.exit_code == 1 and "--resume" in refused.output
    result = invoke("stream", "--scenario", scenario, "--steps", STEPS, "--bank", bank_dir, "--run-dir", tmp_path / "run",
                    "--resume")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [s["resumed"] for s in report["steps"]] == [True, True, True, False]
    # Resumed steps keep the banked vectors bit for bit.
    for name in ("mnist", "digits", "fashion"):
        assert all(torch.equal(a, b) for a, b in zip(source.load(name).values(), bank.load(name).values()))


def test_a_resumed_stream_scores_its_vectors_again_with_another_merge(tmp_path, seen_run, scenario):
    """--merge tsv over a complete bank trains nothing and scores each step's TSV-Merge: the final numbers are
    those `editkit add --all --method tsv` gets for the same vectors through its own path."""
    root, _ = seen_run
    source, bank = Bank(root / "bank"), Bank(tmp_path / "bank")
    for entry in source.entries():
        bank.append(entry.name, source.load(entry.name), task=entry.task, mode=entry.mode, base=entry.base,
                    scenario=entry.scenario, step=entry.step, recipe=entry.recipe, metrics=entry.metrics,
                    provenance=entry.provenance)
    result = invoke("stream", "--scenario", scenario, "--steps", STEPS, "--bank", tmp_path / "bank", "--run-dir",
                    tmp_path / "run", "--resume", "--merge", "tsv")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["merge"] == {"method": "tsv", "options": {}} and "final merged model (alpha = 1.0, taujp, scope seen, tsv)" in result.output
    assert all(s["resumed"] and s["merged"]["method"] == "tsv" and s["merged"]["merge_seconds"] > 0
               for s in report["steps"])
    summed = json.loads((root / "run" / "report.json").read_text())["final"]
    assert report["final"]["single_task"] == summed["single_task"] and report["final"]["per_task"] != summed["per_task"]
    added = invoke("add", "--all", "--method", "tsv", "--bank", tmp_path / "bank", "--json", tmp_path / "add.json")
    assert added.exit_code == 0, added.output
    assert json.loads((tmp_path / "add.json").read_text())["per_task"] == pytest.approx(report["final"]["per_task"])
    refused = invoke("stream", "--scenario", scenario, "--bank", tmp_path / "x", "--merge", "tsv", "--merge-param", "k=1")
    assert refused.exit_code == 1 and "unknown option 'k'" in refused.output and not (tmp_path / "x").exists()


def test_add_reports_sum_and_writes_vector(tmp_path, seen_run):
    root, _ = seen_run
    out, json_path = tmp_path / "sum.safetensors", tmp_path / "add.json"
    result = invoke("add", "mnist", "digits", "--alpha", "0.5,2", "--bank", root / "bank", "--out", out, "--tau-only",
                    "--json", json_path)
    assert result.exit_code == 0, result.output
    bank = Bank(root / "bank")
    saved = load_file(out)
    mnist, digits = bank.load("mnist"), bank.load("digits")
    for key, value in saved.items():
        torch.testing.assert_close(value, 0.5 * mnist[key] + 2 * digits[key])
    numbers = json.loads(json_path.read_text())
    assert set(numbers["per_task"]) == {"mnist", "digits"}
    assert numbers["coefficients"] == {"mnist": 0.5, "digits": 2.0}
    assert re.search(r"absolute\s+\d+\.\d", result.output)


def test_negate_reports_target_and_control(tmp_path, seen_run):
    root, _ = seen_run
    out, json_path = tmp_path / "neg.safetensors", tmp_path / "neg.json"
    result = invoke("negate", "digits", "--alpha", 0.5, "--bank", root / "bank", "--out", out, "--tau-only", "--json",
                    json_path)
    assert result.exit_code == 0, result.output
    saved, tau = load_file(out), Bank(root / "bank").load("digits")
    for key, value in saved.items():
        torch.testing.assert_close(value, -0.5 * tau[key])
    numbers = json.loads(json_path.read_text())
    assert numbers["target_task"] == "digits" and numbers["per_task"]["digits"] == numbers["target"]
    assert set(numbers["per_task"]) == {"mnist", "digits", "fashion", "animal"}
    controls = [numbers["per_task"][t] for t in ("mnist", "fashion", "animal")]
    assert numbers["control"] == pytest.approx(sum(controls) / 3)


def test_bank_commands(seen_run):
    root, _ = seen_run
    listing = invoke("bank", "list", "--bank", root / "bank")
    assert listing.exit_code == 0 and all(n in listing.output for n in ("mnist", "digits", "fashion", "animal"))
    shown = invoke("bank", "show", "fashion", "--bank", root / "bank")
    assert shown.exit_code == 0 and '"mode": "taujp"' in shown.output
    verified = invoke("bank", "verify", "--bank", root / "bank")
    assert verified.exit_code == 0 and "4 vectors verified" in verified.output


def test_scenarios_lists_builtin():
    result = invoke("scenarios")
    assert result.exit_code == 0 and "offline-vision" in result.output


def test_unknown_scenario_lists_known_ones(tmp_path):
    result = invoke("stream", "--scenario", "nope", "--bank", tmp_path / "b")
    assert result.exit_code == 1
    assert "unknown scenario 'nope'" in result.output and "offline-vision" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "b").exists()
