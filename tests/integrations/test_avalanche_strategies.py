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


@pytest.mark.parametrize("name, protocol", [("naive", "task"), ("lwf", "task"), ("replay", "task"), ("lwf", "class"),
                                            ("agem", "task")])
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


def metrics(result) -> dict:
    """A run's ACC and BWT (joint training: its one row, ACC only)."""
    names = [t.name for t in forgetful_stream().tasks]
    if STRATEGIES[result.name].joint:
        return {"acc": sum(result.rows[-1].values()) / len(names), "bwt": None}
    return continual_metrics(names, result.rows)


#: LwF's distillation against the class protocol's new classes needs weight: its loss is the old classes' softmax
#: among themselves, blind to the new classes' logits rising over them.
FORGETTING = {"naive": {}, "replay": {"mem_size": 30}, "lwf": {"alpha": 100.0, "temperature": 2.0}, "joint": {}}



def test_agem_projects_channels_last_gradients_as_the_default_layouts(monkeypatch):
    """Avalanche's A-GEM flattens gradients with ``view``, which a channels-last weight's gradient refuses: with its
    mend, the reference gradient it keeps and every projected gradient are the default layout's, element for
    element, in the weight's logical order, and the optimizer gets gradients laid out as their weights."""
    from avalanche.training.plugins import AGEMPlugin
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from editkit.train.runtime import Runtime

    def recorded(runtime: Runtime) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        references, projected = [], []
        own_reference, own_projection = AGEMPlugin.before_training_iteration, AGEMPlugin.after_backward

        def reference(self, strategy, **kwargs):
            own_reference(self, strategy, **kwargs)
            if self.buffers:
                references.append(self.reference_gradients.clone())

        def projection(self, strategy, **kwargs):
            own_projection(self, strategy, **kwargs)
            if self.buffers:
                projected.append(torch.cat([p.grad.reshape(-1) for p in strategy.model.parameters() if p.grad is not None]))

        def laid_out_as_weights(optimizer, args, kwargs):
            layouts.extend(p.grad.stride() == p.stride() for group in optimizer.param_groups
                           for p in group["params"] if p.grad is not None)

        monkeypatch.setattr(AGEMPlugin, "before_training_iteration", reference)
        monkeypatch.setattr(AGEMPlugin, "after_backward", projection)
        hook = register_optimizer_step_pre_hook(laid_out_as_weights)
        try:
            run_strategy("agem", conv_stream(), recipes(3, 2), runtime=runtime, protocol="task")
        finally:
            hook.remove()
            monkeypatch.undo()
        return references, projected

    layouts: list[bool] = []

    default, channels_last = recorded(Runtime()), recorded(Runtime(channels_last=True))
    assert len(default[0]) == len(channels_last[0]) == 2 and len(default[1]) == 2  # the second task's steps
    for ours, theirs in zip(default, channels_last):
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours, theirs))
    assert layouts and all(layouts)

@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_on_a_stream_that_forgets_replay_and_lwf_forget_less_than_naive_and_joint_training_bounds_them(protocol):
    got = {name: metrics(run_strategy(name, forgetful_stream(), forgetful_recipes(), options=options,
                                      protocol=protocol))
           for name, options in FORGETTING.items()}
    assert got["naive"]["bwt"] < -0.3  # plain fine-tuning forgets
    assert got["replay"]["bwt"] > got["naive"]["bwt"] + 0.1
    assert got["lwf"]["bwt"] > got["naive"]["bwt"] + 0.1
    assert all(got["joint"]["acc"] >= m["acc"] for m in got.values()), got


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ewcs_penalty_grows_with_lambda_and_holds_earlier_tasks_the_more(protocol, monkeypatch):
    """Avalanche's EWC adds lambda * sum F (theta - theta*)^2 to the loss: read there, at every step of the tasks
    after the first it is nothing at lambda 0 and more at each larger lambda, and BWT rises with lambda."""
    with quiet_avalanche_import():
        from avalanche.training.plugins import EWCPlugin
    avalanche_own, added = EWCPlugin.before_backward, []

    def reading(plugin, strategy, **kwargs):
        before = float(strategy.loss.detach())
        avalanche_own(plugin, strategy, **kwargs)
        added.append(float(strategy.loss.detach()) - before)

    monkeypatch.setattr(EWCPlugin, "before_backward", reading)
    penalties, bwt = [], []
    for ewc_lambda in (0.0, 1e3, 1e5):
        added.clear()
        result = run_strategy("ewc", forgetful_stream(), forgetful_recipes(), options={"ewc_lambda": ewc_lambda},
                              protocol=protocol)
        penalties.append(sum(added))
        bwt.append(metrics(result)["bwt"])
    assert penalties[0] == 0.0 < penalties[1] < penalties[2]
    assert bwt[0] < bwt[1] < bwt[2]


