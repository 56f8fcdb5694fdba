"""A family owns its weights' format (``Backbone.native_weights``), the writer names none; reading an export needs
nothing of training."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from torch import nn

from editkit.io.native import write_weights
from editkit.models.backbone import Backbone, NativeWeights


class _Whole(nn.Module):
    """A model of a family from another package: the backbone is its ``body``, ``extra`` is not edited."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.extra = nn.Linear(2, 2)


@dataclass
class _OwnFamily(Backbone):
    whole: nn.Module | None = None

    def native_weights(self) -> NativeWeights:
        return NativeWeights("own-format", self.whole, "`own.load(PATH)`", file="own.safetensors",
                             to_format=lambda state: {f"own/{k}": v for k, v in state.items()})


def _delta(module: nn.Module) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {n: torch.randn_like(p) for n, p in module.named_parameters()}


def test_a_family_of_its_own_is_written_in_its_own_format(tmp_path):
    whole = _Whole()
    backbone = _OwnFamily(name="own", module=whole.body, feature_dim=2, whole=whole)
    before = {k: v.clone() for k, v in whole.state_dict().items()}
    delta = _delta(whole.body)
    weights = write_weights(backbone, delta, tmp_path, {"edit": "theta_0 + tau"})
    assert weights == {"format": "own-format", "files": ["own.safetensors"], "loads": "`own.load(PATH)`"}
    written = load_file(str(tmp_path / "own.safetensors"))
    edited = {f"body.{n}": before[f"body.{n}"] + d for n, d in delta.items()}
    want = {f"own/{k}": edited.get(k, v) for k, v in before.items()}
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in before.items())  # theta_0 restored exactly


def test_a_family_that_names_no_format_writes_its_module_state_dict(tmp_path):
    module = nn.Linear(3, 2)
    backbone = Backbone(name="plain", module=module, feature_dim=2)
    delta = _delta(module)
    weights = write_weights(backbone, delta, tmp_path, {})
    assert weights["format"] == "state-dict" and weights["files"] == ["weights.safetensors"]
    assert "Linear.load_state_dict" in weights["loads"]
    written = load_file(str(tmp_path / "weights.safetensors"))
    assert all(torch.equal(written[n], p.detach() + delta[n]) for n, p in module.named_parameters())


def test_reading_an_export_imports_nothing_of_training():
    """``editkit predict`` reads a directory alone: no bank, scenario, training, merging, data or evaluation module
    is imported with it (checked in a fresh interpreter)."""
    code = ("import json, sys\nimport editkit.runs.predict, editkit.io.read\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('editkit.'))))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True).stdout.strip().splitlines()[-1])
    training = ("editkit.train", "editkit.bank", "editkit.scenario", "editkit.merge", "editkit.data",
                "editkit.eval", "editkit.integrations", "editkit.core.linearize", "editkit.core.tangents",
                "editkit.core.taujp", "editkit.core.curvature", "editkit.io.program", "editkit.io.export")
    assert [m for m in loaded if m.startswith(training)] == []
    assert "editkit.io.read" in loaded
