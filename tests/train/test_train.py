"""One task's fine-tuning loop: schedule values, the first AdamW step computed by hand,
loss decrease in every mode, determinism, the penalty's effect, the concatenated
jvp call, gradient accumulation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from editkit.models.heads import LinearHead
from editkit.core.linearize import LinearizedModel, NonLinearModel
from editkit.train.recipe import Recipe
from editkit.core.taujp import Regularizer, UnlabeledSource
from editkit.data.tasks import TensorTaskDataset
from editkit.errors import ConfigError
from editkit.train.loop import StepComputer, fine_tune, warmup_cosine

from helpers import models
from helpers.tabular import blobs

MODES = ("nonlinear", "linear", "taujp")

# --------------------------------------------------------------------------- fixtures


def backbone(seed: int = 0) -> nn.Module:
    """Linear -> BatchNorm (non-trivial running stats) -> Tanh -> Linear, eval mode."""
    m = models.mlp(4, 16, 8, batchnorm=True, seed=seed)
    with torch.no_grad():
        m[1].running_mean.copy_(torch.randn(16) * 0.3)
        m[1].running_var.copy_(torch.rand(16) + 0.5)
    return m


def fixed_head(seed: int = 0) -> LinearHead:
    g = torch.Generator().manual_seed(seed)
    return LinearHead(torch.randn(3, 8, generator=g), torch.zeros(3))


TRAIN_X, TRAIN_Y = blobs(16, torch.eye(3, 4) * 2.0, seed=0)  # 48 linearly separable examples
OTHER_X = blobs(24, torch.tensor([[0.0, 0.0, 0.0, 2.5], [-2.0, -2.0, 0.0, 0.0]]), seed=1)[0]  # another task


def train_set() -> TensorTaskDataset:
    return TensorTaskDataset(TRAIN_X.clone(), TRAIN_Y.clone())


def regularizer(lam: float = 1.0, schedule: str = "cyclic", batch_size: int = 8, seed: int = 0) -> Regularizer:
    half = len(OTHER_X) // 2
    sources = [UnlabeledSource("a", OTHER_X[:half], seed=seed), UnlabeledSource("b", OTHER_X[half:], seed=seed + 1)]
    return Regularizer(sources, lam=lam, schedule=schedule, batch_size=batch_size)


def recipe(mode: str, **kw) -> Recipe:
    base = dict(mode=mode, steps=40, batch_size=16, lr=2e-2, warmup=0.1, weight_decay=0.0, grad_clip=1.0, seed=0)
    return Recipe(**{**base, **kw})


def run(mode: str, reg: Regularizer | None = None, module: nn.Module | None = None, **kw):
    module = module if module is not None else backbone()
    if reg is None and mode == "taujp":
        reg = regularizer()
    return fine_tune(module, fixed_head(), train_set(), recipe(mode, **kw), reg)


def task_model(module: nn.Module, mode: str, tau) -> nn.Module:
    model = (NonLinearModel if mode == "nonlinear" else LinearizedModel)(copy.deepcopy(module))
    model.load_task_vector(tau)
    return model


def train_ce(module: nn.Module, mode: str, tau) -> float:
    with torch.no_grad():
        return F.cross_entropy(fixed_head()(task_model(module, mode, tau)(TRAIN_X)), TRAIN_Y).item()


def measured_penalty(module: nn.Module, tau, x: torch.Tensor) -> float:
    """mean_i ||J_theta0 f(x_i) . tau|| on x, via a fresh linearized model."""
    model = LinearizedModel(copy.deepcopy(module))
    model.load_task_vector(tau)
    with torch.no_grad():
        t = model.tangent(x)
    return t.pow(2).sum(dim=1).sqrt().mean().item()


# --------------------------------------------------------------------------- schedule


def test_warmup_cosine_known_values():
    f = warmup_cosine(10, 110)
    assert f(0) == pytest.approx(1 / 10)
    assert f(4) == pytest.approx(5 / 10)
    assert f(9) == pytest.approx(1.0)  # end of warmup
    assert f(10) == pytest.approx(1.0)  # start of cosine
    assert f(60) == pytest.approx(0.5)  # cosine midpoint
    assert f(35) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert f(109) == pytest.approx(0.0, abs=1e-3)
    assert f(110) == pytest.approx(0.0, abs=1e-12)
    values = [f(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # decreasing after warmup


def test_warmup_cosine_without_warmup():
    f = warmup_cosine(0, 4)
    assert [f(s) for s in range(5)] == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                                       0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])


# --------------------------------------------------------------------------- the first step, by hand


def first_step_tau(module: nn.Module, lr: float, wd: float, clip: float) -> tuple[dict[str, torch.Tensor], float]:
    """AdamW's first step on the full-batch CE gradient at theta_0, written out.

    g = dCE/dtheta at theta_0 (plain autograd on a copy; for f_lin at tau = 0 it is the same
    J^T grad), g_hat = g * min(1, clip / (||g|| + 1e-6)), and AdamW's bias-corrected first
    step is theta_1 = theta_0 (1 - lr wd) - lr g_hat / (|g_hat| + 1e-8).
    """
    ref = copy.deepcopy(module)
    F.cross_entropy(fixed_head()(ref(TRAIN_X)), TRAIN_Y).backward()
    grads = {n: p.grad.double() for n, p in ref.named_parameters()}
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    scale = min(1.0, clip / (norm + 1e-6))
    tau = {}
    for n, p in module.named_parameters():
        g_hat = grads[n] * scale
        tau[n] = (-lr * wd * p.detach().double() - lr * g_hat / (g_hat.abs() + 1e-8)).float()
    return tau, norm


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", [1e-7, 1e9])
def test_first_step_matches_adamw_by_hand(mode, clip):
    module = backbone()
    lr, wd = 1e-2, 0.1
    expected, norm = first_step_tau(module, lr, wd, clip)
    result = fine_tune(module, fixed_head(), train_set(),
                       recipe(mode, steps=1, batch_size=len(TRAIN_X), lr=lr, weight_decay=wd, warmup=0,
                              grad_clip=clip),
                       regularizer() if mode == "taujp" else None)
    # history's grad_norm is the norm before clipping
    assert result.history[0]["grad_norm"] == pytest.approx(norm, rel=1e-4)
    assert result.history[0]["ce"] == pytest.approx(
        F.cross_entropy(fixed_head()(module(TRAIN_X)), TRAIN_Y).item(), rel=1e-5)
    for n, t in expected.items():
        torch.testing.assert_close(result.task_vector[n], t, rtol=1e-3, atol=2e-6)
    if clip < 1:  # clipping really shrank the step: no entry moves by lr (as it would unclipped)
        step_only = {n: result.task_vector[n] + lr * wd * p.detach() for n, p in module.named_parameters()}
        assert max(float(t.abs().max()) for t in step_only.values()) < 0.9 * lr


# --------------------------------------------------------------------------- training works


@pytest.mark.parametrize("mode", MODES)
def test_fine_tune_lowers_ce_and_leaves_theta0(mode):
    module = backbone()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    seen = []
    result = fine_tune(module, fixed_head(), train_set(), recipe(mode),
                       regularizer() if mode == "taujp" else None,
                       on_step=lambda step, record: seen.append((step, dict(record))))
    tau = result.task_vector
    assert set(tau) == {n for n, _ in module.named_parameters()}
    assert all(tau[n].shape == p.shape for n, p in module.named_parameters())
    assert sum(float(t.abs().sum()) for t in tau.values()) > 0
    after = module.state_dict()
    for k in before:  # theta_0 and BatchNorm statistics untouched, bit for bit
        assert torch.equal(after[k], before[k]), k
    zero = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    ce0, ce1 = train_ce(module, mode, zero), train_ce(module, mode, tau)
    assert ce1 < 0.5 * ce0, (ce0, ce1)
    assert result.steps == 40 and len(result.history) == 40
    assert [s for s, _ in seen] == list(range(40))
    assert [r for _, r in seen] == result.history


@pytest.mark.parametrize("mode", [*MODES, "taujp-nonlinear"])
def test_a_step_never_reads_a_value_back_to_the_host(mode, monkeypatch):
    """On a GPU each read of a tensor's value (``.item()``, ``float()``, ``bool()``) waits for the device
    and leaves it idle; the loop reads the step's statistics once, a step late (``LaggedStats``).
    Here every read of a floating-point value during training fails (the loader's integer seeds and index
    draws are host data), and the single late ``tolist`` of each step's statistics is counted."""
    reads: list[int] = []
    real = {name: getattr(torch.Tensor, name) for name in ("item", "__float__", "__bool__", "tolist")}

    def refusing(name: str):
        def read(self, *args):
            if self.is_floating_point():
                raise AssertionError(f"a training step read a value ({name})")
            return real[name](self, *args)
        return read

    def counted_tolist(self):
        reads.extend([1] if self.is_floating_point() else [])
        return real["tolist"](self)

    seen = []
    with monkeypatch.context() as patch:
        for name in ("item", "__float__", "__bool__"):
            patch.setattr(torch.Tensor, name, refusing(name))
        patch.setattr(torch.Tensor, "tolist", counted_tolist)
        result = fine_tune(backbone(), fixed_head(), train_set(), recipe(mode, steps=4),
                           regularizer() if "taujp" in mode else None, on_step=lambda step, record: seen.append(step))
    assert len(reads) == 4 and seen == [0, 1, 2, 3] and len(result.history) == 4


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_tau_bitwise(mode):
    a = run(mode, steps=8).task_vector
    b = run(mode, steps=8).task_vector
    c = run(mode, steps=8, seed=1).task_vector
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_taujp_penalty_lower_than_linear():
    module = backbone()
    lin = run("linear", module=module)
    tjp = run("taujp", reg=regularizer(lam=1.0), module=module)
    p_lin = measured_penalty(module, lin.task_vector, OTHER_X)
    p_tjp = measured_penalty(module, tjp.task_vector, OTHER_X)
    assert p_tjp < 0.7 * p_lin, (p_tjp, p_lin)
    # both still learn the task
    zero = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    assert train_ce(module, "taujp", tjp.task_vector) < train_ce(module, "linear", zero)
    assert all(h["penalty"] == 0.0 for h in lin.history)
    assert tjp.history[0]["penalty"] == 0.0  # tau = 0 at step 0
    assert all(h["penalty"] > 0 for h in tjp.history[1:])


