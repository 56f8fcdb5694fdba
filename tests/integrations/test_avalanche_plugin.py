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
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.core.taujp import UnlabeledSource
from editkit.data.tasks import tensor_task
from editkit.errors import ConfigError
from editkit._compat import quiet_avalanche_import
from editkit.integrations.avalanche.benchmark import benchmark_from_tasks
from editkit.integrations.avalanche.metrics import MergedAccuracy
from editkit.integrations.avalanche.multitask import MultiHeadTaskModel
from editkit.integrations.avalanche.plugin import TauJpPlugin, UnlabeledBuffer
from editkit.core.batching import TensorBatching
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.runs.stream import probe_heads, run_benchmark
from editkit.integrations.avalanche.benchmark import experiences
from editkit.train.recipe import Recipe, attach_adapter

from helpers.models import mlp

with quiet_avalanche_import():
    from avalanche.core import SupervisedPlugin
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


def train_naive(benchmark, backbone, heads, names, bank, recipe, *, generic=None, eval_every=-1, mem_size=None,
                extra_plugins=()):
    """A stock Naive script with the plugin line; returns the evaluator's collected metrics."""
    model = MultiHeadTaskModel(backbone, [heads[n] for n in names])
    evaluator = EvaluationPlugin(loggers=[TextLogger(io.StringIO())])
    strategy = Naive(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), criterion=nn.CrossEntropyLoss(),
                     train_mb_size=5,
                     train_epochs=3, eval_mb_size=64, device="cpu", evaluator=evaluator, eval_every=eval_every,
                     plugins=[TauJpPlugin(recipe, bank=bank, names=names, scenario="mini", generic=generic,
                                          mem_size=mem_size), *extra_plugins])
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


@pytest.mark.parametrize("mode, adapter, within", [
    ("taujp", "none", False), ("taujp", "none", True), ("taujp", "none", 2), ("taujp-kfac", "none", False),
    ("taujp-kfac", "lora", False), ("linear", "none", False),
    ("nonlinear", "none", False),
    ("taujp-nonlinear", "none", False), ("sequential", "none", False), ("taujp", "lora", False),
    ("nonlinear", "lora", False), ("taujp+sum", "none", False), ("taujp-kfac+sum", "none", False)])
def test_naive_with_plugin_banks_what_editkit_stream_banks(tmp_path, mode, adapter, within):
    """within: the reg rows are part of the batch (``reg_within_batch``: all 3, so both draw 5 labelled rows a
    step; or 2 of them, 6 labelled rows). ``+sum``: each experience fine-tuned beside the earlier vectors
    (``from_sum``)."""
    tasks = synthetic_tasks()
    names = [t.name for t in tasks]
    heads = random_heads(tasks)
    backbone = mlp_backbone()
    mode, _, from_sum = mode.partition("+")
    penalty = {"penalty": "kfac", "curvature_examples": 20} if mode.endswith("-kfac") else {}
    recipe = Recipe(mode=mode.removesuffix("-kfac"), steps=6, batch_size=8, lr=1e-2, reg_batch=3, warmup=2,
                    grad_clip=0.5, adapter=adapter, lora_rank=2, reg_within_batch=within, from_sum=bool(from_sum),
                    **penalty)
    if adapter != "none":  # theta_0 is the model with its adapter at initialisation, for both
        attach_adapter(backbone.module, [recipe])
    state = {k: v.clone() for k, v in backbone.module.state_dict().items()}
    benchmark = benchmark_from_tasks(tasks)
    result = run_benchmark(benchmark, backbone, recipe, tmp_path / "editkit", names=names, heads=heads,
                           scenario="mini", generic=generic_source())
    if adapter != "none":
        assert all(".lora_" in key for key in Bank(tmp_path / "editkit").load(names[0]))
    # periodic evaluation every epoch runs during training and must change nothing
    _, metrics = train_naive(benchmark, backbone, heads, names, tmp_path / "plugin", recipe,
                             generic=generic_source(), eval_every=1)
    worst = check_same_stream(result, names, Bank(tmp_path / "editkit"), Bank(tmp_path / "plugin"), metrics, 1e-6)
    print(f"{mode}: max |tau_plugin - tau_editkit| = {worst:.2e}")
    for name in names:  # the data-free penalty's curvature, banked alike (none elsewhere)
        ours, theirs = (Bank(tmp_path / b).curvature(name) for b in ("plugin", "editkit"))
        assert (ours is None) == (theirs is None) == (not penalty)
        if penalty:
            assert all(torch.equal(ours.to_tensors()[k], v) for k, v in theirs.to_tensors().items())
        # the class statistics too (a head over every class seen), from the same inputs under the merged vectors
        ours, theirs = (Bank(tmp_path / b).prototypes(name) for b in ("plugin", "editkit"))
        assert ours.counts.tolist() == theirs.counts.tolist() and ours.counts.sum() == 54  # 60 less the validation tenth
        assert torch.allclose(ours.merged, theirs.merged, atol=1e-5) and torch.equal(ours.pretrained, theirs.pretrained)
        assert torch.allclose(ours.merged_scatter, theirs.merged_scatter, atol=1e-4)
    for k, v in backbone.module.state_dict().items():  # theta_0 and its BatchNorm statistics never moved
        assert torch.equal(v, state[k]), k


