"""A linearized stream scores incrementally: cached theta_0 features plus running tangent sums.

Ground truth: every score is recomputed here from the banked vectors with ``torch.func.jvp`` of the
plain network at theta_0 (float64, so a sum of tangents and the tangent of a sum agree far below any
argmax margin), the heads' argmax and the labels. The cost claim is counted, not timed: the passes over
a task's test split that each experience runs (t + 2 at experience t, one at the first, and no plain
theta_0 pass), and the passes a resumed stream spends rebuilding the cache (one per seen task).
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, jvp

import editkit.eval.incremental as incremental
from editkit.bank.store import Bank
from editkit.errors import ConfigError
from editkit.models.backbone import Backbone
from editkit.runs.stream import StreamRunner
from editkit.train.recipe import Recipe
from editkit.train.runtime import Runtime
from editkit.util.progress import NullProgress

from helpers.streams import NAMES, data, experiences, network, stream

def accuracy_by_hand(vectors: list[dict[str, torch.Tensor]], task: str) -> float:
    """Accuracy on ``task`` of f(x; theta_0) + J f(x) . sum(vectors), from a jvp of the plain network."""
    module, (sets, heads) = network(), data()
    params = dict(module.named_parameters())
    tangent = {n: sum(v[n] for v in vectors) for n in params} if vectors else {n: torch.zeros_like(p) for n, p in params.items()}
    x, y = sets[task].inputs, sets[task].targets
    primal, tan = jvp(lambda *p: functional_call(module, dict(zip(params, p)), (x,)), tuple(params.values()),
                      tuple(tangent[n] for n in params))
    return float((heads[task]((primal + tan).float()).argmax(1) == y).double().mean())  # fp32 features, as kept


def scores(result) -> list[tuple]:
    """Each experience's scores (the records' timings differ from run to run)."""
    return [(r.pretrained, r.single_task, {k: v for k, v in r.merged.items() if k != "merge_seconds"})
            for r in result.steps]


@pytest.fixture
def passes(monkeypatch):
    """Each pass the cache runs over a task's test split, as (task size, function name), in order."""
    seen: list[tuple[int, str]] = []
    real = incremental.outputs_over

    def counting(fn, dataset, **kwargs):
        seen.append((len(dataset), fn.__name__))
        return real(fn, dataset, **kwargs)

    monkeypatch.setattr(incremental, "outputs_over", counting)
    return seen


def test_every_score_equals_the_linearized_model_computed_by_hand(tmp_path):
    result = stream(tmp_path / "bank")
    bank = Bank(tmp_path / "bank")
    vectors = [bank.load(n) for n in NAMES]
    for t, record in enumerate(result.steps):
        assert record.pretrained == accuracy_by_hand([], NAMES[t])
        assert record.single_task == accuracy_by_hand([vectors[t]], NAMES[t])
        assert record.merged["per_task"] == {n: accuracy_by_hand(vectors[: t + 1], n) for n in NAMES[: t + 1]}


def tangent_by_hand(vector: dict[str, torch.Tensor], task: str) -> torch.Tensor:
    """J f(x) . vector on ``task``'s inputs, from a jvp of the plain network at theta_0."""
    module, (sets, _) = network(), data()
    params = dict(module.named_parameters())
    return jvp(lambda *p: functional_call(module, dict(zip(params, p)), (sets[task].inputs,)), tuple(params.values()),
               tuple(vector[n] for n in params))[1].float()


def test_kept_tangents_are_each_vectors_own_on_every_task_it_was_scored_on(tmp_path, passes):
    """keep_tangents hands over what the scoring computed anyway (no pass more): vector t on tasks 0..t."""
    result = stream(tmp_path / "bank", keep_tangents=True)
    bank = Bank(tmp_path / "bank")
    kept = {vector: set(scored) for vector, scored in result.tangents.items()}
    assert kept == {name: set(NAMES[: t + 1]) for t, name in enumerate(NAMES)}
    for v, scored in result.tangents.items():
        for task, tangent in scored.items():
            torch.testing.assert_close(tangent, tangent_by_hand(bank.load(v), task), rtol=1e-6, atol=1e-7)
    assert len(passes) == 1 + 3 + 4 + 5  # as without keeping them
    assert stream(tmp_path / "plain").tangents == {}


