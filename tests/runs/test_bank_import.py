"""Importing checkpoints fine-tuned elsewhere as bank vectors, and writing edited models with ``add --out``.

Ground truth: theta_ft = theta_0 + a known tau on the tiny open_clip CLIP, saved in every
layout a user brings (open_clip training checkpoint, an ImageEncoder's state dict, Hugging
Face ``CLIPVisionModelWithProjection`` / ``CLIPVisionModel`` / ``CLIPModel``, the module's own
names); each must import to tau. The Hugging Face files are written through the hand mapping
below, which is checked against transformers itself: the Hugging Face model holding the
mapped weights computes open_clip's image features.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import editkit  # noqa: F401  (torchvision shim before open_clip)
from editkit.bank.store import Bank
from editkit.cli import app
from editkit.errors import BankError, IncompatibleVectorsError
from editkit.models.clip import TINY_CLIP_CONFIG
from editkit.io.checkpoints import import_checkpoint, module_parameters
from editkit.scenario.provenance import scenario_provenance
from editkit.scenario.build import build_backbone
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import load_scenario

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])

SCENARIO = """
name = "clip-import"
description = "the tiny random CLIP on a few digits"
[backbone]
family = "clip"
model = "editkit-tiny-clip"
pretrained = "random"
[heads]
kind = "probe"
shots = 2
[[tasks]]
name = "digits"
source = "packaged:digits"
train_size = 40
test_size = 20
[recipe]
mode = "nonlinear"
"""

VISION = TINY_CLIP_CONFIG["vision_cfg"]
HF_CONFIG = dict(hidden_size=VISION["width"], intermediate_size=4 * VISION["width"],
                 num_hidden_layers=VISION["layers"], num_attention_heads=VISION["width"] // VISION["head_width"],
                 image_size=VISION["image_size"], patch_size=VISION["patch_size"],
                 projection_dim=TINY_CLIP_CONFIG["embed_dim"], hidden_act="gelu", layer_norm_eps=1e-5)


def hugging_face_keys(tower: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """open_clip image-tower tensors as a ``CLIPVisionModelWithProjection`` state dict, written out by hand."""
    out = {
        "vision_model.embeddings.class_embedding": tower["class_embedding"],
        "vision_model.embeddings.patch_embedding.weight": tower["conv1.weight"],
        "vision_model.embeddings.position_embedding.weight": tower["positional_embedding"],
        "visual_projection.weight": tower["proj"].t(),
    }
    for ours, theirs in (("ln_pre", "pre_layrnorm"), ("ln_post", "post_layernorm")):
        for kind in ("weight", "bias"):
            out[f"vision_model.{theirs}.{kind}"] = tower[f"{ours}.{kind}"]
    for i in range(VISION["layers"]):
        block, layer = f"transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = tower[f"{block}attn.in_proj_{kind}"].chunk(3)
            out.update({f"{layer}self_attn.q_proj.{kind}": q, f"{layer}self_attn.k_proj.{kind}": k,
                        f"{layer}self_attn.v_proj.{kind}": v})
            for ours, theirs in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"),
                                 ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[f"{layer}{theirs}.{kind}"] = tower[f"{block}{ours}.{kind}"]
    assert len(out) == len(tower) + 4 * VISION["layers"]  # each fused projection became three
    return {k: v.contiguous() for k, v in out.items()}


def hf_vision_model(tower: dict[str, torch.Tensor]) -> transformers.CLIPVisionModelWithProjection:
    model = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(**HF_CONFIG)).eval()
    model.load_state_dict(hugging_face_keys(tower), strict=True)
    return model


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "clip-import.toml"
    path.write_text(SCENARIO)
    return path


@pytest.fixture(scope="module")
def backbone(scenario):
    """The scenario's backbone: theta_0 of every import below."""
    return build_backbone(load_scenario(scenario))


@pytest.fixture(scope="module")
def theta0(backbone) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backbone.module.named_parameters()}


