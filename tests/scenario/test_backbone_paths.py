"""``[backbone]`` values that are paths are read from the scenario file's folder, as task sources are; names
(a torchvision weights name, an open_clip tag, a packaged model, a hub id) stay as written.

Ground truth: the absolute paths the files were written at, and the weights saved there, read back by the
backbone built from another working directory.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torchvision

from editkit.scenario.build import build_backbone
from editkit.scenario.spec import load_scenario

TASK = '[[tasks]]\nname = "bugs"\nsource = "imagefolder:bugs"\n'


def scenario(folder: Path, backbone: str) -> Path:
    """``folder/my.toml`` with the ``[backbone]`` lines ``backbone`` and one image-folder task."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "my.toml"
    path.write_text(f'name = "mine"\n[backbone]\n{backbone}\n{TASK}')
    return path


def test_torchvision_weights_relative_to_the_scenario_are_built_from_another_directory(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "weights").mkdir(parents=True)
    torch.manual_seed(5)
    saved = torchvision.models.resnet18().state_dict()
    torch.save(saved, folder / "weights" / "resnet.pth")
    scenario(folder, 'family = "torchvision"\nmodel = "resnet18"\nweights = "weights/resnet.pth"\nimage_size = 32')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    spec = load_scenario("../project/my.toml")
    assert spec.backbone["weights"] == str(folder / "weights" / "resnet.pth")
    assert spec.backbone["model"] == "resnet18"
    backbone = build_backbone(spec)
    state = backbone.module.state_dict()
    assert set(state) | set(backbone.classifier) == set(saved)
    for key, value in {**state, **backbone.classifier}.items():
        assert torch.equal(value, saved[key]), key


def test_names_stay_and_paths_of_every_family_resolve(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "my-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)

    def backbone(lines: str) -> dict:
        return load_scenario(scenario(folder, lines)).backbone

    assert backbone('family = "torchvision"\nweights = "IMAGENET1K_V1"')["weights"] == "IMAGENET1K_V1"
    assert backbone('family = "torchvision"\nweights = "random"')["weights"] == "random"
    assert backbone('family = "torchvision"\nweights = "w.safetensors"')["weights"] == str(folder / "w.safetensors")
    clip = backbone('family = "clip"\nmodel = "cfg/tiny.json"\npretrained = "ckpt.pt"\ncache_dir = "clip-cache"')
    assert clip == {"family": "clip", "model": str(folder / "cfg" / "tiny.json"),
                    "pretrained": str(folder / "ckpt.pt"), "cache_dir": str(folder / "clip-cache")}
    assert backbone('family = "clip"\nmodel = "ViT-B-32"\npretrained = "openai"') == {
        "family": "clip", "model": "ViT-B-32", "pretrained": "openai"}
    for name in ("smollm2-135m-instruct", "gpt2", "HuggingFaceTB/SmolLM2-135M"):  # packaged, hub ids
        assert backbone(f'family = "causal-lm"\nmodel = "{name}"')["model"] == name
    assert backbone('family = "causal-lm"\nmodel = "my-llama"')["model"] == str(folder / "my-llama")  # a folder there
    assert backbone('family = "causal-lm"\nmodel = "./later"')["model"] == str(folder / "later")  # written as a path
    assert backbone('family = "causal-lm"\nmodel = "q.gguf"')["model"] == str(folder / "q.gguf")
    assert backbone('family = "text-encoder"\nhub_cache = "hub"')["hub_cache"] == str(folder / "hub")
    absolute = tmp_path / "models" / "bert"
    assert backbone(f'family = "text-encoder"\nmodel = "{absolute}"')["model"] == str(absolute)
