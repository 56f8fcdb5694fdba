"""``sequential`` mode: MagMax's continual recipe (fine-tune each task from the previous task's weights, bank
theta_t - theta_0, merge by max magnitude).

Ground truth: a fine-tuning started at theta_0 + tau is plain fine-tuning of a copy of the network whose
weights were edited to theta_0 + tau; the stream's merged scores are recomputed from the banked vectors with a
max-magnitude selection written here with ``argmax`` over stacked absolute values, and the network run at
theta_0 + that vector.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.core.modes import Family, Mode, combined_mode
from editkit.data.tasks import TensorTaskDataset
from editkit.errors import BankError
from editkit.integrations.avalanche.benchmark import Experience
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.runs.stream import run_stream
from editkit.train.loop import fine_tune
from editkit.train.recipe import Recipe

from helpers import models

RECIPE = Recipe(mode="sequential", steps=4, batch_size=10, lr=5e-2, warmup=0, generic=False)


def network() -> nn.Module:
    return models.mlp(4, 12, 6, batchnorm=True, seed=0).double()


def edited(module: nn.Module, tau) -> nn.Module:
    """A copy of ``module`` with its parameters edited in place to theta_0 + tau."""
    c = copy.deepcopy(module).eval()
    with torch.no_grad():
        for n, p in c.named_parameters():
            p.add_(tau[n])
    return c


def tasks() -> tuple[dict[str, TensorTaskDataset], dict[str, LinearHead]]:
    g = torch.Generator().manual_seed(0)
    data, heads = {}, {}
    for i, name in enumerate(("a", "b", "c")):
        x = torch.randn(30, 4, generator=g, dtype=torch.float64) + i
        data[name] = TensorTaskDataset(x, (x[:, i] > i).long() + (x[:, 3 - i] > i + 0.5).long())
        heads[name] = LinearHead(torch.randn(3, 6, generator=g), torch.zeros(3))
    return data, heads


def stream(bank, names=("a", "b", "c"), *, resume=False, task_recipes=None):
    data, heads = tasks()
    exps = [Experience(i, n, i, data[n], data[n], None, 3) for i, n in enumerate(names)]
    return run_stream(exps, Backbone("mlp", network(), 6), heads, RECIPE, bank, scenario="tiny", resume=resume,
                      task_recipes=task_recipes)


def test_the_mode_is_plain_fine_tuning_that_continues_and_merges_by_magmax():
    mode = Mode("sequential")
    assert mode.family is Family.NONLINEAR and not mode.linearized and not mode.penalized
    assert mode.continues and not any(m.continues for m in Mode if m is not mode)
    assert mode.stream_merge == "magmax" and Mode.TAUJP.stream_merge == "task-arithmetic"
    assert combined_mode(["sequential", "nonlinear"]) == "nonlinear"


def test_fine_tuning_from_a_start_is_plain_fine_tuning_of_the_edited_network():
    module = network()
    data, heads = tasks()
    g = torch.Generator().manual_seed(7)
    start = {n: 0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in module.named_parameters()}
    got = fine_tune(module, heads["a"], data["a"], RECIPE, start=start).task_vector
    moved = fine_tune(edited(module, start), heads["a"], data["a"], RECIPE.with_overrides(mode="nonlinear"))
    for n, _ in module.named_parameters():
        torch.testing.assert_close(got[n], moved.task_vector[n] + start[n], rtol=1e-12, atol=1e-12)
    assert any(float((got[n] - start[n]).abs().max()) > 1e-4 for n in got)  # it trained


def test_each_vector_starts_from_the_previous_and_the_stream_scores_their_magmax(tmp_path):
    result = stream(tmp_path / "bank")
    bank = Bank(tmp_path / "bank")
    assert [bank.get(n).mode for n in bank.names()] == ["sequential"] * 3
    module = network()
    data, heads = tasks()
    vectors = {n: bank.load(n) for n in "abc"}
    # b started where a ended: b's vector is plain fine-tuning of the network at theta_0 + tau_a, plus tau_a
    moved = fine_tune(edited(module, vectors["a"]), heads["b"], data["b"], RECIPE.with_overrides(mode="nonlinear"))
    for n in vectors["b"]:
        torch.testing.assert_close(vectors["b"][n], moved.task_vector[n] + vectors["a"][n], rtol=1e-10, atol=1e-10)
    for t, seen in ((1, "ab"), (2, "abc")):
        stacked = {n: torch.stack([vectors[s][n] for s in seen]) for n in vectors["a"]}
        # per entry the value of largest magnitude (argmax picks the first of equal ones; ties have measure zero)
        magmax = {n: s.gather(0, s.abs().argmax(0, keepdim=True))[0] for n, s in stacked.items()}
        merged = edited(module, magmax)
        with torch.no_grad():
            for name in seen:
                x, y = data[name].inputs, data[name].targets
                want = float((heads[name](merged(x).float()).argmax(1) == y).double().mean())
                assert result.steps[t].merged["per_task"][name] == pytest.approx(want)
        assert any(not torch.equal(magmax[n], stacked[n].sum(0)) for n in magmax)  # not the sum


def test_a_resumed_sequential_stream_starts_from_the_banked_vector(tmp_path):
    whole = stream(tmp_path / "whole")
    stream(tmp_path / "cut", names=("a", "b"))
    resumed = stream(tmp_path / "cut", resume=True)
    assert [s.resumed for s in resumed.steps] == [True, True, False]
    one, two = Bank(tmp_path / "whole").load("c"), Bank(tmp_path / "cut").load("c")
    assert all(torch.equal(one[n], two[n]) for n in one)
    scores = [{k: v for k, v in s.merged.items() if k != "merge_seconds"} for s in (resumed.steps[-1], whole.steps[-1])]
    assert scores[0] == scores[1] and scores[0]["method"] == "magmax"


def test_sequential_refuses_to_start_from_a_linearized_vector(tmp_path):
    with pytest.raises(BankError, match="sequential fine-tuning would start from 'a'.*linear"):
        stream(tmp_path / "bank", task_recipes={"a": RECIPE.with_overrides(mode="linear")})
    assert Bank(tmp_path / "bank").names() == ["a"]