@pytest.mark.parametrize("name", ["naive", "joint"])
def test_the_class_protocol_trains_on_global_labels_without_task_ids_and_grows_avalanches_classifier(name,
                                                                                                    monkeypatch):
    """Each experience reaches Avalanche with task label 0 and the classes of its task offset by the classes of the
    tasks before it (3, 2 and 2 classes: 0-2, 3-4, 5-6); the loss sees those labels only, and the
    IncrementalClassifier grows to every class seen (joint training: every class before its one run)."""
    with quiet_avalanche_import():
        from avalanche.models import IncrementalClassifier
    avalanche_own, log = IncrementalClassifier.adaptation, []

    def recording(classifier, experience):
        avalanche_own(classifier, experience)
        log.append(("adapted", sorted(experience.task_labels), sorted(experience.classes_in_this_experience),
                    classifier.classifier.out_features))

    criterion = torch.nn.CrossEntropyLoss.forward
    monkeypatch.setattr(IncrementalClassifier, "adaptation", recording)
    monkeypatch.setattr(torch.nn.CrossEntropyLoss, "forward",
                        lambda self, logits, y: log.append(("loss", set(y.tolist()), logits.shape[1]))
                        or criterion(self, logits, y))
    run_strategy(name, stream((3, 2, 2)), recipes(4, 4, 4), protocol="class")
    adapted = [entry[1:] for entry in log if entry[0] == "adapted"]
    assert adapted == [([0], [0, 1, 2], 3), ([0], [3, 4], 5), ([0], [5, 6], 7)]
    losses = [entry[1:] for entry in log if entry[0] == "loss"]
    if name == "joint":
        assert len(losses) == 12 and set().union(*(y for y, _ in losses)) == set(range(7))
        assert {width for _, width in losses} == {7}
    else:
        assert [(set().union(*(y for y, _ in losses[4 * i: 4 * i + 4])), losses[4 * i][1]) for i in range(3)] == [
            ({0, 1, 2}, 3), ({3, 4}, 5), ({5, 6}, 7)]


@pytest.mark.parametrize("name", ["naive", "replay", "joint"])
def test_class_incremental_accuracy_is_the_argmax_over_every_class_seen_as_counted_by_hand(name, monkeypatch):
    """With nothing moving (lr 1e-30), the classifier's rows are the ones each experience scored with (growing
    copies them): after experience k, each seen task's test inputs through θ0 and the first ``classes seen`` rows,
    the argmax against the label offset by the classes before the task."""
    built, models = stream((3, 2, 2)), []
    own_model = strategies._model
    monkeypatch.setattr(strategies, "_model", lambda *args: models.append(own_model(*args)) or models[-1])
    result = run_strategy(name, built, recipes(3, 3, 3, lr=1e-30), protocol="class")
    linear, offsets = models[0].classifier.classifier, [0, 3, 5]

    def by_hand(index: int, classes: int) -> float:
        task = built.tasks[index]
        with torch.no_grad():
            logits = built.backbone.module(task.test.inputs) @ linear.weight[:classes].T + linear.bias[:classes]
        return (logits.argmax(1) == task.test.targets + offsets[index]).float().mean().item()

    seen = [(1, 3), (3, 7)] if name == "joint" else [(1, 3), (2, 5), (3, 7)]
    expected = [{f"t{i}": pytest.approx(by_hand(i, classes)) for i in range(tasks)} for tasks, classes in seen]
    assert result.rows == (expected[-1:] if name == "joint" else expected)
    assert any(0.0 < v < 1.0 for row in result.rows for v in row.values())  # scores a wrong offset would change


def test_the_class_protocol_refuses_a_stream_without_classes_before_any_work():
    """A language-modelling task is a TaskData without classes: no labels to make global. Refused by name in one
    line before anything is built (the stream here has no backbone to train), by run_strategy and by the bench's
    run_strategies for every protocol asked before the first run."""
    from editkit.data.tasks import TaskData
    from editkit.runs.bench.strategies import run_strategies

    texts = stream()
    lm = SimpleNamespace(tasks=[texts.tasks[0], TaskData("wiki", [], Texts(4, 0), Texts(4, 1), Texts(4, 2))],
                         heads={}, backbone=None)
    message = "the class-incremental protocol needs classification tasks; task 'wiki' has no classes (a " \
              "language-modelling task)"
    with pytest.raises(ConfigError) as err:
        run_strategy("naive", lm, recipes(1, 1), protocol="class")
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        run_strategies(["naive"], {}, lm, recipes(1, 1), runtime=None, progress=None, protocols=("task", "class"))
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:
        run_strategy("naive", texts, recipes(1, 1), protocol="domain")
    assert str(err.value) == "unknown protocol 'domain'; known: task, class"


