"""Avalanche's strategies through an editkit stream, under the task and the class protocol: the recipe's steps
exactly (Avalanche's own clock), the scores of the model they leave (counted by hand when nothing may move), global
labels and a growing head in the class protocol, what each strategy keeps (counted by hand), that the strategies
which should forget less do on a stream that forgets, seeded runs, and refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from editkit._compat import quiet_avalanche_import
from editkit.core.batching import TensorBatching
from editkit.errors import ConfigError
from editkit.eval.continual import PROTOCOLS, continual_metrics
from editkit.integrations.avalanche import strategies
from editkit.integrations.avalanche.strategies import STRATEGIES, copying_synaptic_intelligence, run_strategy
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.train.recipe import Recipe

from helpers.forgetting import forgetful_recipes, forgetful_stream
from helpers.models import mlp

D_IN, FEATURES = 8, 6
VOCAB = 12  # the text stream's token ids


def stream(sizes=(3, 2), train: int = 40, test: int = 30) -> SimpleNamespace:
    """A built scenario's three parts: tasks whose classes shift the input's mean, an MLP backbone, random heads."""
    from editkit.data.tasks import tensor_task

    generator = torch.Generator().manual_seed(0)
    tasks = []
    for t, classes in enumerate(sizes):
        def split(n):
            y = torch.randint(0, classes, (n,), generator=generator)
            return torch.randn(n, D_IN, generator=generator) + torch.nn.functional.one_hot(y, D_IN).float() * 2, y
        (xtr, ytr), (xte, yte) = split(train), split(test)
        tasks.append(tensor_task(f"t{t}", [str(c) for c in range(classes)], xtr, ytr, xte, yte))
    heads = {t.name: LinearHead(torch.randn(t.num_classes, FEATURES, generator=generator),
                                torch.randn(t.num_classes, generator=generator)) for t in tasks}
    backbone = Backbone("mlp", mlp(D_IN, 16, FEATURES, seed=1), FEATURES, batching=TensorBatching())
    return SimpleNamespace(tasks=tasks, heads=heads, backbone=backbone)


def recipes(*steps: int, lr: float = 1e-2) -> list[Recipe]:
    return [Recipe(mode="nonlinear", steps=s, batch_size=16, lr=lr, warmup=0, seed=3) for s in steps]


def by_hand(built, task) -> float:
    """θ0's accuracy on a task's test split: its head's argmax over the backbone's features, counted here."""
    with torch.no_grad():
        predicted = built.heads[task.name](built.backbone.module(task.test.inputs)).argmax(1)
    return (predicted == task.test.targets).float().mean().item()


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_takes_the_recipes_steps_across_epochs_and_scores_every_seen_task(name, protocol):
    built = stream()
    result = run_strategy(name, built, recipes(4, 7), protocol=protocol)  # 36 examples / 16: 7 steps span three epochs
    assert result.steps == 11 and result.protocol == protocol  # Avalanche's clock: 4 + 7 (joint: once over both)
    if STRATEGIES[name].joint:
        assert [list(row) for row in result.rows] == [["t0", "t1"]]
    else:
        assert [list(row) for row in result.rows] == [["t0"], ["t0", "t1"]]
    assert all(0.0 <= v <= 1.0 for row in result.rows for v in row.values())
    assert result.options == STRATEGIES[name].defaults() and result.train_seconds > 0


@pytest.mark.parametrize("name", ["naive", "lwf", "replay"])
def test_a_strategy_that_may_not_move_scores_theta0_as_counted_by_hand(name):
    built = stream()
    result = run_strategy(name, built, recipes(3, 3, lr=1e-30))  # steps taken, nothing moves at float precision
    theta0 = {t.name: by_hand(built, t) for t in built.tasks}
    assert result.rows == [{"t0": pytest.approx(theta0["t0"])}, pytest.approx(theta0)]
    assert all(torch.equal(p, q) for p, q in zip(built.backbone.module.parameters(),
                                                  mlp(D_IN, 16, FEATURES, seed=1).parameters()))  # θ0 untouched


def test_a_strategy_is_seeded_by_the_recipe():
    first, again = run_strategy("naive", stream(), recipes(5, 5)), run_strategy("naive", stream(), recipes(5, 5))
    assert first.rows == again.rows
    assert run_strategy("naive", stream(), [r.with_overrides(seed=4) for r in recipes(5, 5)]).rows != first.rows


def test_options_are_checked_by_name_and_typed_by_their_defaults():
    given = STRATEGIES.parse_params(["ewc.ewc_lambda=100", "replay.mem_size=500", "ewc.mode=online"])
    assert given == {"ewc": {"ewc_lambda": 100.0, "mode": "online"}, "replay": {"mem_size": 500}}
    assert type(given["ewc"]["ewc_lambda"]) is float and type(given["replay"]["mem_size"]) is int
    assert STRATEGIES.options("lwf", {"alpha": 0.5}) == {"alpha": 0.5, "temperature": 1.0}
    for values, message in ((["ewc.ewc_lamda=1"], "strategy 'ewc': unknown option 'ewc_lamda'; known: ewc_lambda, mode"),
                            (["replay.mem_size=1.5"], "strategy 'replay': mem_size must be an integer, got '1.5'"),
                            (["si.si_lambda=strong"], "strategy 'si': si_lambda must be a number, got 'strong'"),
                            (["gem.x=1"], "unknown strategy 'gem'; known: agem, ewc, joint, lwf, naive, replay, si"),
                            (["ewc_lambda=1"], "strategy option 'ewc_lambda=1' is not STRATEGY.OPTION=VALUE")):
        with pytest.raises(ConfigError) as err:
            STRATEGIES.parse_params(values)
        assert str(err.value) == message
    assert run_strategy("replay", stream(), recipes(2, 2), options={"mem_size": 7}).kept["items"] == 7


def test_synaptic_intelligence_records_the_weights_not_views_of_them():
    """Avalanche's SI stored views of the live weights on a CPU, so its importances and penalty were zero at any
    lambda (it scored exactly what Naive scores): mended for the run, what it records stays put when the weights
    move, and a strong lambda holds the first task where Naive forgets it. Outside the run Avalanche's class is its
    own again (a view, as it was)."""
    from editkit._compat import quiet_avalanche_import

    with quiet_avalanche_import():
        from avalanche.training.plugins import SynapticIntelligencePlugin
    avalanche_own = SynapticIntelligencePlugin.__dict__["extract_weights"]

    def recorded_after_a_step() -> bool:
        """Whether what ``extract_weights`` recorded is still the weights before a step once the step is taken."""
        model = torch.nn.Linear(3, 2)
        target = {n: SimpleNamespace(data=None) for n, _ in model.named_parameters()}
        SynapticIntelligencePlugin.extract_weights(model, target, set())
        before = {n: p.detach().clone().flatten() for n, p in model.named_parameters()}
        with torch.no_grad():
            model.weight.add_(1.0)
        return all(torch.equal(target[n].data, before[n]) for n in before)

    with copying_synaptic_intelligence():
        assert recorded_after_a_step()
    assert SynapticIntelligencePlugin.__dict__["extract_weights"] is avalanche_own and not recorded_after_a_step()

    naive = run_strategy("naive", stream(), recipes(20, 20))
    held = run_strategy("si", stream(), recipes(20, 20), options={"si_lambda": 1e6})
    assert naive.rows[1]["t0"] < naive.rows[0]["t0"]  # plain fine-tuning on t1 forgets some of t0
    assert held.rows[1]["t0"] == held.rows[0]["t0"] == naive.rows[0]["t0"]  # the penalty holds t0's weights
    assert SynapticIntelligencePlugin.__dict__["extract_weights"] is avalanche_own  # given back after the run


class BagOfTokens(torch.nn.Module):
    """Features of a padded batch of token ids: the mean embedding of the real tokens, through a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(2)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, D_IN, generator=generator))
        self.out = torch.nn.Parameter(torch.randn(FEATURES, D_IN, generator=generator))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        weights = attention_mask.unsqueeze(-1).float()
        return ((self.embed[input_ids] * weights).sum(1) / weights.sum(1)) @ self.out.T



