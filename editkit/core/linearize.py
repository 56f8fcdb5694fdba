"""First-order Taylor models of a backbone around theta_0.

The paper fine-tunes f_lin(x; theta) = f(x; theta_0) + J_theta0 f(x) . (theta - theta_0)
instead of f itself: task vectors of linearized models add and negate cleanly.
``torch.func.jvp`` computes the primal f(x; theta_0) and the tangent J . tau in one
forward pass (forward-mode AD), so a linearized forward costs about two plain ones.

Trainable state is theta itself (initialised to theta_0), as in the official code,
so AdamW's weight decay acts on theta exactly as it does in non-linear fine-tuning;
the task vector is ``theta - theta_0``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.func import functional_call, jvp

from editkit.core.modes import Mode


@contextlib.contextmanager
def forward_ad_safe_attention() -> Iterator[None]:
    """Route attention through kernels that support forward-mode AD.

    On CPU the flash SDPA kernel and ``nn.MultiheadAttention``'s fused fast path
    have no jvp rule; the MATH SDPA backend and the slow MHA path do.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)


def _freeze(module: nn.Module) -> nn.Module:
    """Eval mode, no gradients: ``module`` *is* theta_0. Frozen in place, not copied, because every
    task model of a stream shares it (a copy per task would hold one more backbone in memory)."""
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class _TaskModel(nn.Module):
    """Shared state of both parameterisations: theta_0 (frozen) and theta (trainable).

    Both answer :meth:`primal_and_tangent`, the first-order term of their vector at theta_0:
    it is the linearized model's forward, and what the tauJp penalty measures of either
    (``taujp-nonlinear`` trains the plain model and penalises this term on the reg batch).
    theta is stored in a ParameterList because parameter names contain dots.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = _freeze(module)
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.theta = nn.ParameterList([nn.Parameter(p.detach().clone()) for _, p in named])

    @property
    def theta0(self) -> dict[str, torch.Tensor]:
        """Read from the wrapped module each time, so ``.to(device)`` / ``.double()`` move it too."""
        return {n: p.detach() for n, p in self.module.named_parameters()}

    @property
    def buffers0(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())

    def train(self, mode: bool = True) -> "_TaskModel":
        """BatchNorm statistics and dropout belong to theta_0: the wrapped module stays in eval mode."""
        super().train(mode)
        self.module.eval()
        return self

    def task_vector(self) -> dict[str, torch.Tensor]:
        theta0 = self.theta0
        return {n: (p.detach() - theta0[n]).clone() for n, p in zip(self.names, self.theta)}

    def load_task_vector(self, tau: Mapping[str, torch.Tensor]) -> None:
        """Set theta = theta_0 + tau (names missing from tau keep theta_0)."""
        unknown = set(tau) - set(self.names)
        if unknown:
            raise KeyError(f"task vector has parameters the backbone lacks: {sorted(unknown)[:5]}")
        theta0 = self.theta0
        with torch.no_grad():
            for n, p in zip(self.names, self.theta):
                p.copy_(theta0[n] + tau[n].to(p) if n in tau else theta0[n])

    def _call(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module at ``params``; ``args``/``kwargs`` are its inputs (e.g. token ids and an attention mask)."""
        return functional_call(self.module, ({**params, **self.buffers0}), args, kwargs)

    def primal_and_tangent(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(x; theta_0), J_theta0 f(x) . tau) from one jvp; gradients flow into theta via tau.

        ``args``/``kwargs`` are the module's inputs. Only theta is differentiated: the
        inputs (an attention mask among them) are closed over, constants of the jvp.
        """
        theta0_map = self.theta0
        tau = tuple(p - theta0_map[n] for n, p in zip(self.names, self.theta))
        theta0 = tuple(theta0_map[n] for n in self.names)

        def f(*params: torch.Tensor) -> torch.Tensor:
            return self._call(dict(zip(self.names, params)), *args, **kwargs)

        with forward_ad_safe_attention():
            return jvp(f, theta0, tau)

    def tangent(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """J_theta0 f(x) . tau alone: the quantity the tauJp penalty measures."""
        return self.primal_and_tangent(*args, **kwargs)[1]


class NonLinearModel(_TaskModel):
    """f(x; theta): ordinary fine-tuning, expressed with the same theta/theta_0 state."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._call(dict(zip(self.names, self.theta)), *args, **kwargs)


class LinearizedModel(_TaskModel):
    """f_lin(x; theta) = f(x; theta_0) + J_theta0 f(x) . (theta - theta_0)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        primal, tangent = self.primal_and_tangent(*args, **kwargs)
        return primal + tangent


def build_task_model(module: nn.Module, mode: str) -> _TaskModel:
    """``nonlinear`` and ``taujp-nonlinear`` fine-tune f itself; ``linear`` and ``taujp`` fine-tune f_lin."""
    if mode not in tuple(Mode):
        raise ValueError(f"unknown mode {mode!r}: expected {', '.join(Mode)}")
    return LinearizedModel(module) if Mode(mode).linearized else NonLinearModel(module)
