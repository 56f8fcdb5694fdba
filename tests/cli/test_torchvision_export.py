"""A user's torchvision model on a user's image folder, and ``editkit add --out`` / ``editkit negate --out``: beside
the program, the state dict written is theta_0 (the weights file) plus or minus the banked vector, with the
classification layer as it came, and torchvision's own model loads it whole."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from safetensors.torch import load_file
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from helpers.cli import one_line_refusal
from helpers.vision import make_image

runner = CliRunner()


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def streamed(tmp_path, mode: str) -> torch.nn.Module:
    """A random ResNet-18 saved as ``resnet18.pth``, an image folder ``bugs``, the scenario ``bugs.toml`` on
    them, streamed in ``mode`` into ``bank``; returns the network (theta_0 and its classification layer)."""
    torch.manual_seed(0)
    net = torchvision.models.resnet18().eval()
    torch.save(net.state_dict(), tmp_path / "resnet18.pth")
    for label, name in enumerate(["ant", "bee"]):
        (tmp_path / "bugs" / name).mkdir(parents=True)
        for i in range(8):
            make_image(label, i, size=16).save(tmp_path / "bugs" / name / f"{i}.png")
    (tmp_path / "bugs.toml").write_text(f"""\
name = "bugs"
[backbone]
family = "torchvision"
model = "resnet18"
weights = "resnet18.pth"
image_size = 32
[heads]
kind = "probe"
shots = 2
[[tasks]]
name = "bugs"
source = "imagefolder:bugs"
[recipe]
mode = "{mode}"
batch_size = 4
""")
    invoke("stream", "--scenario", "bugs.toml", "--steps", 2, "--bank", "bank", "--run-dir", "run")
    return net


def test_stream_then_add_out_writes_a_torchvision_state_dict(offline, tmp_path):
    net = streamed(tmp_path, "nonlinear")
    invoke("add", "bugs", "--alpha", "0.5", "--bank", "bank", "--out", "edited")
    tau = Bank(tmp_path / "bank").load("bugs")
    written = load_file(tmp_path / "edited" / "weights.safetensors")
    theta0 = net.state_dict()
    assert set(written) == set(theta0)
    changed = [k for k in tau if tau[k].abs().sum() > 0]
    assert changed and all(k in theta0 for k in tau)
    for key, value in written.items():
        expected = theta0[key] + 0.5 * tau[key] if key in tau else theta0[key]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    torchvision.models.resnet18().load_state_dict(written)  # loads whole, strict
    provenance = json.loads((tmp_path / "edited" / "editkit.json").read_text())
    assert provenance["weights"]["format"] == "torchvision" and provenance["family"] == "torchvision"
    assert "get_model('resnet18').load_state_dict" in provenance["weights"]["loads"]
    assert (tmp_path / "edited" / "model.pt2").is_file() and provenance["program"]["computes"].startswith("f(x;")
    assert provenance["vectors"]["bugs"]["coefficient"] == 0.5
    assert provenance["base_model"]["fingerprint"] == Bank(tmp_path / "bank").base


def test_negate_out_writes_theta0_minus_alpha_tau_as_a_torchvision_state_dict(offline, tmp_path, monkeypatch):
    net = streamed(tmp_path, "linear")  # a linearized vector: the weights are scored beside f_lin
    (tmp_path / "negated").mkdir()
    (tmp_path / "negated" / "older.txt").write_bytes(b"an older file")
    from editkit.runs import edit

    with monkeypatch.context() as patched:  # a directory with content: refused before anything is built
        patched.setattr(edit, "bank_scenario", lambda *a, **k: pytest.fail("work started"))
        result = runner.invoke(app, ["negate", "bugs", "--bank", "bank", "--out", "negated"])
    one_line_refusal(result, "error: --out negated is a directory that is not empty: pass --force to replace it")
    assert (tmp_path / "negated" / "older.txt").read_bytes() == b"an older file"

    invoke("negate", "bugs", "--alpha", "0.5", "--bank", "bank", "--out", "negated", "--force",
           "--json", "negated.json")
    assert not (tmp_path / "negated" / "older.txt").exists()
    tau = Bank(tmp_path / "bank").load("bugs")
    theta0 = net.state_dict()
    assert [k for k in tau if tau[k].abs().sum() > 0] and all(k in theta0 for k in tau)
    written = load_file(tmp_path / "negated" / "weights.safetensors")
    assert set(written) == set(theta0)
    for key, value in written.items():
        expected = theta0[key] - 0.5 * tau[key] if key in tau else theta0[key]
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    torchvision.models.resnet18().load_state_dict(written)  # loads whole, strict
    provenance = json.loads((tmp_path / "negated" / "editkit.json").read_text())
    assert provenance["operation"] == "negate" and provenance["alpha"] == 0.5
    assert provenance["vectors"]["bugs"]["coefficient"] == -0.5 and provenance["edit"] == "theta_0 - 0.5 * tau[bugs]"
    assert provenance["program"]["computes"].startswith("f_lin(x)")  # linear: the program is f_lin
    report = json.loads((tmp_path / "negated.json").read_text())
    assert provenance["scores"]["per_task"] == report["per_task"]
    assert set(report["weights"]["per_task"]) == {"bugs"}  # what the written weights score, beside f_lin's
