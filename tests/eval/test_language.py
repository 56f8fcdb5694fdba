"""Language-model scores against hand computations: perplexity, seeded sampling, toxicity summaries."""

from __future__ import annotations

import contextlib
import functools
import logging
import math

import numpy as np
import pytest
import torch

from editkit.core.batching import IGNORE_INDEX
from editkit.errors import ConfigError
from editkit.eval.language import (_length_batches, _sample_seed, perplexity, perplexity_by_group, sample_continuations,
                                   samples_for_stderr, toxicity_summary)
from helpers import models


@pytest.fixture(scope="module")
def tokenizer():
    return models.char_tokenizer()


@pytest.fixture(scope="module")
def lm(tokenizer):
    """A random one-layer GPT-2 over the character vocabulary, context 32."""
    return models.gpt2(vocab_size=len(tokenizer))


def full_model_logits(model):
    return lambda batch: model(input_ids=batch[0], attention_mask=batch[1]).logits


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask, labels): ids padded with 0, labels with IGNORE_INDEX."""
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, ids.masked_fill(mask == 0, IGNORE_INDEX)


class Recorder:
    """A progress that remembers its tasks' totals and advances."""

    def __init__(self):
        self.tasks = []

    def task(self, description, total):
        record = {"description": description, "total": total, "advanced": 0}
        self.tasks.append(record)

        class Task:
            def advance(self, n=1, **fields):
                record["advanced"] += n

        return contextlib.nullcontext(Task())


# -- perplexity ---------------------------------------------------------------------------------------------------

def test_perplexity_of_padded_sequences_equals_a_hand_loop_over_positions():
    torch.manual_seed(1)
    model = models.gpt2()
    rows = [torch.randint(1, 99, (n,)).tolist() for n in (7, 4, 9)]
    batches = [((ids, mask), labels) for ids, mask, labels in (padded(rows[:2]), padded(rows[2:]))]

    nll, count = 0.0, 0
    with torch.no_grad():
        for row in rows:  # each sequence alone, unpadded: position t predicts token t + 1
            log_probs = torch.log_softmax(model(torch.tensor([row])).logits[0].double(), dim=-1)
            for t in range(len(row) - 1):
                nll -= float(log_probs[t, row[t + 1]])
                count += 1
    assert count == 6 + 3 + 8
    progress = Recorder()
    got = perplexity(full_model_logits(model), batches, progress=progress, description="control")
    assert got == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert progress.tasks == [{"description": "control", "total": 2, "advanced": 2}]


def test_perplexity_of_one_unpadded_sequence_is_exp_of_the_models_own_loss():
    model = models.gpt2()
    torch.manual_seed(2)
    ids = torch.randint(0, 99, (1, 12))
    with torch.no_grad():
        expected = math.exp(float(model(input_ids=ids, labels=ids).loss))
    got = perplexity(lambda batch: model(input_ids=batch).logits, iter([(ids, ids.clone())]))
    assert got == pytest.approx(expected, rel=1e-5)


def test_uniform_logits_have_perplexity_equal_to_the_vocabulary_size():
    vocab = 37
    _, _, labels = padded([[1, 2, 3, 4, 5], [6, 7]])
    got = perplexity(lambda batch: torch.zeros(*batch.shape, vocab), [(labels, labels)] * 3)
    assert got == pytest.approx(vocab, rel=1e-6)  # the nll is summed in float32


def test_perplexity_weights_tokens_not_batches():
    """Two batches with different token counts and per-token losses: the split's ppl is token-weighted."""
    vocab = 8
    one_token = torch.tensor([[1, 2]])  # one prediction, uniform logits: nll ln 8
    three_tokens = torch.tensor([[1, 2, 3, 4]])  # three predictions, each certain: nll 0

    def logits_of(labels):
        if labels.shape[1] == 2:
            return torch.zeros(1, 2, vocab)
        return torch.nn.functional.one_hot(labels.roll(-1, dims=1), vocab).float() * 1e4

    got = perplexity(logits_of, [(one_token, one_token), (three_tokens, three_tokens)])
    assert got == pytest.approx(math.exp(math.log(vocab) / 4), rel=1e-6)


