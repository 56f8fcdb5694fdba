"""``model.onnx`` beside ``model.pt2``: ONNX Runtime gives editkit's own logits, or the file is not written.

Tiny random models (the registered one-layer CLIP, a two-block BERT) with a random taujp vector, written by
``editkit.runs.export.export_vectors`` as ``--out`` writes them. Ground truth is editkit's own scoring of the same
model (the task model the scorer builds, on each task's whole test split), which ONNX Runtime must give within the
program's tolerance at any batch size (and text length). A conversion that differs or fails, or packages that are
missing, leave no ``model.onnx``, one line saying why, and the program as before; ``editkit predict --runtime onnx``
gives the program's predictions.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import editkit  # noqa: F401  (torchvision shim before open_clip)
from editkit.bank.store import Bank
from editkit.errors import MissingResourceError
from editkit.io import onnx as onnx_io
from editkit.io.program import VERIFY_TOLERANCE
from editkit.io.read import OnnxModel, read_export
from editkit.merge.arithmetic import TaskVector, combine
from editkit.runs import export
from editkit.scenario import provenance
from editkit.scenario.build import build_backbone
from editkit.scenario.options import BuildOptions
from editkit.scenario.provenance import scenario_provenance
from editkit.scenario.spec import load_scenario
from helpers.benchmarks import benchmark_script
from helpers.cli import invoke, one_line_refusal
from helpers.labelled import registered_datasets, scenario_file as text_scenario_file

pytest.importorskip("onnxruntime")
check = benchmark_script("export_check")

CLIP_SCENARIO = """name = "onnx-clip"\n[backbone]\nfamily = "clip"\nmodel = "editkit-tiny-clip"
pretrained = "random"\n[heads]\nkind = "probe"\nshots = 2\n[[tasks]]\nname = "digits"\nsource = "packaged:digits"
train_size = 40\ntest_size = 20\n[[tasks]]\nname = "mnist"\nsource = "packaged:mnist"\ntrain_size = 40
test_size = 20\n"""


def taujp_bank(root: Path, scenario: Path, seed: int = 1) -> Bank:
    """A bank of one random taujp vector per task of ``scenario`` (over every parameter of its backbone)."""
    spec = load_scenario(scenario)
    backbone = build_backbone(spec)
    bank = Bank(root / "bank")
    generator = torch.Generator().manual_seed(seed)
    for task in spec.task_names:
        tau = {n: 0.05 * torch.randn(p.shape, generator=generator) for n, p in backbone.module.named_parameters()}
        bank.append(task, tau, task=task, mode="taujp", base=backbone.fingerprint(), scenario=spec.name,
                    metrics={"single_task": 0.5}, provenance=scenario_provenance(spec, BuildOptions()))
    return bank


def assert_onnx_runtime_scores_as_editkit(out: Path, bank: Bank) -> None:
    """ONNX Runtime on every task's whole test split, in batches of 1 and 7: editkit's own logits, within the
    program's tolerance."""
    built = provenance.bank_scenario(bank, bank.names()[0])
    tasks = [t["name"] for t in read_export(out).tasks]
    own = check.editkit_logits(built, combine(bank, dict.fromkeys(bank.names(), 1.0)), tasks)
    model = OnnxModel(out / "model.onnx")
    assert model.outputs == tasks
    for task in tasks:
        test = built.task(task).test
        for batch in (1, 7):
            got = torch.cat([model(*built.backbone.program_batch(test, range(i, min(i + batch, len(test)))))[task]
                             for i in range(0, len(test), batch)])
            scale = float(own[task].abs().max())
            torch.testing.assert_close(got, own[task], rtol=0, atol=VERIFY_TOLERANCE * max(scale, 1.0))


@pytest.fixture(scope="module")
def clip_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx-clip")
    scenario = root / "clip.toml"
    scenario.write_text(CLIP_SCENARIO)
    bank = taujp_bank(root, scenario)
    return export.export_vectors(bank, dict.fromkeys(bank.names(), 1.0), root / "model"), bank


def test_an_image_export_holds_an_onnx_model_that_onnx_runtime_runs_as_editkit_scores(clip_export):
    out, bank = clip_export
    onnx = json.loads((out / "editkit.json").read_text())["onnx"]
    assert onnx["file"] == "model.onnx" and onnx["inputs"] == ["pixels"] and onnx["outputs"] == ["digits", "mnist"]
    assert onnx["verified"]["within_tolerance"] and onnx["verified"]["examples"] == 40
    assert (out / "model.pt2").is_file() and onnx["files"] == ["model.onnx"]
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out / "model.onnx"))
    (pixels,) = session.get_inputs()
    assert pixels.shape[0] == "batch" and [o.shape[0] for o in session.get_outputs()] == ["batch", "batch"]
    assert_onnx_runtime_scores_as_editkit(out, bank)
    assert 'onnxruntime.InferenceSession("model.onnx")' in (out / "README.md").read_text()


def test_a_text_export_holds_an_onnx_model_of_any_batch_and_length(tmp_path):
    with registered_datasets():
        bank = taujp_bank(tmp_path, text_scenario_file(tmp_path))
        out = export.export_vectors(bank, dict.fromkeys(bank.names(), 1.0), tmp_path / "model")
        onnx = json.loads((out / "editkit.json").read_text())["onnx"]
        assert onnx["inputs"] == ["input_ids", "attention_mask"] and onnx["outputs"] == ["sentiment", "topic"]
        assert_onnx_runtime_scores_as_editkit(out, bank)  # batches of 1 and 7 pad to different lengths


