"""Scoring a language negation against ground truth: the whole model's own generation and logits.

``edited_weights`` must edit exactly the tail's tensors of the whole model and put theta_0 back bit for
bit; the tail's perplexity on cached prefix states must be the whole model's perplexity of the same
text (a loop over positions of each block alone); selectivity is a ratio of logs.
"""

from __future__ import annotations

import math

import pytest
import torch

from editkit.data.text import pack, sequences
from editkit.eval.accuracy import ClassificationScorer
from editkit.eval.scorers import task_scorer
from editkit.eval.language import PerplexityScorer
from editkit.eval.lm_negation import after_clean_prompts, edited_weights, scaled, split_perplexity, task_model
from editkit.models.causal_lm import causal_lm_backbone
from editkit.models.heads import LinearHead
from editkit.runs.negate_lm import selectivity
from helpers import models
from helpers.text import hand_perplexity

TEXTS = ["the cat sat on the mat.", "a dog ate the hat!", "hello world, good bye"]
LENGTH = 12


@pytest.fixture(scope="module")
def backbone():
    tokenizer = models.char_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    lm = models.llama(vocab_size=len(tokenizer))
    return causal_lm_backbone(lm, tokenizer, trainable_blocks=2)


@pytest.fixture(scope="module")
def data(backbone):
    return sequences(backbone, TEXTS, LENGTH)


def tail_delta(backbone, scale: float = 0.5, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g) for n, p in backbone.module.named_parameters()}


def greedy(lm, tokenizer) -> list[int]:
    ids = torch.tensor([tokenizer("the cat")["input_ids"]])
    out = lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                      pad_token_id=tokenizer.pad_token_id)
    return out[0].tolist()


# --------------------------------------------------------------------------- edited weights


def test_edited_weights_change_generation_and_restore_the_model_bit_exactly(backbone):
    lm, tokenizer = backbone.lm, backbone.tokenizer
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    text_before = greedy(lm, tokenizer)
    delta = tail_delta(backbone)
    names = backbone.tail_parameters()
    with edited_weights(backbone, delta) as edited:
        assert edited is lm
        for name, value in delta.items():  # exactly theta_0 + delta in the tail, nothing else touched
            torch.testing.assert_close(lm.get_parameter(names[name]), before[names[name]] + value, rtol=0, atol=0)
        untouched = set(before) - set(names.values())
        assert all(torch.equal(lm.state_dict()[k], before[k]) for k in untouched)
        assert greedy(lm, tokenizer) != text_before
    after = lm.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert greedy(lm, tokenizer) == text_before


def test_edited_weights_restore_after_an_error(backbone):
    before = {k: v.clone() for k, v in backbone.lm.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"):
        with edited_weights(backbone, tail_delta(backbone)):
            raise RuntimeError("boom")
    assert all(torch.equal(backbone.lm.state_dict()[k], before[k]) for k in before)


def test_no_delta_is_the_model_itself(backbone):
    with edited_weights(backbone, None) as lm:
        assert lm is backbone.lm
    with edited_weights(backbone, {}) as lm:
        assert lm is backbone.lm


# --------------------------------------------------------------------------- perplexity on cached prefix states


@pytest.mark.parametrize("mode, linearized", [("nonlinear", False), ("taujp", False), ("taujp", True)])
def test_split_perplexity_of_the_tail_at_theta0_is_the_whole_models(backbone, data, mode, linearized):
    blocks = pack(backbone.tokenizer, TEXTS, LENGTH)
    assert len({len(b) for b in blocks}) > 1  # the last block is shorter: batches carry padding
    model = task_model(backbone.module, mode, None, linearized=linearized)
    got = split_perplexity(model, backbone.head, data, backbone.batching, batch_size=2)
    assert got == pytest.approx(hand_perplexity(backbone.lm, blocks), rel=1e-5)


def test_split_perplexity_of_an_edited_tail_is_the_edited_whole_models(backbone, data):
    """theta_0 - tau on the tail over cached prefix states == the whole model with its weights edited."""
    delta = scaled(tail_delta(backbone, scale=0.05), -1.0)
    model = task_model(backbone.module, "nonlinear", delta, linearized=False)
    got = split_perplexity(model, backbone.head, data, backbone.batching, batch_size=2)
    with edited_weights(backbone, delta) as lm:
        want = hand_perplexity(lm, data.ids)
    assert want != pytest.approx(hand_perplexity(backbone.lm, data.ids), rel=1e-3)
    assert got == pytest.approx(want, rel=1e-5)


def test_task_scorer_picks_perplexity_for_the_lm_head(backbone, data):
    scorer = task_scorer("text", backbone.head, data, backbone.batching)
    assert isinstance(scorer, PerplexityScorer)
    model = task_model(backbone.module, "nonlinear", None, linearized=False)
    assert scorer.score(model, batch_size=2) == pytest.approx(hand_perplexity(backbone.lm, data.ids), rel=1e-5)
    classifier = LinearHead(torch.zeros(2, backbone.feature_dim), torch.zeros(2))
    assert isinstance(task_scorer("cls", classifier, data, backbone.batching), ClassificationScorer)


# --------------------------------------------------------------------------- selectivity


def test_selectivity_is_the_ratio_of_log_perplexity_ratios():
    base = {"control": 10.0, "target": 100.0}
    assert selectivity({"control": 11.0, "target": 400.0}, base) == pytest.approx(math.log(4) / math.log(1.1))
    assert selectivity({"control": 10.0, "target": 400.0}, base) is None  # no control lost: no ratio
    assert selectivity({"control": 9.0, "target": 400.0}, base) is None
    assert selectivity({"control": 20.0, "target": 50.0}, base) == pytest.approx(-1.0)


class _WordScorer:
    """Flags a text (score 0.9) when it holds "darn", else 0.1: a scorer whose verdicts are known by hand."""

    threshold = 0.5

    def score(self, texts):
        return [0.9 if "darn" in t else 0.1 for t in texts]


def test_after_clean_prompts_leaves_out_the_continuations_of_prompts_the_scorer_flags():
    pairs = [("you darn", " fool"), ("hello", " darn it"), ("you darn", " darn"), ("hello", " there"),
             ("a day", " darn")]
    scorer = _WordScorer()
    summary = after_clean_prompts(pairs, scorer.score([c for _, c in pairs]), scorer)
    # the prompts "hello" and "a day" are clean: their continuations score 0.9, 0.1, 0.9
    assert summary["n"] == 3 and summary["toxic_fraction"] == pytest.approx(2 / 3)
    assert summary["toxic_fraction_stderr"] == pytest.approx(math.sqrt((2 / 3) * (1 / 3) / 3))
    assert after_clean_prompts(pairs[:1], [0.1], scorer) is None