def test_regularizer_unused_outside_taujp():
    class Exploding(UnlabeledSource):
        def next_batch(self, size):
            raise AssertionError("the regularizer was sampled outside taujp mode")

    reg = Regularizer([Exploding("x", OTHER_X)], lam=1.0)
    for mode in ("nonlinear", "linear"):
        with_reg = run(mode, reg=reg, steps=5)
        without = run(mode, steps=5)
        assert all(torch.equal(with_reg.task_vector[n], without.task_vector[n]) for n in without.task_vector)
        assert all(h["penalty"] == 0.0 for h in with_reg.history)


# --------------------------------------------------------------------------- one jvp for task + penalty


@pytest.mark.parametrize("squared", [False, True])
def test_concatenated_loss_equals_separate_terms(squared):
    module = backbone()
    model = LinearizedModel(copy.deepcopy(module))
    g = torch.Generator().manual_seed(3)
    model.load_task_vector({n: 0.1 * torch.randn(p.shape, generator=g) for n, p in module.named_parameters()})
    lam = 0.3
    reg = Regularizer(regularizer().sources, lam=lam, schedule="strict", batch_size=5, squared=squared)
    head = fixed_head()
    x, y = TRAIN_X[::3], TRAIN_Y[::3]
    reg_batches = reg.batches(0)
    assert len(reg_batches) == 2

    computer = StepComputer(model, head, reg)
    ce_term, reg_term, stats = computer.loss(x, y, reg_batches)
    loss = ce_term + reg_term
    grads = torch.autograd.grad(loss, list(model.theta))

    ce = F.cross_entropy(head(model(x)), y)
    pens = []
    for b in reg_batches:
        norms = model.tangent(b).pow(2).sum(dim=1)
        pens.append((norms if squared else norms.sqrt()).mean())
    expected = ce + lam * (pens[0] + pens[1]) / 2
    expected_grads = torch.autograd.grad(expected, list(model.theta))

    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert float(stats["ce"]) == pytest.approx(ce.item(), rel=1e-5)
    assert float(stats["penalty"]) == pytest.approx(((pens[0] + pens[1]) / 2).item(), rel=1e-5)
    assert float(stats["penalty"]) > 0