@pytest.fixture(scope="module")
def tau(theta0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {n: 0.01 * torch.randn(p.shape, generator=generator) for n, p in theta0.items()}


@pytest.fixture(scope="module")
def tuned(theta0, tau) -> dict[str, torch.Tensor]:
    return {n: theta0[n] + tau[n] for n in theta0}


def saved(model) -> dict[str, torch.Tensor]:
    """The state dict ``save_pretrained`` writes for ``model`` (the on-disk layout, which may differ from
    ``state_dict()``'s)."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        return load_file(str(Path(directory) / "model.safetensors"))


def whole_clip(backbone, tower: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The whole open_clip model's state dict with ``tower`` as its image tower, keys under ``prefix``."""
    state = {**backbone.clip_model.state_dict(), **{f"visual.{k}": v for k, v in tower.items()}}
    return {prefix + k: v.clone() for k, v in state.items()}


def hf_clip_model(tower: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A real ``CLIPModel`` (tiny random text tower) whose vision side holds ``tower``."""
    config = transformers.CLIPConfig(vision_config=HF_CONFIG, projection_dim=HF_CONFIG["projection_dim"],
                                     text_config=dict(vocab_size=99, hidden_size=16, intermediate_size=32,
                                                      num_hidden_layers=1, num_attention_heads=2,
                                                      max_position_embeddings=8))
    model = transformers.CLIPModel(config)
    state = model.state_dict()
    vision = hugging_face_keys(tower)
    assert set(vision) <= set(state)
    return {**state, **vision}


def write(path: Path, state: dict, *, torch_file: bool = False) -> Path:
    if torch_file:
        torch.save(state, path)
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def drop(state: dict, key: str) -> dict:
    return {k: v for k, v in state.items() if k != key}


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in sorted(root.iterdir()) if p.is_file()} if root.exists() else {}


# --------------------------------------------------------------------------- the Hugging Face mapping


def test_hand_mapping_gives_transformers_the_open_clip_tower(backbone, tuned):
    """Ground truth for the Hugging Face layout: with the mapped weights, transformers' CLIP vision model
    computes the open_clip tower's features."""
    model = hf_vision_model(tuned)
    x = torch.randn(3, 3, VISION["image_size"], VISION["image_size"], generator=torch.Generator().manual_seed(1))
    tower = copy.deepcopy(backbone.module)
    tower.load_state_dict(tuned, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(pixel_values=x).image_embeds, tower(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- import round trips


LAYOUTS = {
    "open_clip training checkpoint (.pt)": ("open_clip", lambda b, t: {"epoch": 3, "name": "ft",
                                                                        "state_dict": whole_clip(b, t)}, True),
    "ImageEncoder state dict saved under DDP": ("open_clip", lambda b, t: whole_clip(b, t, "module.model."), False),
    "CLIPVisionModelWithProjection, saved by transformers": ("hf-clip", lambda b, t: saved(hf_vision_model(t)), False),
    "CLIPModel (.bin)": ("hf-clip", lambda b, t: hf_clip_model(t), True),
    "the module's own names": ("state-dict", lambda b, t: dict(t), False),
    "OpenAI's archive state (scalars beside the weights)": (
        "open_clip", lambda b, t: {**whole_clip(b, t), "input_resolution": torch.tensor(224),
                                   "context_length": torch.tensor(77), "vocab_size": torch.tensor(49408)}, True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_imports_to_tau(layout, scenario, backbone, tuned, tau, tmp_path):
    name, make, torch_file = LAYOUTS[layout]
    path = write(tmp_path / ("ft.pt" if torch_file else "ft.safetensors"), make(backbone, tuned), torch_file=torch_file)
    bank = Bank(tmp_path / "bank")
    entry = import_checkpoint(bank, scenario, "digits", path)
    assert (entry.mode, entry.task, entry.scenario) == ("nonlinear", "digits", "clip-import")
    assert entry.base == backbone.fingerprint() == bank.base
    imported = entry.provenance["imported"]
    assert imported["finetuned"] == {"file": str(path.resolve()), "sha256": sha256(path), "layout": name}
    assert imported["not_held"] == [] and "base" not in imported
    assert entry.provenance["scenario_file"] == str(scenario.resolve())
    vector = bank.load("digits")
    assert vector.keys() == tau.keys()
    for key in tau:
        torch.testing.assert_close(vector[key], tau[key], rtol=0, atol=1e-6)
    norm = torch.cat([t.flatten().double() for t in tau.values()]).norm().item()
    assert entry.metrics["tau_norm"] == pytest.approx(norm, rel=1e-5)


def vision_only(tower: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """``tower`` in a ``CLIPVisionModel`` as this transformers saves it (no projection, no ``vision_model.``)."""
    model = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**HF_CONFIG))
    mapped = {k.removeprefix("vision_model."): v for k, v in hugging_face_keys(tower).items()}
    model.load_state_dict(drop(mapped, "visual_projection.weight"), strict=True)
    model.save_pretrained(directory)
    return load_file(str(directory / "model.safetensors"))


VISION_ONLY = {
    "as transformers 4 saved it (vision_model.*)": lambda t, d: drop(hugging_face_keys(t), "visual_projection.weight"),
    "as transformers 5 saves it": vision_only,
}


@pytest.mark.parametrize("layout", VISION_ONLY)
def test_a_vision_model_without_projection_leaves_proj_at_theta0(layout, scenario, tuned, tau, tmp_path):
    """A ``CLIPVisionModel`` has no projection: fine-tuning one cannot move it, so its tau is 0."""
    path = write(tmp_path / "vision.safetensors", VISION_ONLY[layout](tuned, tmp_path / "saved"))
    entry = import_checkpoint(tmp_path / "bank", scenario, "digits", path)
    vector = Bank(tmp_path / "bank").load("digits")
    assert entry.provenance["imported"]["not_held"] == ["proj"]
    assert entry.provenance["imported"]["finetuned"]["layout"] == "hf-clip"
    assert torch.equal(vector["proj"], torch.zeros_like(tau["proj"]))
    for key in tau.keys() - {"proj"}:
        torch.testing.assert_close(vector[key], tau[key], rtol=0, atol=1e-6)


def test_a_base_checkpoint_replaces_theta0_when_it_holds_the_backbone_values(scenario, theta0, tuned, tmp_path):
    """τ = θ_ft − base. A half-precision copy of θ0 is θ0 (compared in its own dtype), so τ is taken against
    the half-precision values, which is what the fine-tuning started from."""
    half = write(tmp_path / "base.safetensors", hugging_face_keys({k: v.half() for k, v in theta0.items()}))
    finetuned = write(tmp_path / "ft.safetensors", dict(tuned))
    entry = import_checkpoint(tmp_path / "bank", scenario, "digits", finetuned, base=half)
    vector = Bank(tmp_path / "bank").load("digits")
    for key in tuned:
        assert torch.equal(vector[key], tuned[key] - theta0[key].half().float()), key
    assert entry.provenance["imported"]["base"] == {"file": str(half.resolve()), "sha256": sha256(half),
                                                    "layout": "hf-clip"}


def test_a_wrong_base_is_refused_in_one_line_and_nothing_is_banked(scenario, theta0, tuned, tmp_path):
    bank_dir = tmp_path / "bank"
    import_checkpoint(bank_dir, scenario, "digits", write(tmp_path / "ok.safetensors", dict(tuned)))
    before = snapshot(bank_dir)
    wrong = {**theta0, "ln_post.weight": theta0["ln_post.weight"] + 1e-3}
    base = write(tmp_path / "other-base.safetensors", wrong)
    result = invoke("bank", "import", "--bank", bank_dir, "--scenario", scenario, "--name", "again", "--task", "digits",
                    "--finetuned", tmp_path / "ok.safetensors", "--base", base)
    assert result.exit_code == 1, result.output
    line = " ".join(result.output.split())
    assert line.startswith("error: base checkpoint") and "'ln_post.weight'" in line and "Traceback" not in line
    with pytest.raises(IncompatibleVectorsError, match="'ln_post.weight'"):  # what the Python API raises
        import_checkpoint(bank_dir, scenario, "again", tmp_path / "ok.safetensors", base=base, task="digits")
    assert snapshot(bank_dir) == before and Bank(bank_dir).names() == ["digits"]


# --------------------------------------------------------------------------- refusals


BLOCK_0 = "vision_model.encoder.layers.0.self_attn"
REFUSED = {
    "an unknown key": (lambda t: {**t, "head.weight": torch.zeros(2)}, "key(s) the backbone does not: head.weight"),
    "a missing parameter": (lambda t: drop(t, "ln_post.bias"), "lacks 1 of the backbone's parameters: ln_post.bias"),
    "another shape": (lambda t: {**t, "proj": t["proj"].t()}, "proj (16, 32) (backbone (32, 16))"),
    "half a fused projection": (lambda t: drop(hugging_face_keys(t), f"{BLOCK_0}.v_proj.bias"), f"{BLOCK_0}.q_proj.bias"),
    "a text-tower key of the wrong model": (lambda t: {**hugging_face_keys(t), "text_encoder.x": torch.zeros(1)},
                                            "text_encoder.x"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_keys_that_do_not_fit_the_backbone_are_refused_by_name(case, scenario, tuned, tmp_path):
    make, expected = REFUSED[case]
    path = write(tmp_path / "ft.safetensors", make(dict(tuned)))
    with pytest.raises(BankError, match=re.escape(expected)):
        import_checkpoint(tmp_path / "bank", scenario, "digits", path)
    assert not (tmp_path / "bank").exists()


def test_changed_buffers_are_refused(make_mlp, tmp_path):
    """A task vector holds parameters only: a checkpoint whose BatchNorm statistics moved is another model."""
    module = make_mlp(3, 4, 2, batchnorm=True)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    path = write(tmp_path / "same.safetensors", state)
    layout, params, not_held = module_parameters(path, module, "fine-tuned")
    assert (layout, not_held) == ("state-dict", ()) and params.keys() == dict(module.named_parameters()).keys()
    state["1.running_mean"] += 0.5
    with pytest.raises(BankError, match=r"buffer '1\.running_mean' .*max \|difference\| 0\.5"):
        module_parameters(write(tmp_path / "moved.safetensors", state), module, "fine-tuned")


def test_unreadable_checkpoints_are_one_line(scenario, tuned, tmp_path):
    good = write(tmp_path / "good.safetensors", dict(tuned))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    pickled = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), pickled)
    for path, expected in ((truncated, "truncated or unreadable"), (garbage, "truncated or not a torch file"),
                           (pickled, "pickled Python objects"), (tmp_path / "absent.pt", "does not exist"),
                           (tmp_path, "is a directory")):
        result = invoke("bank", "import", "--bank", tmp_path / "bank", "--scenario", scenario,
                        "--name", "digits", "--finetuned", path)
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert " ".join(lines).startswith("error: ") and expected in " ".join(" ".join(lines).split()), result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "bank").exists()


# --------------------------------------------------------------------------- add --out


def test_add_out_writes_the_edited_model_and_it_reimports(scenario, backbone, theta0, tuned, tmp_path, monkeypatch):
    """Imported into its own default bank, not the stream's; then θ0 + α·τ as the whole open_clip model's
    checkpoint: its image tower holds every parameter bit-exact, and importing it back (open_clip layout) gives α·τ."""
    monkeypatch.chdir(tmp_path)
    result = invoke("bank", "import", "--scenario", scenario, "--name", "digits",
                    "--finetuned", write(tmp_path / "ft.safetensors", dict(tuned)))
    assert result.exit_code == 0, result.output
    bank_dir = tmp_path / "banks" / "clip-import-imported"
    assert Bank(bank_dir).names() == ["digits"] and not (tmp_path / "banks" / "clip-import-nonlinear").exists()
    assert "imported digits (task digits, state-dict layout" in " ".join(result.output.split())
    out = tmp_path / "model"
    result = invoke("add", "digits", "--alpha", "0.5", "--bank", bank_dir, "--out", out)
    assert result.exit_code == 0, result.output
    banked = Bank(bank_dir).load("digits")
    state = load_file(str(out / "open_clip_model.safetensors"))
    module = build_backbone(load_scenario(scenario)).module
    module.load_state_dict({k.removeprefix("visual."): v for k, v in state.items() if k.startswith("visual.")},
                           strict=True)
    for name, param in module.named_parameters():
        assert torch.equal(param, theta0[name] + 0.5 * banked[name]), name
    with safe_open(str(out / "open_clip_model.safetensors"), framework="pt") as fh:
        assert json.loads(fh.metadata()["editkit"])["edit"] == "theta_0 + 0.5 * tau[digits]"
    provenance = json.loads((out / "editkit.json").read_text())
    assert (provenance["weights"]["format"], provenance["mode"]) == ("open_clip", "nonlinear")
    assert provenance["base_model"]["fingerprint"] == backbone.fingerprint()
    assert provenance["method"] == "task-arithmetic" and provenance["options"] == {}
    import_checkpoint(bank_dir, scenario, "half", out / "open_clip_model.safetensors", task="digits")
    again = Bank(bank_dir).load("half")
    for key in banked:
        torch.testing.assert_close(again[key], 0.5 * banked[key], rtol=0, atol=1e-6)


def test_add_out_writes_linearized_vectors_as_weights_and_tau_only_writes_the_vector(scenario, backbone, tau,
                                                                                     tmp_path):
    """A linearized vector's model is f(x; θ0) + J f(x)·τ: the program computes it, and beside it a CLIP export
    writes the weights θ0 + τ (scored beside f_lin)."""
    bank = Bank(tmp_path / "bank")
    bank.append("digits", tau, task="digits", mode="taujp", base=backbone.fingerprint(), scenario="clip-import",
                metrics={"single_task": 0.5}, provenance=scenario_provenance(load_scenario(scenario), BuildOptions()))
    out = tmp_path / "model"
    result = invoke("add", "digits", "--bank", bank.root, "--out", out, "--json", tmp_path / "add.json")
    assert result.exit_code == 0 and (out / "open_clip_model.safetensors").exists(), result.output
    assert set(json.loads((tmp_path / "add.json").read_text())["weights"]["per_task"]) == {"digits"}
    assert json.loads((out / "editkit.json").read_text())["program"]["computes"].startswith("f_lin(x)")
    result = invoke("add", "digits", "--bank", bank.root, "--tau-only")  # says what --out writes: no --out
    assert result.exit_code == 1 and "give --out too" in " ".join(result.output.split())
    vector = tmp_path / "tau.safetensors"
    result = invoke("add", "digits", "--bank", bank.root, "--out", vector, "--tau-only")
    assert result.exit_code == 0, result.output
    written = load_file(str(vector))
    assert written.keys() == tau.keys() and all(torch.equal(written[k], tau[k]) for k in tau)
