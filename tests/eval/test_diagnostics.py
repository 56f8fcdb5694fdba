"""tauJp matrix, correlation and weight-disentanglement error on tiny models with known answers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from editkit.eval.diagnostics import (
    correlation,
    disentanglement_error,
    off_diagonal,
    pair_interference,
    taujp_matrix,
)
from editkit.core.linearize import build_task_model
from editkit.errors import ConfigError
from editkit.models.heads import LinearHead


def module_predictor(module, mode, vectors, heads, inputs):
    """Reference oracle for xi: runs the real task model (``mode``'s) at theta_0 + a1 tau_1 + a2 tau_2
    and takes the argmax of task t's head, with no caching or tangent shortcuts."""
    model = build_task_model(module, mode).eval()
    tau1, tau2 = vectors

    @torch.no_grad()
    def predict(t: int, a1: float, a2: float) -> torch.Tensor:
        model.load_task_vector({k: a1 * tau1[k] + a2 * tau2[k] for k in tau1})
        return heads[t](model(inputs[t])).argmax(dim=1)

    return predict


def linear_backbone(weight: torch.Tensor) -> nn.Module:
    """f(x) = W x: its Jacobian-vector product with tau = dW is dW x, exactly."""
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.eval()


def test_taujp_matrix_of_a_linear_model_is_dW_x():
    module = linear_backbone(torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, -1.0]]))
    tau_a = {"weight": torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])}   # moves feature 0 by x0
    tau_b = {"weight": torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 2.0]])}   # moves feature 1 by 2 x2
    x_a = torch.tensor([[1.0, 5.0, 0.0], [3.0, -1.0, 0.0]])                # task a: x2 = 0
    x_b = torch.tensor([[0.0, 7.0, 1.0], [0.0, 2.0, -1.0], [4.0, 0.0, 3.0]])
    m = taujp_matrix(module, [tau_a, tau_b], [x_a, x_b], batch_size=2)
    # M[a][a] = mean(|1|, |3|) = 2          M[a][b] = mean(0, 0, 4) = 4/3
    # M[b][a] = mean(0, 0) = 0              M[b][b] = mean(2, 2, 6) = 10/3
    expected = np.array([[2.0, 4.0 / 3.0], [0.0, 10.0 / 3.0]])
    np.testing.assert_allclose(m, expected, rtol=1e-6)
    np.testing.assert_allclose(off_diagonal(m), [4.0 / 3.0, 0.0])
    assert pair_interference(m, 0, 1) == pytest.approx(2.0 / 3.0)


def test_taujp_matrix_matches_finite_differences_on_a_nonlinear_model(make_mlp):
    module = make_mlp(5, 8, 3, seed=0).double()
    taus = [{n: 1e-1 * torch.randn_like(p) for n, p in module.named_parameters()} for _ in range(2)]
    xs = [torch.randn(6, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)]
    m = taujp_matrix(module, taus, xs)
    eps = 1e-6
    base = {n: p.detach().clone() for n, p in module.named_parameters()}
    for a, tau in enumerate(taus):
        for b, x in enumerate(xs):
            outs = []
            for sign in (1, -1):
                params = {n: base[n] + sign * eps * tau[n] for n in base}
                outs.append(torch.func.functional_call(module, params, (x,)))
            fd = (outs[0] - outs[1]) / (2 * eps)
            assert m[a, b] == pytest.approx(float(fd.norm(dim=1).mean()), rel=1e-6)


def test_correlation_known_values():
    c = correlation([1.0, 2.0, 3.0], [1.0, 3.0, 2.0])
    # deviations (-1, 0, 1) and (-1, 1, 0): r = 1 / sqrt(2 * 2) = 0.5; ranks are the values -> rho = 0.5
    assert c["pearson"] == pytest.approx(0.5)
    assert c["spearman"] == pytest.approx(0.5)
    assert c["n"] == 3
    assert correlation([1, 2, 3, 4], [8, 6, 4, 2])["pearson"] == pytest.approx(-1.0)
    undefined = correlation([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])
    assert undefined["pearson"] is None and undefined["spearman"] is None
    assert correlation([1.0, 2.0], [2.0, 1.0])["pearson"] is None


