"""TauJpPlugin in a stock Avalanche ``Naive`` strategy, checked against editkit's own stream runner.

The ground truth for the plugin is ``editkit.runs.stream.run_benchmark``: the same recipe,
seed, heads and generic source must bank the same vectors, and the merged metrics must be
the numbers the stream runner stores. A tiny MLP backbone (with BatchNorm whose statistics
must stay theta_0's) covers the modes quickly; the slow test repeats it on two packaged
datasets with the real EfficientNet-Lite0 backbone.
"""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.core.taujp import UnlabeledSource
from editkit.data.tasks import tensor_task
from editkit.errors import ConfigError
from editkit.integrations.avalanche.benchmark import benchmark_from_tasks, quiet_avalanche_import
from editkit.integrations.avalanche.metrics import MergedAccuracy
from editkit.integrations.avalanche.multitask import MultiHeadTaskModel
from editkit.integrations.avalanche.plugin import TauJpPlugin, UnlabeledBuffer
from editkit.core.batching import TensorBatching
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.runs.stream import run_benchmark
from editkit.train.recipe import Recipe

from helpers.models import mlp

with quiet_avalanche_import():
    from avalanche.models import MultiTaskModule
    from avalanche.training import Naive
    from avalanche.logging import TextLogger
    from avalanche.training.plugins import EvaluationPlugin

D_IN, FEATURES = 8, 6


def mlp_backbone() -> Backbone:
    """An MLP whose BatchNorm holds non-default running statistics (train mode would change them)."""
    module = mlp(D_IN, 16, FEATURES, batchnorm=True, seed=1)
    bn = module[1]
    bn.running_mean.copy_(torch.linspace(-1, 1, 16))
    bn.running_var.copy_(torch.linspace(0.5, 2, 16))
    return Backbone("mlp", module, FEATURES)


def synthetic_tasks(sizes=(3, 4), train: int = 60, test: int = 30):
    """Tasks whose classes shift the input mean; different class counts per task."""
    generator = torch.Generator().manual_seed(0)
    tasks = []
    for t, classes in enumerate(sizes):
        def split(n):
            y = torch.randint(0, classes, (n,), generator=generator)
            x = torch.randn(n, D_IN, generator=generator) + torch.nn.functional.one_hot(y, D_IN).float() * 2
            return x, y
        (xtr, ytr), (xte, yte) = split(train), split(test)
        tasks.append(tensor_task(f"t{t}", [str(c) for c in range(classes)], xtr, ytr, xte, yte))
    return tasks


def random_heads(tasks, seed: int = 0) -> dict[str, LinearHead]:
    generator = torch.Generator().manual_seed(seed)
    return {t.name: LinearHead(torch.randn(t.num_classes, FEATURES, generator=generator),
                               torch.randn(t.num_classes, generator=generator)) for t in tasks}


def generic_source(seed: int = 7) -> UnlabeledSource:
    return UnlabeledSource("generic", torch.randn(50, D_IN, generator=torch.Generator().manual_seed(3)), seed=seed)


def train_naive(benchmark, backbone, heads, names, bank, recipe, *, generic=None, eval_every=-1, mem_size=None):
    """A stock Naive script with the plugin line; returns the evaluator's collected metrics."""
    model = MultiHeadTaskModel(backbone, [heads[n] for n in names])
    evaluator = EvaluationPlugin(loggers=[TextLogger(io.StringIO())])
    strategy = Naive(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
                     train_mb_size=5,
                     train_epochs=3, eval_mb_size=64, device="cpu", evaluator=evaluator, eval_every=eval_every,
                     plugins=[TauJpPlugin(recipe, bank=bank, names=names, scenario="mini", generic=generic,
                                          mem_size=mem_size)])
    for t, exp in enumerate(benchmark.train_stream):
        strategy.train(exp, eval_streams=[benchmark.test_stream[: t + 1]])
        strategy.eval(benchmark.test_stream[: t + 1])
    return strategy, evaluator.get_all_metrics()


def check_same_stream(result, names, editkit_bank: Bank, plugin_bank: Bank, metrics, atol: float) -> float:
    """Vectors equal within ``atol``; merged metrics and banked numbers equal editkit's. Returns the max difference."""
    worst = 0.0
    for name in names:
        ours, theirs = plugin_bank.load(name), editkit_bank.load(name)
        assert ours.keys() == theirs.keys()
        worst = max(worst, max((ours[k] - theirs[k]).abs().max().item() for k in ours))
        mine, ref = plugin_bank.get(name), editkit_bank.get(name)
        assert (mine.mode, mine.step, mine.scenario, mine.recipe, mine.base) == \
            (ref.mode, ref.step, ref.scenario, ref.recipe, ref.base)
        for key in ("single_task", "pretrained"):
            assert mine.metrics[key] == pytest.approx(ref.metrics[key], abs=1e-9)
        assert mine.metrics["merged"]["per_task"] == pytest.approx(ref.metrics["merged"]["per_task"], abs=1e-9)
    assert worst <= atol
    for t, step in enumerate(result.steps):  # one stream value per strategy.eval after experience t
        assert metrics["MergedAcc_Stream/eval_phase/test_stream"][1][t] == pytest.approx(step.merged["absolute"])
        assert metrics["MergedNormAcc_Stream/eval_phase/test_stream"][1][t] == pytest.approx(step.merged["normalized"])
        for i, name in enumerate(names[: t + 1]):
            key = f"MergedAcc_Exp/eval_phase/test_stream/Task{i:03d}/Exp{i:03d}"
            assert metrics[key][1][t - i] == pytest.approx(step.merged["per_task"][name])
    return worst


@pytest.mark.parametrize("mode", ["taujp", "linear"])
def test_naive_with_plugin_banks_what_editkit_stream_banks(tmp_path, mode):
    tasks = synthetic_tasks()
    names = [t.name for t in tasks]
    heads = random_heads(tasks)
    backbone = mlp_backbone()
    state = {k: v.clone() for k, v in backbone.module.state_dict().items()}
    recipe = Recipe(mode=mode, steps=6, batch_size=8, lr=1e-2, reg_batch=3, warmup=2, grad_clip=0.5)
    benchmark = benchmark_from_tasks(tasks)
    result = run_benchmark(benchmark, backbone, recipe, tmp_path / "editkit", names=names, heads=heads,
                           scenario="mini", generic=generic_source())
    # periodic evaluation every epoch runs during training and must change nothing
    _, metrics = train_naive(benchmark, backbone, heads, names, tmp_path / "plugin", recipe,
                             generic=generic_source(), eval_every=1)
    worst = check_same_stream(result, names, Bank(tmp_path / "editkit"), Bank(tmp_path / "plugin"), metrics, 1e-6)
    print(f"{mode}: max |tau_plugin - tau_editkit| = {worst:.2e}")
    for k, v in backbone.module.state_dict().items():  # theta_0 and its BatchNorm statistics never moved
        assert torch.equal(v, state[k]), k
