"""theta_0's continuations on disk: read back only for the same model, prompts, seed and sampling settings.

Each test counts the calls that really sample (``sample_continuations``): a hit samples nothing and gives the
texts a fresh sampling gives; a change of any one input (the precision too) is a miss; a torn, edited or foreign entry is sampled
again and rewritten, never trusted; an edited model (a delta) is never cached.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from editkit import settings
from editkit.eval import lm_negation
from editkit.eval.lm_negation import LanguageNegation, sampled
from editkit.models.causal_lm import causal_lm_backbone
from helpers import models
from helpers.text import record_sampled_dtypes

PROMPTS = ["the cat", "a dog ate", "hello"]
SETTINGS = LanguageNegation(samples=5, max_new_tokens=3, neutral_samples=0, seed=0)


class _Scorer:
    threshold = 0.5

    def score(self, texts):
        return [0.9 if "a" in t else 0.1 for t in texts]


def _backbone(seed: int = 0):
    tokenizer = models.char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return causal_lm_backbone(models.llama(vocab_size=len(tokenizer), seed=seed), tokenizer, trainable_blocks=1)


@pytest.fixture(scope="module")
def backbone():
    return _backbone()


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """The cache in a fresh directory, and the list of real samplings made (their prompt lists)."""
    monkeypatch.setenv(settings.DERIVED_CACHE_ENV, str(tmp_path / "cache"))
    made: list[list[str]] = []
    real = lm_negation.sample_continuations

    def counting(model, tokenizer, prompts, **kwargs):
        made.append(list(prompts))
        return real(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(lm_negation, "sample_continuations", counting)
    return made


def _texts(backbone, prompts=PROMPTS, options=SETTINGS, delta=None):
    result = sampled(backbone, delta, prompts, [], _Scorer(), options)
    return [(e["prompt"], e["continuation"]) for e in result["examples"]], result["toxic_fraction"]


def _entries(tmp_path):
    return sorted((tmp_path / "cache" / "samples").glob("*.json"))


def test_a_second_sampling_of_theta0_reads_the_same_texts_without_sampling(backbone, calls, tmp_path):
    first = _texts(backbone)
    assert len(calls) == 1 and len(_entries(tmp_path)) == 1
    assert _texts(backbone) == first
    assert len(calls) == 1


@pytest.mark.parametrize("change", ["model", "precision", "prompts", "seed", "samples", "max_new_tokens",
                                    "temperature", "top_p"])
def test_each_input_of_the_sampling_changed_alone_is_a_miss(backbone, calls, tmp_path, change):
    _texts(backbone)
    if change == "model":
        _texts(_backbone(seed=1))
    elif change == "precision":
        in_bf16 = _backbone()
        in_bf16.precision = "bf16"
        _texts(in_bf16)
    elif change == "prompts":
        _texts(backbone, prompts=PROMPTS[:2])
    else:
        value = {"seed": 1, "samples": 6, "max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9}[change]
        _texts(backbone, options=dataclasses.replace(SETTINGS, **{change: value}))
    assert len(calls) == 2 and len(_entries(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["torn", "edited text", "foreign key", "not json"])
def test_a_damaged_entry_is_sampled_again_and_rewritten(backbone, calls, tmp_path, damage):
    fresh = _texts(backbone)
    (path,) = _entries(tmp_path)
    original = path.read_text()
    entry = json.loads(original)
    if damage == "torn":
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    elif damage == "edited text":
        entry["pairs"][0][1] = "you fool"
        path.write_text(json.dumps(entry))
    elif damage == "foreign key":
        entry["key"]["seed"] = 7
        path.write_text(json.dumps(entry))
    else:
        path.write_bytes(b"\xff\xfe garbage")
    assert _texts(backbone) == fresh
    assert len(calls) == 2
    assert path.read_text() == original  # rewritten whole
    assert _texts(backbone) == fresh and len(calls) == 2


def test_an_edited_model_is_never_cached(backbone, calls, tmp_path):
    delta = {name: 0.1 * p.detach().sign() for name, p in backbone.module.named_parameters()}
    _texts(backbone, delta=delta)
    _texts(backbone, delta=delta)
    assert len(calls) == 2 and not _entries(tmp_path)


def test_bf16_samples_from_a_bf16_copy_and_leaves_theta0_in_fp32(calls, monkeypatch):
    backbone = _backbone()
    backbone.precision = "bf16"
    before = {name: value.clone() for name, value in backbone.lm.state_dict().items()}
    dtypes = record_sampled_dtypes(monkeypatch, lm_negation)
    _texts(backbone)
    assert dtypes == [{torch.bfloat16}]
    after = backbone.lm.state_dict()
    assert all(after[name].dtype == value.dtype and torch.equal(after[name], value) for name, value in before.items())