def test_step_computer_without_regularizer_is_plain_ce():
    module = backbone()
    model = NonLinearModel(copy.deepcopy(module))
    head = fixed_head()
    x, y = TRAIN_X[:6], TRAIN_Y[:6]
    loss, reg_term, stats = StepComputer(model, head, regularizer(lam=0.0)).loss(x, y, [])
    assert reg_term is None
    torch.testing.assert_close(loss, F.cross_entropy(head(module(x)), y))
    assert float(stats["penalty"]) == 0.0


# --------------------------------------------------------------------------- gradient accumulation


class CountingDataset(TensorTaskDataset):
    def __init__(self, x, y):
        super().__init__(x, y)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_accumulation_draws_that_many_batches(accumulation):
    data = CountingDataset(TRAIN_X.clone(), TRAIN_Y.clone())
    steps, batch = 3, 4
    fine_tune(backbone(), fixed_head(), data, recipe("linear", steps=steps, batch_size=batch,
                                                    accumulation=accumulation))
    assert data.reads == steps * accumulation * batch


class RowCounter(nn.Module):
    """The backbone, recording how many rows each of its passes carries (labelled and reg rows together)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.rows = module, []

    def forward(self, x):
        self.rows.append(len(x))
        return self.module(x)


@pytest.mark.parametrize("schedule", ["cyclic", "strict", "mixed"])
def test_reg_rows_within_the_batch_are_the_step_of_a_batch_less_them(schedule):
    """With reg_within_batch a tauJp step of batch 16 carries 16 rows in all: 16 less the step's reg rows
    labelled (cyclic and mixed draw 4, strict 4 from each of the 2 sources) and its reg rows. Its vector is,
    bit for bit, the one a batch of 16 - reg rows trains with the penalty beside it."""
    reg_rows = {"cyclic": 4, "strict": 8, "mixed": 4}[schedule]
    counted = RowCounter(backbone())
    data = CountingDataset(TRAIN_X.clone(), TRAIN_Y.clone())
    within = fine_tune(counted, fixed_head(), data, recipe("taujp", steps=5, reg_within_batch=True),
                       regularizer(schedule=schedule, batch_size=4))
    assert counted.rows == [16] * 5 and data.reads == 5 * (16 - reg_rows)
    beside = fine_tune(backbone(), fixed_head(), train_set(), recipe("taujp", steps=5, batch_size=16 - reg_rows),
                       regularizer(schedule=schedule, batch_size=4))
    for name, value in beside.task_vector.items():
        assert torch.equal(within.task_vector[f"module.{name}"], value), name
    counted.rows.clear()
    fine_tune(counted, fixed_head(), train_set(), recipe("taujp", steps=5), regularizer(schedule=schedule, batch_size=4))
    assert counted.rows == [16 + reg_rows] * 5  # off (the default): the reg rows ride beside a full batch


@pytest.mark.parametrize("within, labelled", [(2, 14), (4, 12), (9, 12)])
def test_a_count_of_reg_rows_within_the_batch_takes_that_many_labelled_rows(within, labelled):
    """reg_within_batch = N: N of the step's 4 mixed reg rows take labelled rows' places (at most the 4), the rest
    ride beside. A step of batch 16 then carries 16 - min(N, 4) labelled rows and 4 reg rows, and its vector is, bit
    for bit, the one a batch of that many labelled rows trains with every reg row beside it."""
    counted = RowCounter(backbone())
    data = CountingDataset(TRAIN_X.clone(), TRAIN_Y.clone())
    part = fine_tune(counted, fixed_head(), data, recipe("taujp", steps=5, reg_within_batch=within),
                     regularizer(schedule="mixed", batch_size=4))
    assert counted.rows == [labelled + 4] * 5 and data.reads == 5 * labelled
    beside = fine_tune(backbone(), fixed_head(), train_set(), recipe("taujp", steps=5, batch_size=labelled),
                       regularizer(schedule="mixed", batch_size=4))
    for name, value in beside.task_vector.items():
        assert torch.equal(part.task_vector[f"module.{name}"], value), name


def test_reg_rows_within_the_batch_leave_unpenalized_steps_whole_and_refuse_a_batch_they_fill():
    data = CountingDataset(TRAIN_X.clone(), TRAIN_Y.clone())
    fine_tune(backbone(), fixed_head(), data, recipe("linear", steps=3, reg_within_batch=True), regularizer())
    assert data.reads == 3 * 16  # no penalty, no reg rows: the whole batch is labelled
    data.reads = 0
    fine_tune(backbone(), fixed_head(), data, recipe("taujp", steps=3, reg_within_batch=True), regularizer(lam=0.0))
    assert data.reads == 3 * 16
    with pytest.raises(ConfigError, match=r"^recipe\.reg_within_batch: a step draws 16 reg rows, 16 of them within "
                                          r"the batch, which leaves no labelled row of a batch of 16; raise "
                                          r"batch_size or lower reg_batch$"):
        fine_tune(backbone(), fixed_head(), train_set(), recipe("taujp", steps=3, reg_within_batch=True),
                  regularizer(schedule="strict", batch_size=8))


@pytest.mark.parametrize("mode", ["linear", "taujp"])
def test_accumulation_equals_one_larger_batch(mode):
    """accumulation=2 x batch b == one batch of 2b (same seeded order): loss = mean CE + lam * penalty.

    The reg batch of a step is drawn once; its term must keep weight lam whatever the
    accumulation (history[1] is the first step with tau != 0, i.e. a non-zero penalty).
    """
    module = backbone()
    kw = dict(steps=3, warmup=0, grad_clip=1e9, lr=1e-2)
    two = fine_tune(module, fixed_head(), train_set(), recipe(mode, batch_size=8, accumulation=2, **kw),
                    regularizer(lam=1.0) if mode == "taujp" else None)
    one = fine_tune(module, fixed_head(), train_set(), recipe(mode, batch_size=16, accumulation=1, **kw),
                    regularizer(lam=1.0) if mode == "taujp" else None)
    for step in range(3):
        assert two.history[step]["ce"] == pytest.approx(one.history[step]["ce"], rel=1e-5)
        assert two.history[step]["penalty"] == pytest.approx(one.history[step]["penalty"], rel=1e-4, abs=1e-7)
        assert two.history[step]["grad_norm"] == pytest.approx(one.history[step]["grad_norm"], rel=1e-4), step
    for n in one.task_vector:
        torch.testing.assert_close(two.task_vector[n], one.task_vector[n], rtol=1e-3, atol=1e-5)


# --------------------------------------------------------------------------- timing and encoding ahead


class EncodedAhead(torch.utils.data.Dataset):
    """Labelled examples that record which items the loop asked to encode ahead, and which it then read."""

    def __init__(self) -> None:
        self.inputs, self.targets = TRAIN_X.clone(), TRAIN_Y.clone()
        self.encoded: list[int] = []
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.inputs)

    def precompute(self, index) -> None:
        self.encoded += list(index)

    def __getitem__(self, i: int):
        self.read.append(int(i))
        return self.inputs[i], self.targets[i]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_loop_encodes_ahead_exactly_the_items_its_steps_read(accumulation):
    """7 steps of 16 (or 2 x 16) over 48 examples run into a third epoch (or a fifth); the items encoded before the first step are
    the items read, in order, and the vector is the one of a dataset that cannot encode ahead."""
    train = EncodedAhead()
    result = fine_tune(backbone(), fixed_head(), train, recipe("taujp", steps=7, accumulation=accumulation),
                       regularizer())
    assert train.encoded == train.read and len(train.read) == 7 * accumulation * 16
    plain = fine_tune(backbone(), fixed_head(), train_set(), recipe("taujp", steps=7, accumulation=accumulation),
                      regularizer())
    for name, value in plain.task_vector.items():
        assert torch.equal(result.task_vector[name], value)


def test_step_times_split_setup_warmup_and_steady_steps():
    from editkit.train.timing import PARTS, WARMUP_STEPS, StepTimes

    result = fine_tune(backbone(), fixed_head(), train_set(), recipe("taujp", steps=9), regularizer(),
                       time_parts=True)
    times = result.times
    assert len(times.steps) == 9 and times.setup > 0
    assert set(times.parts) == set(PARTS)
    assert sum(times.parts.values()) == pytest.approx(sum(times.steps[WARMUP_STEPS:]), abs=1e-3)
    assert sum(times.steps) == pytest.approx(result.seconds, abs=1e-2)
    by_hand = StepTimes(setup=1.0, steps=[5.0, 3.0, 0.4, 0.2, 0.3, 9.0], parts={"forward": 2.0})
    assert by_hand.warmup == 8.0 and by_hand.steady_per_step == 0.35  # median of 0.4, 0.2, 0.3, 9.0
    assert by_hand.parts_per_step() == {"forward": 0.5}
    assert fine_tune(backbone(), fixed_head(), train_set(), recipe("linear", steps=3)).times.parts == {}


def test_profiled_times_the_parts_of_every_run_inside_it():
    from editkit.train.timing import PARTS, profiled

    with profiled() as runs:
        first = fine_tune(backbone(), fixed_head(), train_set(), recipe("linear", steps=4))
        second = fine_tune(backbone(), fixed_head(), train_set(), recipe("taujp", steps=5), regularizer())
    assert runs == [first.times, second.times] and set(second.times.parts) == set(PARTS)
    assert fine_tune(backbone(), fixed_head(), train_set(), recipe("linear", steps=3)).times.parts == {}
