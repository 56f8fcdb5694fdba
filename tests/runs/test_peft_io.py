"""LoRA task vectors through PEFT itself: adapters PEFT wrote become bank vectors bit for bit, and what ``--out``
writes loads with ``PeftModel.from_pretrained`` and with plain transformers, giving the logits of the weights
editkit scored, which are checked against weights edited by hand (W + s sum_i alpha_i B_i A_i).

Tiny random Llama (two blocks, the last one trainable) with a character tokenizer; nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import editkit  # noqa: F401  (torchvision shim before transformers)
from editkit.bank.store import Bank
from editkit.errors import BankError, IncompatibleVectorsError
from editkit.runs import export
from editkit.io.peft import import_peft_adapter
from helpers.cli import invoke
from helpers.exports import negated_out_matches_report, rude_scenario

RANK, ALPHA = 2, 4.0
LAST = "model.layers.1.self_attn"


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft")
    with rude_scenario(root, "peft") as (path, model_dir):
        yield root, path, model_dir


def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def peft_adapter(model_dir, out, seed: int, layers=(1,)):
    """An adapter PEFT itself builds and saves (q_proj and v_proj of the given blocks), its B drawn at random."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], layers_to_transform=list(layers))
    model = get_peft_model(base_model(model_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    return load_file(str(out / "adapter_model.safetensors"))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 9, 12, 3, 40, 7, 22, 1]])


def test_peft_adapters_import_bit_exact_merge_as_weights_and_export_stacked(scenario, tmp_path):
    from peft import PeftModel

    root, path, model_dir = scenario
    bank = tmp_path / "bank"
    files = [peft_adapter(model_dir, tmp_path / f"adapter{i}", seed=i) for i in (1, 2)]
    for i, name in ((0, "rude"), (1, "rude2")):
        result = invoke("bank", "import", "--peft", tmp_path / f"adapter{i + 1}", "--name", name, "--task", "rude",
                        "--scenario", path, "--bank", bank)
        assert result.exit_code == 0, result.output
    stored = Bank(bank)
    assert stored.get("rude").mode == "nonlinear" and stored.get("rude").recipe["lora_rank"] == RANK
    assert "nonlinear, lora r2" in invoke("bank", "list", "--bank", bank).output
    tensors = stored.load("rude")
    for key, value in files[0].items():  # the adapter itself, bit for bit, under the tail's names
        ours = key.replace("base_model.model.model.", "").replace(".weight", ".default.weight")
        assert torch.equal(tensors[ours], value), key

    s = ALPHA / RANK
    by_hand = {}
    for proj in ("q_proj", "v_proj"):
        a1, b1 = (files[0][f"base_model.model.{LAST}.{proj}.lora_{f}.weight"] for f in "AB")
        a2, b2 = (files[1][f"base_model.model.{LAST}.{proj}.lora_{f}.weight"] for f in "AB")
        by_hand[proj] = s * (b1 @ a1 + 0.5 * (b2 @ a2))
    merged = stored.merge({"rude": 1.0, "rude2": 0.5})
    assert sorted(merged) == ["layers.1.self_attn.q_proj.base_layer.weight", "layers.1.self_attn.v_proj.base_layer.weight"]
    torch.testing.assert_close(merged["layers.1.self_attn.q_proj.base_layer.weight"], by_hand["q_proj"])

    out = tmp_path / "model"
    export.export_vectors(stored, {"rude": 1.0, "rude2": 0.5}, out)
    hand = base_model(model_dir)
    with torch.no_grad():
        for proj in ("q_proj", "v_proj"):
            getattr(hand.model.layers[1].self_attn, proj).weight += by_hand[proj]
    expected = logits(hand, IDS)
    torch.testing.assert_close(logits(base_model(out), IDS), expected, rtol=1e-5, atol=1e-5)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 2 * RANK and sorted(config["target_modules"]) == [f"{LAST}.q_proj", f"{LAST}.v_proj"]
    peft_model = PeftModel.from_pretrained(base_model(model_dir), out / "adapter").eval()
    torch.testing.assert_close(logits(peft_model, IDS), expected, rtol=1e-5, atol=1e-5)


def test_imports_refuse_a_misfit_adapter_and_a_bank_of_full_vectors(scenario, tmp_path):
    _, path, model_dir = scenario
    peft_adapter(model_dir, tmp_path / "both", seed=3, layers=(0, 1))
    with pytest.raises(BankError, match="does not fit .* keys it does not have"):
        import_peft_adapter(tmp_path / "bank", path, "rude", tmp_path / "both")
    assert not (tmp_path / "bank").exists()
    result = invoke("stream", "--scenario", path, "--bank", tmp_path / "full", "--run-dir", tmp_path / "run",
                    "--steps", 1)
    assert result.exit_code == 0, result.output
    peft_adapter(model_dir, tmp_path / "last", seed=4)
    with pytest.raises(IncompatibleVectorsError, match="adapter and full vectors"):
        import_peft_adapter(tmp_path / "full", path, "rude2", tmp_path / "last", task="rude")
    assert Bank(tmp_path / "full").names() == ["rude"]


@pytest.mark.parametrize("mode", ["taujp", "nonlinear"])
def test_an_adapter_stream_negated_out_loads_in_plain_transformers_and_peft(scenario, tmp_path, mode):
    """L-LoRA (taujp) and plain LoRA: the negation's exported model gives the perplexities editkit reported,
    and its adapter, over the base model, the same logits."""
    from peft import PeftModel

    _, path, model_dir = scenario
    bank, out, run_dir = tmp_path / "bank", tmp_path / "negated", tmp_path / "run"
    result = invoke("stream", "--scenario", path, "--bank", bank, "--run-dir", tmp_path / "stream", "--mode", mode,
                    "--adapter", "lora", "--lora-rank", RANK, "--lora-alpha", ALPHA, "--lora-targets", "q_proj,v_proj")
    assert result.exit_code == 0, result.output
    vector = Bank(bank).load("rude")
    assert sorted(vector) == sorted(f"layers.1.self_attn.{p}.lora_{f}.default.weight"
                                    for p in ("q_proj", "v_proj") for f in "AB")
    negated_out_matches_report(bank, run_dir, out)
    exported = logits(base_model(out), IDS)
    assert not torch.allclose(exported, logits(base_model(model_dir), IDS))
    peft_model = PeftModel.from_pretrained(base_model(model_dir), out / "adapter").eval()
    torch.testing.assert_close(logits(peft_model, IDS), exported, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key, value", [("use_dora", True), ("bias", "all"), ("modules_to_save", ["classifier"])])
def test_adapter_configs_a_vector_cannot_hold_are_refused_by_name(tmp_path, key, value):
    from safetensors.torch import save_file

    from editkit.errors import ConfigError, MissingResourceError
    from editkit.io.peft import read_adapter_config

    with pytest.raises(MissingResourceError, match="lacks adapter_config.json, adapter_model.safetensors"):
        read_adapter_config(tmp_path)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "use_dora": False,
              "bias": "none", "modules_to_save": None, key: value}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=f"{key} = .* is not supported"):
        read_adapter_config(tmp_path)