def test_an_epoch_with_reg_rows_within_the_batch_is_a_pass_over_every_labelled_example(tmp_path):
    """Batches of 8 with the 3 reg rows within carry 5 labelled rows: one epoch of a task of n train examples
    is ceil(n / 5) steps (not ceil(n / 8)), in editkit's stream and through the plugin alike."""
    tasks = synthetic_tasks()
    sizes = [len(t.train) for t in tasks]
    assert sizes == [54, 54]  # 60 less the validation carved out of them: 11 steps of 5 rows, not 7 of 8
    names = [t.name for t in tasks]
    heads = random_heads(tasks)
    backbone = mlp_backbone()
    recipe = Recipe(mode="taujp", epochs=1, batch_size=8, lr=1e-2, reg_batch=3, warmup=2, reg_within_batch=True)
    benchmark = benchmark_from_tasks(tasks)
    result = run_benchmark(benchmark, backbone, recipe, tmp_path / "editkit", names=names, heads=heads,
                           scenario="mini", generic=generic_source())
    _, metrics = train_naive(benchmark, backbone, heads, names, tmp_path / "plugin", recipe, generic=generic_source())
    check_same_stream(result, names, Bank(tmp_path / "editkit"), Bank(tmp_path / "plugin"), metrics, 1e-6)
    assert [Bank(tmp_path / "editkit").get(n).recipe["steps"] for n in names] == [11, 11]  # ceil(54 / 5)
    assert [step.cost.train_steps for step in result.steps] == [11, 11]


def test_multi_head_logits_are_unpadded_where_avalanche_pads_zeros():
    """All-negative probe logits: Avalanche's zero padding would make a padded column win."""
    backbone = mlp_backbone()
    heads = [LinearHead(torch.zeros(3, FEATURES), torch.tensor([-5.0, -1.0, -3.0])),  # argmax 1
             LinearHead(torch.zeros(5, FEATURES), torch.tensor([-4.0, -6.0, -7.0, -2.0, -9.0]))]  # argmax 3
    model = MultiHeadTaskModel(backbone, heads).eval()
    x = torch.randn(4, D_IN)
    labels = torch.tensor([0, 1, 0, 1])
    with torch.no_grad():
        single = model(x[labels == 0], torch.zeros(2, dtype=torch.long))
        mixed = model(x, labels)
        model.max_class_label = 5
        padded = MultiTaskModule.forward(model, x, labels)  # what Avalanche's base class returns
    assert single.shape == (2, 3) and torch.equal(single, heads[0].bias.expand(2, 3))
    assert torch.equal(mixed[labels == 0, :3], heads[0].bias.expand(2, 3))
    assert torch.isneginf(mixed[labels == 0, 3:]).all()
    assert torch.equal(mixed[labels == 1], heads[1].bias.expand(2, 5))
    assert mixed.argmax(1).tolist() == [1, 3, 1, 3]
    assert padded.argmax(1).tolist() == [3, 3, 3, 3]  # task 0 has no class 3: its padded zero won


