"""Where writers may write, and ``--tau-only``'s file: refused before any work, written whole, read back bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from editkit.errors import ConfigError
from editkit.io.targets import check_file_target, check_target
from editkit.io.tau import write_tau
from helpers.cli import invoke


def test_a_directory_target_refuses_a_file_and_a_full_directory_unless_forced(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match="is a file: --out names the directory"):
        check_target(tmp_path / "file", force=True)
    with pytest.raises(ConfigError, match="is a directory that is not empty: pass --force"):
        check_target(tmp_path / "full")
    assert check_target(tmp_path / "full", force=True) == tmp_path / "full"
    assert check_target(tmp_path / "new") == tmp_path / "new"


def test_a_file_target_refuses_a_directory_always_and_a_file_unless_forced(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match="is a directory: --out names the file"):
        check_file_target(tmp_path, force=True)
    with pytest.raises(ConfigError, match="exists: pass --force"):
        check_file_target(tmp_path / "file")
    assert check_file_target(tmp_path / "file", force=True) == tmp_path / "file"


def test_tau_only_writes_the_tensors_bit_for_bit_with_a_readable_header(tmp_path):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(3, 4), "b": torch.randn(5, dtype=torch.float64)}
    out = write_tau(tensors, tmp_path / "sub" / "tau.safetensors", mode="taujp", coefficients={"x": 0.5, "y": -1.0})
    back = load_file(str(out))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    with safe_open(str(out), framework="pt") as handle:
        meta = handle.metadata()
    assert meta["mode"] == "taujp" and json.loads(meta["coefficients"]) == {"x": 0.5, "y": -1.0}
    with pytest.raises(ConfigError, match="exists"):
        write_tau(tensors, out, mode="taujp", coefficients={})
    assert load_file(str(out)).keys() == tensors.keys()  # the refused write left the file as it was


@pytest.mark.parametrize("target", ["file", "dir"])
def test_tau_only_refuses_its_target_before_any_work(tmp_path, target):
    """``--tau-only --out`` goes through the same checks as a model's ``--out``: an existing file without --force,
    or a directory, is refused in one line, before the bank is even read (this bank does not exist)."""
    out = tmp_path / "out"
    if target == "file":
        out.write_text("mine")
    else:
        out.mkdir()
    result = invoke("add", "a", "--bank", tmp_path / "no-bank", "--out", out, "--tau-only")
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert ("exists: pass --force" if target == "file" else "is a directory") in " ".join(result.output.split())
    assert out.is_dir() or out.read_text() == "mine"
