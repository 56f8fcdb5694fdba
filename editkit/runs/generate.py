"""Look at an edit's effect: ``editkit generate``, theta_0's and the edited model's continuations side by side.

The edited model is either a bank vector at a coefficient, **theta_0 + alpha tau** (``alpha = -1`` is the
negation theta_0 - tau; the weights themselves, as ``editkit negate`` samples them, for linearized vectors
too), or a model directory written by ``editkit negate NAME --out DIR`` / ``editkit add --out DIR``, compared
with the base model its ``editkit.json`` names (or one given). Both models continue the same prompts with
the same seeded sampling (:func:`editkit.eval.language.sample_continuations`: sample ``i`` continues prompt
``i % n`` with the random stream ``(seed, i)`` in both models), and a toxicity scorer scores every
continuation (``editkit.eval.toxicity.TOXICITY_SCORERS``; by default the scenario's ``[negation] scorer``).
Default prompts: the first few held-out (test) prompts of the scenario's ``[negation] prompts`` corpus.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from editkit.bank.store import Bank
from editkit.errors import BankError, ConfigError
from editkit.eval.language import EXAMPLES, sample_continuations, scored_examples, toxicity_summary
from editkit.eval.lm_negation import LanguageNegation, SAMPLE_BATCH, edited_weights, in_precision
from editkit.eval.toxicity import TOXICITY_SCORERS
from editkit.merge.arithmetic import combine
from editkit.io.layout import MANIFEST_FILE
from editkit.scenario.provenance import bank_backbone, find_scenario, recorded_scenario
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import ScenarioSpec
from editkit.util.progress import NullProgress, Progress

log = logging.getLogger(__name__)

#: Default number of prompts: the first this many of the scenario's test prompts.
DEFAULT_PROMPTS = EXAMPLES


@dataclass
class Models:
    """theta_0 and the edited model: how to sample from each (``edited()`` yields the edited LM), and what
    the scenario, if known, says about prompts, scoring and the precision both are sampled in (``negate``'s)."""

    base: Any
    tokenizer: Any
    edited_tokenizer: Any
    label: str
    settings: LanguageNegation
    edited_lm: Any = None
    backbone: Any = None
    delta: dict = field(default_factory=dict)
    precision: str = "fp32"

    def edited(self):
        if self.edited_lm is not None:
            return contextlib.nullcontext(self.edited_lm)
        return edited_weights(self.backbone, self.delta)


def coefficient_label(alpha: float, name: str) -> str:
    """``theta_0 - 2 tau[toxic]`` for alpha = -2."""
    sign = "-" if alpha < 0 else "+"
    magnitude = abs(alpha)
    return f"theta_0 {sign} {'' if magnitude == 1 else f'{magnitude:g} '}tau[{name}]"


def _settings(spec: ScenarioSpec | None) -> LanguageNegation:
    return (spec.negation if spec is not None else None) or LanguageNegation()


def from_bank(bank: Bank | Path | str, name: str, alpha: float, *, build: BuildOptions | None = None) -> Models:
    """theta_0 and theta_0 + alpha tau of bank vector ``name`` (a causal LM's), the backbone built alone."""
    bank = bank if isinstance(bank, Bank) else Bank(bank)
    if not (bank.exists() and name in bank.names()):
        raise BankError(f"bank {bank.root} has no vector {name!r}: run `editkit negate {name}` (or `editkit stream`) "
                        "first, or pass --bank DIR")
    entry = bank.get(name)
    spec = recorded_scenario(entry)
    if spec.backbone.get("family") != "causal-lm":
        raise ConfigError(f"vector {name!r} was fine-tuned on a {spec.backbone.get('family')} backbone: "
                          "editkit generate samples text from causal language models only")
    vector = combine(bank, {name: float(alpha)})  # read and verified before the model is built
    backbone = bank_backbone(bank, name, build)
    return Models(base=backbone.lm, tokenizer=backbone.tokenizer, edited_tokenizer=backbone.tokenizer,
                  label=coefficient_label(alpha, name), settings=_settings(spec), backbone=backbone,
                  delta=vector.tensors, precision=spec.precision or "fp32")


def from_directory(directory: Path | str, *, base: str | None = None) -> Models:
    """An exported model directory and the base model it was made from (``base``, else its ``editkit.json``'s)."""
    from editkit.models.lm_weights import load_causal_lm

    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        raise ConfigError(f"--model {directory} is not a directory: name a model directory (editkit negate / add "
                          "--out writes one)")
    provenance: dict[str, Any] = {}
    if (directory / MANIFEST_FILE).is_file():
        provenance = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    recorded = provenance.get("base_model") or {}
    base = base or recorded.get("model")
    if not base:
        raise ConfigError(f"{directory} does not name its base model ({MANIFEST_FILE}): pass --base MODEL, "
                          "the model theta_0 came from")
    spec = None
    if provenance.get("scenario"):
        try:
            spec = find_scenario(provenance["scenario"], provenance.get("scenario_file"))
        except ConfigError:
            log.info("scenario %s of %s is not known here: default prompts and scorer", provenance["scenario"],
                     directory)
    hub_cache = (recorded.get("options") or {}).get("hub_cache")
    edited_lm, edited_tokenizer = load_causal_lm(str(directory))
    base_lm, tokenizer = load_causal_lm(base, hub_cache=hub_cache)
    return Models(base=base_lm, tokenizer=tokenizer, edited_tokenizer=edited_tokenizer, label=str(directory),
                  settings=_settings(spec), edited_lm=edited_lm,
                  precision=(spec.precision if spec is not None else None) or "fp32")


def read_prompts(prompts: Sequence[str] | None = None, prompts_file: Path | str | None = None) -> list[str]:
    """Prompts given one by one and / or one per non-empty line of a file."""
    given = list(prompts or [])
    if prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise ConfigError(f"--prompts-file {path} does not exist")
        given += [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return given


def generate(models: Models, prompts: Sequence[str] | None = None, *, scorer: str | None = None,
             count: int = DEFAULT_PROMPTS, samples_per_prompt: int = 1, max_new_tokens: int | None = None,
             seed: int | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Continuations of ``prompts`` (default: the first ``count`` test prompts of the scenario) by theta_0 and the
    edited model, each scored; returns ``{"edited", "scorer", "threshold", "seed", "max_new_tokens", "rows",
    "theta_0", "edited_summary"}``, ``rows`` lining the two models' samples up (prompt, continuation and score
    of each), the summaries being :func:`toxicity_summary`'s."""
    progress = progress or NullProgress()
    settings = models.settings
    scorer_name = scorer or settings.scorer
    record = TOXICITY_SCORERS[scorer_name]  # an unknown name is refused before any sampling
    if samples_per_prompt < 1 or count < 1:
        raise ConfigError("--samples-per-prompt and --prompts must be at least 1")
    if not prompts:
        from editkit.data.text import corpus_split

        prompts = corpus_split(settings.prompts, "test")[:count]
    prompts = list(prompts)
    seed = settings.seed if seed is None else seed
    max_new_tokens = max_new_tokens or settings.max_new_tokens
    samples = len(prompts) * samples_per_prompt
    options = dict(samples=samples, max_new_tokens=max_new_tokens, seed=seed, batch_size=SAMPLE_BATCH)
    base_pairs = sample_continuations(in_precision(models.base, models.precision), models.tokenizer, prompts,
                                      progress=progress, **options)
    with models.edited() as lm:
        edited_pairs = sample_continuations(in_precision(lm, models.precision), models.edited_tokenizer, prompts,
                                            progress=progress, **options)
    judge = record.build()
    base_scores = judge.score([c for _, c in base_pairs])
    edited_scores = judge.score([c for _, c in edited_pairs])
    rows = [{"index": b["index"], "prompt": b["prompt"], "theta_0": b["continuation"], "theta_0_score": b["score"],
             "edited": e["continuation"], "edited_score": e["score"]}
            for b, e in zip(scored_examples(base_pairs, base_scores, samples),
                            scored_examples(edited_pairs, edited_scores, samples))]
    return {"edited": models.label, "scorer": scorer_name, "threshold": float(judge.threshold), "seed": seed,
            "max_new_tokens": max_new_tokens, "rows": rows,
            "theta_0": toxicity_summary(base_scores, judge.threshold),
            "edited_summary": toxicity_summary(edited_scores, judge.threshold)}
