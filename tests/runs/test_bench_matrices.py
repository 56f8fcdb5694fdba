"""Every merge method's accuracy matrix (``bench --matrices``): after step t, the method's merge of the first t
vectors at coefficient 1 on the tasks seen, against that merge built here and scored by ``evaluate_vector``."""

from __future__ import annotations

import pytest
import torch

from editkit.bank.store import Bank
from editkit.data.tasks import TaskData, TensorTaskDataset
from editkit.eval.accuracy import ClassificationScorer, evaluate_vector
from editkit.eval.sweep import ModeEvaluator, SharedModels, TaskSplits
from editkit.merge import MERGE_METHODS, method_options
from editkit.models.backbone import state_fingerprint
from editkit.models.heads import LinearHead
from editkit.runs.bench.matrices import method_matrices
from editkit.train.recipe import Recipe
from editkit.util.progress import NullProgress

from helpers import models

NAMES = ["a", "b", "c"]


def three_tasks(tmp_path, mode: str):
    """theta_0 (a small MLP), three 3-class tasks with random heads, and a bank of three random vectors."""
    torch.manual_seed(0)
    module = models.mlp(6, 8, 5, seed=0)
    tasks = [TaskData(n, ["0", "1", "2"], *(TensorTaskDataset(torch.randn(k, 6), torch.randint(0, 3, (k,)))
                                            for k in (20, 9, 40))) for n in NAMES]
    heads = {n: LinearHead(torch.randn(3, 5), torch.randn(3)) for n in NAMES}
    base, bank = state_fingerprint(module.state_dict()), Bank(tmp_path / f"bank-{mode}")
    vectors = {n: {k: 0.6 * torch.randn_like(p) for k, p in module.named_parameters()} for n in NAMES}
    for n in NAMES:
        bank.append(n, vectors[n], task=n, mode=mode, base=base, recipe=Recipe().to_dict())
    data = TaskSplits(module, tasks, batch_size=8, xi_samples=5, progress=NullProgress())
    ev = ModeEvaluator(mode, bank, {n: n for n in NAMES}, data, heads, base, SharedModels.of(module))
    return module, tasks, heads, vectors, ev


def by_hand(module, mode, tasks, heads, vectors, method: str, t: int) -> dict[str, float]:
    """The method's merge of the first ``t`` vectors (the sum of what it returns) scored on those tasks' tests."""
    merged = MERGE_METHODS[method].build({n: vectors[n] for n in NAMES[:t]}, **method_options(method, {}, tasks=t))
    tau = {k: sum(v[k] for v in merged.values()) for k in vectors["a"]}
    scorers = [ClassificationScorer(task.name, heads[task.name], task.test) for task in tasks[:t]]
    return evaluate_vector(module, mode, tau, scorers, batch_size=8)


@pytest.mark.parametrize("mode", ["linear", "nonlinear"])
@pytest.mark.parametrize("method", ["task-arithmetic", "ties", "magmax"])
def test_each_row_is_the_methods_merge_of_the_vectors_so_far(tmp_path, mode, method):
    module, tasks, heads, vectors, ev = three_tasks(tmp_path, mode)
    if ev.linearized:
        ev.compute_tangents(NAMES)
    hand = [by_hand(module, mode, tasks, heads, vectors, method, t) for t in (1, 2, 3)]
    final = {"method": method, "coefficient": "1.0", "per_task": hand[-1]}  # the table's row ends the matrix
    got = method_matrices(ev, [method], NAMES, [final], lambda t: {method: method_options(method, {}, tasks=t)},
                          NullProgress())[method]
    expected = [[hand[0]["a"], None, None], [hand[1]["a"], hand[1]["b"], None], [hand[2][n] for n in NAMES]]
    assert got["matrix"] == [[pytest.approx(v, abs=1e-12) if v is not None else None for v in row] for row in expected]
    assert got["bwt"] == pytest.approx((hand[2]["a"] - hand[0]["a"] + hand[2]["b"] - hand[1]["b"]) / 2)
    assert got["forgetting"] == pytest.approx((max(hand[0]["a"], hand[1]["a"]) - hand[2]["a"]
                                               + hand[1]["b"] - hand[2]["b"]) / 2)
    assert not ev.extras and all(key[0] in NAMES for key in ev._tangents)  # each step's merged vectors dropped
    if method != "task-arithmetic":  # a merge of one vector is not that vector: the first row is a real merge
        assert MERGE_METHODS[method].build({"a": vectors["a"]}, **method_options(method, {}, tasks=1)).keys() != {"a"}


def test_methods_that_name_their_vector_alike_are_scored_apart(tmp_path):
    """An extension's merge may name its vector as a built-in's does ("ties"): each step is still scored with its
    own method's vector, not the other's memoised predictions."""
    from dataclasses import replace

    module, tasks, heads, vectors, ev = three_tasks(tmp_path, "nonlinear")
    negated = replace(MERGE_METHODS["ties"], build=lambda vectors, **options: {
        "ties": {k: -sum(v[k] for v in vectors.values()) for k in next(iter(vectors.values()))}})
    MERGE_METHODS.register("negated-sum", negated)
    try:
        options_for = lambda t: {m: method_options("ties", {}, tasks=t) for m in ("ties", "negated-sum")}
        finals = [{"method": m, "coefficient": "1.0", "per_task": {n: 0.0 for n in NAMES}} for m in ("ties", "negated-sum")]
        got = method_matrices(ev, ["ties", "negated-sum"], NAMES, finals, options_for, NullProgress())
    finally:
        MERGE_METHODS.unregister("negated-sum")
    scorers = [ClassificationScorer(t.name, heads[t.name], t.test) for t in tasks[:2]]
    minus = evaluate_vector(module, "nonlinear", {k: -(vectors["a"][k] + vectors["b"][k]) for k in vectors["a"]},
                            scorers, batch_size=8)
    assert got["negated-sum"]["matrix"][1][:2] == [pytest.approx(minus["a"], abs=1e-12), pytest.approx(minus["b"], abs=1e-12)]
    assert got["ties"]["matrix"][1][:2] == [pytest.approx(v, abs=1e-12)
                                            for v in by_hand(module, "nonlinear", tasks, heads, vectors, "ties", 2).values()]
