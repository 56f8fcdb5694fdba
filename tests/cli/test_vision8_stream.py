"""vision8 through the `editkit` CLI on stand-ins: the tiny CLIP, generated data in the real formats.

A 2-task vision8-shaped scenario (EuroSAT as an image-folder tree, MNIST as a
Hugging Face parquet copy) runs end to end with per-task epochs, zero-shot heads
and lazy penalty sources; the same run under ``torchrun -m editkit`` with 2 gloo
processes banks the same vectors; the real ``vision8`` scenario stops before
training, one line per missing piece, when weights and data are absent; negation
tunes alpha on validation and can use an ImageNet validation copy as control.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import editkit  # noqa: F401  (torchvision shim before open_clip)
from editkit.cli import app
from editkit.bank.store import Bank
from editkit.data import clip_templates as ct
from editkit.data.vision8 import VISION8_ORDER
from helpers import vision
from helpers.vision import write_hf_parquet, write_image_folder

runner = CliRunner()
TRAIN = 36  # 40 generated train images minus the 10% validation split
EPOCHS = {"EuroSAT": 4, "MNIST": 2}
BATCH = 16

SCENARIO = """
name = "vision8-mini"
description = "two vision8-shaped tasks on the tiny CLIP"
[backbone]
family = "clip"
model = "editkit-tiny-clip"
pretrained = "random"
[heads]
kind = "zero-shot"
[data]
augment = false
[control]
kind = "imagenet"
[[tasks]]
name = "EuroSAT"
source = "vision8:EuroSAT"
epochs = {EuroSAT}
[[tasks]]
name = "MNIST"
source = "vision8:MNIST"
epochs = {MNIST}
[recipe]
mode = "taujp"
batch_size = {batch}
lr = 1e-2
weight_decay = 0.1
warmup = 0
reg_batch = 4
generic = false
"""


def colored_image(label: int, index: int, *, size: int = 12, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A class-coloured noisy image: learnable in a few steps by the tiny CLIP."""
    rng = np.random.default_rng(seed * 100003 + index)
    base = np.array([(label * 97) % 256, (label * 57 + 80) % 256, (label * 151 + 160) % 256], dtype=np.float64)
    image = Image.fromarray(np.clip(base + rng.normal(0, 20, size=(size, size, 3)), 0, 255).astype(np.uint8))
    return image.convert("L") if mode == "L" else image


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Offline, private caches, one intra-op thread (the torchrun processes use one too)."""
    root = tmp_path_factory.mktemp("v8env")
    patch = pytest.MonkeyPatch()
    patch.setenv("HF_HUB_OFFLINE", "1")
    patch.setenv("EDITKIT_CACHE", str(root / "cache"))
    for name in ("EDITKIT_DATA", "EDITKIT_CLIP_CACHE", "EDITKIT_IMAGENET"):
        patch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield root
    torch.set_num_threads(threads)
    patch.undo()


@pytest.fixture(scope="module")
def data_root(env):
    root = env / "data"
    patch = pytest.MonkeyPatch()
    patch.setattr(vision, "make_image", colored_image)
    write_image_folder(root / "eurosat", list(ct.EUROSAT_FOLDERS), train_per_class=4, test_per_class=2)
    write_hf_parquet(root / "mnist", sizes={"train": 40, "test": 20}, num_classes=10,
                     class_names=[str(i) for i in range(10)], mode="L", size=28)
    write_hf_parquet(root / "imagenet", sizes={"validation": 20}, num_classes=10)  # labels 0..9 of the 1000
    patch.undo()
    return root


@pytest.fixture(scope="module")
def scenario(env) -> Path:
    path = env / "vision8-mini.toml"
    path.write_text(SCENARIO.format(batch=BATCH, **EPOCHS))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def single_run(env, data_root, scenario):
    out = env / "single"
    result = invoke("stream", "--scenario", scenario, "--data-root", data_root, "--bank", out / "bank",
                    "--run-dir", out / "run", "--device", "cpu")
    assert result.exit_code == 0, result.output
    return out, result


@pytest.mark.slow
def test_stream_runs_end_to_end_with_per_task_epochs(single_run, data_root, scenario, env):
    out, result = single_run
    assert "final merged model" in result.output and "after MNIST" in result.output
    report = json.loads((out / "run" / "report.json").read_text())
    assert [s["task"] for s in report["steps"]] == ["EuroSAT", "MNIST"]
    bank = Bank(out / "bank")
    assert bank.names() == ["EuroSAT", "MNIST"] and bank.verify() == []
    for step in report["steps"]:
        task = step["task"]
        expected = EPOCHS[task] * -(-TRAIN // BATCH)  # epochs x ceil(train size / batch)
        assert step["train_size"] == TRAIN and step["train_steps"] == expected
        recipe = bank.get(task).recipe
        assert recipe["epochs"] == EPOCHS[task] and recipe["steps"] == expected
        provenance = bank.get(task).provenance  # the build options, recorded apart from the metrics
        assert provenance["build"]["tasks"]["data_root"] == str(data_root.resolve()) and "build" not in step
        assert provenance["scenario_file"] == str(scenario.resolve())
        assert 0.0 <= step["pretrained"] <= 1.0 and 0.0 <= step["single_task"] <= 1.0
    # fine-tuning learns something on the class-coloured images
    assert report["steps"][0]["single_task"] > report["steps"][0]["pretrained"]
    assert set(report["final"]["per_task"]) == {"EuroSAT", "MNIST"}
    # zero-shot heads were cached per dataset
    heads = sorted(p.name.split("-")[0] for p in (env / "cache" / "heads").glob("*.safetensors"))
    assert heads == ["EuroSAT", "MNIST"]


@pytest.mark.slow
def test_every_recipe_value_from_the_cli_and_the_joint_setting(env, data_root, scenario, tmp_path):
    args = ["--steps", 2, "--scope", "all", "--batch-size", 8, "--accumulation", 2, "--lr", 0.02,
            "--weight-decay", 0, "--warmup", 1, "--grad-clip", 0.5, "--reg-batch", 2, "--lam", 0.3,
            "--schedule", "strict", "--squared", "--seed", 1, "--workers", 1, "--precision", "fp32"]
    result = invoke("stream", "--scenario", scenario, "--data-root", data_root, "--bank", tmp_path / "bank",
                    "--run-dir", tmp_path / "run", *args)
    assert result.exit_code == 0, result.output
    recipe = Bank(tmp_path / "bank").get("EuroSAT").recipe
    assert "epochs" not in recipe  # --steps replaces the per-task epochs
    assert recipe == {"mode": "taujp", "steps": 2, "batch_size": 8, "lr": 0.02, "weight_decay": 0.0, "warmup": 1.0,
                      "grad_clip": 0.5, "accumulation": 2, "lam": 0.3, "schedule": "strict", "scope": "all",
                      "reg_batch": 2, "squared": True, "generic": False, "seed": 1}
    epochs = invoke("stream", "--scenario", scenario, "--data-root", data_root, "--bank", tmp_path / "bank2",
                    "--run-dir", tmp_path / "run2", "--epochs", 0.5, "--mode", "linear")
    assert epochs.exit_code == 0, epochs.output
    assert [Bank(tmp_path / "bank2").get(t).recipe["steps"] for t in ("EuroSAT", "MNIST")] == [2, 2]


def _comparable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the attention key bias: its gradient is zero (softmax ignores a shift of all logits), so AdamW
    turns float noise into +-lr steps there, in any two runs that sum in a different order. It never changes
    the model's outputs."""
    out = dict(tensors)
    for key, value in tensors.items():
        if key.endswith("attn.in_proj_bias"):
            width = len(value) // 3
            out[key] = torch.cat([value[:width], value[2 * width:]])
    return out


