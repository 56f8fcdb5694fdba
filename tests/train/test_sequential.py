"""Fine-tunings that start from earlier vectors: ``sequential`` mode, MagMax's continual recipe (fine-tune each
task from the previous task's weights, bank theta_t - theta_0, merge by max magnitude), and ``from_sum`` (each
task at theta_0 plus the sum of the vectors banked before it, banking what it adds).

Ground truth: a fine-tuning started at theta_0 + tau is plain fine-tuning of a copy of the network whose
weights were edited to theta_0 + tau; the stream's merged scores are recomputed from the banked vectors with a
max-magnitude selection written here with ``argmax`` over stacked absolute values, and the network run at
theta_0 + that vector. For ``from_sum``: the linearized model's output at a point is f(x; theta_0) plus the
directional derivative of f along the displacement, taken by central differences of the network in float64; the
penalty is the mean per-row L2 norm of that derivative along the *added* vector alone; and a stream's vectors,
summed, are where the last task's fine-tuning ended (``start`` there trains the same steps from the same point).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.core.modes import Family, Mode, combined_mode
from editkit.core.linearize import LinearizedModel
from editkit.core.taujp import Regularizer, UnlabeledSource
from editkit.data.tasks import TensorTaskDataset
from editkit.errors import BankError, ConfigError
from editkit.integrations.avalanche.benchmark import Experience
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.runs.stream import run_stream
from editkit.train.loop import StepComputer, fine_tune
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


def stream(bank, names=("a", "b", "c"), *, resume=False, task_recipes=None, recipe=RECIPE):
    data, heads = tasks()
    exps = [Experience(i, n, i, data[n], data[n], None, 3) for i, n in enumerate(names)]
    return run_stream(exps, Backbone("mlp", network(), 6), heads, recipe, bank, scenario="tiny", resume=resume,
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


SUM_RECIPE = Recipe(mode="taujp", from_sum=True, steps=4, batch_size=10, lr=5e-2, lam=0.5, reg_batch=4, warmup=0,
                generic=False)


def directional(module, x, along, eps: float = 1e-6) -> torch.Tensor:
    """d/de f(x; theta_0 + e * along) at e = 0, by central differences (float64)."""
    with torch.no_grad():
        return (edited(module, {n: eps * v for n, v in along.items()})(x)
                - edited(module, {n: -eps * v for n, v in along.items()})(x)) / (2 * eps)


def draws(seed: int, module, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in module.named_parameters()}


def test_the_forward_moves_along_the_sum_and_the_penalty_along_what_the_task_adds():
    module = network()
    earlier, added = draws(1, module), draws(2, module)
    model = LinearizedModel(module)
    model.load_task_vector(added, beside=earlier)
    x, x_o = torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64) + 1
    regularizer = Regularizer([UnlabeledSource("o", x_o)], lam=0.5, batch_size=4)
    computer = StepComputer(model, torch.nn.Identity(), regularizer)
    features, reg = computer.features(x, [x_o])
    total = {n: earlier[n] + added[n] for n in earlier}
    with torch.no_grad():
        f0 = module(x)
    torch.testing.assert_close(features, f0 + directional(module, x, total), rtol=1e-7, atol=1e-8)
    by_hand = 0.5 * torch.linalg.vector_norm(directional(module, x_o, added), dim=1).mean()
    torch.testing.assert_close(reg, by_hand.float(), rtol=1e-6, atol=1e-7)  # the penalty is taken in float32
    # along the sum it would be another number: the penalty reads the added vector alone
    along_sum = 0.5 * torch.linalg.vector_norm(directional(module, x_o, total), dim=1).mean()
    assert abs(float(reg.detach()) - float(along_sum)) > 1e-3
    vector = model.task_vector()
    assert all(torch.allclose(vector[n], added[n], rtol=0, atol=1e-12) for n in added)
    model.load_task_vector(added)  # a plain load forgets the sum it was trained beside
    assert model.beside is None and all(torch.allclose(model.task_vector()[n], added[n]) for n in added)


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
def test_the_banked_vectors_sum_to_where_the_last_fine_tuning_ended(tmp_path, mode):
    """Without a penalty a from_sum fine-tuning is the same steps as one started at the sum (``start``); only
    what it banks differs. So the sum of a stream's banked vectors is that run's end point."""
    recipe = Recipe(mode=mode, from_sum=True, steps=4, batch_size=10, lr=5e-2, warmup=0, generic=False)
    result = stream(tmp_path / "bank", recipe=recipe)
    bank = Bank(tmp_path / "bank")
    vectors = {n: bank.load(n) for n in "abc"}
    data, heads = tasks()
    earlier = {n: vectors["a"][n] + vectors["b"][n] for n in vectors["a"]}
    plain = recipe.with_overrides(from_sum=False)
    ended = fine_tune(network(), heads["c"], data["c"], plain, start=earlier).task_vector
    for n in ended:
        torch.testing.assert_close(earlier[n] + vectors["c"][n], ended[n], rtol=1e-10, atol=1e-10)
    assert max(float(vectors["c"][n].abs().max()) for n in ended) > 1e-3  # it banked what it added, not the sum
    # the merged model after the last task (alpha = 1) is the model trained last, and its single-task model: where
    # its fine-tuning ended, not its vector alone
    x, y = data["c"].inputs, data["c"].targets
    with torch.no_grad():
        features = (edited(network(), ended)(x) if mode == "nonlinear"
                    else network()(x) + directional(network(), x, ended))
    want = float((heads["c"](features.float()).argmax(1) == y).double().mean())
    assert result.steps[-1].merged["per_task"]["c"] == pytest.approx(want) == result.steps[-1].single_task
    assert bank.get("c").recipe["from_sum"] is True


def test_a_resumed_stream_trains_beside_the_banked_vectors(tmp_path):
    stream(tmp_path / "whole", recipe=SUM_RECIPE)
    stream(tmp_path / "cut", names=("a", "b"), recipe=SUM_RECIPE)
    resumed = stream(tmp_path / "cut", resume=True, recipe=SUM_RECIPE)
    assert [s.resumed for s in resumed.steps] == [True, True, False]
    one, two = Bank(tmp_path / "whole").load("c"), Bank(tmp_path / "cut").load("c")
    assert all(torch.equal(one[n], two[n]) for n in one)


def test_a_bank_of_vectors_trained_alone_is_refused_by_a_from_sum_run(tmp_path):
    stream(tmp_path / "bank", names=("a",), recipe=SUM_RECIPE.with_overrides(from_sum=False))
    with pytest.raises(BankError, match="from_sum None banked, True now"):
        stream(tmp_path / "bank", resume=True, recipe=SUM_RECIPE)


@pytest.mark.parametrize("fields, says", [
    ({"mode": "sequential"}, "a sequential fine-tuning cannot start"),
    ({"mode": "nonlinear", "adapter": "lora"}, "a nonlinear fine-tuning with a LoRA adapter cannot start"),
])
def test_from_sum_is_refused_where_the_vectors_would_not_add(fields, says):
    with pytest.raises(ConfigError, match=says):
        Recipe(from_sum=True, **fields)
    assert "from_sum" not in Recipe().to_dict() and Recipe(from_sum=True).to_dict()["from_sum"] is True
