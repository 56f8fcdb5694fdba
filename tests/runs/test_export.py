"""Edited models written out (``editkit negate NAME --out DIR``, ``editkit add --out``, ``editkit.runs.export``):
the family's own formats beside the program.

Tiny random models only. A causal LM's export is loaded by plain transformers in a subprocess that never
imports editkit, and its perplexities of the test blocks, computed there by hand from the logits (exp of the
mean next-token negative log-likelihood), are the ones ``editkit negate`` reported for the exported row.
A text encoder's Hugging Face directory holds exactly theta_0 + alpha * tau in every parameter (and theta_0
elsewhere) and its program the linearized model; a CLIP export's checkpoint loads through
``open_clip.create_model_and_transforms``, and an L-LoRA one carries its PEFT adapter. Refusals: a non-empty
directory, a file, a vector of another base model, and a writer that crashes, which leaves nothing behind.
(The program's exactness, end to end: ``test_takeaway.py``; a seq2seq export: ``tests/cli/test_glue4.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import editkit  # noqa: F401  (torchvision shim before open_clip)
from editkit.bank.store import Bank
from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.io import targets
from editkit.io import export as io_export
from editkit.runs import export
from editkit.merge.arithmetic import TaskVector
from editkit.scenario.provenance import scenario_provenance
from editkit.scenario.build import BuiltScenario, build_backbone
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import load_scenario
from helpers import models
from helpers.cli import invoke, one_line_refusal
from helpers.exports import held_out_blocks, negated_out_matches_report, plain_transformers, rude_scenario
from helpers.labelled import registered_datasets, scenario_file as text_scenario_file

@pytest.fixture(scope="module")
def language(tmp_path_factory):
    """A two-block random Llama with a character tokenizer, its rude-text scenario, and the bank of one short
    stream (taujp, the last block)."""
    root = tmp_path_factory.mktemp("export-lm")
    with rude_scenario(root, "export") as (scenario, model_dir):
        result = invoke("stream", "--scenario", scenario, "--bank", root / "bank", "--run-dir", root / "stream")
        assert result.exit_code == 0, result.output
        yield root, scenario, model_dir, root / "bank"


def test_negate_out_writes_a_model_plain_transformers_loads_with_the_reported_perplexities(language, tmp_path):
    root, scenario, model_dir, bank = language
    out, run_dir = tmp_path / "detoxified", tmp_path / "run"
    result = invoke("negate", "rude", "--bank", bank, "--alpha", 2, "--run-dir", run_dir, "--out", out)
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "report.json").read_text())
    assert report["export"] == str(out)
    row = next(r for r in report["rows"] if r["alpha"] == 2.0)
    assert {"control_flin", "target_flin"} <= set(row)  # taujp: f_lin's perplexities beside the weights'

    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md",
                 "editkit.json"):
        assert (out / name).is_file(), name
    hand = plain_transformers(out, held_out_blocks())
    assert hand["editkit_imported"] is False and hand["generation_config"]
    assert hand["target"] == pytest.approx(row["target"], rel=1e-5)
    assert hand["control"] == pytest.approx(row["control"], rel=1e-5)
    theta0 = next(r for r in report["rows"] if r["alpha"] == 0.0)
    assert hand["target"] != pytest.approx(theta0["target"], rel=1e-3)  # the export is not theta_0

    provenance = json.loads((out / "editkit.json").read_text())
    stored = Bank(bank)
    assert provenance["base_model"] == {"model": str(model_dir), "options": provenance["base_model"]["options"],
                                        "fingerprint": stored.base}
    assert provenance["vectors"]["rude"]["coefficient"] == -2.0 and provenance["alpha"] == 2.0
    assert provenance["mode"] == "taujp" and provenance["linearized"]
    assert provenance["weights"]["format"] == "transformers" and "program" not in provenance  # the directory is it
    assert provenance["editkit_version"] == editkit.__version__
    card = (out / "README.md").read_text()
    assert stored.base in card and str(model_dir) in card and "AutoModelForCausalLM.from_pretrained" in card
    exported = next(line for line in card.splitlines() if "(this model)" in line)
    assert f"{row['control']:.4g}" in exported and f"{row['control_flin']:.4g}" in exported
    assert f"{row['target_flin']:.4g}" in exported and "f_lin" in card


def test_a_vector_with_the_lm_head_exports_an_untied_model_with_the_reported_perplexities(tmp_path):
    """``trainable_head``: the tiny Llama's head is tied to its embedding; the export must keep the embedding at
    theta_0, the head edited, and say so in its config, or transformers would tie them again on loading."""
    from safetensors.torch import load_file

    with rude_scenario(tmp_path, "exporthead", backbone={"trainable_head": True}) as (scenario, model_dir):
        bank, out, run_dir = tmp_path / "bank", tmp_path / "out", tmp_path / "run"
        result = invoke("stream", "--scenario", scenario, "--bank", bank, "--run-dir", tmp_path / "stream")
        assert result.exit_code == 0, result.output
        assert "lm_head.weight" in Bank(bank).shapes("rude")
        negated_out_matches_report(bank, run_dir, out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    theta0, written = load_file(str(model_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert torch.equal(written["model.embed_tokens.weight"], theta0["model.embed_tokens.weight"])
    assert not torch.equal(written["lm_head.weight"], theta0["model.embed_tokens.weight"])


def test_negate_out_refuses_a_non_empty_directory_before_any_work(language, tmp_path):
    _, _, _, bank = language
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = invoke("negate", "rude", "--bank", bank, "--alpha", 1, "--run-dir", tmp_path / "run", "--out", out)
    one_line_refusal(result, f"--out {out} is a directory that is not empty: pass --force")
    assert not (tmp_path / "run").exists() and (out / "keep.txt").read_text() == "mine"


def test_force_replaces_and_a_crash_leaves_the_target_untouched(language, tmp_path, monkeypatch):
    _, _, _, bank_dir = language
    bank = Bank(bank_dir)
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.txt").write_text("old")

    def broken(manifest):
        raise RuntimeError("disk full")

    monkeypatch.setattr(io_export, "model_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        export.export_vectors(bank, {"rude": -1.0}, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary sibling left
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="disk full"):
        export.export_vectors(bank, {"rude": -1.0}, fresh)
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    monkeypatch.undo()
    export.export_vectors(bank, {"rude": -1.0}, out, force=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_vector_of_another_base_model_is_refused_by_fingerprint(language, tmp_path):
    root, _, _, bank_dir = language
    bank = Bank(bank_dir)
    other_llama = models.char_llama_checkpoint(tmp_path / "other-llama", seed=1)
    other = build_backbone(load_scenario(root / "export-rude.toml"), BuildOptions(model=str(other_llama)))
    built = BuiltScenario(load_scenario(root / "export-rude.toml"), other, [], {})
    with pytest.raises(IncompatibleVectorsError, match="was built on another base model than .*: its vectors were fine-tuned from"):
        io_export.write_export(built, TaskVector(bank.load("rude"), "taujp"), tmp_path / "out", base=bank.base,
                            provenance={}, tasks=[])
    assert not (tmp_path / "out").exists()


def test_a_gpt2_export_holds_theta0_plus_delta_and_its_logits(tmp_path):
    """The API on a causal LM built in memory: every parameter of the loaded export is theta_0 + delta (tail) or
    theta_0, and the plain model gives the logits editkit's edited weights give."""
    from transformers import AutoModelForCausalLM

    from editkit.eval.lm_negation import edited_weights
    from editkit.models.causal_lm import causal_lm_backbone

    lm = models.gpt2(n_layer=2)
    backbone = causal_lm_backbone(lm, models.char_tokenizer(), trainable_blocks=1, name="tiny-gpt2")
    torch.manual_seed(3)
    delta = {n: 0.1 * torch.randn_like(p) for n, p in backbone.module.named_parameters()}
    theta0 = {n: p.clone() for n, p in lm.named_parameters()}
    io_export.write_export(BuiltScenario(None, backbone, [], {}), TaskVector(delta, "nonlinear"), tmp_path / "gpt2",
                        base=backbone.fingerprint(), provenance=_provenance(), tasks=[])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    full = backbone.tail_parameters()
    edited_names = {full[n]: n for n in delta}
    for name, param in loaded.named_parameters():
        want = theta0[name] + delta[edited_names[name]] if name in edited_names else theta0[name]
        assert torch.equal(param, want), name
    assert all(torch.equal(p, theta0[n]) for n, p in lm.named_parameters())  # restored exactly
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    with edited_weights(backbone, delta) as model, torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-6)