@pytest.mark.slow
def test_torchrun_two_gloo_processes_bank_the_single_process_vectors(single_run, env, data_root, scenario, tmp_path):
    out, _ = single_run
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "EDITKIT_CACHE": str(env / "cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "editkit",
           "stream", "--scenario", str(scenario), "--data-root", str(data_root), "--bank", str(tmp_path / "bank"),
           "--run-dir", str(tmp_path / "run"), "--device", "cpu"]
    done = subprocess.run(cmd, env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("final merged model") == 1  # rank 0 alone reports
    one, two = Bank(out / "bank"), Bank(tmp_path / "bank")
    assert two.names() == one.names() and two.base == one.base
    for name in one.names():
        a, b = _comparable(one.load(name)), _comparable(two.load(name))
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=2e-6, msg=f"{name} {key}")
        assert two.get(name).recipe == one.get(name).recipe
        assert two.get(name).metrics["single_task"] == one.get(name).metrics["single_task"]
        assert two.get(name).metrics["runtime"] == "cpu x 2 processes, fp32"
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["final"]["per_task"] == json.loads((out / "run" / "report.json").read_text())["final"]["per_task"]


def test_vision8_without_weights_or_data_stops_before_training(env, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty hub cache
    monkeypatch.setenv("EDITKIT_CLIP_CACHE", str(tmp_path / "clip"))
    start = time.perf_counter()
    result = invoke("stream", "--scenario", "vision8", "--bank", tmp_path / "bank", "--run-dir", tmp_path / "run")
    assert time.perf_counter() - start < 60
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "9 missing pieces" in result.output and "nothing was trained" in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("  - ")]
    assert len(lines) == 9
    assert "CLIP weights ViT-B-32/openai" in lines[0] and "--pretrained" in lines[0]
    for line, dataset in zip(lines[1:], VISION8_ORDER):
        assert f"dataset {dataset} not found" in line and "--data-root" in line
    assert not (tmp_path / "bank").exists() and not (tmp_path / "run").exists()


def test_check_reports_what_is_there(data_root, scenario):
    ok = invoke("stream", "--scenario", scenario, "--data-root", data_root, "--check")
    assert ok.exit_code == 0 and "ok" in ok.output
    missing = invoke("stream", "--scenario", scenario, "--check")  # no data root
    assert missing.exit_code == 1 and "2 missing pieces" in missing.output


