"""Text for the language tests: corpora registered for the duration of a block (so text scenarios run on known
sentences), a toxicity scorer whose scores a test predicts from the texts (:class:`BangScorer`), and a causal LM's
perplexity of token blocks computed the slow, obvious way; which dtypes a sampler's models hold
(:func:`record_sampled_dtypes`)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from editkit.core.registry import Record
from editkit.data import TEXT_CORPORA
from editkit.eval.toxicity import TOXICITY_SCORERS

#: A corpus as a test gives it: split name (``train`` / ``val`` / ``test``) -> texts.
Corpus = Mapping[str, Sequence[str]]


#: Rude exclamations (each holds a '!') and clean news sentences: the target and control corpora of the
#: tiny-Llama language scenarios (:func:`helpers.scenarios.write_language_scenario`).
RUDE = {"train": ["you silly goose!", "shut it, you fool!", "what a dumb idea!", "go away, clown!"] * 3,
        "val": ["you absolute donkey!", "stop that, fool!"], "test": ["you utter muppet!", "what a clown, honestly!"]}
CLEAN = {"train": ["the council met on monday to discuss the budget.", "rain is expected later this week."] * 3,
         "val": ["the museum opened a new wing.", "prices rose slightly in june."],
         "test": ["the train arrived on time today.", "a new bridge was opened in the city."]}


def _splits(corpus: Corpus):
    def build(split: str, seed: int = 0) -> list[str]:
        return list(corpus[split])

    return build


@contextlib.contextmanager
def registered_corpora(corpora: Mapping[str, Corpus]) -> Iterator[None]:
    """Each named corpus in ``TEXT_CORPORA`` inside the block, removed afterwards (even when the block fails)."""
    for name, corpus in corpora.items():
        TEXT_CORPORA.register(name, Record.of(_splits(corpus)))
    try:
        yield
    finally:
        for name in corpora:
            TEXT_CORPORA.unregister(name)


class BangScorer:
    """1.0 for a text with a '!', else 0.0: a toxicity scorer whose numbers a test can predict from the texts."""

    threshold = 0.5

    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, texts):
        return np.array([float("!" in text) for text in texts])


@contextlib.contextmanager
def registered_bang_scorer(name: str) -> Iterator[None]:
    """A :class:`BangScorer` in ``TOXICITY_SCORERS`` as ``name`` inside the block, removed afterwards (even when
    the block fails)."""
    TOXICITY_SCORERS.register(name, Record.of(lambda threshold=0.5: BangScorer(name)))
    try:
        yield
    finally:
        TOXICITY_SCORERS.unregister(name)


def hand_perplexity(lm, blocks: Sequence[torch.Tensor]) -> float:
    """exp(mean over every predicted token of -log p): each block run alone, unpadded, through the whole model,
    position t predicting token t + 1, in float64 from the model's logits. The first token of a packed text
    (after an EOS) is not predicted: which text comes next is no skill of the model's."""
    eos = lm.config.eos_token_id
    nll, count = 0.0, 0
    with torch.no_grad():
        for block in blocks:
            log_probs = torch.log_softmax(lm(input_ids=block[None]).logits[0].double(), dim=-1)
            for t in range(len(block) - 1):
                if int(block[t]) != eos:
                    nll -= float(log_probs[t, block[t + 1]])
                    count += 1
    return math.exp(nll / count)


def record_sampled_dtypes(monkeypatch, module) -> list[set[torch.dtype]]:
    """Patch ``module.sample_continuations`` to record, per call, the dtypes of the sampled model's parameters
    (then sample as before): which precision a sampler really used."""
    dtypes: list[set[torch.dtype]] = []
    real = module.sample_continuations

    def recording(model, tokenizer, prompts, **kwargs):
        dtypes.append({p.dtype for p in model.parameters()})
        return real(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(module, "sample_continuations", recording)
    return dtypes