def test_what_each_strategy_keeps_is_read_from_avalanche_and_counts_as_by_hand():
    """Three tasks of two classes, 54 training examples each (60 less the validation tenth); an example is 8 fp32
    inputs and an int64 label (40 bytes). θ0's MLP and the strategy's copy of it have P parameters each; a task
    head is a 2 x 6 weight and 2 biases (buffers, fixed); the class protocol's IncrementalClassifier a C x 6 weight,
    C biases and C int8 active-unit flags, C growing 2, 4, 6."""
    P, F, example = sum(p.numel() for p in mlp(D_IN, 16, FEATURES).parameters()), FEATURES, 8 * 4 + 8
    head, classifier = 2 * F + 2, lambda c: c * F + c
    options = {"replay": {"mem_size": 12}, "agem": {"patterns_per_exp": 5, "sample_size": 10}}
    expected = {
        "naive": ({"what": "nothing", "items": 0, "bytes": 0},) * 2,
        "replay": ({"what": "12 labelled examples", "items": 12, "bytes": 12 * example},) * 2,
        "agem": ({"what": "15 labelled examples", "items": 15, "bytes": 15 * example},) * 2,  # 5 of each experience
        "joint": ({"what": "162 labelled examples", "items": 162, "bytes": 162 * example},) * 2,
        # the model after the last experience, whole: θ0, theta and the heads (the classifier and its flags)
        "lwf": ({"what": "a model copy", "items": 1, "bytes": 4 * (2 * P + 3 * head)},
                {"what": "a model copy", "items": 1, "bytes": 4 * (2 * P + classifier(6)) + 6}),
        # every parameter (θ0's too) and an importance of each, saved after each of the three experiences; the
        # penalty pads an earlier experience's to the grown head in place (Avalanche's ParamData.expand)
        "ewc": ({"what": "weights + importances per past experience", "items": 3, "bytes": 3 * 2 * 4 * 2 * P},
                {"what": "weights + importances per past experience", "items": 3,
                 "bytes": 3 * 2 * 4 * (2 * P + classifier(6))}),
        # seven tables (two of the penalty, five of the path integral) over the trained parameters, grown with the head
        "si": ({"what": "weights + importances + path integrals", "items": 1, "bytes": 7 * 4 * P},
               {"what": "weights + importances + path integrals", "items": 1, "bytes": 7 * 4 * (P + classifier(6))}),
    }
    for name, (task, among) in expected.items():
        for protocol, kept in zip(PROTOCOLS, (task, among)):
            result = run_strategy(name, stream((2, 2, 2), train=60), recipes(2, 2, 2), protocol=protocol,
                                  options=options.get(name))
            assert result.kept == kept, (name, protocol)


def test_the_bench_sections_hold_each_protocols_scores_kept_and_cost():
    """run_strategies runs each strategy under each protocol asked (PROTOCOLS' order); strategy_sections turns the
    runs into one row per strategy (task ACC as ``absolute``, class ACC as ``class_incremental``, no normalized
    accuracy) and the protocol's continual numbers, options, kept and cost."""
    from editkit.runs.bench.strategies import run_strategies, strategy_sections
    from editkit.train.runtime import Runtime
    from editkit.util.progress import NullProgress

    built, tasks = stream(), ["t0", "t1"]
    results = run_strategies(["naive", "replay"], {"replay": {"mem_size": 6}}, built, recipes(3, 3),
                             runtime=Runtime(), progress=NullProgress(), protocols=("class", "task"))
    assert {name: list(runs) for name, runs in results.items()} == {"naive": list(PROTOCOLS), "replay": list(PROTOCOLS)}
    got = strategy_sections(results, tasks)
    replay = results["replay"]
    row = next(r for r in got["rows"] if r["method"] == "replay")
    assert row == {"method": "replay", "label": "Replay", "mode": None, "variant": "avalanche", "coefficient": None,
                   "alpha": None, "per_task": replay["task"].rows[-1],
                   "absolute": pytest.approx(sum(replay["task"].rows[-1].values()) / 2), "normalized": None,
                   "class_incremental": pytest.approx(sum(replay["class"].rows[-1].values()) / 2),
                   "class_incremental_per_task": replay["class"].rows[-1]}
    assert got["continual"]["replay"] == continual_metrics(tasks, replay["task"].rows)
    assert got["continual_class_incremental"]["replay"] == continual_metrics(tasks, replay["class"].rows)
    assert got["strategies"]["replay"]["options"] == {"task": {"mem_size": 6}, "class": {"mem_size": 6}}
    assert got["kept"]["replay"] == {**replay["task"].kept, "mib": replay["task"].kept["bytes"] / 2**20,
                                     "protocols": {p: replay[p].kept for p in PROTOCOLS}}
    cost = got["strategy_cost"]["replay"]
    assert cost["steps"] == 12 and set(cost["protocols"]) == set(PROTOCOLS)
    assert cost["train_seconds"] == pytest.approx(sum(c["train_seconds"] for c in cost["protocols"].values()))

    only_task = strategy_sections({"naive": {"task": results["naive"]["task"]}}, tasks)
    assert "continual_class_incremental" not in only_task and only_task["rows"][0]["class_incremental"] is None
