"""``editkit negate`` on language vectors, end to end through the CLI.

A tiny random Llama and a character tokenizer are saved as a checkpoint directory; a scenario file
names it, text corpora registered by the test and a toxicity scorer registered by the test (it flags
continuations holding a '!'), so the whole path runs in seconds: stream (fine-tune, bank) -> negate
(validation alpha grid, test rows, sampled continuations scored) -> report.json. theta_0's perplexities
are checked against the loaded model run by hand on the same test blocks.

The slow test runs the real embedded default (SmolLM2 and the pinned corpora, fetched into the cache).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from editkit.data.text import pack
from editkit.eval.language import distinct_n
from editkit.models.lm_weights import load_causal_lm
from helpers.cli import invoke, one_line_refusal
from helpers.scenarios import write_language_scenario
from helpers.text import CLEAN, RUDE, hand_perplexity, registered_bang_scorer, registered_corpora

MAX_LENGTH, EVAL_BLOCKS = 16, 3

CALM = {"train": ["we walked along the river.", "the garden was quiet."], "val": ["the tea was warm and sweet."],
        "test": ["birds sang in the old oak tree.", "she read a book by the window."]}
PROMPTS = {"train": ["so then"], "val": ["you are", "he said"], "test": ["well, you", "she told him"]}
CORPORA = {"tiny-rude": RUDE, "tiny-clean": CLEAN, "tiny-calm": CALM, "tiny-prompts": PROMPTS}


@pytest.fixture(scope="module")
def language_extensions():
    with registered_bang_scorer("bang"), registered_corpora(CORPORA):
        yield


def scenario_file(tmp: Path, *, name: str = "tiny-rude", seed: int = 0, negation: bool = True) -> Path:
    """A two-block random Llama saved with its tokenizer, and the scenario that fine-tunes its last block
    (without its [negation] table when ``negation`` is False)."""
    path, _ = write_language_scenario(
        tmp, name, task_corpus="tiny-rude", control=["tiny-calm", "tiny-clean"], prompts="tiny-prompts",
        scorer="bang", negation=NEGATION if negation else None, max_length=MAX_LENGTH, eval_blocks=EVAL_BLOCKS,
        generic_corpus="tiny-clean", steps=10, lr=1e-2, seed=seed)
    return path


NEGATION = {"alphas": [0.5, 1.0, 2.0], "samples": 6, "neutral_samples": 4, "max_new_tokens": 4,
            "eval_blocks": EVAL_BLOCKS, "batch_size": 2}


def stream(scenario: Path, root: Path) -> Path:
    """The bank `editkit stream --steps 3` fills from ``scenario``."""
    bank = root / "bank"
    result = invoke("stream", "--scenario", scenario, "--bank", bank, "--run-dir", root / "stream", "--steps", 3)
    assert result.exit_code == 0, result.output
    return bank


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, language_extensions):
    """(scenario file, bank) after one stream of the tiny scenario, shared by the tests that only read the bank."""
    root = tmp_path_factory.mktemp("tiny-rude")
    scenario = scenario_file(root)
    return scenario, stream(scenario, root)


def test_negate_a_language_vector_writes_the_report_with_theta0_by_hand(tmp_path, streamed):
    scenario, bank = streamed
    run_dir = tmp_path / "negate"
    result = invoke("negate", "rude", "--bank", bank, "--run-dir", run_dir)
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "report.json").read_text())

    assert report["operation"] == "negate" and report["vector"] == "rude" and report["target_task"] == "rude"
    assert report["scenario"] == "tiny-rude" and report["mode"] == "taujp"
    tuning = report["tuning"]
    assert [row["alpha"] for row in tuning["grid"]] == [0.5, 1.0, 2.0]
    assert report["alpha"] == tuning["alpha"] in (0.5, 1.0, 2.0)
    rows = {row["model"]: row for row in report["rows"]}
    assert list(rows)[:3] == ["theta_0", "+tau", "-tau"]
    assert rows["theta_0"]["alpha"] == 0.0 and rows["+tau"]["alpha"] == -1.0 and rows["-tau"]["alpha"] == 1.0
    for row in rows.values():
        assert all(math.isfinite(row[key]) and row[key] > 1 for key in ("control", "target"))
    # sampling (the costly part) for theta_0, +tau and the chosen negation only
    sampled = {name: row for name, row in rows.items() if row["alpha"] in (0.0, -1.0, report["alpha"])}
    assert all(("n" in row) == (name in sampled) for name, row in rows.items())
    for row in sampled.values():
        assert row["n"] == 6 and 0.0 <= row["toxic_fraction"] <= 1.0
        assert row["toxic_fraction_stderr"] == pytest.approx(
            math.sqrt(row["toxic_fraction"] * (1 - row["toxic_fraction"]) / 6))
    openings = {"birds sang in the old oak", "she read a book by the", "a new bridge was opened in"}
    for row in sampled.values():  # a few scored samples to read, the same prompts (and streams) for every model
        assert [e["prompt"] for e in row["examples"]] == [PROMPTS["test"][i % 2] for i in range(5)]
        assert all(e["score"] == float("!" in e["continuation"]) for e in row["examples"])
    # neutral prompts for theta_0 and the chosen negation (is the language still varied?), not for +tau
    assert "distinct_2" not in rows["+tau"]
    varied = [row for row in sampled.values() if row["alpha"] >= 0]
    for row in varied:
        neutral = row["neutral_examples"]  # all 4 neutral samples: openings of the control corpora's test texts
        assert len(neutral) == row["neutral_samples"] == 4 and {e["prompt"] for e in neutral} <= openings
        assert row["distinct_2"] == pytest.approx(distinct_n(e["continuation"] for e in neutral))
    assert len(varied) == 2 and [e["prompt"] for e in varied[0]["neutral_examples"]] == [
        e["prompt"] for e in varied[1]["neutral_examples"]]
    for row in rows.values():  # taujp vectors are linearized: the exact f_lin perplexities of negations too
        assert ("control_flin" in row) == (row["alpha"] > 0)
    assert rows["-tau"]["target"] != rows["theta_0"]["target"]  # the vector did something
    assert (run_dir / "negation.png").stat().st_size > 0

    lm, tokenizer = load_causal_lm(str(scenario.parent / "tiny-llama-0"))
    target = pack(tokenizer, RUDE["test"], MAX_LENGTH, limit=EVAL_BLOCKS)
    calm, clean = (pack(tokenizer, corpus["test"], MAX_LENGTH, limit=EVAL_BLOCKS) for corpus in (CALM, CLEAN))
    assert rows["theta_0"]["target"] == pytest.approx(hand_perplexity(lm, target), rel=1e-5)
    # the rule's control pools both control corpora's blocks; the test rows give each corpus's own as well
    assert rows["theta_0"]["control"] == pytest.approx(hand_perplexity(lm, calm + clean), rel=1e-5)
    assert list(rows["theta_0"]["controls"]) == ["tiny-calm", "tiny-clean"]
    assert rows["theta_0"]["controls"]["tiny-calm"] == pytest.approx(hand_perplexity(lm, calm), rel=1e-5)
    assert rows["theta_0"]["controls"]["tiny-clean"] == pytest.approx(hand_perplexity(lm, clean), rel=1e-5)
    assert set(rows["-tau"]["controls_flin"]) == {"tiny-calm", "tiny-clean"}
    assert "controls" not in tuning["grid"][0]  # validation reads the pooled control only


def test_a_fixed_alpha_skips_tuning(tmp_path, streamed):
    _, bank = streamed
    result = invoke("negate", "rude", "--bank", bank, "--alpha", 2, "--run-dir", tmp_path / "fixed")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "fixed" / "report.json").read_text())
    assert report["tuning"] is None and report["alpha"] == 2.0
    assert [row["model"] for row in report["rows"]] == ["theta_0", "+tau", "-tau", "-2 tau"]


def test_negate_fine_tunes_and_scores_on_one_built_scenario_and_times_its_parts(tmp_path, language_extensions,
                                                                              monkeypatch):
    """`editkit negate NAME` of a scenario whose bank lacks the vector: the stream and the negation use one build
    (the model loaded once, the prefix states computed once), and the report's seconds name every part."""
    from editkit import settings
    from editkit.scenario import build

    scenario = scenario_file(tmp_path, name="rude")  # a scenario named for its task: `negate rude` finds both
    monkeypatch.setenv(settings.SCENARIOS_ENV, str(scenario.parent))
    builds = []
    real = build.build_scenario
    monkeypatch.setattr(build, "build_scenario", lambda *a, **k: builds.append(1) or real(*a, **k))
    from editkit.runs import negate_lm
    from editkit.scenario import provenance

    monkeypatch.setattr(negate_lm, "build_scenario", build.build_scenario)
    monkeypatch.setattr(provenance, "build_scenario", build.build_scenario)  # a banked vector's scenario rebuilt
    result = invoke("negate", "rude", "--bank", tmp_path / "bank", "--steps", 3, "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert len(builds) == 1
    seconds = json.loads((tmp_path / "run" / "report.json").read_text())["seconds"]
    assert {"loading", "fine-tuning", "validation", "test"} <= set(seconds)
    parts = seconds["parts"]
    chosen = [part for part in parts if part.startswith("sampling -")]  # the negation at the chosen alpha
    assert len(chosen) == 1 and chosen[0].endswith(" tau")
    assert set(parts) == {"val perplexities", "test perplexities", "sampling theta_0", "sampling +tau", *chosen}
    assert all(value > 0 for value in parts.values())


def test_the_data_free_penalty_measures_the_next_token_distribution_and_banks_its_curvature(tmp_path,
                                                                                           language_extensions,
                                                                                           monkeypatch):
    """`negate NAME --penalty kfac` of a scenario whose penalty measures the next-token distribution: the penalty
    reads the generic text's curvature through the model's head (no reg rows drawn), the task's own curvature is
    banked measuring the same, and the bank is the stream's `-kfac` one."""
    from editkit import settings
    from editkit.bank.store import Bank

    scenario = scenario_file(tmp_path, name="rude")
    scenario.write_text(scenario.read_text().replace("[recipe]\n", '[recipe]\npenalty_on = "distribution"\n'))
    monkeypatch.setenv(settings.SCENARIOS_ENV, str(scenario.parent))
    monkeypatch.chdir(tmp_path)
    result = invoke("negate", "rude", "--steps", 3, "--alpha", 1.0, "--penalty", "kfac")
    assert result.exit_code == 0, result.output
    bank = Bank(tmp_path / "banks" / "rude-taujp-kfac")
    entry, curvature = bank.get("rude"), bank.curvature("rude")
    assert entry.recipe["penalty"] == "kfac" and entry.recipe["penalty_on"] == "distribution"
    assert curvature.measure == "distribution" and curvature.examples > 0 and curvature.blocks
    assert (tmp_path / "runs" / "negate-rude-taujp-kfac" / "report.json").is_file()
    unpenalized = invoke("negate", "rude", "--steps", 3, "--alpha", 1.0, "--penalty", "kfac", "--lam", 0,
                         "--bank", tmp_path / "bank0")
    assert unpenalized.exit_code == 0, unpenalized.output
    tau, tau0 = bank.load("rude"), Bank(tmp_path / "bank0").load("rude")
    assert any(not torch.equal(tau[n], tau0[n]) for n in tau)  # the penalty moved the vector


def test_theta0s_scores_are_computed_once_whatever_asks_for_them(streamed, monkeypatch):
    """The bench scores three vectors on one evaluation: theta_0's perplexities and its sampling run once."""
    from editkit.runs.negate_lm import NegationEvaluation, negation_settings
    from editkit.scenario.build import build_scenario
    from editkit.scenario.spec import load_scenario

    built = build_scenario(load_scenario(streamed[0]))
    evaluation = NegationEvaluation(built, "rude", negation_settings(built, {"samples": 4}))
    calls = []
    for name in ("perplexities", "toxicity"):
        work = getattr(evaluation, name)
        counted = lambda *a, _work=work, _name=name, **k: calls.append(_name) or _work(*a, **k)  # noqa: E731
        monkeypatch.setattr(evaluation, name, counted)
    plain = evaluation.theta0("test", sampled=False)
    sampled = evaluation.theta0("test", sampled=True)
    assert evaluation.theta0("test", sampled=True) == sampled and evaluation.theta0("test", sampled=False) == plain
    assert calls == ["perplexities", "toxicity"]
    assert {key: sampled[key] for key in plain} == plain and sampled["n"] == 4


def test_a_language_bench_over_seeds_is_refused_before_any_work(tmp_path, language_extensions):
    scenario = scenario_file(tmp_path)
    result = invoke("bench", "--scenario", scenario, "--seeds", 2, "--bank-root", tmp_path / "banks")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--seeds, --orders and --strategies are for classification scenarios" in " ".join(result.output.split())
    assert "language negation" in " ".join(result.output.split())
    strategies = invoke("bench", "--scenario", scenario, "--strategies", "lwf", "--bank-root", tmp_path / "banks")
    assert strategies.exit_code == 1 and "are for classification scenarios" in " ".join(strategies.output.split())
    assert not (tmp_path / "banks").exists()


def test_the_language_bench_negates_full_and_adapter_vectors_as_negate_does(tmp_path, language_extensions):
    """`bench --adapters none,lora`: a bank per stream, and each stream's negation (scored on theta_0 with or
    without the adapter, theta_0 shared per adapter) is exactly what `editkit negate` reports for that bank alone."""
    scenario = scenario_file(tmp_path)
    result = invoke("bench", "--scenario", scenario, "--adapters", "none,lora", "--modes", "taujp", "--steps", 3,
                    "--lora-rank", 2, "--lora-lr", "5e-2", "--bank-root", tmp_path / "banks", "--run-dir",
                    tmp_path / "run")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert list(report["modes"]) == ["taujp", "taujp-lora"]
    assert report["comparison"]["checks"] == {}  # tauJp is compared with other modes of its own adapter only
    for label in ("taujp", "taujp-lora"):
        alone = tmp_path / f"alone-{label}"
        negated = invoke("negate", "rude", "--bank", tmp_path / "banks" / f"tiny-rude-{label}", "--run-dir", alone)
        assert negated.exit_code == 0, negated.output
        want = json.loads((alone / "report.json").read_text())
        got = report["modes"][label]
        assert got["alpha"] == want["alpha"] and [r["model"] for r in got["rows"]] == [r["model"] for r in want["rows"]]
        for mine, theirs in zip(got["rows"], want["rows"]):
            for key in ("control", "target", "toxic_fraction"):
                if theirs.get(key) is None:  # a row the rule did not choose is not sampled: no toxic fraction either way
                    assert mine.get(key) is None, (label, mine["model"], key)
                else:  # (pytest >= 9.2 refuses approx(None))
                    assert mine.get(key) == pytest.approx(theirs[key], rel=1e-5), (label, mine["model"], key)


# --------------------------------------------------------------------------- refusals


def test_a_language_vector_of_a_scenario_without_negation_is_refused_by_the_accuracy_negation(tmp_path,
                                                                                              language_extensions):
    """Without a [negation] table the vector goes the classification way, which must refuse it, not crash."""
    bank = stream(scenario_file(tmp_path, name="tiny-rude-plain", negation=False), tmp_path)
    one_line_refusal(invoke("negate", "rude", "--bank", bank), "was fine-tuned on a language model", exit_code=None)


def test_a_scenario_built_on_another_base_model_is_refused_by_fingerprint(tmp_path, streamed):
    """The bench path hands negate_language an evaluation of a built scenario: its base model must be the bank's."""
    from editkit.bank.store import Bank
    from editkit.errors import IncompatibleVectorsError
    from editkit.runs.negate_lm import NegationEvaluation, negate_language, negation_settings
    from editkit.scenario.build import build_scenario
    from editkit.scenario.spec import load_scenario

    other = build_scenario(load_scenario(scenario_file(tmp_path, name="tiny-rude-other", seed=1)))
    evaluation = NegationEvaluation(other, "rude", negation_settings(other))
    with pytest.raises(IncompatibleVectorsError, match="built on another base model"):
        negate_language(Bank(streamed[1]), "rude", evaluation=evaluation)


# --------------------------------------------------------------------------- the real default, reduced


@pytest.mark.slow
def test_negate_toxic_reduced_default(tmp_path, monkeypatch):
    """`editkit negate toxic` itself: SmolLM2 and the pinned corpora and scorer, fetched into the normal cache."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    result = invoke("negate", "toxic", "--steps", 2, "--samples", 8, "--neutral-samples", 8, "--eval-blocks", 4,
                    "--alphas", "1,2", "--bank", tmp_path / "bank", "--run-dir", run_dir)
    assert result.exit_code == 0, result.output
    report = json.loads((run_dir / "report.json").read_text())
    assert report["scenario"] == "toxic" and report["vector"] == "toxic" and report["mode"] == "taujp"
    assert report["settings"]["samples"] == 8 and report["settings"]["eval_blocks"] == 4
    assert [row["alpha"] for row in report["tuning"]["grid"]] == [1.0, 2.0]
    assert [row["model"] for row in report["rows"]][:3] == ["theta_0", "+tau", "-tau"]
    for row in report["rows"]:
        assert math.isfinite(row["control"]) and math.isfinite(row["target"]) and row["n"] == 8
    varied = [row for row in report["rows"] if "distinct_2" in row]  # theta_0 and the negation
    assert [row["model"] for row in varied][0] == "theta_0" and len(varied) == 2
    assert all(row["neutral_samples"] == 8 and 0 < row["distinct_2"] <= 1 for row in varied)