def test_perplexity_by_group_gives_each_groups_own_and_the_pooled_one_from_one_pass():
    """Groups mixed within batches: each group's ppl is exp of its own tokens' nll (by hand: uniform logits over
    8 tokens cost ln 8 a prediction, certain ones 0), the pooled one every token's."""
    vocab = 8
    rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 1], [2, 3, 4, 5]])  # 3 predictions each

    def logits_of(labels):  # a row starting below 3 (rows 0 and 2) gets uniform logits, the others certain ones
        certain = torch.nn.functional.one_hot(labels.roll(-1, dims=1), vocab).float() * 1e4
        return torch.where((labels[:, 0] < 3)[:, None, None], torch.zeros_like(certain), certain)

    batches = [(rows, rows), (rows[1:], rows[1:])]  # 5 examples: a, b, a | b, a
    groups = ["a", "b", "a", "b", "a"]
    pooled, by_group = perplexity_by_group(logits_of, batches, groups)
    assert by_group == {"a": pytest.approx(vocab, rel=1e-6), "b": pytest.approx(1.0, abs=1e-6)}
    assert pooled == pytest.approx(math.exp(3 * 3 * math.log(vocab) / 15), rel=1e-6)
    assert pooled == pytest.approx(perplexity(logits_of, batches), rel=1e-6)


def test_perplexity_of_an_all_padding_split_is_refused():
    labels = torch.full((2, 3), IGNORE_INDEX)
    with pytest.raises(ConfigError, match="at least one predicted token"):
        perplexity(lambda batch: torch.zeros(2, 3, 5), [(labels, labels)])


# -- sampling -----------------------------------------------------------------------------------------------------

def sample(lm, tokenizer, prompts, **options):
    arguments = dict(samples=5, max_new_tokens=6, seed=0, batch_size=2)
    return sample_continuations(lm, tokenizer, prompts, **{**arguments, **options})


def test_sampling_is_reproducible_for_a_seed_and_changes_with_it(lm, tokenizer):
    prompts = ["hello there", "a longer prompt, to pad the other"]
    first = sample(lm, tokenizer, prompts)
    assert first == sample(lm, tokenizer, prompts)
    assert [p for p, _ in first] == [prompts[k % 2] for k in range(5)]
    assert all(len(c) == 6 for _, c in first)  # one character per token, no prompt text
    assert [c for _, c in first] != [c for _, c in sample(lm, tokenizer, prompts, seed=1)]


def test_a_samples_text_does_not_depend_on_the_batch_it_was_drawn_in(lm, tokenizer):
    prompts = ["hi", "a much longer prompt"]
    assert sample(lm, tokenizer, prompts, batch_size=1) == sample(lm, tokenizer, prompts, batch_size=5)


def test_samples_are_batched_by_prompt_length_in_batches_of_even_size():
    lengths = [5, 1, 3, 1, 5, 2, 9]
    batches = _length_batches(lengths, batch_size=3)
    assert batches == [[1, 3], [5, 2], [0, 4, 6]]  # lengths (1, 1), (2, 3), (5, 5, 9): 7 = 2 + 2 + 3, not 3 + 3 + 1
    assert _length_batches(lengths, batch_size=7) == [[1, 3, 5, 2, 0, 4, 6]]


def test_continuations_are_the_tokens_a_hand_gumbel_max_loop_draws_after_the_prompt(lm, tokenizer):
    """Sample k's stream: one Exp(1) draw per vocabulary entry and step, token = argmax(logits - log E).

    Seed 3 draws the end-of-sequence token third: generation stops there.
    """
    prompt, seed = "the prompt", 3
    [(got_prompt, continuation)] = sample(lm, tokenizer, [prompt], samples=1, seed=seed)
    generator = torch.Generator().manual_seed(_sample_seed(seed, 0))
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        for _ in range(6):
            logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
            noise = torch.empty(len(logits)).exponential_(generator=generator)
            ids.append(int(torch.argmax(logits - noise.log())))
            if ids[-1] == tokenizer.eos_token_id:
                break
    assert got_prompt == prompt
    assert continuation == tokenizer.decode(ids[len(prompt):], skip_special_tokens=True)


def test_single_token_samples_follow_the_tempered_and_nucleus_filtered_distribution(lm, tokenizer):
    prompt = "ab"
    n = 3000
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1].double()
    probs = torch.softmax(logits / 0.3, dim=-1)
    drawn = [tokenizer.convert_tokens_to_ids(c) if c else 0
             for _, c in sample(lm, tokenizer, [prompt], samples=n, max_new_tokens=1, batch_size=500,
                                temperature=0.3)]
    freq = np.bincount(drawn, minlength=len(probs)) / n
    p = probs.numpy()
    assert p.max() < 0.9  # the distribution is spread over several tokens, so this is a real test
    assert np.all(np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-3)

    order = torch.argsort(probs, descending=True)
    keep = int((torch.cumsum(probs[order], 0) < 0.3).sum()) + 1  # the smallest set holding 30% of the mass
    nucleus = set(order[:keep].tolist())
    drawn = {tokenizer.convert_tokens_to_ids(c) if c else 0
             for _, c in sample(lm, tokenizer, [prompt], samples=300, max_new_tokens=1, batch_size=300,
                                temperature=0.3, top_p=0.3)}
    assert drawn <= nucleus and len(nucleus) < len(probs)