def test_every_tasks_logits_come_from_one_pass_of_the_backbone():
    """LwF asks for every trained task's logits twice a step, Replay and A-GEM send batches of every task: the heads
    share one pass of the backbone, and each task's logits are its head on theta_0's features, as one task's
    forward gives them."""
    backbone = mlp_backbone()
    heads = [LinearHead(torch.randn(3, FEATURES), torch.randn(3)), LinearHead(torch.randn(5, FEATURES), torch.randn(5))]
    model = MultiHeadTaskModel(backbone, heads, mode="nonlinear").eval()
    model.known_train_tasks_labels = {0, 1}
    x, calls = torch.randn(4, D_IN), []
    backbone.module.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        every = model(x, None)
        mixed = model(x, torch.tensor([1, 0, 0, 1]))
        assert len(calls) == 1  # the same batch again, theta unmoved: its features are reused
        features = backbone.module(x)
    torch.testing.assert_close(mixed[[1, 2], :3], heads[0](features[[1, 2]]), rtol=0, atol=0)
    torch.testing.assert_close(mixed[[0, 3]], heads[1](features[[0, 3]]), rtol=0, atol=0)
    assert list(every) == [0, 1]
    for label, head in enumerate(heads):
        torch.testing.assert_close(every[label], head(features), rtol=0, atol=0)
        torch.testing.assert_close(every[label], model(x, torch.full((4,), label)), rtol=0, atol=0)


def test_lwf_second_forward_of_a_batch_reuses_its_features_until_theta_moves():
    """LwF's step: the strategy's forward of a batch, then every head on the same batch. The backbone runs once, the
    gradient is the one two separate passes give, and an optimizer step, a new batch or a deep copy (LwF keeps one)
    never gets features of other weights."""
    import copy

    backbone = mlp_backbone()
    heads = [LinearHead(torch.randn(3, FEATURES), torch.randn(3)), LinearHead(torch.randn(5, FEATURES), torch.randn(5))]
    model = MultiHeadTaskModel(backbone, heads, mode="nonlinear").train()
    model.known_train_tasks_labels = {0, 1}
    x, labels, calls = torch.randn(4, D_IN), torch.ones(4, dtype=torch.long), []
    backbone.module.register_forward_hook(lambda *_: calls.append(1))

    def lwf_loss(model, x):
        every = model(x, None)
        return nn.functional.cross_entropy(model(x, labels), torch.tensor([0, 1, 2, 3])) + every[0].square().mean()

    theta = list(model.task_model.theta)
    torch.autograd.backward(lwf_loss(model, x))
    assert len(calls) == 1
    reused = [p.grad.clone() for p in theta]
    # ground truth: the same loss from two separate passes of the backbone, no features kept
    def plain(x):  # the backbone at theta, called directly
        return torch.func.functional_call(backbone.module, dict(zip(model.task_model.names, theta)), (x,))

    separate = [plain(x) for _ in range(2)]
    loss = (nn.functional.cross_entropy(heads[1](separate[0]), torch.tensor([0, 1, 2, 3]))
            + heads[0](separate[1]).square().mean())
    for got, want in zip(reused, torch.autograd.grad(loss, theta)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)

    kept = copy.deepcopy(model)  # LwF's copy of the model after an experience
    calls.clear()
    kept(x, None)
    assert len(calls) == 1, "a deep copy starts with nothing remembered"
    with torch.no_grad():
        model(x, None)  # remembered
        torch.optim.SGD(theta, lr=0.5).step()
        calls.clear()
        moved = model(x, None)[1]
        model(x.clone(), None)
        assert len(calls) == 2, "features of moved weights and of another batch are computed"
        want = heads[1](plain(x))
    torch.testing.assert_close(moved, want, rtol=0, atol=0)


class Label:
    """A label object whose lifetime a test can watch."""

    def __init__(self, value: int) -> None:
        self.value = value


class LabelledItems(torch.utils.data.Dataset):
    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs_ = inputs
        self.labels: list[weakref.ref] = []

    def __len__(self) -> int:
        return len(self.inputs_)

    def __getitem__(self, i: int):
        label = Label(i)
        self.labels.append(weakref.ref(label))
        return self.inputs_[i], label, 0


def test_buffer_keeps_inputs_never_labels():
    inputs = torch.randn(20, D_IN)
    dataset = LabelledItems(inputs)
    buffer = UnlabeledBuffer(TensorBatching(), mem_size=6, seed=0)
    source = buffer.add("t0", dataset, index=0)
    gc.collect()
    assert dataset.labels and all(ref() is None for ref in dataset.labels)  # no label survived in the buffer
    assert len(source) == 6 and source.inputs.shape == (6, D_IN)
    chosen = torch.randperm(20, generator=torch.Generator().manual_seed(1))[:6]  # seed + 1 + index
    assert torch.equal(source.inputs, inputs[chosen])
    everything = UnlabeledBuffer(TensorBatching(), mem_size=None).add("t0", dataset, index=0)
    assert torch.equal(everything.inputs, inputs)


