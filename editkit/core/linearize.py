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
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn
from torch.func import functional_call, jvp

from editkit.core.adapters import attached, is_adapter_parameter, trainable_names
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


@contextlib.contextmanager
def forward_ad_safe_batchnorm(module: nn.Module) -> Iterator[None]:
    """Under CPU autocast, run ``module``'s BatchNorm layers in fp32.

    CPU autocast leaves BatchNorm to its input's dtype, and BatchNorm's forward-mode rule then gives a bf16 primal
    an fp32 tangent (its statistics are fp32); the next convolution gets a bf16 primal and an fp32 tangent, which
    it refuses. Cast to fp32 first, primal and tangent both stay fp32 through the norm, and the next autocast op
    casts them together. CUDA autocast needs nothing (its kernels take the mixed dtypes).
    """
    if not torch.is_autocast_enabled("cpu"):
        yield
        return
    hooks = [m.register_forward_pre_hook(lambda _, args: (args[0].float(), *args[1:]))
             for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


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

    theta covers ``names``: by default every parameter of the module, or only its LoRA factors when
    it carries an adapter (:mod:`editkit.core.adapters`); the other parameters are constants of
    theta_0. Scoring a merged vector passes the vector's own names (plain-LoRA merges are weight updates).
    """

    def __init__(self, module: nn.Module, names: list[str] | None = None, *, from_init: bool = False) -> None:
        super().__init__()
        self.from_init = from_init
        self.module = _freeze(module)
        params = dict(module.named_parameters())
        self.names = list(names) if names is not None else trainable_names(module)
        unknown = [n for n in self.names if n not in params]
        if unknown:
            raise KeyError(f"task vector has parameters the backbone lacks: {sorted(unknown)[:5]}")
        self.theta = nn.ParameterList([nn.Parameter(params[n].detach().clone()) for n in self.names])
        #: The earlier vectors' sum this one is fine-tuned beside (``from_sum``; None: none): theta starts at
        #: theta_0 + it, and what the vector and the penalty read is what theta adds to it.
        self.beside: dict[str, torch.Tensor] | None = None

    @property
    def theta0(self) -> dict[str, torch.Tensor]:
        """theta's values at theta_0, read from the wrapped module each time, so ``.to(device)`` / ``.double()``
        move them too."""
        params = dict(self.module.named_parameters())
        return {n: params[n].detach() for n in self.names}

    @property
    def buffers0(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())

    def train(self, mode: bool = True) -> "_TaskModel":
        """BatchNorm statistics and dropout belong to theta_0: the wrapped module stays in eval mode."""
        super().train(mode)
        self.module.eval()
        return self

    @property
    def origin(self) -> dict[str, torch.Tensor]:
        """Where task vectors are measured from: theta_0 (a plain LoRA adapter's is the zero adapter)."""
        return self.theta0

    def task_vector(self) -> dict[str, torch.Tensor]:
        """theta - origin, less the vectors it was fine-tuned beside (:attr:`beside`): what this task adds."""
        origin, beside = self.origin, self.beside or {}
        return {n: (p.detach() - origin[n] - beside[n] if n in beside else p.detach() - origin[n]).clone()
                for n, p in zip(self.names, self.theta)}

    def load_task_vector(self, tau: Mapping[str, torch.Tensor], *,
                         beside: Mapping[str, torch.Tensor] | None = None) -> None:
        """Set theta = origin + tau (names missing from tau keep theta_0), plus ``beside``, the earlier vectors'
        sum a ``from_sum`` fine-tuning starts from, kept as :attr:`beside` until the next load."""
        unknown = (set(tau) | set(beside or {})) - set(self.names)
        if unknown:
            raise KeyError(f"task vector has parameters the backbone lacks: {sorted(unknown)[:5]}")
        origin, theta0 = self.origin, self.theta0
        self.beside = None if beside is None else {
            n: beside[n].detach().to(p) for n, p in zip(self.names, self.theta) if n in beside}
        with torch.no_grad():
            for n, p in zip(self.names, self.theta):
                p.copy_(origin[n] + tau[n].to(p) if n in tau else theta0[n])
                if n in (self.beside or {}):
                    p.add_(self.beside[n])

    def live_vector(self, theta0: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """theta - theta_0 by name, less :attr:`beside`, differentiable in theta: the vector this task adds, which
        a penalty on the vector reads."""
        displacement, beside = self._displacement(theta0), self.beside or {}
        return {n: d - beside[n] if n in beside else d for n, d in displacement.items()}

    def _displacement(self, theta0: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """theta - theta_0 by name, differentiable in theta: where the model is."""
        theta0 = theta0 if theta0 is not None else self.theta0
        return {n: p - theta0[n] for n, p in zip(self.names, self.theta)}

    def _call(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """The module at ``params`` (theta's names; other parameters keep theta_0); ``args``/``kwargs`` are its
        inputs (e.g. token ids and an attention mask)."""
        return functional_call(self.module, ({**params, **self.buffers0}), args, kwargs)

    def primal_and_tangent(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(x; theta_0), J_theta0 f(x) . (theta - theta_0)) from one jvp; gradients flow into theta.

        ``args``/``kwargs`` are the module's inputs. Only theta is differentiated: the
        inputs (an attention mask among them) are closed over, constants of the jvp.
        """
        return self._jvp(self._displacement, args, kwargs)

    def primal_and_added(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(f(x; theta_0), J_theta0 f(x) . tau), tau the vector this task adds (:meth:`live_vector`): what the
        tauJp penalty measures. The same as :meth:`primal_and_tangent` unless the model is fine-tuned beside
        earlier vectors."""
        return self._jvp(self.live_vector, args, kwargs)

    def _jvp(self, along: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
             args: tuple, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The module's primal and its tangent along ``along(theta_0)`` (by name) at theta_0, from one jvp."""
        theta0_map = self.theta0
        tau = tuple(along(theta0_map).values())
        theta0 = tuple(theta0_map[n] for n in self.names)

        def f(*params: torch.Tensor) -> torch.Tensor:
            return self._call(dict(zip(self.names, params)), *args, **kwargs)

        with forward_ad_safe_attention(), forward_ad_safe_batchnorm(self.module):
            return jvp(f, theta0, tau)

    def tangent(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """J_theta0 f(x) . (theta - theta_0) alone: the linearized model's change of the output."""
        return self.primal_and_tangent(*args, **kwargs)[1]


class NonLinearModel(_TaskModel):
    """f(x; theta): ordinary fine-tuning, expressed with the same theta/theta_0 state."""

    @property
    def origin(self) -> dict[str, torch.Tensor]:
        """theta_0, except a LoRA adapter's factors, measured from zero: the zero adapter is theta_0's function
        as the initial one (A0, B = 0) is, and a vector that is the adapter itself is what PEFT saves and what
        weight updates s * B A are read from (:class:`~editkit.core.adapters.LoraWeights`). With ``from_init``
        (a linearized vector's weights: the ordinary model at phi_0 + tau) the factors are measured from phi_0."""
        if self.from_init:
            return self.theta0
        return {n: torch.zeros_like(t) if is_adapter_parameter(n) else t for n, t in self.theta0.items()}

    def train(self, mode: bool = True) -> "NonLinearModel":
        """A LoRA adapter's dropout is part of plain LoRA training (not of theta_0), so it follows ``mode``."""
        super().train(mode)
        if attached(self.module) is not None:
            for name, layer in self.module.named_modules():
                if name.endswith("lora_dropout"):
                    layer.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._call(dict(zip(self.names, self.theta)), *args, **kwargs)


class LinearizedModel(_TaskModel):
    """f_lin(x; theta) = f(x; theta_0) + J_theta0 f(x) . (theta - theta_0)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        primal, tangent = self.primal_and_tangent(*args, **kwargs)
        return primal + tangent


def build_task_model(module: nn.Module, mode: str, names: list[str] | None = None,
                     vector_mode: str | None = None) -> _TaskModel:
    """``nonlinear`` and ``taujp-nonlinear`` fine-tune f itself; ``linear`` and ``taujp`` fine-tune f_lin.
    ``names``: the parameters theta covers (default: the adapter's factors when the module carries one, else all);
    ``vector_mode``: the mode of the vectors it will hold, when not ``mode`` (a linearized vector scored as the
    ordinary model at its weights)."""
    if mode not in tuple(Mode):
        raise ValueError(f"unknown mode {mode!r}: expected {', '.join(Mode)}")
    if Mode(mode).linearized:
        return LinearizedModel(module, names)
    return NonLinearModel(module, names, from_init=Mode(vector_mode or mode).linearized)
