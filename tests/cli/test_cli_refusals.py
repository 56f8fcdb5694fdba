"""Bad input through the CLI: one clear red line, exit code 1, no traceback, bank unchanged."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from editkit.cli import app
from editkit.bank.store import Bank

runner = CliRunner()
BASE = "sha256:" + "ab" * 32


def snapshot(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def make_bank(root: Path, modes: dict[str, str], *, base: str = BASE, metrics: dict | None = None) -> Bank:
    bank = Bank(root)
    for i, (name, mode) in enumerate(modes.items()):
        tensors = {"layer.weight": torch.full((3, 2), float(i + 1)), "layer.bias": torch.arange(3.0) * (i + 1)}
        bank.append(name, tensors, task=name, mode=mode, base=base, scenario="offline-vision", step=i,
                    metrics=metrics or {"single_task": 0.5})
    return bank


def refused(args: list[str], bank_dir: Path, *expected: str) -> str:
    before = snapshot(bank_dir)
    result = runner.invoke(app, [*args, "--bank", str(bank_dir)])
    assert result.exit_code == 1, result.output
    output = " ".join(result.stderr.split())  # stdout may hold the lines of tasks that ran before the refusal
    assert output.startswith(("error:", "problem:")) and "Traceback" not in result.output
    for text in expected:
        assert text in output, output
    assert snapshot(bank_dir) == before
    return output


@pytest.fixture
def bank_dir(tmp_path) -> Path:
    make_bank(tmp_path / "bank", {"mnist": "taujp", "digits": "taujp"})
    return tmp_path / "bank"


def test_missing_name(bank_dir):
    refused(["add", "mnist", "nope"], bank_dir, "nope", "mnist", "digits")
    refused(["negate", "nope"], bank_dir, "nope")
    refused(["bank", "show", "nope"], bank_dir, "nope")
    refused(["bank", "remove", "nope"], bank_dir, "nope")


def test_corrupt_file_refused_and_reported(bank_dir):
    path = bank_dir / "digits.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    refused(["add", "mnist", "digits"], bank_dir, "digits", "checksum mismatch")
    refused(["negate", "digits"], bank_dir, "checksum mismatch")
    refused(["bank", "verify"], bank_dir, "digits")


def test_truncated_file_refused(bank_dir):
    path = bank_dir / "mnist.safetensors"
    path.write_bytes(path.read_bytes()[:40])
    refused(["add", "--all"], bank_dir, "mnist", "truncated")


def test_mixing_linear_and_nonlinear_refused(tmp_path):
    bank_dir = tmp_path / "bank"
    make_bank(bank_dir, {"a": "nonlinear", "b": "linear"})
    refused(["add", "a", "b"], bank_dir, "nonlinear", "linear")


def test_empty_or_missing_bank(tmp_path):
    result = runner.invoke(app, ["add", "--all", "--bank", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no task vectors" in result.output
    assert not (tmp_path / "none").exists()


def test_vector_of_another_base_model_refused(tmp_path):
    """The bank's base is not the scenario's backbone: refused before anything is evaluated."""
    bank_dir = tmp_path / "bank"
    make_bank(bank_dir, {"mnist": "taujp"})
    refused(["negate", "mnist"], bank_dir, "another base model")


def test_appending_a_vector_of_another_base_is_refused(bank_dir):
    from editkit.errors import IncompatibleVectorsError

    before = snapshot(bank_dir)
    with pytest.raises(IncompatibleVectorsError):
        Bank(bank_dir).append("x", {"layer.weight": torch.zeros(3, 2)}, task="x", mode="taujp", base="sha256:" + "cd" * 32)
    assert snapshot(bank_dir) == before


def test_alpha_list_must_match_names(bank_dir):
    refused(["add", "mnist", "digits", "--alpha", "0.5,1,2"], bank_dir, "3 alphas for 2 vectors")
    refused(["add", "mnist", "--alpha", "x"], bank_dir, "--alpha must be a number")
