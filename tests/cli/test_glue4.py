"""The paper's T5 / GLUE path, ``scenarios/glue4.toml``, through the ``editkit`` command.

Offline with nothing local, ``stream --check`` lists the model and each of the four GLUE configs, one
line each with how to provide it, and trains nothing. With a tiny random T5 saved as the hub id
``google/flan-t5-small`` and generated GLUE parquet, both in Hugging Face cache layouts, a copy of the
scenario (recipe kept) passes ``--check``, streams two steps per task into a bank and prints the table;
``editkit add`` then scores the banked sum with the teacher-forced scorer.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from editkit import settings
from editkit.bank.store import Bank
from editkit.cli import app
from editkit.data.glue import GLUE_REPO
from helpers.glue import write_glue, write_t5
from helpers.scenarios import assert_refused_before_work, write_toml
from helpers.hub import hub_repo

#: The scenario files of this checkout (the installed package may point elsewhere).
SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"
TASKS = ["cola", "sst2", "mrpc", "rte"]
MODEL = "google/flan-t5-small"
runner = CliRunner()


def test_offline_check_lists_the_model_and_each_glue_task_before_any_work(offline, tmp_path):
    result = runner.invoke(app, ["stream", "--scenario", "glue4", "--check"])
    assert result.exit_code == 1
    hub = offline
    expected = [f"{MODEL} is not in the Hugging Face cache at {hub}: on a machine with internet run `hf download {MODEL}`"]
    expected += [f"the dataset {GLUE_REPO} is not in {hub}: on a machine with internet run "
                 f'`hf download {GLUE_REPO} --repo-type dataset --include "{task}/*"`' for task in TASKS]
    assert_refused_before_work(result.output, "glue4", expected, tmp_path)


def _small_copy(directory: Path, hub: Path) -> Path:
    """glue4 with the model looked up in ``hub`` and prompts cut short (recipe kept)."""
    data = tomllib.loads((SCENARIOS / "glue4.toml").read_text())
    data["backbone"]["hub_cache"] = str(hub)
    data["data"]["max_length"] = 16
    return write_toml(data, directory / "glue4.toml")


@pytest.mark.slow
def test_tiny_t5_streams_two_steps_per_task_from_local_copies(offline, tmp_path, monkeypatch):
    hub, data = offline, tmp_path / "data"
    hub_repo(hub, MODEL, write_t5)
    hub_repo(data, GLUE_REPO, write_glue, kind="datasets")
    monkeypatch.setenv(settings.DATA_ENV, str(data))  # the datasets are read from $EDITKIT_DATA, not the hub cache
    scenario = _small_copy(tmp_path, hub)

    check = runner.invoke(app, ["stream", "--scenario", str(scenario), "--check"])
    assert check.exit_code == 0 and "ok" in check.output, check.output
    bank_dir = tmp_path / "bank"
    result = runner.invoke(app, ["stream", "--scenario", str(scenario), "--steps", "2", "--bank", str(bank_dir),
                                 "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert "after rte (step 4)" in result.output and "final merged model (alpha = 1.0, taujp, scope all)" in result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["scenario"] == "glue4" and report["mode"] == "taujp"
    assert report["recipe"]["lr"] == 1e-5 and report["recipe"]["weight_decay"] == 0.01
    assert report["recipe"]["batch_size"] == 16 and report["recipe"]["lam"] == 0.1 and report["recipe"]["steps"] == 2
    assert set(report["final"]["per_task"]) == set(TASKS)
    assert all(0.0 <= v <= 1.0 for v in report["final"]["per_task"].values())
    bank = Bank(bank_dir)
    assert bank.names() == TASKS and bank.verify() == []
    tau = bank.load("rte")
    assert "shared.weight" in tau and any(value.abs().sum() > 0 for value in tau.values())  # every parameter is theta

    out = tmp_path / "merged"
    added = runner.invoke(app, ["add", "--all", "--bank", str(bank_dir), "--json", str(tmp_path / "add.json"),
                                "--out", str(out)])
    assert added.exit_code == 0, added.output
    summed = json.loads((tmp_path / "add.json").read_text())
    assert summed["per_task"] == pytest.approx(report["final"]["per_task"])  # the stream's merge, rebuilt from the bank
    assert_the_program_scores_teacher_forced_as_reported(out, bank, summed)

    bench = runner.invoke(app, ["bench", "--scenario", str(scenario), "--bank-root", str(tmp_path / "banks")])
    assert bench.exit_code != 0
    assert "editkit bench sweeps classification heads; the heads of 'glue4' are text-to-text" in " ".join(bench.output.split())
    assert not (tmp_path / "banks").exists()  # refused before any training


def assert_the_program_scores_teacher_forced_as_reported(out: Path, bank: Bank, report: dict) -> None:
    """``--out`` of a seq2seq bank: a Hugging Face directory of theta_0 + the sum in every parameter, and a program
    of the linearized model over (prompt, teacher-forced decoder input) whose every-label-token accuracy on each
    task's test split is the reported one; and its ``model.onnx``, whose logits ONNX Runtime gives as the program's
    on those splits (within the program's tolerance)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    from editkit.core.batching import IGNORE_INDEX
    from editkit.io import onnx as onnx_io
    from editkit.io.program import VERIFY_TOLERANCE
    from editkit.io.read import OnnxModel, read_export
    from editkit.scenario import provenance

    manifest = json.loads((out / "editkit.json").read_text())
    assert manifest["input"]["kind"] == "text-to-text" and manifest["weights"]["format"] == "transformers"
    assert [t["name"] for t in manifest["tasks"]] == TASKS and manifest["tasks"][0]["head"] == "identity"
    built = provenance.bank_scenario(bank, "cola")
    tau = {n: sum(bank.load(name)[n] for name in TASKS) for n in bank.load("cola")}
    loaded = AutoModelForSeq2SeqLM.from_pretrained(out)
    theta0 = dict(built.backbone.model.named_parameters())
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, theta0[name] + tau[name], rtol=0, atol=1e-6)
    program = read_export(out).program()
    converted = not onnx_io.missing_packages()
    if converted:  # the seq2seq program converts like the others: one output per task, checked before it is kept
        assert manifest["onnx"]["outputs"] == TASKS and manifest["onnx"]["verified"]["within_tolerance"]
        onnx_model = OnnxModel(out / "model.onnx")
    for task in TASKS:
        test = built.task(task).test
        inputs = built.backbone.program_batch(test, range(len(test)))
        labels = built.backbone.batching.collate_labels([test[i][1] for i in range(len(test))])
        with torch.inference_mode():
            logits = program(*inputs)[task]
        right = ((logits.argmax(-1) == labels) | (labels == IGNORE_INDEX)).all(dim=1)
        assert float(right.double().mean()) == pytest.approx(report["per_task"][task], abs=0), task
        if converted:
            scale = max(float(logits.abs().max()), 1.0)
            torch.testing.assert_close(onnx_model(*inputs)[task], logits, rtol=0, atol=VERIFY_TOLERANCE * scale)
