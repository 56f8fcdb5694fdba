"""Directional derivatives of a module by hand: what linearized tangents are checked against."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def random_direction(module: nn.Module, seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    """A random tau of entries ~ N(0, scale^2): the step eps * tau then stays well inside the region where the
    tail is close to linear (unit entries would swamp these weights, initialised at std 0.02)."""
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            for n, p in module.named_parameters()}


def central_difference(tail: nn.Module, direction: dict[str, torch.Tensor], eps: float, hidden, mask) -> torch.Tensor:
    """(tail(theta_0 + eps d) - tail(theta_0 - eps d)) / 2 eps: the directional derivative by hand."""
    theta0 = {n: p.detach() for n, p in tail.named_parameters()}

    def at(sign: float) -> torch.Tensor:
        params = {n: theta0[n] + sign * eps * direction[n] for n in theta0}
        return functional_call(tail, params, (hidden,), {"attention_mask": mask})

    with torch.no_grad():
        return (at(1.0) - at(-1.0)) / (2 * eps)
