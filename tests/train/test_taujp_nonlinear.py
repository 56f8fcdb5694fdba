"""``taujp-nonlinear``: plain fine-tuning plus the tauJp penalty measured through the Jacobian at theta_0.

Ground truth: central finite differences of directly edited float64 copies of theta_0 for the
penalty's tangents (image MLP and a tiny GPT-2 tail with padding, features and logits), autograd
through an explicitly built Jacobian for the penalty's gradient, plain autograd of a copy at theta
for the task loss, a hand argmax of the merged non-linear model for a banked stream, and hand sums
for the family rule (which vectors may be combined, and what mode their sum is recorded as).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.core.linearize import LinearizedModel, NonLinearModel, build_task_model
from editkit.core.modes import Family, Mode, combined_mode
from editkit.core.taujp import Regularizer, UnlabeledSource
from editkit.data.tasks import TensorTaskDataset
from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.integrations.avalanche.benchmark import Experience
from editkit.merge.arithmetic import TaskVector, combine
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead
from editkit.runs import stream as stream_module
from editkit.runs.bench.run import BenchConfig
from editkit.merge.arithmetic import merged_vector
from editkit.runs.stream import run_stream
from editkit.train.loop import StepComputer, fine_tune
from editkit.train.recipe import Recipe

from helpers import models
from helpers.lm_steps import mean_distribution_norm, mean_sequence_norm, two_penalized_steps
from helpers.tabular import blobs

MODE = "taujp-nonlinear"

# --------------------------------------------------------------------------- a tiny image problem, float64


def backbone(dtype: torch.dtype = torch.float64) -> nn.Module:
    """Linear -> BatchNorm (non-trivial running stats) -> Tanh -> Linear, eval mode."""
    m = models.mlp(4, 6, 5, batchnorm=True, seed=0)
    with torch.no_grad():
        m[1].running_mean.copy_(torch.randn(6) * 0.3)
        m[1].running_var.copy_(torch.rand(6) + 0.5)
    return m.to(dtype)


def head() -> LinearHead:
    """float32, as the loop feeds heads (features are cast to float32 before the head)."""
    g = torch.Generator().manual_seed(5)
    return LinearHead(torch.randn(3, 5, generator=g), torch.zeros(3))


X, Y = blobs(4, torch.eye(3, 4) * 2.0, seed=0)
OTHER = blobs(10, torch.tensor([[0.0, 0.0, 0.0, 2.5], [-2.0, -2.0, 0.0, 0.0]]), seed=1)[0]


def regularizer(lam: float = 0.3, squared: bool = False, dtype: torch.dtype = torch.float64) -> Regularizer:
    """Two sources, both penalised every step (strict), so the mean over sources is exercised."""
    other = OTHER.to(dtype)
    sources = [UnlabeledSource("a", other[:10], seed=0), UnlabeledSource("b", other[10:], seed=1)]
    return Regularizer(sources, lam=lam, schedule="strict", batch_size=5, squared=squared)


def random_tau(module: nn.Module, scale: float, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in module.named_parameters()}


def at(module: nn.Module, tau: dict[str, torch.Tensor], eps: float = 1.0) -> nn.Module:
    """A copy of ``module`` whose parameters are edited in place to theta_0 + eps * tau."""
    c = copy.deepcopy(module).eval()
    with torch.no_grad():
        for n, p in c.named_parameters():
            p.add_(eps * tau[n])
    return c


def fd_tangent(module: nn.Module, tau, *inputs, eps: float = 1e-5, **kwargs) -> torch.Tensor:
    """(f(theta_0 + eps tau) - f(theta_0 - eps tau)) / (2 eps): the directional derivative J_theta0 f . tau."""
    with torch.no_grad():
        return (at(module, tau, eps)(*inputs, **kwargs) - at(module, tau, -eps)(*inputs, **kwargs)) / (2 * eps)


def step_computer(module: nn.Module, tau, reg: Regularizer) -> StepComputer:
    model = build_task_model(copy.deepcopy(module), MODE)
    model.load_task_vector(tau)
    return StepComputer(model, head(), reg)


# --------------------------------------------------------------------------- the mode and its family


def test_mode_is_penalized_plain_fine_tuning_of_the_nonlinear_family():
    mode = Mode(MODE)
    assert mode is Mode.TAUJP_NONLINEAR and mode == "taujp-nonlinear"
    assert mode.penalized and not mode.linearized and mode.family is Family.NONLINEAR
    assert [m.value for m in Mode if m.penalized] == ["taujp", "taujp-nonlinear"]
    assert Family.NONLINEAR.modes == ("nonlinear", "taujp-nonlinear", "sequential")
    assert Family.LINEARIZED.modes == ("linear", "taujp")
    assert isinstance(build_task_model(backbone(), MODE), NonLinearModel)
    assert Recipe(mode=MODE).regularized and not Recipe(mode=MODE, lam=0.0).regularized


def test_family_rule_mixes_taujp_nonlinear_with_nonlinear_only(tmp_path):
    """Both are theta - theta_0 of the plain model: they sum, recorded as plain ``nonlinear`` when mixed."""
    bank = Bank(tmp_path)
    values = {"plain": (1.0, "nonlinear"), "pen": (10.0, MODE), "pen2": (100.0, MODE), "lin": (1000.0, "taujp")}
    for i, (name, (value, mode)) in enumerate(values.items()):
        bank.append(name, {"w": torch.full((2, 3), value), "b": torch.arange(3.0) * value}, task=name, mode=mode,
                    base="sha256:test", step=i)

    mixed = combine(bank, {"plain": 1.0, "pen": 2.0})
    assert mixed.mode == "nonlinear"
    assert torch.equal(mixed.tensors["w"], torch.full((2, 3), 21.0))
    assert torch.equal(mixed.tensors["b"], torch.tensor([0.0, 21.0, 42.0]))
    assert combine(bank, {"pen": 1.0, "pen2": -1.0}).mode == MODE  # one mode: kept
    assert merged_vector(bank, {"plain": 1.0, "pen": 1.0}, "ties", {"k": 1.0}).mode == "nonlinear"

    plain, pen, lin = (TaskVector(bank.load(n), bank.get(n).mode) for n in ("plain", "pen", "lin"))
    assert (plain + pen).mode == "nonlinear" and (pen + pen).mode == MODE and (pen * 2.0).mode == MODE
    torch.testing.assert_close((plain + pen).tensors["w"], torch.full((2, 3), 11.0))
    assert combined_mode(["taujp", "linear"]) == "linear" and combined_mode([MODE]) == MODE

    with pytest.raises(IncompatibleVectorsError, match="nonlinear: nonlinear, taujp-nonlinear"):
        bank.merge({"pen": 1.0, "lin": 1.0})
    with pytest.raises(IncompatibleVectorsError):
        pen + lin  # noqa: B018
    with pytest.raises(IncompatibleVectorsError, match="linearized: linear, taujp"):
        combined_mode([MODE, "linear"])


# --------------------------------------------------------------------------- one step against ground truth


@pytest.mark.parametrize("squared", [False, True])
def test_step_is_ce_at_theta_plus_the_finite_difference_penalty(squared):
    module = backbone()
    tau = random_tau(module, 0.3)
    reg = regularizer(squared=squared)
    reg_batches = reg.batches(0)
    ce, penalty, stats = step_computer(module, tau, reg).loss(X.double(), Y, reg_batches)

    # the task batch: the plain model at theta (not f_lin, which differs at this tau)
    expected_ce = F.cross_entropy(head()(at(module, tau)(X.double()).float()), Y)
    torch.testing.assert_close(ce, expected_ce, rtol=1e-6, atol=0)
    linearized = LinearizedModel(copy.deepcopy(module))
    linearized.load_task_vector(tau)
    with torch.no_grad():
        assert abs(float(F.cross_entropy(head()(linearized(X.double()).float()), Y)) - expected_ce.item()) > 1e-3

    # the penalty: lam * mean over sources of mean_i ||(f(theta_0 + eps tau; x_i) - f(theta_0 - eps tau; x_i)) / 2eps||
    per_source = []
    for batch in reg_batches:
        norms = fd_tangent(module, tau, batch).pow(2).sum(dim=1)
        per_source.append((norms if squared else norms.sqrt()).mean())
    expected = 0.3 * torch.stack(per_source).mean()
    assert penalty.item() == pytest.approx(float(expected), rel=1e-6)  # the loop scores tangents in float32
    assert float(stats["penalty"]) == pytest.approx(float(expected) / 0.3, rel=1e-6)
    assert float(stats["ce"]) == pytest.approx(expected_ce.item(), rel=1e-6)


def test_gradient_matches_autograd_through_the_explicit_jacobian():
    """d/dtheta [CE(f(x; theta)) + lam mean_s mean_i ||J_i (theta - theta_0)||], J built column by column."""
    module = backbone()
    tau = random_tau(module, 0.2, seed=4)
    reg = regularizer()
    reg_batches = reg.batches(0)
    computer = step_computer(module, tau, reg)
    ce, penalty, _ = computer.loss(X.double(), Y, reg_batches)
    theta = list(computer.model.theta)
    pen_grads = torch.autograd.grad(penalty, theta, retain_graph=True)
    total_grads = torch.autograd.grad(ce + penalty, theta)

    names = [n for n, _ in module.named_parameters()]
    shapes = [p.shape for _, p in module.named_parameters()]
    sizes = [p.numel() for _, p in module.named_parameters()]
    theta0 = torch.cat([p.detach().flatten() for _, p in module.named_parameters()])
    buffers = dict(module.named_buffers())

    def call(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        params = {n: t.reshape(s) for n, t, s in zip(names, flat.split(sizes), shapes)}
        return functional_call(module, {**params, **buffers}, (x,))

    jacobians = [torch.autograd.functional.jacobian(lambda flat: call(flat, b), theta0) for b in reg_batches]
    flat_tau = torch.cat([tau[n].flatten() for n in names]).requires_grad_(True)
    ref_penalty = 0.3 * torch.stack([torch.linalg.vector_norm(j @ flat_tau, dim=1).mean() for j in jacobians]).mean()
    ref_pen_grad = torch.autograd.grad(ref_penalty, flat_tau)[0]
    flat_theta = (theta0 + flat_tau.detach()).requires_grad_(True)
    ref_ce = F.cross_entropy(head()(call(flat_theta, X.double()).float()), Y)
    ref_ce_grad = torch.autograd.grad(ref_ce, flat_theta)[0]

    assert penalty.item() == pytest.approx(ref_penalty.item(), rel=1e-6)
    torch.testing.assert_close(torch.cat([g.flatten() for g in pen_grads]), ref_pen_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([g.flatten() for g in total_grads]), ref_pen_grad + ref_ce_grad,
                               rtol=1e-5, atol=1e-7)
    # and the penalty's directional derivative along a random direction, by central differences in theta
    direction = random_tau(module, 1.0, seed=9)
    h = 1e-3
    plus, minus = ({n: tau[n] + s * h * direction[n] for n in names} for s in (1, -1))
    with torch.no_grad():
        fd = (step_computer(module, plus, reg).loss(X.double(), Y, reg_batches)[1]
              - step_computer(module, minus, reg).loss(X.double(), Y, reg_batches)[1]).item() / (2 * h)
    analytic = sum(float((g * direction[n]).sum()) for g, n in zip(pen_grads, names))
    assert fd == pytest.approx(analytic, rel=1e-3)


def test_penalty_and_its_gradient_vanish_at_theta0():
    module = backbone()
    zero = {n: torch.zeros_like(p) for n, p in module.named_parameters()}
    reg = regularizer()
    computer = step_computer(module, zero, reg)
    ce, penalty, stats = computer.loss(X.double(), Y, reg.batches(0))
    assert penalty.item() == 0.0 and float(stats["penalty"]) == 0.0 and ce.item() > 0
    grads = torch.autograd.grad(penalty, list(computer.model.theta), allow_unused=True)
    assert all(g is None or (torch.isfinite(g).all() and float(g.abs().max()) == 0.0) for g in grads)


def test_the_penalty_keeps_the_vector_quieter_on_other_inputs_than_plain_fine_tuning():
    module = backbone(torch.float32)
    data = TensorTaskDataset(X.clone(), Y.clone())
    recipe = Recipe(mode=MODE, steps=15, batch_size=12, lr=3e-2, warmup=0, seed=0)
    pen = fine_tune(module, head(), data, recipe, regularizer(lam=2.0, dtype=torch.float32))
    plain = fine_tune(module, head(), data, recipe.with_overrides(mode="nonlinear"))
    assert pen.history[0]["penalty"] == 0.0 and all(h["penalty"] > 0 for h in pen.history[1:])
    assert all(h["penalty"] == 0.0 for h in plain.history)
    quiet = {}
    for name, result in (("pen", pen), ("plain", plain)):
        t = {n: v.double() for n, v in result.task_vector.items()}
        quiet[name] = float(fd_tangent(backbone(), t, OTHER.double()).norm(dim=1).mean())
    assert quiet["pen"] < 0.7 * quiet["plain"], quiet


# --------------------------------------------------------------------------- a causal-LM tail with padding


@pytest.mark.parametrize("penalty_on", ["features", "logits", "distribution"])
def test_causal_lm_tail_penalty_equals_finite_differences_over_real_positions(penalty_on):
    """Two steps of a GPT-2 tail on cached prefix states. Step 1's logged penalty: central differences of the
    float64 tail at theta_0 +- eps tau (tau = the one-step vector) on the reg batch drawn second, padded
    positions dropped, the head applied for logits (weighted by theta_0's next-token probabilities for the
    distribution)."""
    run = two_penalized_steps(MODE, penalty_on)
    batch = run.reg_batch
    tail = copy.deepcopy(run.backbone.module).double()
    tau = {n: v.double() for n, v in run.tau.items()}
    tangent = fd_tangent(tail, tau, batch.inputs.double(), eps=1e-4, attention_mask=batch.attention_mask)
    lengths = batch.attention_mask.sum(1).tolist()
    assert min(lengths) < batch.inputs.shape[1]  # padding present
    head = copy.deepcopy(run.backbone.head).double()
    if penalty_on == "distribution":
        with torch.no_grad():
            logits = head(tail(batch.inputs.double(), attention_mask=batch.attention_mask))
        by_hand = mean_distribution_norm(logits, head(tangent), lengths)
    else:
        tangent = head(tangent) if penalty_on == "logits" else tangent
        by_hand = mean_sequence_norm(tangent, lengths, per_vocabulary=penalty_on == "logits")
    assert by_hand > 1e-4
    assert run.two.history[1]["penalty"] == pytest.approx(by_hand, rel=1e-4)


# --------------------------------------------------------------------------- a stream banks it


class StepLog:
    """A run logger that keeps each task's logged penalties."""

    def __init__(self) -> None:
        self.penalties: dict[str, list[float]] = {}

    def train_step(self, task, step, values) -> None:
        self.penalties.setdefault(task, []).append(values["penalty"])

    def experience(self, record) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_stream_banks_taujp_nonlinear_vectors_and_scores_them_as_plain_ones(tmp_path):
    module = models.mlp(4, 16, 8, batchnorm=True, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    other = torch.randn(40, 4, generator=g) + 1.5
    data = {"a": TensorTaskDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()),
            "b": TensorTaskDataset(other, (other[:, 2] > 1.5).long())}
    exps = [Experience(i, name, i, d, d, None, 3) for i, (name, d) in enumerate(data.items())]
    heads = {name: LinearHead(torch.randn(3, 8, generator=g), torch.zeros(3)) for name in data}
    recipe = Recipe(mode=MODE, steps=4, batch_size=10, lr=5e-2, warmup=0, reg_batch=5, lam=1.0, generic=False)
    log = StepLog()
    result = run_stream(exps, Backbone("mlp", module, 8), heads, recipe, tmp_path / "bank", scenario="tiny",
                        logger=log)

    bank = Bank(tmp_path / "bank")
    assert bank.names() == ["a", "b"]
    assert {bank.get(n).mode for n in bank.names()} == {MODE}
    assert bank.get("b").recipe["mode"] == MODE
    assert log.penalties["a"] == [0.0] * 4  # the first task has no earlier one to be quiet on
    assert all(p > 0 for p in log.penalties["b"][1:])  # b is penalised on a's inputs
    merged = at(module, {n: bank.load("a")[n] + bank.load("b")[n] for n, _ in module.named_parameters()})
    with torch.no_grad():
        for name, d in data.items():
            accuracy = float((heads[name](merged(d.inputs)).argmax(1) == d.targets).float().mean())
            assert result.steps[-1].merged["per_task"][name] == pytest.approx(accuracy)


# --------------------------------------------------------------------------- the command line


def test_cli_stream_and_bench_take_the_mode(monkeypatch):
    runner = CliRunner()
    given = {}

    def stop(scenario, **kwargs):
        given.update(kwargs)
        raise ConfigError("stopped before training")

    monkeypatch.setattr(stream_module, "run_scenario", stop)
    accepted = runner.invoke(app, ["stream", "--mode", MODE, "--steps", "1"])
    assert accepted.exit_code == 1 and "stopped before training" in accepted.output, accepted.output
    assert given["mode"] == MODE
    refused = runner.invoke(app, ["stream", "--mode", "taujp-nonlinar"])
    assert refused.exit_code == 2 and MODE in refused.output
    assert BenchConfig(modes=f"taujp,{MODE}").validated().modes == ("taujp", MODE)
    assert tuple(BenchConfig().modes) == ("nonlinear", "linear", "taujp")  # the paper's three unless asked
