"""Scores of a language model: perplexity of held-out text, sampled continuations, toxicity summaries.

Negating a language task is judged by two perplexities (the control: clean text, which
should barely move; the target: the negated task's text, which should rise) and by how
toxic the model's sampled continuations of held-out prompts are.

- :func:`perplexity` weights every token of a split equally (``exp`` of the total
  negative log-likelihood over the total number of predicted tokens), so long and short
  sequences count by their length, as in the usual corpus perplexity. It only needs a
  function from a batch to next-token logits, so the same code scores the full model,
  a tail on cached prefix states, or a linearized tail.
- :func:`sample_continuations` draws each continuation from its own seeded random
  stream, so a sample does not depend on which batch it was generated in.
- :class:`PerplexityScorer` is the stream's scorer of language-modelling tasks.
- :func:`toxicity_summary` reports fractions and means with their standard errors, and
  :func:`samples_for_stderr` says how many samples a wanted standard error takes.
- :func:`distinct_n` says how varied sampled text is: a negation that breaks the language
  makes continuations repetitive long before it makes them toxic-free.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Any, Callable, Hashable, Iterable, Sequence

import numpy as np
import torch

from editkit.core.objectives import next_token_nll
from editkit.eval.accuracy import SplitScorer
from editkit.errors import ConfigError
from editkit.util.progress import NullProgress, Progress

log = logging.getLogger(__name__)


def perplexity(logits_of: Callable[[Any], torch.Tensor], batches: Iterable[tuple[Any, torch.Tensor]], *,
               progress: Progress = NullProgress(), description: str = "perplexity") -> float:
    """Token-weighted perplexity of a whole split: ``exp(sum of nll / number of predicted tokens)``.

    ``logits_of(batch)`` gives next-token logits ``(N, T, V)``; ``labels`` are the token ids
    ``(N, T)`` with ``IGNORE_INDEX`` at padding (the causal shift is applied here). Averaging
    per batch instead would weight a token by the size of the batch it fell in.
    """
    return _exp_mean(_nll_totals(logits_of, batches, None, progress, description).values())


def perplexity_by_group(logits_of: Callable[[Any], torch.Tensor], batches: Iterable[tuple[Any, torch.Tensor]],
                        groups: Sequence[Hashable], *, progress: Progress = NullProgress(),
                        description: str = "perplexity") -> tuple[float, dict[Hashable, float]]:
    """The split's :func:`perplexity` and each group's, from one pass: ``groups[i]`` is the group of the loader's
    i-th example (a pooled split's corpora are scored with the pooled text, not once more each)."""
    totals = _nll_totals(logits_of, batches, groups, progress, description)
    return _exp_mean(totals.values()), {group: _exp_mean([total]) for group, total in totals.items()}


def _exp_mean(totals: Iterable[tuple[float, int]]) -> float:
    """``exp(total nll / total tokens)`` of (nll, tokens) pairs."""
    totals = list(totals)
    nll, tokens = sum(t[0] for t in totals), sum(t[1] for t in totals)
    if tokens == 0:
        raise ConfigError("perplexity needs at least one predicted token; the split is empty or all padding")
    return math.exp(nll / tokens)


@torch.no_grad()
def _nll_totals(logits_of: Callable[[Any], torch.Tensor], batches: Iterable[tuple[Any, torch.Tensor]],
                groups: Sequence[Hashable] | None, progress: Progress, description: str
                ) -> dict[Hashable, tuple[float, int]]:
    """Summed next-token nll and predicted tokens per group (one group, None, without ``groups``)."""
    totals: dict[Hashable, tuple[float, int]] = {}
    seen = 0
    with progress.task(description, total=len(batches) if hasattr(batches, "__len__") else 0) as task:
        for batch, labels in batches:
            logits = logits_of(batch)
            labels = labels.to(logits.device)
            members = [None] * len(labels) if groups is None else groups[seen : seen + len(labels)]
            seen += len(labels)
            for group in dict.fromkeys(members):
                rows = [i for i, member in enumerate(members) if member == group]
                whole = len(rows) == len(members)
                nll, count = next_token_nll(logits if whole else logits[rows], labels if whole else labels[rows])
                before = totals.get(group, (0.0, 0))
                totals[group] = (before[0] + float(nll), before[1] + count)
            task.advance()
    return totals


class _SeededSampling:
    """A logits processor that turns greedy decoding into sampling, one random stream per sample.

    Temperature and nucleus (top-p) filtering warp the scores; adding Gumbel noise and taking
    the argmax (what greedy decoding does next) then draws from the warped distribution
    (the Gumbel-max trick). The noise of row ``i`` comes from its own generator, consumed
    one draw per step, so a sample's tokens depend on its seed, never on its batch mates.
    """

    def __init__(self, seeds: list[int], temperature: float, top_p: float) -> None:
        from transformers import TemperatureLogitsWarper, TopPLogitsWarper

        self.seeds = seeds
        self.generators: list[torch.Generator] | None = None
        self.warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        self.warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        if self.generators is None:
            self.generators = [torch.Generator(scores.device).manual_seed(s) for s in self.seeds]
        exponential = torch.stack([torch.empty(scores.shape[1], device=scores.device, dtype=scores.dtype)
                                   .exponential_(generator=g) for g in self.generators])
        return scores - exponential.log()  # -log(Exp(1)) is Gumbel(0, 1)


def _sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a call seeded ``seed`` (independent streams per sample)."""
    return int(np.random.SeedSequence((seed, index)).generate_state(1, np.uint64)[0])


def _prompt_ids(tokenizer: Any, prompts: list[str], budget: int | None) -> list[list[int]]:
    """Token ids of each prompt, keeping only its last ``budget`` tokens (all if None); one warning if any was cut.

    An empty prompt starts from the tokenizer's BOS (else EOS) token: generation needs one.
    The tokenizer's own over-length notice is silenced: this function warns once for all prompts.
    """
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    ids = [tokenizer(p, verbose=False)["input_ids"] or [start] for p in prompts]
    if budget is None:
        return ids
    cut = sum(len(i) > budget for i in ids)
    if cut:
        log.warning("%d of %d prompts are longer than the %d tokens the model's context leaves before the new "
                    "tokens; kept the last %d tokens of each", cut, len(prompts), budget, budget)
    return [i[-budget:] for i in ids]


def _left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) with the padding on the left, so every row ends where generation starts."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def sample_continuations(model: Any, tokenizer: Any, prompts: list[str], *, samples: int, max_new_tokens: int,
                         seed: int, batch_size: int, temperature: float = 1.0, top_p: float = 1.0,
                         progress: Progress = NullProgress()) -> list[tuple[str, str]]:
    """``samples`` (prompt, continuation) pairs: prompts cycled in order, continuations sampled from ``model``.

    Sample ``k`` continues ``prompts[k % len(prompts)]`` with its own random stream derived from
    ``(seed, k)``, so the same call gives the same texts whatever ``batch_size`` (up to the float
    rounding that different left padding brings). Samples are generated in batches of similar
    prompt length and returned in order. Prompts too long for the model's context
    (less ``max_new_tokens``) keep their last tokens, with one logged warning per call.
    The continuation is the generated text only, without the prompt or special tokens.
    """
    if not prompts or samples < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ConfigError("sampling needs at least one prompt, one sample, one new token and a batch size >= 1")
    context = getattr(model.config, "max_position_embeddings", None)
    budget = context - max_new_tokens if context else None
    if budget is not None and budget < 1:
        raise ConfigError(f"{max_new_tokens} new tokens do not fit the model's context of {context} tokens")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompt_ids = _prompt_ids(tokenizer, prompts, budget)
    device = next(model.parameters()).device
    continuations: list[str] = [""] * samples
    with progress.task("sampling continuations", total=math.ceil(samples / batch_size)) as task:
        for indices in _length_batches([len(prompt_ids[k % len(prompts)]) for k in range(samples)], batch_size):
            unique = sorted({k % len(prompts) for k in indices})
            ids, mask = _left_padded([prompt_ids[p] for p in unique], pad_id)
            rows = torch.tensor([unique.index(k % len(prompts)) for k in indices])
            cache = _prefilled(model, ids.to(device), mask.to(device), rows.to(device))
            sampling = _SeededSampling([_sample_seed(seed, k) for k in indices], temperature, top_p)
            out = model.generate(input_ids=ids[rows].to(device), attention_mask=mask[rows].to(device),
                                 **{_cache_argument(model): cache}, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad_id, logits_processor=[sampling])
            for k, text in zip(indices, tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)):
                continuations[k] = text
            task.advance()
    return [(prompts[k % len(prompts)], text) for k, text in enumerate(continuations)]


def _cache_argument(model: Any) -> str:
    """The name transformers gives the key-value cache argument: ``cache`` from 5.x on, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"


def _prefilled(model: Any, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> Any:
    """The key-value cache of every prompt but its last token, computed once per distinct prompt and then
    repeated for the samples (``rows``) that continue it; None when no prompt has two tokens.

    A thousand samples of a hundred-odd prompts continue each prompt several times: ``generate`` would run
    the prompt through the model for every sample. Positions follow the attention mask, as ``generate``
    numbers left-padded rows, so the cache is the one ``generate`` would have built; it then runs the last
    prompt token and the new ones.
    """
    from transformers import DynamicCache

    if ids.shape[1] < 2:
        return None
    cache = DynamicCache(config=model.config)
    prefix_mask = mask[:, :-1]
    positions = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 1)
    with torch.no_grad():
        model.base_model(input_ids=ids[:, :-1], attention_mask=prefix_mask, position_ids=positions,
                         use_cache=True, **{_cache_argument(model): cache})
    cache.batch_select_indices(rows)
    return cache


def _length_batches(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into the fewest batches of at most ``batch_size``, by prompt length, sizes even.

    Prompts of similar length share a batch, so little of the prefill is spent on left
    padding (on the toxic prompts, half the padded positions), and no batch is a small
    remainder that costs a whole generation loop for a few rows.
    """
    order = sorted(range(len(lengths)), key=lambda k: (lengths[k], k))
    count = math.ceil(len(order) / batch_size)
    return [order[i * len(order) // count:(i + 1) * len(order) // count] for i in range(count)]


def _mean_and_stderr(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error ``sqrt(variance / n)`` (population variance: ``sqrt(p(1-p)/n)`` for 0/1 values)."""
    return float(values.mean()), float(np.sqrt(values.var() / len(values)))


def toxicity_summary(scores: np.ndarray, threshold: float) -> dict[str, float | int]:
    """Toxic fraction (scores strictly above ``threshold``) and mean score of samples, each with its standard error.

    One formula serves both: the toxic fraction is the mean of the 0/1 indicators, whose
    standard error is ``sqrt(p(1-p)/n)``.
    """
    scores = np.asarray(scores, dtype=float).reshape(-1)
    if scores.size == 0:
        raise ConfigError("a toxicity summary needs at least one scored sample")
    fraction, fraction_se = _mean_and_stderr((scores > threshold).astype(float))
    mean, mean_se = _mean_and_stderr(scores)
    return {"toxic_fraction": fraction, "toxic_fraction_stderr": fraction_se, "mean_score": mean,
            "mean_score_stderr": mean_se, "n": int(scores.size)}


#: Examples a report keeps per scored model (:func:`scored_examples`).
EXAMPLES = 5


def scored_examples(pairs: list[tuple[str, str]], scores: Any, k: int = EXAMPLES) -> list[dict[str, Any]]:
    """The first ``k`` samples as ``{"index", "prompt", "continuation", "score"}`` rows, for a report to show.

    ``pairs`` are :func:`sample_continuations`' (prompt, continuation) pairs and ``scores`` the scorer's
    score of each continuation, in the same order. The first ``k``, not the most toxic: sample ``i`` of
    every model continues the same prompt (``prompts[i % len(prompts)]``) with the same random stream
    (``(seed, i)``), so the examples of theta_0 and of each edited model, called with the same seed and
    prompts, line up row by row, and the first ``k`` are ``k`` different prompts when there are that many.
    """
    scores = np.asarray(scores, dtype=float).reshape(-1)
    if len(scores) != len(pairs):
        raise ConfigError(f"{len(scores)} scores for {len(pairs)} samples")
    return [{"index": i, "prompt": prompt, "continuation": continuation, "score": float(scores[i])}
            for i, (prompt, continuation) in enumerate(pairs[:max(0, k)])]


def distinct_n(texts: Iterable[str], n: int = 2) -> float:
    """Distinct-n: the number of different word n-grams over the number of word n-grams in all ``texts``.

    The usual measure of how varied sampled text is (Li et al., 2016): a model that repeats itself, or
    collapses to a few phrases, scores low. Words are whitespace-separated and lower-cased; a text with
    fewer than ``n`` words contributes nothing. 0.0 when no text has an n-gram.
    """
    grams = [tuple(words[i:i + n]) for text in texts for words in [text.lower().split()]
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def samples_for_stderr(max_stderr: float) -> int:
    """The fewest samples whose worst-case (p = 0.5) standard error of a fraction is <= ``max_stderr``.

    ``0.5 / sqrt(n) <= max_stderr`` gives ``n = ceil(0.25 / max_stderr**2)`` (0.03 -> 278);
    rounding before the ceiling keeps an exact square such as 0.05 -> 100 from becoming 101.
    """
    if not max_stderr > 0:
        raise ConfigError(f"a standard error to reach must be positive, got {max_stderr}")
    return max(1, math.ceil(round((0.5 / max_stderr) ** 2, 9)))


class PerplexityScorer(SplitScorer):
    """Perplexity of a language-modelling split under the task's fixed LM head (lower is better).

    A :class:`~editkit.eval.accuracy.SplitScorer`, so streams score text tasks as they score
    classification tasks: the sums are the split's negative log-likelihood and its number of
    predicted tokens (token-weighted, as :func:`perplexity`).
    """

    def tally(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nll, count = next_token_nll(logits, labels)
        return torch.stack([nll.double(), torch.tensor(float(count), dtype=torch.float64, device=nll.device)])

    def finish(self, nll: float, count: float) -> float:
        if count == 0:
            raise ConfigError(f"task {self.name!r}: perplexity needs at least one predicted token")
        return math.exp(nll / count)
