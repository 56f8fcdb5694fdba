"""A curvature of what the input penalty measures through a language model's head (``penalty_on`` logits and
distribution), against that penalty computed on the inputs: the quadratic forms are the same where K-FAC is exact
(one linear layer; for the distribution, one position of one example), and the sampled probes average to it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jvp

from editkit.core.curvature import Curvature, CurvatureRegularizer, compute_curvature
from editkit.core.taujp import distribution_penalty, penalty
from editkit.errors import ConfigError


def layer_and_head(seed: int = 0) -> tuple[nn.Linear, nn.Linear, dict[str, torch.Tensor]]:
    """A trained layer (5 -> 4) on the sequence's features, a fixed head onto 7 logits, and a vector for the layer."""
    torch.manual_seed(seed)
    layer, head = nn.Linear(5, 4), nn.Linear(4, 7, bias=False)
    head.requires_grad_(False)
    tau = {n: torch.randn_like(p) * 0.3 for n, p in layer.named_parameters()}
    return layer, head, tau


def features_and_tangent(layer: nn.Module, x: torch.Tensor, tau: dict[str, torch.Tensor]):
    """theta_0's features and J tau, by one jvp."""
    params = {n: p.detach() for n, p in layer.named_parameters()}
    names = list(tau)
    return jvp(lambda *v: functional_call(layer, {**params, **dict(zip(names, v))}, (x,)),
               tuple(params[n] for n in names), tuple(tau[n] for n in names))


def test_the_logits_measure_is_the_input_penalty_s_form_for_one_layer():
    """penalty_on = logits, squared: the mean over examples and the vocabulary of the sum over positions of
    (W J tau)^2, the input penalty's own arithmetic; exact for one layer (its metric W^T W / V is one matrix)."""
    layer, head, tau = layer_and_head()
    x = torch.randn(3, 2, 5)  # 3 sequences of 2 positions
    _, tangent = features_and_tangent(layer, x, tau)
    want = penalty(head(tangent), squared=True, over_sequence=True).item()
    curvature = compute_curvature(layer, [x], exact=True, measure="logits", head=head)
    assert curvature.measure == "logits"
    assert curvature.quadratic(tau).item() == pytest.approx(want, rel=1e-5)


def test_the_distribution_measure_is_the_input_penalty_s_form_at_one_position():
    """penalty_on = distribution, squared: sum_v p_v (t_v - sum_w p_w t_w)^2 with t = W J tau and p theta_0's
    next-token probabilities; exact for one layer on one example's one position (its metric depends on p)."""
    layer, head, tau = layer_and_head()
    x = torch.randn(1, 1, 5)
    features, tangent = features_and_tangent(layer, x, tau)
    want = distribution_penalty(head(features), head(tangent), squared=True).item()
    curvature = compute_curvature(layer, [x], exact=True, measure="distribution", head=head)
    assert curvature.quadratic(tau).item() == pytest.approx(want, rel=1e-5)


def test_sampled_next_tokens_average_to_the_distribution_s_form():
    """One drawn token a position (e_y - p, y ~ p), over 4000 copies of one input: within 10% of the exact form
    (an estimate's spread here is ~3%); the same seed draws the same factors."""
    layer, head, tau = layer_and_head(seed=1)
    x = torch.randn(1, 1, 5).expand(4000, 1, 5).contiguous()
    features, tangent = features_and_tangent(layer, x[:1], tau)
    want = distribution_penalty(head(features), head(tangent), squared=True).item()
    drawn = compute_curvature(layer, [x], measure="distribution", head=head, seed=3)
    assert drawn.quadratic(tau).item() == pytest.approx(want, rel=0.10)
    again = compute_curvature(layer, [x], measure="distribution", head=head, seed=3)
    assert torch.equal(again.quadratic(tau), drawn.quadratic(tau))


def test_the_measure_is_banked_and_curvatures_of_two_measures_are_not_combined():
    layer, head, _ = layer_and_head()
    x = torch.randn(2, 1, 5)
    features = compute_curvature(layer, [x], exact=True)
    distribution = compute_curvature(layer, [x], exact=True, measure="distribution", head=head)
    back = Curvature.from_tensors(distribution.to_tensors(), distribution.header())
    assert back.measure == "distribution" and back.describe()["measure"] == "distribution"
    header = features.header()
    del header["measure"]  # written before curvatures measured anything but the features
    assert Curvature.from_tensors(features.to_tensors(), header).measure == "features"
    for combine in ("sum", "apart"):
        with pytest.raises(ConfigError, match="curvatures measuring distribution and features cannot be combined"):
            CurvatureRegularizer([features, distribution], lam=1.0, combine=combine)
    with pytest.raises(ConfigError, match="measuring logits needs the head"):
        compute_curvature(layer, [x], measure="logits")