# --- weight disentanglement -------------------------------------------------------------------


def block_setup(seed: int = 0):
    """f(x) = W x with 4 features; task 0's head reads features 0-1, task 1's head features 2-3."""
    g = torch.Generator().manual_seed(seed)
    module = linear_backbone(torch.randn(4, 3, generator=g))
    head0 = LinearHead(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]), torch.zeros(2))
    head1 = LinearHead(torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]), torch.zeros(2))
    inputs = (torch.randn(40, 3, generator=g), torch.randn(40, 3, generator=g))
    return module, (head0, head1), inputs, g


GRID = [-2.0, -1.0, 0.0, 0.5, 1.0, 2.0]


@pytest.mark.parametrize("mode", ["nonlinear", "linear"])
def test_xi_of_a_vector_merged_with_a_zero_vector(mode):
    module, heads, inputs, g = block_setup()
    tau = {"weight": torch.randn(4, 3, generator=g)}      # entangled: touches both tasks' features
    zero = {"weight": torch.zeros(4, 3)}
    xi = disentanglement_error(module_predictor(module, mode, (tau, zero), heads, inputs), GRID)
    # the vector's own task: theta_0 + a1 tau + a2 * 0 is exactly the single-vector model
    assert np.all(xi.terms[0] == 0.0)
    # merging a zero vector with a zero-scaled vector changes nothing at all
    assert np.all(xi.total[GRID.index(0.0), :] == 0.0)
    # the zero vector's task compares theta_0 with theta_0 + a1 tau: independent of a2, and equal
    # to the disagreement computed directly with matrix products
    w0 = module.weight.detach()
    for i, a1 in enumerate(GRID):
        x = inputs[1]
        direct = ((heads[1](x @ w0.T)).argmax(1) != heads[1](x @ (w0 + a1 * tau["weight"]).T).argmax(1)).double().mean()
        np.testing.assert_allclose(xi.total[i, :], float(direct))
    assert xi.total.max() > 0  # the vector does move task 1's predictions somewhere on the grid


@pytest.mark.parametrize("mode", ["nonlinear", "linear"])
def test_xi_is_zero_for_disentangled_vectors_and_positive_for_entangled_ones(mode):
    module, heads, inputs, g = block_setup(1)
    mask0 = torch.zeros(4, 3)
    mask0[:2] = 1.0
    tau1 = {"weight": 3 * torch.randn(4, 3, generator=g) * mask0}          # only task 0's features
    tau2 = {"weight": 3 * torch.randn(4, 3, generator=g) * (1 - mask0)}    # only task 1's features
    xi = disentanglement_error(module_predictor(module, mode, (tau1, tau2), heads, inputs), GRID)
    assert np.all(xi.total == 0.0)
    entangled = {"weight": 3 * torch.randn(4, 3, generator=g)}
    xi2 = disentanglement_error(module_predictor(module, mode, (tau1, entangled), heads, inputs), GRID)
    assert xi2.total.max() > 0
    assert np.all(xi2.total <= 2.0) and np.all(xi2.total >= 0.0)


def test_xi_memoises_and_reports_cells():
    calls, cells = [], []

    def predict(t, a1, a2):
        calls.append((t, a1, a2))
        return torch.tensor([int(a1 > 0), int(a2 > 0)])

    xi = disentanglement_error(predict, [0.0, 1.0], on_cell=lambda: cells.append(1))
    assert len(calls) == len(set(calls))
    assert len(cells) == 4
    # task 0 compares (a1, 0) with (a1, a2): prediction depends on a2 at entry 1 -> 0.5 when a2 = 1
    np.testing.assert_allclose(xi.terms[0], [[0.0, 0.5], [0.0, 0.5]])
    np.testing.assert_allclose(xi.terms[1], [[0.0, 0.0], [0.5, 0.5]])
    with pytest.raises(ConfigError):
        disentanglement_error(predict, [])