class Texts(torch.utils.data.Dataset):
    """Token-id sequences of 1 to 9 tokens; the label is whether the first token is in the vocabulary's top half."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.items = [torch.randint(1, VOCAB, (int(k),), generator=generator)
                      for k in torch.randint(1, 10, (n,), generator=generator)]
        self.targets = [int(ids[0] >= VOCAB // 2) for ids in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.items[index], self.targets[index]


def text_stream() -> SimpleNamespace:
    """Two tasks of texts of different lengths, batched by a SequenceBatching backbone, with random heads."""
    from editkit.core.batching import SequenceBatching
    from editkit.data.tasks import TaskData

    generator = torch.Generator().manual_seed(5)
    tasks = [TaskData(f"t{t}", ["low", "high"], Texts(40, 10 * t), Texts(10, 10 * t + 1), Texts(30, 10 * t + 2))
             for t in range(2)]
    heads = {t.name: LinearHead(torch.randn(2, FEATURES, generator=generator), torch.zeros(2)) for t in tasks}
    backbone = Backbone("bag-of-tokens", BagOfTokens(), FEATURES, batching=SequenceBatching(pad_id=0))
    return SimpleNamespace(tasks=tasks, heads=heads, backbone=backbone)


def text_by_hand(built, task) -> float:
    """θ0's accuracy on a text task, each text run alone with no padding."""
    with torch.no_grad():
        right = [int(built.heads[task.name](built.backbone.module(ids[None], torch.ones(1, len(ids)))).argmax()) == y
                 for ids, y in task.test]
    return sum(right) / len(right)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_runs_over_texts_of_different_lengths(name, protocol):
    """Avalanche's loaders, Replay's buffer and A-GEM's memory batch texts through the backbone's batching (their
    labels made global in the class protocol)."""
    built = text_stream()
    result = run_strategy(name, built, recipes(4, 7), protocol=protocol)
    assert result.steps == 11
    assert all(0.0 <= v <= 1.0 for row in result.rows for v in row.values())
    if protocol == "task" and not STRATEGIES[name].joint:
        frozen = run_strategy(name, text_stream(), recipes(3, 3, lr=1e-30))
        assert frozen.rows[-1] == pytest.approx({t.name: text_by_hand(built, t) for t in built.tasks})