class TrainingModes(SupervisedPlugin):
    """Records, at every training forward, whether the model and its BatchNorm are in train mode."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.bn = bn
        self.modes: list[tuple[bool, bool]] = []

    def after_forward(self, strategy, **kwargs) -> None:
        self.modes.append((strategy.model.training, self.bn.training))


def test_plugin_keeps_theta0_batchnorm_and_bounds_its_buffer(tmp_path):
    tasks = synthetic_tasks()
    names = [t.name for t in tasks]
    backbone = mlp_backbone()
    spy = TrainingModes(backbone.module[1])
    recipe = Recipe(steps=3, batch_size=8, reg_batch=2)
    strategy, _ = train_naive(benchmark_from_tasks(tasks), backbone, random_heads(tasks), names, tmp_path / "bank",
                              recipe, mem_size=5, extra_plugins=[spy])
    assert spy.modes == [(True, False)] * 6  # Avalanche's train() reached the wrapper, never theta_0's BatchNorm
    assert torch.equal(backbone.module[1].running_mean, torch.linspace(-1, 1, 16))
    plugin = next(p for p in strategy.plugins if isinstance(p, TauJpPlugin))
    assert [len(s) for s in plugin.buffer.sources] == [5, 5]
    assert sum(isinstance(m, MergedAccuracy) for m in strategy.evaluator.metrics) == 1  # added once, not per call
    assert strategy.train_epochs == 3 and isinstance(strategy.optimizer, torch.optim.SGD)  # the script's, restored


def test_plugin_refuses_what_a_strategy_cannot_do(tmp_path):
    with pytest.raises(ConfigError, match="scope 'seen'"):
        TauJpPlugin(bank=tmp_path, scope="all")
    with pytest.raises(ConfigError, match="accumulation"):
        TauJpPlugin(bank=tmp_path, accumulation=2)
    with pytest.raises(ConfigError, match="penalty_on = 'distribution' is a language model's"):
        TauJpPlugin(bank=tmp_path, penalty="kfac", penalty_on="distribution")
    with pytest.raises(ConfigError, match="unknown recipe field"):
        TauJpPlugin(bank=tmp_path, lamda=0.1)


def packaged_benchmark(backbone, train: int = 80, test: int = 40):
    from editkit.data.packaged import packaged_task

    tasks = [packaged_task(name, name, backbone, train, test) for name in ["mnist", "digits"]]
    return benchmark_from_tasks(tasks), [t.name for t in tasks]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["taujp", "linear"])
def test_packaged_two_task_stream_plugin_equals_editkit(tmp_path, mode):
    """The real backbone (EfficientNet-Lite0, BatchNorm everywhere) on two packaged datasets."""
    from editkit.models import efficientnet

    backbone = efficientnet.build(image_size=32)
    benchmark, names = packaged_benchmark(backbone)
    heads = probe_heads(backbone, experiences(benchmark, names), seed=0)
    recipe = Recipe(mode=mode, steps=3, batch_size=16, reg_batch=4)
    crops = torch.randn(40, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    result = run_benchmark(benchmark, backbone, recipe, tmp_path / "editkit", names=names, heads=heads,
                           scenario="mini", generic=UnlabeledSource("generic", crops, seed=9))
    _, metrics = train_naive(benchmark, backbone, heads, names, tmp_path / "plugin", recipe,
                             generic=UnlabeledSource("generic", crops, seed=9))
    worst = check_same_stream(result, names, Bank(tmp_path / "editkit"), Bank(tmp_path / "plugin"), metrics, 1e-5)
    print(f"{mode}: max |tau_plugin - tau_editkit| = {worst:.2e}; merged {result.final['absolute']:.4f} / "
          f"{result.final['normalized']:.4f}")


@pytest.mark.slow
def test_example_script_runs_offline(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "examples" / "avalanche_plugin.py"), "--steps", "2",
                          "--train-size", "60", "--test-size", "30", "--bank", str(tmp_path / "bank")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "MergedAcc_Stream/eval_phase/test_stream" in out.stdout and "merged model (alpha = 1)" in out.stdout
    bank = Bank(tmp_path / "bank")
    assert bank.names() == ["mnist", "digits"] and bank.get("digits").metrics["merged"]["per_task"].keys() == {
        "mnist", "digits"}