def test_scores_equal_the_direct_evaluation(tmp_path, monkeypatch):
    cached = stream(tmp_path / "cached")
    monkeypatch.setattr("editkit.runs.stream.cacheable", lambda *args: False)
    direct = stream(tmp_path / "direct")
    assert scores(cached) == scores(direct)


def test_each_experience_runs_only_the_new_vector_passes(tmp_path, passes):
    marks: list[int] = []
    stream(tmp_path / "bank", on_step=lambda record: marks.append(len(passes)))
    per_experience = [b - a for a, b in zip([0, *marks], marks)]
    assert per_experience == [1, 3, 4, 5]  # t + 2 passes at experience t, one at the first
    names = [name for _, name in passes]
    assert "forward" not in names  # theta_0 comes from the primal of tau_t's jvp, never a plain pass


def test_a_resumed_stream_rebuilds_the_cache_from_the_bank(tmp_path, passes):
    stream(tmp_path / "bank", names=NAMES[:2])
    before = len(passes)
    resumed = stream(tmp_path / "bank", resume=True)
    assert [r.resumed for r in resumed.steps] == [True, True, False, False]
    vectors = [Bank(tmp_path / "bank").load(n) for n in NAMES]
    for t in (2, 3):
        assert resumed.steps[t].merged["per_task"] == {n: accuracy_by_hand(vectors[: t + 1], n) for n in NAMES[: t + 1]}
    # experience 2: one rebuild pass per seen task (a, b) with their banked sum, then tau_2 and the sum on c
    assert len(passes) - before == 2 + 2 + 5


def test_the_merged_scores_of_a_banked_vector_are_rebuilt_when_missing(tmp_path, passes):
    """A crash between banking a vector and storing its merged scores: resume scores the merged model from
    the bank alone."""
    fresh = stream(tmp_path / "bank", names=NAMES[:3])
    Bank(tmp_path / "bank").update_metrics("c", {"merged": None})
    before = len(passes)
    resumed = stream(tmp_path / "bank", names=NAMES[:3], resume=True)
    assert resumed.steps[2].merged == fresh.steps[2].merged
    assert [name for _, name in passes[before:]] == ["primal_and_tangent"] * 3  # one pass per task, nothing else


def test_a_cache_over_its_budget_spills_to_the_run_directory_and_scores_the_same(tmp_path, monkeypatch):
    in_memory = stream(tmp_path / "memory")
    monkeypatch.setenv("EDITKIT_EVAL_CACHE_MB", "0")
    spill = tmp_path / "run"
    stores = []
    real = incremental.IncrementalScores.__init__

    def keep(self, *args, **kwargs):
        real(self, *args, **kwargs)
        stores.append(self.store)

    monkeypatch.setattr(incremental.IncrementalScores, "__init__", keep)
    spilled = stream(tmp_path / "spilled", spill_dir=spill)
    assert scores(spilled) == scores(in_memory)
    assert stores and stores[0].held_bytes == 0
    assert list(spill.iterdir()) == []  # the spill files are removed when the run ends


@pytest.mark.parametrize("mode", ["nonlinear", "taujp-nonlinear", "sequential"])
def test_non_linear_vectors_are_scored_by_running_the_network(mode):
    recipe = Recipe(mode=mode, steps=1, batch_size=10, generic=False)
    runner = StreamRunner(experiences(), Backbone("mlp", network(), 6), data()[1], recipe, Bank.__new__(Bank),
                          scenario="tiny", generic=None, progress=NullProgress(), runtime=Runtime())
    assert runner.incremental is None


@pytest.mark.parametrize("mode", ["taujp", "nonlinear"])
def test_a_bad_cache_budget_is_refused_by_name_before_anything_is_banked(tmp_path, monkeypatch, mode):
    monkeypatch.setenv("EDITKIT_EVAL_CACHE_MB", "lots")
    with pytest.raises(ConfigError, match="EDITKIT_EVAL_CACHE_MB must be a whole number of MiB, got 'lots'"):
        stream(tmp_path / "bank", mode=mode)
    assert not (tmp_path / "bank").exists()