@pytest.mark.parametrize("name", ["agem", "replay"])
def test_a_rehearsal_strategy_keeps_the_same_memory_whatever_the_global_generators_hold(name):
    """A-GEM picks the patterns it keeps with Python's ``random.shuffle``: a run is the recipe's seed's, whatever
    Python's and numpy's generators held before it, and they hold what they held after it."""
    import random

    import numpy as np

    options = {"patterns_per_exp": 6, "sample_size": 12} if name == "agem" else {"mem_size": 6}
    runs = []
    for seed in (1, 2):
        random.seed(seed)
        np.random.seed(seed)
        before = random.getstate(), np.random.get_state()[1].copy()
        runs.append(run_strategy(name, stream((3, 3, 3), train=60), recipes(6, 6, 6, lr=0.3), options=options))
        assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    assert runs[0].rows == runs[1].rows and runs[0].kept == runs[1].kept


def conv_stream() -> SimpleNamespace:
    """The stream of :func:`stream` on a backbone with a convolution: its 8 inputs as a 2-channel 2x2 image."""
    built = stream()
    torch.manual_seed(2)
    module = torch.nn.Sequential(torch.nn.Unflatten(1, (2, 2, 2)), torch.nn.Conv2d(2, FEATURES, 2),
                                 torch.nn.Flatten()).eval()
    built.backbone = Backbone("conv", module, FEATURES, batching=TensorBatching())
    return built


@pytest.mark.parametrize("name, protocol", [("naive", "task"), ("lwf", "task"), ("replay", "task"), ("lwf", "class")])
def test_a_strategy_runs_in_the_runtimes_precision_and_layout(name, protocol, monkeypatch):
    """Every pass of the backbone, training and scoring, runs under bf16 autocast exactly when the runtime asks
    for it, and on channels-last weights exactly when it asks for those, and the strategy's loss always sees fp32
    logits: a strategy row of ``--precision bf16`` is trained, timed and scored as the modes beside it are."""
    from editkit.train.runtime import Runtime

    for runtime in (Runtime(), Runtime(precision="bf16", channels_last=True)):
        built, seen = conv_stream(), set()
        conv = built.backbone.module[1]

        def record(module, args, runtime=runtime):
            weight = module.weight
            seen.add((torch.is_autocast_enabled("cpu"),
                      weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()))

        conv.register_forward_pre_hook(record)
        losses = []
        criterion = torch.nn.CrossEntropyLoss.forward
        monkeypatch.setattr(torch.nn.CrossEntropyLoss, "forward",
                            lambda self, logits, y: losses.append(logits.dtype) or criterion(self, logits, y))
        result = run_strategy(name, built, recipes(3, 2), runtime=runtime, protocol=protocol)
        monkeypatch.undo()
        assert set(losses) == {torch.float32}  # the loss in fp32, as autocast runs editkit's own
        asked = runtime.precision == "bf16"
        assert seen == {(asked, asked)}, runtime
        assert len(result.rows) == 2 and all(0.0 <= a <= 1.0 for row in result.rows for a in row.values())
