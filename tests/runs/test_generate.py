"""``editkit generate``: theta_0's and an edited model's continuations side by side, scored.

A tiny random Llama (character tokenizer) fine-tuned for a few steps on exclamations; the scorer registered
here flags a continuation holding a '!', so every score is predictable from the text. The continuations
are checked against :func:`sample_continuations` run by hand on theta_0 and on theta_0 - tau, and an
exported directory (``--model``) gives the same samples as the bank vector it was written from.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from editkit.bank.store import Bank
from editkit.errors import ConfigError
from editkit.eval.language import sample_continuations, scored_examples
from editkit.eval.lm_negation import SAMPLE_BATCH, edited_weights
from editkit.runs import export
from editkit.scenario.provenance import bank_backbone
from helpers.cli import invoke, one_line_refusal
from helpers.scenarios import write_language_scenario
from helpers.text import record_sampled_dtypes, registered_bang_scorer, registered_corpora

RUDE = {"train": ["you silly goose!", "shut it, you fool!", "what a dumb idea!", "go away, clown!"] * 3,
        "val": ["stop that, fool!"], "test": ["you utter muppet!"]}
CLEAN = {"train": ["the council met on monday.", "rain is expected later."] * 3, "val": ["a museum opened."],
         "test": ["the train arrived on time."]}
PROMPTS = {"train": ["so then"], "val": ["you are"], "test": ["well, you", "she told him", "and then", "oh"]}
CORPORA = {"gen-rude": RUDE, "gen-clean": CLEAN, "gen-prompts": PROMPTS}
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    scenario, _ = write_language_scenario(
        root, "gen-rude", task_corpus="gen-rude", control="gen-clean", prompts="gen-prompts", scorer="gen-bang",
        max_length=16, steps=4, lr=3e-2, negation={"max_new_tokens": NEW_TOKENS, "seed": 3})
    with registered_bang_scorer("gen-bang"), registered_corpora(CORPORA):
        result = invoke("stream", "--scenario", scenario, "--bank", root / "bank", "--run-dir", root / "run")
        assert result.exit_code == 0, result.output
        yield root, root / "bank"


def by_hand(bank_dir: Path, prompts: list[str], coefficient: float, seed: int = 3) -> tuple[list, list]:
    """(theta_0's, theta_0 + coefficient tau's) continuations, sampled as a user of the library would."""
    bank = Bank(bank_dir)
    backbone = bank_backbone(bank, "rude")
    delta = {k: coefficient * v for k, v in bank.load("rude").items()}
    options = dict(samples=len(prompts), max_new_tokens=NEW_TOKENS, seed=seed, batch_size=SAMPLE_BATCH)
    base = sample_continuations(backbone.lm, backbone.tokenizer, prompts, **options)
    with edited_weights(backbone, delta) as lm:
        edited = sample_continuations(lm, backbone.tokenizer, prompts, **options)
    return [c for _, c in base], [c for _, c in edited]


def test_generate_prints_and_writes_both_models_continuations_with_their_scores(streamed, tmp_path):
    _, bank = streamed
    prompts = PROMPTS["test"]
    given = [arg for p in prompts for arg in ("--prompt", p)] + ["--samples-per-prompt", 2]
    result = invoke("generate", "rude", "--bank", bank, "--alpha", -10, *given, "--json", tmp_path / "gen.json")
    assert result.exit_code == 0, result.output  # a large alpha: on a random model, sampling noise dominates
    assert "theta_0 vs theta_0 - 10 tau[rude]" in " ".join(result.output.split())
    out = json.loads((tmp_path / "gen.json").read_text())
    base, edited = by_hand(bank, prompts * 2, -10.0)
    assert [r["prompt"] for r in out["rows"]] == prompts * 2
    assert [r["theta_0"] for r in out["rows"]] == base and [r["edited"] for r in out["rows"]] == edited
    assert base != edited  # the vector changed what is sampled
    for row in out["rows"]:
        assert row["theta_0_score"] == float("!" in row["theta_0"]) and row["edited_score"] == float("!" in row["edited"])
    assert out["scorer"] == "gen-bang" and out["seed"] == 3 and out["max_new_tokens"] == NEW_TOKENS
    assert out["theta_0"]["n"] == 8 and out["edited_summary"]["mean_score"] == np.mean([r["edited_score"]
                                                                                         for r in out["rows"]])

    negated = invoke("generate", "rude", "--bank", bank, "--negate", "--alpha", 10, *given, "--json",
                     tmp_path / "neg.json")
    assert negated.exit_code == 0, negated.output
    assert json.loads((tmp_path / "neg.json").read_text())["rows"] == out["rows"]


def test_default_prompts_are_the_scenarios_first_test_prompts(streamed, tmp_path):
    _, bank = streamed
    result = invoke("generate", "rude", "--bank", bank, "--prompts", 3, "--samples-per-prompt", 2,
                    "--json", tmp_path / "gen.json")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "gen.json").read_text())["rows"]
    assert [r["prompt"] for r in rows] == PROMPTS["test"][:3] * 2
    base, edited = by_hand(bank, PROMPTS["test"][:3] * 2, 1.0)
    assert [r["theta_0"] for r in rows][:3] == base[:3]  # sample i: prompt i % n, stream (seed, i)


def test_an_exported_directory_samples_as_its_bank_vector(streamed, tmp_path):
    _, bank = streamed
    out = export.export_vectors(Bank(bank), {"rude": -2.0}, tmp_path / "model")
    args = ["--prompt", "well, you", "--prompt", "oh", "--seed", 5]
    from_dir = invoke("generate", "--model", out, *args, "--json", tmp_path / "dir.json")
    assert from_dir.exit_code == 0, from_dir.output
    from_bank = invoke("generate", "rude", "--bank", bank, "--alpha", -2, *args, "--json", tmp_path / "bank.json")
    assert from_bank.exit_code == 0, from_bank.output
    rows_dir = json.loads((tmp_path / "dir.json").read_text())
    rows_bank = json.loads((tmp_path / "bank.json").read_text())
    assert rows_dir["edited"] == str(out.resolve()) and rows_dir["scorer"] == "gen-bang"  # the scenario's, via editkit.json
    for a, b in zip(rows_dir["rows"], rows_bank["rows"]):
        assert (a["theta_0"], a["edited"]) == (b["theta_0"], b["edited"])


def test_refusals_are_one_line(streamed, tmp_path):
    _, bank = streamed
    one_line_refusal(invoke("generate", "rude", "--bank", bank, "--scorer", "nope", "--prompt", "x"),
                     "unknown toxicity scorer 'nope'")
    one_line_refusal(invoke("generate"), "name a bank vector or give --model DIR")
    one_line_refusal(invoke("generate", "missing", "--bank", bank), "has no vector 'missing'")
    (tmp_path / "bare").mkdir()
    one_line_refusal(invoke("generate", "--model", tmp_path / "bare"), "does not name its base model")
    one_line_refusal(invoke("generate", "rude", "--bank", bank, "--prompts-file", tmp_path / "none.txt"),
                     "does not exist")


def test_scored_examples_keeps_the_first_k_in_sample_order():
    pairs = [("a", "x!"), ("b", "y"), ("c", "z")]
    assert scored_examples(pairs, [1.0, 0.0, 0.25], 2) == [
        {"index": 0, "prompt": "a", "continuation": "x!", "score": 1.0},
        {"index": 1, "prompt": "b", "continuation": "y", "score": 0.0}]
    assert len(scored_examples(pairs, np.zeros(3), 10)) == 3 and scored_examples(pairs, np.zeros(3), 0) == []
    with pytest.raises(ConfigError, match="2 scores for 3 samples"):
        scored_examples(pairs, [0.0, 1.0])


def test_a_bf16_scenario_samples_both_models_from_bf16_copies(streamed, monkeypatch):
    import torch

    from editkit.runs import generate as generating

    models = generating.from_bank(streamed[1], "rude", -1.0)
    assert models.precision == "fp32"  # the scenario names none
    models.precision = "bf16"
    dtypes = record_sampled_dtypes(monkeypatch, generating)
    generating.generate(models, ["well, you"])  # the fixture holds the scorer and corpora registered
    assert dtypes == [{torch.bfloat16}, {torch.bfloat16}]
    assert {p.dtype for p in models.base.parameters()} == {torch.float32}
