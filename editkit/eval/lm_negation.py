"""Negating a language task: what theta_0 - alpha tau does to perplexities and to sampled text.

The paper's negation experiment on language models: fine-tune on toxic text, subtract
the task vector, and check that toxicity falls while language ability is kept. Three
numbers per edited model:

- **control perplexity**: on held-out clean text (language ability; must stay close
  to theta_0's);
- **target perplexity**: on held-out toxic text (how much of the task was removed;
  higher is better);
- **toxicity**: the fraction of sampled continuations of held-out prompts that a
  toxicity scorer flags, with its standard error, and the mean score.

The negated model is theta_0 - alpha tau applied to the weights, for every mode: it is
an ordinary model that can generate. For vectors of linearized models the exact
f_lin perplexities are reported beside it. alpha is chosen on validation splits by
the control-perplexity rule (``editkit.merge.coefficients``), so the number of
samples only matters for the final rows, not for the choice.

Perplexities run on the cached prefix states through the tail only, so a grid of
alphas costs a few tail passes; sampling runs the whole model.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from editkit.core.batching import labelled_collate
from editkit.core.linearize import LinearizedModel, NonLinearModel
from editkit.core.modes import Mode
from editkit.merge.coefficients import DEFAULT_PERPLEXITY_RULE, PERPLEXITY_RULES
from editkit.eval.language import (EXAMPLES, distinct_n, perplexity, perplexity_by_group,
                                   sample_continuations, scored_examples, toxicity_summary)
from editkit.eval.sample_cache import cached_samples, sample_key
from editkit.util.fields import choice
from editkit.util.progress import NullProgress, Progress

#: Sampled continuations per scored model: the toxic fraction's standard error is at most 0.5 / sqrt(1000) =
#: 0.016, about 0.009 near a fraction of 0.1, so halving such a fraction shows as ~4 standard errors of the
#: difference (with the 278 samples of a 0.03 error, no change below 0.08 could show at all).
SAMPLES = 1000
#: Continuations sampled together: each generation step costs about the same for 1 or 128 rows on a CPU,
#: so large batches make sampling several times cheaper.
SAMPLE_BATCH = 128
#: Words of a clean text that make a neutral prompt: enough to set the topic, too few to give the text away.
NEUTRAL_PROMPT_WORDS = 6


@dataclass(frozen=True)
class LanguageNegation:
    """How a language task's negation is scored: the ``[negation]`` table of a text scenario.

    Each field's ``metadata["help"]`` is its one description (the CLI's options are made from it).
    """

    control_text: tuple[str, ...] = field(default=("clean-reviews", "clean-speeches"), metadata={
        "help": "Text corpora whose validation / test splits give the control perplexity (language ability), "
                "comma-separated: the rule reads their pooled text, the test rows each one as well. Keep them "
                "apart from the tauJp source, or the rule protects exactly the text the penalty kept."})
    prompts: str = field(default="toxic-prompts", metadata={
        "help": "Text corpus whose validation / test splits are the prompts continued for the toxicity score."})
    scorer: str = field(default="toxblock", metadata={"help": "Toxicity scorer of the sampled continuations."})
    alphas: tuple[float, ...] = field(default=(0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0), metadata={
        "help": "Negation coefficients tried (theta_0 - alpha tau), comma-separated."})
    rule: str = choice(DEFAULT_PERPLEXITY_RULE, tuple(PERPLEXITY_RULES),
                       "How alpha is chosen on validation: the largest target perplexity whose control perplexity "
                       "stays within the rule's bound of theta_0's (relative: (1 + margin) x; absolute: + margin).")
    margin: float | None = field(default=None, metadata={
        "help": "The rule's margin (default: 0.05 relative, 0.5 absolute)."})
    samples: int = field(default=SAMPLES, metadata={
        "help": f"Sampled continuations per scored model (the default keeps the toxic fraction's standard error "
                f"<= {0.5 / SAMPLES ** 0.5:.3f})."})
    max_new_tokens: int = field(default=20, metadata={"help": "Tokens sampled per continuation."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature of the continuations."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus (top-p) mass the continuations are sampled from "
                                                        "(1: the whole distribution)."})
    neutral_samples: int = field(default=200, metadata={
        "help": "Continuations of neutral prompts (the openings of the control corpora's texts) sampled per test "
                "model for distinct-2, how varied its language stays (0: none)."})
    eval_blocks: int | None = field(default=96, metadata={
        "help": "At most this many token blocks per perplexity split (default: all with 0)."})
    batch_size: int = field(default=16, metadata={"help": "Sequences per evaluation batch."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampled continuations."})

    def __post_init__(self) -> None:
        object.__setattr__(self, "alphas", tuple(float(a) for a in _listed(self.alphas)))
        object.__setattr__(self, "control_text", tuple(_listed(self.control_text)))
        if self.eval_blocks == 0:
            object.__setattr__(self, "eval_blocks", None)


def _listed(value: str | Sequence[Any]) -> Sequence[Any]:
    """A list setting as given: comma-separated text (the CLI, a scenario's single name) or a sequence."""
    return value.split(",") if isinstance(value, str) else value


def task_model(tail: nn.Module, mode: str, delta: Mapping[str, torch.Tensor] | None, *,
               linearized: bool) -> nn.Module:
    """The tail at theta_0 + delta: its weights edited, or (``linearized``) the exact f_lin of a linear vector."""
    names = list(delta) if delta else None  # a plain-LoRA delta is weight updates, not the adapter's factors
    if linearized and Mode(mode).linearized:
        model: nn.Module = LinearizedModel(tail, names)
    else:  # a linearized vector's weights hold its adapter factors from their initialisation
        model = NonLinearModel(tail, names, from_init=Mode(mode).linearized)
    if delta is not None:
        model.load_task_vector(delta)
    return model


def split_perplexity(model: nn.Module, head: nn.Module, dataset: Any, batching: Any, *, batch_size: int,
                     progress: Progress | None = None, description: str = "perplexity") -> float:
    """Perplexity of ``head(model(prefix states))`` over a split of token sequences."""
    loader, logits_of = _scored_split(model, head, dataset, batching, batch_size)
    return perplexity(logits_of, loader, progress=progress or NullProgress(), description=description)


def split_perplexity_by_group(model: nn.Module, head: nn.Module, dataset: Any, batching: Any,
                              groups: Sequence[Hashable], *, batch_size: int, progress: Progress | None = None,
                              description: str = "perplexity") -> tuple[float, dict[Hashable, float]]:
    """:func:`split_perplexity` and each group's (``groups[i]``: sequence i's), from one pass over the split."""
    loader, logits_of = _scored_split(model, head, dataset, batching, batch_size)
    return perplexity_by_group(logits_of, loader, groups, progress=progress or NullProgress(), description=description)


def _scored_split(model: nn.Module, head: nn.Module, dataset: Any, batching: Any,
                  batch_size: int) -> tuple[DataLoader, Callable[[Any], torch.Tensor]]:
    """The split's batches in order, and the logits of a batch: ``head(model(prefix states))``."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=labelled_collate(batching))

    def logits_of(batch: Any) -> torch.Tensor:
        return head(batching.run(model, batch))

    return loader, logits_of


@contextlib.contextmanager
def edited_weights(backbone: Any, delta: Mapping[str, torch.Tensor] | None) -> Iterator[nn.Module]:
    """The whole model with theta_0 + delta in its tail, restored exactly afterwards (for sampling)."""
    if not delta:
        yield backbone.lm
        return
    names = backbone.tail_parameters()
    saved = {}
    try:
        with torch.no_grad():
            for name, value in delta.items():
                param = backbone.lm.get_parameter(names[name])
                saved[name] = param.detach().clone()
                param.add_(value.to(param))
        yield backbone.lm
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                backbone.lm.get_parameter(names[name]).copy_(value)


def in_precision(lm: nn.Module, precision: str) -> nn.Module:
    """``lm`` itself in fp32; in bf16 a copy with bf16 weights (generation then casts nothing: under autocast each
    of a continuation's steps would cast every weight again). Its logits come back as fp32 for sampling."""
    return copy.deepcopy(lm).to(torch.bfloat16) if precision == "bf16" else lm


def neutral_prompts(texts: Sequence[str], words: int = NEUTRAL_PROMPT_WORDS) -> list[str]:
    """The openings (first ``words`` words) of clean texts: prompts that ask for nothing toxic."""
    return [" ".join(text.split()[:words]) for text in texts if len(text.split()) > words]


def sampled(backbone: Any, delta: Mapping[str, torch.Tensor] | None, prompts: list[str], neutral: list[str],
            scorer: Any, settings: LanguageNegation, *, progress: Progress | None = None) -> dict[str, Any]:
    """What theta_0 + delta's sampled continuations show: of ``prompts``, the toxic fraction (with its standard
    error), the mean score and a few scored examples; of ``neutral`` prompts, distinct-2 (how varied the text is).

    theta_0's own continuations (no ``delta``) are read from the sample cache when it holds them
    (:mod:`editkit.eval.sample_cache`): they are the same texts every time. Sampled in the backbone's precision
    (:func:`in_precision`)."""
    progress = progress or NullProgress()
    how = {"max_new_tokens": settings.max_new_tokens, "seed": settings.seed, "temperature": settings.temperature,
           "top_p": settings.top_p, "batch_size": SAMPLE_BATCH}
    theta0 = backbone.fingerprint() if not delta else None

    def sample(lm: nn.Module, chosen: list[str], samples: int) -> list[tuple[str, str]]:
        def fresh() -> list[tuple[str, str]]:
            return sample_continuations(lm, backbone.tokenizer, chosen, samples=samples, progress=progress, **how)

        if theta0 is None:
            return fresh()
        device = next(lm.parameters()).device.type
        return cached_samples(sample_key(theta0, chosen, device, samples=samples, precision=backbone.precision,
                                         **how), fresh)

    with edited_weights(backbone, delta) as edited:
        lm = in_precision(edited, backbone.precision)
        pairs = sample(lm, prompts, settings.samples)
        varied = sample(lm, neutral, settings.neutral_samples) if settings.neutral_samples and neutral else []
    scores = scorer.score([continuation for _, continuation in pairs])
    result: dict[str, Any] = {**toxicity_summary(scores, scorer.threshold), "examples": scored_examples(pairs, scores),
                              "after_clean_prompts": after_clean_prompts(pairs, scores, scorer)}
    if varied:
        result.update(distinct_2=distinct_n(c for _, c in varied), neutral_samples=len(varied),
                      neutral_examples=[{"prompt": p, "continuation": c} for p, c in varied[:EXAMPLES]])
    return result


def after_clean_prompts(pairs: list[tuple[str, str]], scores: Any, scorer: Any) -> dict[str, Any] | None:
    """The toxicity summary of the continuations whose prompt the scorer does not flag itself (None if none).

    Many RealToxicityPrompts openings are toxic ("... you dumb"), and their likeliest continuation is too,
    whatever was negated; this part shows what a model adds to a prompt that asked for nothing toxic.
    """
    prompts = sorted({prompt for prompt, _ in pairs})
    flagged = dict(zip(prompts, np.asarray(scorer.score(prompts)) > scorer.threshold))
    kept = [score for (prompt, _), score in zip(pairs, scores) if not flagged[prompt]]
    return toxicity_summary(kept, scorer.threshold) if kept else None


def scaled(tau: Mapping[str, torch.Tensor], coefficient: float) -> dict[str, torch.Tensor]:
    return {name: value * coefficient for name, value in tau.items()}