@pytest.mark.slow
def test_negate_tunes_alpha_on_validation(single_run, tmp_path):
    out, _ = single_run
    json_path = tmp_path / "neg.json"
    result = invoke("negate", "EuroSAT", "--bank", out / "bank", "--tune-alpha", "--control", "tasks",
                    "--json", json_path)
    assert result.exit_code == 0, result.output
    r = json.loads(json_path.read_text())
    tuning = r["tuning"]
    assert [row["alpha"] for row in tuning["grid"]] == pytest.approx([i / 20 for i in range(21)])
    chosen = next(row for row in tuning["grid"] if row["alpha"] == tuning["alpha"])
    assert chosen["control"] >= 0.95 * tuning["control_pretrained"] - 1e-12
    eligible = [row for row in tuning["grid"] if row["control"] >= tuning["threshold"] - 1e-12]
    assert chosen["target"] == min(row["target"] for row in eligible)
    assert r["alpha"] == tuning["alpha"] and r["coefficients"] == {"EuroSAT": -tuning["alpha"]}
    assert r["control_set"] == "tasks" and set(r["per_task"]) == {"EuroSAT", "MNIST"}


@pytest.mark.slow
def test_negate_uses_imagenet_validation_as_control(single_run, tmp_path, monkeypatch):
    out, _ = single_run
    # one prompt template instead of open_clip's 80 keeps the 1000-class head quick on the CPU
    monkeypatch.setattr(ct, "imagenet_templates", lambda: ["a photo of a {}."])
    json_path = tmp_path / "neg.json"
    result = invoke("negate", "MNIST", "--bank", out / "bank", "--alpha", 0.5, "--json", json_path)
    assert result.exit_code == 0, result.output
    r = json.loads(json_path.read_text())
    assert r["control_set"] == "imagenet" and set(r["per_task"]) == {"MNIST", "ImageNet"}
    assert r["control"] == r["per_task"]["ImageNet"] and r["alpha"] == 0.5
    refused = invoke("negate", "MNIST", "--bank", out / "bank", "--control", "imagenet",
                     "--control-data", tmp_path / "nowhere")
    assert refused.exit_code == 1 and "nowhere" in refused.output


@pytest.mark.slow
def test_bench_reads_file_backed_tasks_and_reuses_the_streams_bank(single_run, env, data_root, scenario, tmp_path):
    """`editkit bench` on image-folder / parquet tasks with zero-shot heads: inputs are read through
    DataLoaders (never stacked in memory), --data-root reaches every task, and the taujp bank the
    stream wrote is reused, not retrained."""
    out, _ = single_run
    bank_root = tmp_path / "banks"
    bank_root.mkdir()
    (bank_root / "vision8-mini-taujp").symlink_to(out / "bank", target_is_directory=True)
    run_dir = tmp_path / "run"
    result = invoke("bench", "--scenario", scenario, "--modes", "taujp", "--data-root", data_root,
                    "--bank-root", bank_root, "--run-dir", run_dir, "--device", "cpu", "--grid", "3",
                    "--negation-grid", "3", "--xi-samples", "6")
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "report.json").read_text())
    assert report["cost"]["taujp"]["trained_now"] == [] and report["cost"]["taujp"]["reused"] == ["EuroSAT", "MNIST"]
    # the bench's exact linearized evaluation agrees with the stream's own (real forward passes)
    stream_final = report["streams"]["taujp"]["steps"][-1]["merged"]["per_task"]
    row = next(r for r in report["addition"]["rows"]
               if r["method"] == "task-arithmetic" and r["mode"] == "taujp" and r["coefficient"] == "1.0")
    assert row["per_task"] == pytest.approx(stream_final, abs=1e-9)
    assert len(report["xi"]["modes"]["taujp"]["xi"]) == len(report["xi"]["grid"])
    # the scenario names ImageNet as control and a local copy exists: negation is measured on it
    negation = report["negation"]["taujp"]
    assert negation["control"] == "ImageNet" and "on ImageNet" in result.output
    assert len({row["pretrained"]["control"] for row in negation["rows"]}) == 1  # one control set for every target
    # same held-out ImageNet split and numbers as `editkit negate --tune-alpha` (an independent code path)
    neg_json = tmp_path / "neg.json"
    neg = invoke("negate", "EuroSAT", "--bank", out / "bank", "--tune-alpha", "--control", "imagenet", "--json", neg_json)
    assert neg.exit_code == 0, neg.output
    tuning = json.loads(neg_json.read_text())["tuning"]
    row = next(r for r in negation["rows"] if r["task"] == "EuroSAT")
    assert row["val_pretrained"]["control"] == pytest.approx(tuning["control_pretrained"], abs=1e-12)
    assert row["val_pretrained"]["target"] == pytest.approx(tuning["target_pretrained"], abs=1e-12)
    by_alpha = {r["alpha"]: r for r in tuning["grid"]}
    for i, alpha in enumerate(negation["alphas"]):  # bench: cached tangents; negate: real linearized forwards
        assert row["val_target"][i] == pytest.approx(by_alpha[alpha]["target"], abs=1e-12)
        assert row["val_control"][i] == pytest.approx(by_alpha[alpha]["control"], abs=1e-12)