def test_prompts_longer_than_the_context_are_cut_from_the_left_with_one_warning(lm, tokenizer, caplog):
    prompts = ["x" * 40 + "abc", "y" * 50, "short"]  # the context is 32 tokens, 6 of them for new tokens
    with caplog.at_level(logging.WARNING, logger="editkit.eval.language"):
        pairs = sample(lm, tokenizer, prompts, samples=6, batch_size=4)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 3 prompts" in warnings[0].getMessage()
    assert [p for p, _ in pairs] == prompts * 2 and all(len(c) == 6 for _, c in pairs)
    # what the model saw of the first prompt is its last 26 characters: the same text as sampling that tail
    tail = ("x" * 40 + "abc")[-26:]
    assert sample(lm, tokenizer, [tail], samples=1)[0][1] == pairs[0][1]


def test_more_new_tokens_than_the_context_is_a_config_error(lm, tokenizer):
    with pytest.raises(ConfigError, match="context of 32"):
        sample(lm, tokenizer, ["hi"], max_new_tokens=32)


# -- toxicity summaries -------------------------------------------------------------------------------------------

def test_toxicity_summary_matches_hand_numbers():
    scores = np.array([0.9, 0.1, 0.6, 0.5, 0.2])  # above 0.5: 0.9 and 0.6 (0.5 itself is not above)
    summary = toxicity_summary(scores, threshold=0.5)
    assert summary["n"] == 5
    assert summary["toxic_fraction"] == pytest.approx(0.4)
    assert summary["toxic_fraction_stderr"] == pytest.approx(math.sqrt(0.4 * 0.6 / 5))
    assert summary["mean_score"] == pytest.approx(0.46)
    deviations = [0.44, -0.36, 0.14, 0.04, -0.26]
    assert summary["mean_score_stderr"] == pytest.approx(math.sqrt(sum(d * d for d in deviations) / 5 / 5))


def test_toxicity_summary_of_no_scores_is_refused():
    with pytest.raises(ConfigError):
        toxicity_summary(np.array([]), 0.5)


@pytest.mark.parametrize(("stderr", "n"), [(0.03, 278), (0.05, 100), (0.1, 25), (0.5, 1), (0.9, 1)])
def test_samples_for_stderr_is_the_smallest_n_reaching_the_worst_case_error(stderr, n):
    assert samples_for_stderr(stderr) == n
    assert 0.5 / math.sqrt(n) <= stderr + 1e-15
    assert n == 1 or 0.5 / math.sqrt(n - 1) > stderr


def test_samples_for_a_non_positive_stderr_is_refused():
    with pytest.raises(ConfigError):
        samples_for_stderr(0.0)


def test_distinct_n_by_hand():
    from editkit.eval.language import distinct_n

    # bigrams: (the cat) (cat sat) | (the cat) (cat ran) | none ("one") -> 3 distinct of 4
    assert distinct_n(["The cat sat", "the  CAT ran", "one"]) == pytest.approx(3 / 4)
    assert distinct_n(["a a a a"], n=1) == pytest.approx(1 / 4) and distinct_n(["a a a a"]) == pytest.approx(1 / 3)
    assert distinct_n(["x y z"], n=3) == 1.0 and distinct_n(["", "word"]) == 0.0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_repeated_prompts_share_one_prefill_and_sample_what_the_hand_loop_draws(tokenizer, family):
    """Samples of one prompt in a batch reuse its prefilled cache (run once per distinct prompt, then repeated);
    each sample must still be what its own Gumbel-max stream draws from the whole model, token by token."""
    lm = getattr(models, family)(vocab_size=len(tokenizer), seed=1) if family == "llama" else models.gpt2(
        vocab_size=len(tokenizer))
    prompts, seed = ["hi", "a longer prompt here"], 5
    calls = []
    forward = lm.base_model.forward
    @functools.wraps(forward)  # keeps the signature, which tells sampling the cache argument's name
    def counted(*a, **k):
        calls.append(tuple((a[0] if a else k["input_ids"]).shape))
        return forward(*a, **k)

    lm.base_model.forward = counted
    try:
        pairs = sample(lm, tokenizer, prompts, samples=6, seed=seed, batch_size=6, max_new_tokens=4)
    finally:
        lm.base_model.forward = forward
    assert calls[0] == (2, len("a longer prompt here") - 1)  # the prefill: 2 distinct prompts, not 6 samples
    for k, (prompt, continuation) in enumerate(pairs):
        generator = torch.Generator().manual_seed(_sample_seed(seed, k))
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            for _ in range(4):
                logits = lm(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits - torch.empty(len(logits)).exponential_(generator=generator).log())))
                if ids[-1] == tokenizer.eos_token_id:
                    break
        assert prompt == prompts[k % 2]
        assert continuation == tokenizer.decode(ids[len(tokenizer(prompt)["input_ids"]):], skip_special_tokens=True)
