"""theta_0's prefix states on disk: read back, bit for bit, only for the same prefix and the same blocks.

Each test counts the real prefix passes (``prefix_states``) and compares what a dataset reads with the states
a fresh pass computes: a second dataset of the same text computes nothing; another model, another prefix depth,
another precision or other text is a miss, while another tail (what fine-tuning and negation change) is not; a damaged entry is
computed again and rewritten, never trusted.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from editkit import settings
from editkit.data import text
from editkit.data.text import sequences
from editkit.models.causal_lm import causal_lm_backbone
from helpers import models

TEXTS = ["the cat sat on the mat.", "a dog ate the hat!", "hello world, good bye", "one more line of text here"]
LENGTH = 10


def _backbone(seed: int = 0, blocks: int = 2):
    tokenizer = models.char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return causal_lm_backbone(models.llama(vocab_size=len(tokenizer), seed=seed), tokenizer, trainable_blocks=blocks)


@pytest.fixture
def passes(monkeypatch, tmp_path):
    """The cache in a fresh directory, and the number of blocks each real prefix pass computed."""
    monkeypatch.setenv(settings.DERIVED_CACHE_ENV, str(tmp_path / "cache"))
    made: list[int] = []
    real = text.prefix_states

    def counting(backbone, blocks):
        made.append(len(blocks))
        return real(backbone, blocks)

    monkeypatch.setattr(text, "prefix_states", counting)
    return made


def _states(backbone, texts=TEXTS):
    return sequences(backbone, texts, LENGTH).states


def _entries(tmp_path):
    return sorted((tmp_path / "cache" / "prefix-states").glob("*.safetensors"))


def test_a_second_dataset_of_the_same_text_reads_the_states_bit_for_bit_without_a_prefix_pass(passes, tmp_path):
    backbone = _backbone()
    first = _states(backbone)
    assert sum(passes) == len(first) and _entries(tmp_path)
    again = _states(backbone)
    assert sum(passes) == len(first)  # nothing computed
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def _states_by_hand(backbone, blocks):
    """Each block alone through the whole model's first layers (the hidden state entering the tail's first block)."""
    first = backbone.module.first
    with torch.no_grad():
        return [backbone.lm.model(input_ids=ids[None], output_hidden_states=True).hidden_states[first][0]
                for ids in blocks]


def test_the_states_are_the_whole_models_own_hidden_states(passes):
    backbone = _backbone()
    data = sequences(backbone, TEXTS, LENGTH)
    _states(backbone)  # stored
    for got, truth in zip(sequences(backbone, TEXTS, LENGTH).states, _states_by_hand(backbone, data.ids)):
        torch.testing.assert_close(got, truth, rtol=1e-5, atol=1e-5)


def _in_bf16(backbone):
    backbone.precision = "bf16"
    return backbone


@pytest.mark.parametrize("change", ["weights", "depth", "precision", "text"])
def test_another_prefix_or_other_text_is_a_miss(passes, tmp_path, change):
    _states(_backbone())
    computed = sum(passes)
    if change == "weights":
        _states(_backbone(seed=1))
    elif change == "depth":
        _states(_backbone(blocks=1))
    elif change == "precision":
        _states(_in_bf16(_backbone()))
    else:
        _states(_backbone(), texts=[t.upper() for t in TEXTS])
    assert sum(passes) == 2 * computed and len(_entries(tmp_path)) == 2


def test_bf16_states_are_the_prefix_run_under_bf16_autocast_kept_as_float32(passes):
    """In bf16 the prefix runs under autocast (its products rounded to bf16: close to fp32's, not equal) and what the
    tail reads is float32, as its parameters are."""
    fp32 = _states(_backbone())
    bf16 = _states(_in_bf16(_backbone()))
    data = sequences(_backbone(), TEXTS, LENGTH)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        truth = _states_by_hand(_backbone(), data.ids)
    for got, exact, autocast in zip(bf16, fp32, truth):
        assert got.dtype == torch.float32 and not torch.equal(got, exact)
        torch.testing.assert_close(got, autocast.float(), rtol=0, atol=0)
        torch.testing.assert_close(got, exact, rtol=0.05, atol=0.05)


def test_another_tail_reads_the_same_states(passes):
    first = _states(_backbone())
    edited = _backbone()
    with torch.no_grad():
        for p in edited.module.parameters():  # the tail is what a vector changes; the prefix stays theta_0
            p.add_(1.0)
    again = _states(edited)
    assert sum(passes) == len(first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("damage", ["torn", "foreign key", "a block too few", "not finite"])
def test_a_damaged_entry_is_computed_again_and_rewritten(passes, tmp_path, damage):
    backbone = _backbone()
    first = _states(backbone)
    computed = sum(passes)
    path = _entries(tmp_path)[0]
    original = path.read_bytes()
    if damage == "torn":
        path.write_bytes(original[: len(original) // 2])
    else:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as stored:
            key, tensors = stored.metadata()["key"], {k: stored.get_tensor(k) for k in stored.keys()}
        if damage == "foreign key":
            key = key.replace('"format": 1', '"format": 0')
        elif damage == "a block too few":
            tensors.pop(str(len(tensors) - 1))
        else:
            tensors["0"][0, 0] = float("nan")
        save_file(tensors, str(path), metadata={"key": key})
    again = _states(backbone)
    assert sum(passes) == computed + len(first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert path.read_bytes() == original