def test_predict_runtime_onnx_gives_the_programs_predictions(clip_export, tmp_path):
    out, _ = clip_export
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    rows = {}
    for runtime in ("torch", "onnx"):
        result = invoke("predict", "--model", out, tmp_path, "--runtime", runtime, "--json", tmp_path / f"{runtime}.j")
        assert result.exit_code == 0, result.output
        rows[runtime] = json.loads((tmp_path / f"{runtime}.j").read_text())
    assert [(r["input"], r["task"], r["class"]) for r in rows["onnx"]] == [
        (r["input"], r["task"], r["class"]) for r in rows["torch"]] and len(rows["onnx"]) == 6
    assert [r["probability"] for r in rows["onnx"]] == pytest.approx([r["probability"] for r in rows["torch"]],
                                                                     abs=1e-5)


# --------------------------------------------------------------------------- not written, in one line


def test_an_onnx_model_that_differs_is_not_written_and_the_program_stays(clip_export, tmp_path, monkeypatch):
    """The ONNX model of another program (theta_0's, not the edited one) is converted and run for real: ONNX
    Runtime's logits are not editkit's, so it is refused in one line, and predict --runtime onnx says so."""
    _, bank = clip_export
    convert = onnx_io.convert
    built = provenance.bank_scenario(bank, "digits")
    from editkit.io.program import trace

    theta0, _ = trace(built.backbone, TaskVector({}, "nonlinear"), {t: built.heads[t] for t in bank.names()})
    monkeypatch.setattr(onnx_io, "convert", lambda program, *args: convert(theta0, *args))
    out = export.export_vectors(bank, dict.fromkeys(bank.names(), 1.0), tmp_path / "model")
    skipped = json.loads((out / "editkit.json").read_text())["onnx"]["skipped"]
    assert skipped.startswith("model.onnx was not written: ONNX Runtime's logits differ from editkit's by up to ")
    assert skipped.endswith("model.pt2 is kept") and "\n" not in skipped
    assert not list(out.glob("model.onnx*")) and (out / "model.pt2").is_file()
    one_line_refusal(invoke("predict", "--model", out, tmp_path, "--runtime", "onnx"),
                     f"{out} has no model.onnx: {skipped}")


def test_the_export_check_measures_a_refused_onnx_model_in_the_onnx_process(clip_export, tmp_path):
    """Where ``--out`` refused model.onnx, ``benchmarks/export_check.py`` converts the same program again into a
    scratch directory and runs it in its onnxruntime-only process: here (a copy of an export whose file was kept,
    made to read as refused) the refused file scores every task as editkit's own logits do."""
    import shutil

    out, bank = clip_export
    refused = tmp_path / "refused"
    shutil.copytree(out, refused)
    manifest = json.loads((refused / "editkit.json").read_text())
    manifest["onnx"] = {"skipped": "model.onnx was not written: (as if refused)"}
    (refused / "editkit.json").write_text(json.dumps(manifest))
    (refused / "model.onnx").unlink()
    built = provenance.bank_scenario(bank, bank.names()[0])
    vector, tasks = combine(bank, dict.fromkeys(bank.names(), 1.0)), bank.names()
    data, own = check.payload(built, tasks), check.editkit_logits(built, vector, tasks)
    rows = {t: {"reported": float((own[t].argmax(1) == data[t]["labels"]).double().mean())} for t in tasks}
    measured = check.onnx_check(refused, data, own, rows, 1.0, built, vector)
    assert measured["skipped"] == "model.onnx was not written: (as if refused)"
    assert measured["unkept"]["same_accuracy"] and measured["unkept"]["process_imported"] == []
    for task in tasks:
        scale = float(own[task].abs().max())
        assert rows[task]["unkept_onnx"] == rows[task]["reported"]
        assert rows[task]["unkept_onnx_max_abs_logit_difference"] <= VERIFY_TOLERANCE * max(scale, 1.0)
    assert not (refused / "model.onnx").exists()  # measured in scratch, nothing added to the export


def test_a_conversion_that_fails_or_missing_packages_skip_onnx_in_one_line(clip_export, tmp_path, monkeypatch):
    _, bank = clip_export

    def fail(*args, **kwargs):
        raise RuntimeError("no translation for aten::made_up\nmore detail")

    with monkeypatch.context() as patch:
        patch.setattr(torch.onnx, "export", fail)
        out = export.export_vectors(bank, {"digits": 1.0}, tmp_path / "failed")
    assert json.loads((out / "editkit.json").read_text())["onnx"] == {"skipped": (
        "model.onnx was not written: torch.onnx could not convert the program (RuntimeError inside the exporter; "
        "its message is in the log); model.pt2 is kept")}
    assert not list(out.glob("model.onnx*")) and (out / "model.pt2").is_file()

    monkeypatch.setattr(onnx_io, "missing_packages", lambda: ["onnxscript", "onnxruntime"])
    result = invoke("add", "--all", "--bank", bank.root, "--out", tmp_path / "without")
    assert result.exit_code == 0, result.output
    line = "model.onnx was not written: onnxscript, onnxruntime not installed (pip install 'editkit[onnx]')"
    assert [l for l in result.output.splitlines() if "model.onnx" in l] == [line]
    assert (tmp_path / "without" / "model.pt2").is_file() and not (tmp_path / "without" / "model.onnx").exists()
    assert f"No ONNX model: {line}." in (tmp_path / "without" / "README.md").read_text()


def test_runtime_onnx_needs_onnx_runtime(clip_export, monkeypatch):
    import builtins

    out, _ = clip_export
    real_import = builtins.__import__

    def without_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_onnxruntime)
    with pytest.raises(MissingResourceError, match=r"--runtime onnx needs ONNX Runtime: pip install 'editkit\[onnx\]'"):
        read_export(out).model("onnx")