def _provenance() -> dict:
    return {"editkit_version": editkit.__version__, "operation": "add", "scenario": "test", "family": "causal-lm",
            "base_model": {"model": "tiny", "fingerprint": "sha256:0"}, "vectors": {}, "mode": "nonlinear",
            "linearized": False, "method": "task-arithmetic", "options": {}, "alpha": None, "delta": "delta",
            "edit": "theta_0 + delta", "scores": {}}


# --------------------------------------------------------------------------- encoders, seq2seq, CLIP: round trips


def _bank_with(tmp_path: Path, scenario_text: str, name: str, tau: dict, mode: str = "nonlinear") -> Bank:
    """A bank holding ``tau`` as vector ``name`` of the scenario written from ``scenario_text``."""
    path = tmp_path / "scenario.toml"
    path.write_text(scenario_text)
    spec = load_scenario(path)
    backbone = build_backbone(spec)
    bank = Bank(tmp_path / "bank")
    bank.append(name, tau, task=name, mode=mode, base=backbone.fingerprint(), scenario=spec.name,
                metrics={"single_task": 0.5}, provenance=scenario_provenance(spec, BuildOptions()))
    return bank


def _random_tau(module: torch.nn.Module | dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """A small random vector over a module's parameters (or over the tensors of a mapping)."""
    generator = torch.Generator().manual_seed(seed)
    named = module.items() if isinstance(module, dict) else module.named_parameters()
    return {n: 0.05 * torch.randn(p.shape, generator=generator) for n, p in named}


def test_a_text_encoder_export_is_the_whole_encoder_at_theta0_plus_alpha_tau(tmp_path):
    """The Hugging Face directory holds the whole encoder at theta_0 + alpha tau (its pooler too, at theta_0), and
    the program beside it the linearized model with the task's head."""
    from transformers import AutoModel

    with registered_datasets():
        scenario = text_scenario_file(tmp_path)
        spec_backbone = build_backbone(load_scenario(scenario))
        tau = _random_tau(spec_backbone.module)
        bank = _bank_with(tmp_path, scenario.read_text(), "sentiment", tau, mode="taujp")
        out = export.export_vectors(bank, {"sentiment": 0.5}, tmp_path / "encoder")
    loaded = AutoModel.from_pretrained(out)
    theta0 = AutoModel.from_pretrained(tmp_path / "tiny-bert")
    names = {f"encoder.layer.{n.removeprefix('tail.layers.')}": n for n in tau}
    assert set(names) <= {n for n, _ in loaded.named_parameters()}
    for name, param in loaded.named_parameters():  # the pooler included: theta_0, not re-initialized
        want = theta0.get_parameter(name) + 0.5 * tau[names[name]] if name in names else theta0.get_parameter(name)
        assert torch.equal(param, want), name
    manifest = json.loads((out / "editkit.json").read_text())
    assert manifest["family"] == "text-encoder" and manifest["linearized"] and manifest["mode"] == "taujp"
    assert [t["name"] for t in manifest["tasks"]] == ["sentiment"] and manifest["input"]["tokenizer"] == "."
    assert (out / "tokenizer.json").is_file() and (out / "model.pt2").is_file()
    assert "AutoModel.from_pretrained" in (out / "README.md").read_text()


CLIP_SCENARIO = """name = "export-clip"\n[backbone]\nfamily = "clip"\nmodel = "editkit-tiny-clip"
pretrained = "random"\n[heads]\nkind = "probe"\nshots = 2\n[[tasks]]\nname = "digits"\nsource = "packaged:digits"
train_size = 40\ntest_size = 20\n"""


def test_a_clip_export_loads_through_open_clip(tmp_path):
    import open_clip

    from editkit.models.clip import TINY_MODEL_NAME, register_tiny_clip

    backbone = build_backbone(load_scenario(_write(tmp_path / "probe.toml", CLIP_SCENARIO)))
    tau = _random_tau(backbone.module)
    bank = _bank_with(tmp_path, CLIP_SCENARIO, "digits", tau, mode="taujp")
    out = export.export_vectors(bank, {"digits": 0.5}, tmp_path / "clip")
    manifest = json.loads((out / "editkit.json").read_text())
    assert manifest["input"]["on"] == "PIL" and manifest["input"]["interpolation"] == "bicubic"
    assert manifest["program"]["verified"]["max_abs_logit_difference"] < 1e-5
    register_tiny_clip()
    model, _, _ = open_clip.create_model_and_transforms(TINY_MODEL_NAME,
                                                        pretrained=str(out / "open_clip_model.safetensors"))
    for name, param in model.named_parameters():
        theta0 = backbone.clip_model.get_parameter(name)
        key = name.removeprefix("visual.")
        want = theta0 + 0.5 * tau[key] if name.startswith("visual.") else theta0
        assert torch.equal(param, want), name


def test_add_out_writes_an_open_clip_checkpoint_and_refuses_a_file(tmp_path):
    """``add --out`` on a CLIP bank: the whole open_clip model beside the program (a linearized vector's weights
    scored beside f_lin)."""
    backbone = build_backbone(load_scenario(_write(tmp_path / "probe.toml", CLIP_SCENARIO)))
    bank = _bank_with(tmp_path, CLIP_SCENARIO, "digits", _random_tau(backbone.module), mode="taujp")
    a_file = tmp_path / "edited.safetensors"
    a_file.write_text("x")
    one_line_refusal(invoke("add", "digits", "--bank", bank.root, "--out", a_file),
                     f"--out {a_file} is a file: --out names the directory the model is written into")
    out, json_path = tmp_path / "edited", tmp_path / "add.json"
    result = invoke("add", "digits", "--bank", bank.root, "--out", out, "--json", json_path)
    assert result.exit_code == 0, result.output
    report = json.loads(json_path.read_text())
    assert set(report["weights"]["per_task"]) == {"digits"} and report["mode"] == "taujp"
    from safetensors import safe_open

    with safe_open(str(out / "open_clip_model.safetensors"), framework="pt") as fh:
        assert "visual.conv1.weight" in fh.keys() and "token_embedding.weight" in fh.keys()
    manifest = json.loads((out / "editkit.json").read_text())
    assert manifest["weights"]["format"] == "open_clip" and manifest["scores"]["weights"] == report["weights"]


def test_add_out_refuses_a_non_empty_directory_before_any_work(tmp_path, monkeypatch):
    backbone = build_backbone(load_scenario(_write(tmp_path / "probe.toml", CLIP_SCENARIO)))
    bank = _bank_with(tmp_path, CLIP_SCENARIO, "digits", _random_tau(backbone.module))
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("x")
    from editkit.runs import edit

    monkeypatch.setattr(edit, "bank_scenario", lambda *a, **k: pytest.fail("work started"))
    result = invoke("add", "digits", "--bank", bank.root, "--out", out)
    one_line_refusal(result, "is a directory")


def test_check_target_refusals(tmp_path):
    with pytest.raises(ConfigError, match="is a file: --out names the directory"):
        targets.check_target(Path(__file__), force=True)  # a file is never replaced by a directory
    (tmp_path / "x").write_text("x")
    with pytest.raises(ConfigError, match="is a directory that is not empty: pass --force"):
        targets.check_target(tmp_path)
    assert targets.check_target(tmp_path, force=True) == tmp_path
    assert targets.check_target(tmp_path / "new") == tmp_path / "new"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_clip_llora_export_is_the_plain_model_and_its_peft_adapter(tmp_path):
    """An L-LoRA vector of CLIP: the checkpoint is the plain open_clip model, each adapted weight
    W + s (B0 + alpha dB)(A0 + alpha dA) by hand (B0 = 0), the rest theta_0; beside it, PEFT's adapter gives the
    same image features over theta_0's model."""
    import open_clip
    from peft import PeftModel

    from editkit.models.clip import TINY_MODEL_NAME, register_tiny_clip
    from editkit.train.recipe import Recipe, attach_adapter

    recipe = Recipe(mode="taujp", adapter="lora", lora_rank=2, lora_alpha=4.0)
    backbone = build_backbone(load_scenario(_write(tmp_path / "probe.toml", CLIP_SCENARIO)))
    attach_adapter(backbone.module, [recipe])
    phi0 = {n: p.detach().clone() for n, p in backbone.module.named_parameters() if ".lora_" in n}
    tau = _random_tau(phi0)
    path = tmp_path / "scenario.toml"
    path.write_text(CLIP_SCENARIO)
    spec = load_scenario(path)
    bank = Bank(tmp_path / "bank")
    bank.append("digits", tau, task="digits", mode="taujp", base=backbone.fingerprint(), scenario=spec.name,
                recipe=recipe.to_dict(), metrics={"single_task": 0.5}, provenance=scenario_provenance(spec, BuildOptions()))
    out = export.export_vectors(bank, {"digits": 0.5}, tmp_path / "clip")
    register_tiny_clip()
    model, _, _ = open_clip.create_model_and_transforms(TINY_MODEL_NAME,
                                                        pretrained=str(out / "open_clip_model.safetensors"))
    plain = build_backbone(spec).clip_model
    adapted = {n.split(".lora_A.")[0] for n in tau if ".lora_A." in n}
    for name, param in model.named_parameters():
        want = plain.get_parameter(name)
        layer = name.removeprefix("visual.").removesuffix(".weight")
        if name.startswith("visual.") and name.endswith(".weight") and layer in adapted:
            a = phi0[f"{layer}.lora_A.default.weight"] + 0.5 * tau[f"{layer}.lora_A.default.weight"]
            b = 0.5 * tau[f"{layer}.lora_B.default.weight"]
            want = want + 2.0 * (b.flatten(1) @ a.flatten(1)).reshape(want.shape)  # conv1 too: B is 1x1
        torch.testing.assert_close(param, want, rtol=1e-6, atol=1e-6)
    images = torch.randn(2, 3, 32, 32)
    peft_model = PeftModel.from_pretrained(plain, out / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model.base_model.model.encode_image(images), model.eval().encode_image(images),
                                   rtol=1e-5, atol=1e-5)
