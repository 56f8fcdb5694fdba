"""The edited model to take away (``--out DIR``), checked as its user would run it.

Streams run a few steps on reduced scenarios (the real EfficientNet-Lite0 and packaged images; a tiny BERT on
registered texts; a folder of the user's own images, in plain fine-tuning). ``editkit add --all --out DIR`` writes the model, and a
process that never imports editkit (``benchmarks/export_check.py``) loads ``DIR/model.pt2`` with
``torch.export.load`` alone, reads each task's whole test split (pixels; or the raw texts, tokenized there by the
tokenizer saved in DIR) and counts its correct predictions: ground truth is the report ``editkit add`` wrote (the
same count, so the same printed digits) and editkit's own logits of the same model (to 1e-5). ``editkit predict``
reads image files and text files through the manifest alone, and gives the program's predictions on the inputs
editkit's own preprocessing makes of them; bad inputs are refused by name, and nothing is half-written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from editkit.bank.store import Bank
from editkit.errors import ExportError
from editkit.merge.arithmetic import combine
from editkit.io import export as io_export
from editkit.runs import export
from editkit.scenario import provenance
from editkit.io.read import read_export
from helpers.benchmarks import benchmark_script
from helpers.cli import invoke, one_line_refusal
from helpers.labelled import registered_datasets, scenario_file as text_scenario_file
from helpers.scenarios import write_scenario

pytestmark = pytest.mark.slow  # streams are trained through the CLI
check = benchmark_script("export_check")
STEPS = 3


def stream_and_export(root: Path, scenario: Path, *extra) -> tuple[Path, dict]:
    """Stream ``scenario`` into ``root/bank``, then ``add --all --out root/model``; (model directory, add's report)."""
    result = invoke("stream", "--scenario", scenario, "--steps", STEPS, "--bank", root / "bank", "--run-dir",
                    root / "run", *extra)
    assert result.exit_code == 0, result.output
    result = invoke("add", "--all", "--bank", root / "bank", "--out", root / "model", "--json", root / "add.json")
    assert result.exit_code == 0, result.output
    assert f"model written to {root / 'model'}" in " ".join(result.output.split())
    return root / "model", json.loads((root / "add.json").read_text())


def assert_plain_process_scores_as_reported(model_dir: Path, report: dict) -> None:
    """The program in a process without editkit: each task's accuracy over its whole test split is the reported
    one, its logits editkit's own."""
    bank = Bank(model_dir.parent / "bank")
    built = provenance.bank_scenario(bank, bank.names()[0])
    tasks = list(report["per_task"])
    plain, logits = check.run_plain(model_dir, check.payload(built, tasks))
    assert plain["editkit_imported"] is False
    own = check.editkit_logits(built, combine(bank, dict.fromkeys(bank.names(), 1.0)), tasks)
    for task in tasks:
        counted = plain["tasks"][task]
        assert counted["correct"] / counted["total"] == report["per_task"][task], task
        assert counted["total"] == len(built.task(task).test)
        torch.testing.assert_close(logits[task], own[task], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- images: the offline-vision path


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    root = tmp_path_factory.mktemp("takeaway-vision")
    scenario = write_scenario(root, ("digits", "mnist"), "takeaway-mini", train_size=120, test_size=60)
    model_dir, report = stream_and_export(root, scenario)
    return root, scenario, model_dir, report


def test_a_taujp_program_scores_as_the_report_in_a_process_without_editkit(vision):
    root, _, model_dir, report = vision
    assert report["mode"] == "taujp" and set(report["weights"]["per_task"]) == {"digits", "mnist"}
    assert_plain_process_scores_as_reported(model_dir, report)


def test_the_directory_holds_the_program_the_weights_the_heads_and_says_how_to_use_them(vision):
    root, _, model_dir, report = vision
    assert sorted(p.name for p in model_dir.iterdir()) == ["README.md", "editkit.json", "heads.safetensors",
                                                           "model.onnx", "model.pt2", "weights.safetensors"]
    manifest = json.loads((model_dir / "editkit.json").read_text())
    assert [t["name"] for t in manifest["tasks"]] == ["digits", "mnist"]
    assert manifest["tasks"][0]["classes"] == [str(c) for c in range(10)]
    assert manifest["input"]["size"] == [32, 32] and manifest["input"]["on"] == "tensor"
    assert manifest["program"]["computes"].startswith("f_lin(x) = f(x; theta_0) + J f(x; theta_0) . delta")
    assert manifest["program"]["verified"]["max_abs_logit_difference"] < 1e-5
    assert manifest["onnx"]["outputs"] == ["digits", "mnist"] and manifest["onnx"]["verified"]["within_tolerance"]
    assert manifest["scores"]["per_task"] == report["per_task"]
    assert manifest["scores"]["weights"]["per_task"] == report["weights"]["per_task"]
    assert manifest["weights"]["format"] == "efficientnet"

    # the weights alone: the package's whole network at theta_0 + delta, loaded by the package itself
    from efficientnet_lite_pytorch import EfficientNet

    bank = Bank(root / "bank")
    built = provenance.bank_scenario(bank, "digits")
    delta = {n: bank.load("digits")[n] + bank.load("mnist")[n] for n in bank.load("digits")}
    network = EfficientNet.from_name("efficientnet-lite0")
    network.load_state_dict(load_file(str(model_dir / "weights.safetensors")))
    theta0 = dict(built.backbone.module.named_parameters())
    by_tensor = {id(p): n for n, p in built.backbone.network.named_parameters()}
    loaded = dict(network.named_parameters())
    for name, value in delta.items():
        assert torch.equal(loaded[by_tensor[id(theta0[name])]], theta0[name] + value), name
    heads = load_file(str(model_dir / "heads.safetensors"))
    assert torch.equal(heads["digits.weight"], built.heads["digits"].weight)
    assert torch.equal(heads["mnist.bias"], built.heads["mnist"].bias)

    card = (model_dir / "README.md").read_text()
    assert 'torch.export.load("model.pt2").module()' in card and "f_lin" in card
    assert f"| digits | {100 * report['per_task']['digits']:.1f} | {100 * report['weights']['per_task']['digits']:.1f} |" in card


def test_the_program_takes_any_batch_size_under_inference_mode(vision):
    _, _, model_dir, _ = vision
    program = read_export(model_dir).program()
    pixels = torch.randn(5, 3, 32, 32)
    with torch.inference_mode():
        whole = program(pixels)
        single = program(pixels[3:4])
    for task in ("digits", "mnist"):
        assert whole[task].shape == (5, 10)
        torch.testing.assert_close(single[task][0], whole[task][3], rtol=1e-5, atol=1e-5)


def test_predict_reads_image_files_as_editkit_preprocesses_them(vision, tmp_path):
    """PNG files of the digits images (8x8 grayscale, kept as the dataset holds them): editkit predict's
    predictions are the program's on the backbone's own preprocessing of the same arrays."""
    from sklearn.datasets import load_digits

    root, _, model_dir, _ = vision
    images = (load_digits().images[:6] * 16).astype(np.uint8)
    folder = tmp_path / "pictures"
    folder.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image).save(folder / f"{i}.png")
    (folder / "notes.md").write_text("passed over in a folder")
    json_path = tmp_path / "predictions.json"
    result = invoke("predict", "--model", model_dir, folder, "--task", "digits", "--json", json_path)
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    assert [Path(r["input"]).name for r in rows] == [f"{i}.png" for i in range(6)]
    assert {r["task"] for r in rows} == {"digits"}

    built = provenance.bank_scenario(Bank(root / "bank"), "digits")
    with torch.inference_mode():
        logits = read_export(model_dir).program()(built.backbone.preprocess_arrays(images))["digits"]
    probabilities = torch.softmax(logits.double(), dim=-1)
    for row, p in zip(rows, probabilities):
        assert row["class"] == str(int(p.argmax())) and row["probability"] == pytest.approx(float(p.max()), abs=1e-6)
    assert "digits" in result.output and "predicted class" in result.output


def test_negate_out_writes_the_negated_model_with_the_heads_it_scored(vision, tmp_path):
    root, _, _, _ = vision
    out = tmp_path / "negated"
    result = invoke("negate", "digits", "--alpha", 0.5, "--bank", root / "bank", "--out", out, "--json",
                    tmp_path / "negate.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "negate.json").read_text())
    manifest = json.loads((out / "editkit.json").read_text())
    assert [t["name"] for t in manifest["tasks"]] == ["digits", "mnist"] and manifest["alpha"] == 0.5
    assert manifest["program"]["computes"].endswith("delta = -0.5 * tau[digits]")
    built = provenance.bank_scenario(Bank(root / "bank"), "digits")
    program = read_export(out).program()
    for task in ("digits", "mnist"):
        test = built.task(task).test
        labels = torch.tensor([int(test[i][1]) for i in range(len(test))])
        with torch.inference_mode():
            logits = program(*built.backbone.program_batch(test, range(len(test))))[task]
        assert float((logits.argmax(1) == labels).double().mean()) == pytest.approx(report["per_task"][task], abs=0)


# --------------------------------------------------------------------------- text


def test_a_text_program_tokenizes_in_plain_transformers_and_scores_as_the_report(tmp_path):
    with registered_datasets():
        model_dir, report = stream_and_export(tmp_path, text_scenario_file(tmp_path))
        assert_plain_process_scores_as_reported(model_dir, report)
        manifest = json.loads((model_dir / "editkit.json").read_text())
        assert manifest["input"]["kind"] == "text" and manifest["input"]["max_length"] == 12
        assert manifest["input"]["names"] == ["input_ids", "attention_mask"]
        assert manifest["weights"]["format"] == "transformers"

        texts = ["a fine warm film", "the bank raised its rates", "boring and flat"]
        (tmp_path / "inputs.txt").write_text("\n".join(texts[:2]) + "\n\n")
        (tmp_path / "inputs.csv").write_text("id,review\n1,boring and flat\n")
        json_path = tmp_path / "predictions.json"
        result = invoke("predict", "--model", model_dir, tmp_path / "inputs.txt", tmp_path / "inputs.csv",
                        "--column", "review", "--json", json_path)
        assert result.exit_code == 0, result.output
        rows = json.loads(json_path.read_text())
        built = provenance.bank_scenario(Bank(tmp_path / "bank"), "sentiment")
        tokenizer = built.backbone.tokenizer
        ids = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
        from editkit.models.inputs import pad_right

        with torch.inference_mode():
            logits = read_export(model_dir).program()(*pad_right(ids, tokenizer.pad_token_id))
        assert len(rows) == 6 and [r["task"] for r in rows[:2]] == ["sentiment", "topic"]
        for i in range(3):
            for j, task in enumerate(("sentiment", "topic")):
                p = torch.softmax(logits[task][i].double(), dim=-1)
                classes = built.task(task).classes
                assert rows[2 * i + j]["class"] == classes[int(p.argmax())]
                assert rows[2 * i + j]["probability"] == pytest.approx(float(p.max()), abs=1e-6)
        image = tmp_path / "photo.png"
        Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(image)
        one_line_refusal(invoke("predict", "--model", model_dir, image), f"{image} is an image, and this model "
                         "takes text")
        one_line_refusal(invoke("predict", "--model", model_dir, tmp_path / "inputs.csv"),
                         "has no column 'text' (columns: id, review): pass --column")


# --------------------------------------------------------------------------- a user's own images


def test_a_user_image_folder_exports_a_program_that_scores_as_the_report(tmp_path, monkeypatch):
    """A user's folder of photos of another size, streamed in plain fine-tuning (``nonlinear``): the program is f at
    the edited weights, and scores as the report."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("test", 6)):
        for label, shade in (("dark", 40), ("light", 200)):
            folder = tmp_path / "shapes" / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(rng.normal(shade, 30, (20, 24, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    result = invoke("init", "shapes", "--out", "shapes.toml")
    assert result.exit_code == 0, result.output
    model_dir, report = stream_and_export(tmp_path, tmp_path / "shapes.toml", "--mode", "nonlinear")
    assert "weights" not in report  # the program is these weights' model: nothing else to score
    manifest = json.loads((model_dir / "editkit.json").read_text())
    assert manifest["program"]["computes"] == "f(x; theta_0 + 1 * tau[shapes])"
    assert_plain_process_scores_as_reported(model_dir, report)
    json_path = tmp_path / "predictions.json"
    result = invoke("predict", "--model", model_dir, tmp_path / "shapes" / "test", "--json", json_path)
    assert result.exit_code == 0, result.output
    rows = json.loads(json_path.read_text())
    assert len(rows) == 12 and all(r["class"] in ("dark", "light") for r in rows)


# --------------------------------------------------------------------------- refusals


def test_predict_refuses_what_is_not_an_export_or_not_an_input(vision, tmp_path):
    _, _, model_dir, _ = vision
    one_line_refusal(invoke("predict", "--model", tmp_path, "x.png"),
                     f"{tmp_path} has no editkit.json: it is not a model written by editkit add / negate --out")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "editkit.json").write_text("{not json")
    one_line_refusal(invoke("predict", "--model", broken, "x.png"), "is not readable JSON")
    newer = tmp_path / "newer"
    newer.mkdir()
    manifest = json.loads((model_dir / "editkit.json").read_text())
    (newer / "editkit.json").write_text(json.dumps({**manifest, "format_version": 99}))
    one_line_refusal(invoke("predict", "--model", newer, "x.png"), "export format 99, newer than this editkit reads")
    text = tmp_path / "inputs.txt"
    text.write_text("hello\n")
    one_line_refusal(invoke("predict", "--model", model_dir, text), f"{text} is a text file, and this model takes images")
    fake = tmp_path / "fake.png"
    fake.write_text("not an image")
    one_line_refusal(invoke("predict", "--model", model_dir, fake), f"{fake} is not an image this model can read")
    one_line_refusal(invoke("predict", "--model", model_dir, fake, "--task", "cars"),
                     "the model does no task 'cars': its tasks are digits, mnist")


def test_out_refusals_come_before_any_work_and_a_refused_program_leaves_nothing(vision, tmp_path, monkeypatch):
    root, _, _, _ = vision
    bank = root / "bank"
    a_file = tmp_path / "model.safetensors"
    a_file.write_text("mine")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    from editkit.runs import edit

    with monkeypatch.context() as patch:
        patch.setattr(edit, "bank_scenario", lambda *a, **k: pytest.fail("work started"))
        one_line_refusal(invoke("add", "--all", "--bank", bank, "--out", a_file),
                         f"--out {a_file} is a file: --out names the directory")
        one_line_refusal(invoke("add", "--all", "--bank", bank, "--out", taken),
                         f"--out {taken} is a directory that is not empty: pass --force")
        one_line_refusal(invoke("negate", "digits", "--bank", bank, "--out", taken), "is a directory that is not empty")
    assert a_file.read_text() == "mine" and (taken / "keep.txt").read_text() == "mine"

    class Wrong(torch.nn.Module):  # a program that is not the model: every logit 0
        def forward(self, pixels):
            return {"digits": pixels.new_zeros(pixels.shape[0], 10)}

    def wrong_trace(backbone, vector, heads):
        inputs = backbone.program_inputs()
        return torch.export.export(Wrong(), inputs.example, dynamic_shapes=inputs.dynamic), inputs

    monkeypatch.setattr(io_export, "trace", wrong_trace)
    with pytest.raises(ExportError, match="does not reproduce editkit's scoring"):
        export.export_vectors(Bank(bank), {"digits": 1.0}, taken, force=True)
    assert sorted(p.name for p in taken.iterdir()) == ["keep.txt"]  # the old content, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "taken"]  # no temporary sibling


# --------------------------------------------------------------------------- preprocessing as data


def test_each_image_familys_preprocessing_is_the_one_its_spec_describes(tiny_clip):
    """What predict makes of a picture (from the spec alone) is what the family itself makes of it, bit for bit:
    EfficientNet and torchvision (tensor resize; grayscale and colour pictures of another size), open_clip
    (its PIL transform)."""
    from editkit.models import efficientnet, torchvision_models
    from editkit.models.inputs import image_transform

    rng = np.random.default_rng(1)
    pictures = [Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8)),
                Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))]
    effnet = efficientnet.build(32, pretrained=False)
    vision = torchvision_models.build("resnet18", image_size=48)
    for backbone in (effnet, vision, tiny_clip):
        spec = json.loads(json.dumps(backbone.input_spec))  # as editkit.json holds it
        transform = image_transform(spec)
        for picture in pictures:
            assert torch.equal(transform(picture), backbone.preprocess(picture)), (backbone.name, picture.mode)
    gray = np.asarray(pictures[0])
    assert torch.equal(image_transform(effnet.input_spec)(pictures[0]), effnet.preprocess_arrays(gray[None])[0])
