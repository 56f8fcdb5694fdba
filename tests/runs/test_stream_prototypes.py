"""A stream banks each classification task's class statistics with its vector: the merged set equal to one
computed here from the banked vectors so far (a jvp of theta_0 along their sum for a linearized mode, a forward at
theta_0 + their sum for a plain one), the pretrained set theta_0's; a resumed run fills in a vector banked
without them, or with an earlier format of them, and trains nothing; a language model's stream banks none."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from editkit.bank.store import Bank
from editkit.core.prototypes import capped_rows
from editkit.runs.stream import StreamRunner, run_scenario

from helpers.prototypes import features_at, statistics_by_hand
from helpers.scenarios import write_language_scenario
from helpers.streams import NAMES, data, network, stream
from helpers.text import CLEAN, RUDE, registered_corpora

CAP = 6  # inputs per class: fewer than the tiny tasks have, so the seeded choice is exercised


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
def test_banked_statistics_are_the_merged_models_features_on_each_tasks_training_inputs(tmp_path, monkeypatch, mode):
    monkeypatch.setattr("editkit.eval.features.PROTOTYPE_EXAMPLES_PER_CLASS", CAP)
    stream(tmp_path / "bank", mode=mode, names=NAMES[:2])
    bank = Bank(tmp_path / "bank")
    sets, _ = data()
    for k, name in enumerate(NAMES[:2]):
        x, y = sets[name].inputs, sets[name].targets
        rows = capped_rows(y, CAP, seed=0)
        banked = bank.prototypes(name)
        assert banked.counts.tolist() == torch.bincount(y, minlength=3).clamp_max(CAP).tolist()
        assert bank.get(name).prototypes["examples"] == len(rows)
        vectors = [bank.load(n) for n in NAMES[: k + 1]]  # the stream's merge: their sum
        merged = features_at(network(), {p: sum(v[p] for v in vectors) for p in vectors[0]}, x[rows],
                             linearized=mode == "linear")
        with torch.no_grad():
            pretrained = network()(x[rows])
        for kind, features in (("merged", merged), ("pretrained", pretrained)):
            means, scatter = statistics_by_hand(features, y[rows], 3)
            torch.testing.assert_close(banked.means(kind), means, rtol=0, atol=1e-6)
            torch.testing.assert_close(banked.scatter(kind), scatter, rtol=0, atol=1e-5)
        assert (banked.merged - banked.pretrained).abs().max() > 1e-3  # the vectors moved them
    assert bank.verify() == [] and bank.orphans() == []


class Recorded:
    """A progress that keeps the description of every bar it opens."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    @contextlib.contextmanager
    def task(self, description: str, total: int):
        self.lines.append(description)
        yield self

    def advance(self, n: int = 1, **fields: float) -> None:
        pass

    def note(self, line: str) -> None:
        pass


def test_a_resumed_stream_fills_in_prototypes_of_vectors_banked_without_them_and_trains_nothing(tmp_path,
                                                                                                monkeypatch):
    root = tmp_path / "bank"
    stream(root, names=NAMES[:2])
    first = {n: Bank(root).prototypes(n) for n in NAMES[:2]}
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["vectors"]:  # as a bank written before prototypes existed
        (root / entry.pop("prototypes")["file"]).unlink()
    (root / "manifest.json").write_text(json.dumps(manifest))
    vectors = {n: (root / f"{n}.safetensors").read_bytes() for n in NAMES[:2]}

    def no_training(self, t):
        raise AssertionError(f"experience {t} was trained again")

    monkeypatch.setattr(StreamRunner, "train", no_training)
    progress = Recorded()
    stream(root, names=NAMES[:2], resume=True, progress=progress)
    bank = Bank(root)
    assert {n: (root / f"{n}.safetensors").read_bytes() for n in NAMES[:2]} == vectors
    for name in NAMES[:2]:
        filled = bank.prototypes(name)
        assert all(torch.equal(a, b) for a, b in zip(filled.to_tensors().values(), first[name].to_tensors().values()))
    assert [line for line in progress.lines if line.startswith("prototypes")] == ["prototypes of a", "prototypes of b"]
    assert bank.verify() == [] and bank.orphans() == []


def test_a_resumed_stream_replaces_prototypes_of_an_earlier_format_and_removes_their_file(tmp_path, monkeypatch):
    """A bank written when each task's prototypes were its own model's (format 1, one file name): the resumed
    run computes them again under the merged model, banks them under the new format's file name and removes
    the old file; the vectors stay as they were."""
    root = tmp_path / "bank"
    stream(root, names=NAMES[:2])
    current = {n: Bank(root).prototypes(n) for n in NAMES[:2]}
    manifest = json.loads((root / "manifest.json").read_text())
    for entry in manifest["vectors"]:
        old = root / f"{entry['name']}.prototypes.safetensors"
        (root / entry["prototypes"]["file"]).rename(old)
        entry["prototypes"].update(file=old.name, format="prototypes-1")
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert Bank(root).prototypes("a") is None  # an earlier format is not read as this one
    vectors = {n: (root / f"{n}.safetensors").read_bytes() for n in NAMES[:2]}
    monkeypatch.setattr(StreamRunner, "train", lambda self, t: pytest.fail(f"experience {t} was trained again"))
    stream(root, names=NAMES[:2], resume=True)
    bank = Bank(root)
    assert {n: (root / f"{n}.safetensors").read_bytes() for n in NAMES[:2]} == vectors
    for name in NAMES[:2]:
        assert bank.get(name).prototypes["file"] == f"{name}.prototypes-2.safetensors"
        assert all(torch.equal(a, b) for a, b in zip(bank.prototypes(name).to_tensors().values(),
                                                     current[name].to_tensors().values()))
    assert not list(root.glob("*.prototypes.safetensors"))
    assert bank.verify() == [] and bank.orphans() == []


def test_computing_prototypes_again_on_a_resume_that_has_them_is_skipped(tmp_path, monkeypatch):
    stream(tmp_path / "bank", names=NAMES[:1])
    monkeypatch.setattr(StreamRunner, "prototypes", lambda *args: pytest.fail("prototypes computed again"))
    progress = Recorded()
    stream(tmp_path / "bank", names=NAMES[:1], resume=True, progress=progress)
    assert not any(line.startswith("prototypes") for line in progress.lines)


def test_a_language_model_stream_banks_no_prototypes(tmp_path):
    scenario, _ = write_language_scenario(tmp_path, "tiny-lm", task_corpus="tiny-rude", control="tiny-clean",
                                          prompts="tiny-clean", scorer="none", steps=2, lr=1e-2)
    with registered_corpora({"tiny-rude": RUDE, "tiny-clean": CLEAN}):
        run_scenario(scenario, bank=tmp_path / "bank", run_dir=tmp_path / "run")
    bank = Bank(tmp_path / "bank")
    assert bank.names() == ["rude"] and bank.get("rude").prototypes == {}
    assert not list((tmp_path / "bank").glob("*.prototypes*.safetensors"))
