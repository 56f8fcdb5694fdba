"""LinearizedModel / NonLinearModel against ground truth.

Ground truth: central finite differences of a deep copy whose parameters are edited
directly (float64), second-order Taylor remainder, reverse-mode gradients of the
plain module, hand-edited copies. Real architectures (open_clip ViT, HF BERT,
EfficientNet-Lite0) run on tiny random configurations; nothing is downloaded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from editkit.core.linearize import (
    LinearizedModel,
    NonLinearModel,
    build_task_model,
    forward_ad_safe_attention,
)

from helpers import models

# --------------------------------------------------------------------------- helpers


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """Linear -> BatchNorm (non-trivial running stats, eval) -> Tanh -> [Dropout] -> Linear."""
    m = models.mlp(5, 8, 3, batchnorm=True, dropout=dropout, seed=seed).to(dtype)
    bn = m[1]
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(8, dtype=dtype) * 0.5)
        bn.running_var.copy_(torch.rand(8, dtype=dtype) + 0.5)
        bn.weight.copy_(torch.rand(8, dtype=dtype) + 0.5)
        bn.bias.copy_(torch.randn(8, dtype=dtype) * 0.1)
    return m


def random_tau(module: nn.Module, scale: float = 1.0, seed: int = 1, only=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tau = {}
    for n, p in module.named_parameters():
        t = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale
        if only is not None and not only(n):
            t = torch.zeros_like(t)
        tau[n] = t
    return tau


def edited_forward(module: nn.Module, tau: dict[str, torch.Tensor], eps: float, x, dtype=None) -> torch.Tensor:
    """Forward of a deep copy whose parameters are theta_0 + eps * tau (eval mode)."""
    c = copy.deepcopy(module)
    if dtype is not None:
        c = c.to(dtype)
        if torch.is_tensor(x) and x.is_floating_point():
            x = x.to(dtype)
    c.eval()
    with torch.no_grad():
        for n, p in c.named_parameters():
            p.add_(eps * tau[n].to(p.dtype))
        return c(x)


def central_difference(module, tau, x, eps, dtype=torch.float64) -> torch.Tensor:
    return (edited_forward(module, tau, eps, x, dtype) - edited_forward(module, tau, -eps, x, dtype)) / (2 * eps)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def tangent_of(module: nn.Module, tau, x) -> torch.Tensor:
    lin = LinearizedModel(module)
    lin.load_task_vector(tau)
    with torch.no_grad():
        return lin.tangent(x)


# --------------------------------------------------------------------------- small MLP, float64


def test_mlp_tangent_matches_central_differences():
    m = mlp()
    x = torch.randn(6, 5, dtype=torch.float64)
    tau = random_tau(m, 0.3)
    fd = central_difference(m, tau, x, eps=1e-5)
    tangent = tangent_of(copy.deepcopy(m), tau, x)
    assert fd.norm() > 1e-2
    assert tangent.dtype == torch.float64
    assert rel_err(tangent, fd) < 1e-8


def test_mlp_tangent_uses_running_stats_not_batch_stats():
    # a batch of one example: train-mode BatchNorm would fail / differ, eval uses running stats
    m = mlp()
    x = torch.randn(1, 5, dtype=torch.float64)
    tau = random_tau(m, 0.3, seed=3)
    lin = LinearizedModel(copy.deepcopy(m)).train()
    lin.load_task_vector(tau)
    fd = central_difference(m, tau, x, eps=1e-5)
    assert rel_err(lin.tangent(x).detach(), fd) < 1e-8


def test_taylor_remainder_is_second_order():
    m = mlp()
    x = torch.randn(6, 5, dtype=torch.float64)
    tau = random_tau(m, 1.0, seed=2)
    lin = LinearizedModel(copy.deepcopy(m))

    def remainder(eps: float) -> float:
        lin.load_task_vector({n: eps * t for n, t in tau.items()})
        with torch.no_grad():
            f_lin = lin(x)
        return float((f_lin - edited_forward(m, tau, eps, x)).norm())

    for eps in (4e-2, 2e-2, 1e-2):
        r1, r2 = remainder(eps), remainder(eps / 2)
        assert r1 > 1e-10, "remainder vanished: the model is not testing curvature"
        assert 3.0 <= r1 / r2 <= 5.0, (eps, r1, r2)


def test_zero_task_vector_gives_the_module_exactly():
    m = mlp()
    x = torch.randn(7, 5, dtype=torch.float64)
    expected = m(x).detach()
    lin = LinearizedModel(copy.deepcopy(m))
    tv = lin.task_vector()
    assert set(tv) == {n for n, _ in m.named_parameters()}
    for n, p in m.named_parameters():
        assert tv[n].shape == p.shape and torch.count_nonzero(tv[n]) == 0
    primal, tangent = lin.primal_and_tangent(x)
    assert torch.count_nonzero(tangent) == 0
    torch.testing.assert_close(primal.detach(), expected, rtol=0, atol=1e-13)
    torch.testing.assert_close(lin(x).detach(), expected, rtol=0, atol=1e-13)


def test_task_vector_round_trip_is_exact(make_mlp):
    # dyadic theta_0 and tau: theta_0 + tau and (theta_0 + tau) - theta_0 are exact in float32
    m = make_mlp(4, 3, 2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-16, 17, p.shape, generator=g).float() / 8)
    tau = {n: torch.randint(-32, 33, p.shape, generator=g).float() / 16 for n, p in m.named_parameters()}
    lin = LinearizedModel(m)
    lin.load_task_vector(tau)
    got = lin.task_vector()
    assert set(got) == set(tau)
    for n in tau:
        assert torch.equal(got[n], tau[n]), n
    # theta itself is theta_0 + tau
    for (n, p0), theta in zip(m.named_parameters(), lin.theta):
        assert torch.equal(theta.detach(), p0.detach() + tau[n])


def test_load_task_vector_partial_and_unknown():
    m = mlp(torch.float32)
    lin = LinearizedModel(m)
    lin.load_task_vector({"0.weight": torch.ones(8, 5)})
    tv = lin.task_vector()
    torch.testing.assert_close(tv["0.weight"], torch.ones(8, 5))
    assert all(torch.count_nonzero(t) == 0 for n, t in tv.items() if n != "0.weight")
    # loading again replaces (theta = theta_0 + tau, not accumulated)
    lin.load_task_vector({"3.bias": torch.full((3,), 0.5)})
    tv = lin.task_vector()
    assert torch.count_nonzero(tv["0.weight"]) == 0
    torch.testing.assert_close(tv["3.bias"], torch.full((3,), 0.5))
    with pytest.raises(KeyError):
        lin.load_task_vector({"no.such.param": torch.zeros(1)})


@settings(max_examples=15, deadline=None)
@given(a=st.floats(-3, 3), b=st.floats(-3, 3))
def test_tangent_is_linear_in_tau(a, b):
    m = mlp()
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    t1, t2 = random_tau(m, 1.0, seed=11), random_tau(m, 1.0, seed=12)
    mix = {n: a * t1[n] + b * t2[n] for n in t1}
    j1, j2, jm = (tangent_of(m, t, x) for t in (t1, t2, mix))
    torch.testing.assert_close(jm, a * j1 + b * j2, rtol=1e-9, atol=1e-9)


def test_gradient_into_theta_is_vjp_of_the_plain_module():
    # f_lin is linear in theta, so d<c, f_lin>/d theta = J^T c at theta_0, whatever tau is
    m = mlp()
    x = torch.randn(6, 5, dtype=torch.float64)
    c = torch.randn(6, 3, dtype=torch.float64)
    ref = copy.deepcopy(m)
    (c * ref(x)).sum().backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    lin = LinearizedModel(copy.deepcopy(m))
    lin.load_task_vector(random_tau(m, 0.5, seed=4))
    (c * lin(x)).sum().backward()
    for n, theta in zip(lin.names, lin.theta):
        torch.testing.assert_close(theta.grad, expected[n], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- frozen state


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("cls", [LinearizedModel, NonLinearModel])
def test_theta0_and_buffers_frozen_by_an_optimizer_step(cls):
    m = mlp(torch.float32, dropout=0.5)
    before = snapshot(m)
    model = cls(m)
    model.train()
    assert model.training
    assert all(not sub.training for sub in model.module.modules()), "wrapped module must stay in eval mode"
    theta_before = [p.detach().clone() for p in model.theta]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(4, 5)
    loss = model(x).square().sum()
    loss.backward()
    opt.step()
    after = m.state_dict()
    assert set(after) == set(before)
    for k in before:  # parameters and BatchNorm running stats, bit for bit
        assert torch.equal(after[k], before[k]), k
    assert all(p.grad is None for p in m.parameters())
    assert all(not sub.training for sub in model.module.modules())
    changed = [not torch.equal(p.detach(), t0) for p, t0 in zip(model.theta, theta_before)]
    assert all(changed)
    assert any(torch.count_nonzero(t) > 0 for t in model.task_vector().values())


def test_train_mode_is_deterministic_and_uses_running_stats():
    # dropout and train-mode BatchNorm would make these differ from the eval copy
    m = mlp(torch.float64, dropout=0.5)
    tau = random_tau(m, 0.2, seed=6)
    x = torch.randn(5, 5, dtype=torch.float64)
    model = NonLinearModel(copy.deepcopy(m)).train()
    model.load_task_vector(tau)
    expected = edited_forward(m, tau, 1.0, x)
    torch.testing.assert_close(model(x).detach(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model(x).detach(), expected, rtol=1e-12, atol=1e-12)


def test_nonlinear_model_equals_edited_copy_and_its_gradient():
    m = mlp()
    tau = random_tau(m, 0.5, seed=7)
    x = torch.randn(6, 5, dtype=torch.float64)
    model = NonLinearModel(copy.deepcopy(m))
    model.load_task_vector(tau)
    out = model(x)
    torch.testing.assert_close(out.detach(), edited_forward(m, tau, 1.0, x), rtol=1e-12, atol=1e-12)
    # gradient w.r.t. theta equals the plain module's gradient at theta_0 + tau
    c = torch.randn(6, 3, dtype=torch.float64)
    (c * out).sum().backward()
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.add_(tau[n])
    (c * ref(x)).sum().backward()
    for n, theta in zip(model.names, model.theta):
        torch.testing.assert_close(theta.grad, dict(ref.named_parameters())[n].grad, rtol=1e-10, atol=1e-12)


def test_moving_the_model_moves_theta0_and_buffers():
    """nn.Module contract: .to()/.double() converts all state, so f_lin keeps working.

    A CPU stand-in for ``model.to('cuda')`` after construction.
    """
    m = mlp(torch.float32)
    ref = copy.deepcopy(m).double()
    x = torch.randn(5, 5, dtype=torch.float64)
    lin = LinearizedModel(m).double()
    torch.testing.assert_close(lin(x).detach(), ref(x).detach(), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- attention context


def test_forward_ad_safe_attention_restores_fastpath_flag():
    original = torch.backends.mha.get_fastpath_enabled()
    try:
        for state in (True, False):
            torch.backends.mha.set_fastpath_enabled(state)
            with forward_ad_safe_attention():
                assert torch.backends.mha.get_fastpath_enabled() is False
            assert torch.backends.mha.get_fastpath_enabled() is state
            with pytest.raises(ZeroDivisionError):
                with forward_ad_safe_attention():
                    1 / 0
            assert torch.backends.mha.get_fastpath_enabled() is state
    finally:
        torch.backends.mha.set_fastpath_enabled(original)


def test_batchnorm_between_convolutions_under_cpu_bf16_autocast():
    """CPU autocast leaves BatchNorm's tangent fp32 beside a bf16 primal, which the next convolution refused: the
    norm runs in fp32 inside the jvp, so f_lin trains in bf16 and its tangent is the fp32 one to bf16 precision."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU6(), nn.Conv2d(8, 8, 3, groups=8),
                           nn.BatchNorm2d(8), nn.Flatten())
    with torch.no_grad():
        for bn in (module[1], module[4]):
            bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
    x, tau = torch.randn(4, 3, 9, 9), random_tau(module, 0.1)
    exact = tangent_of(copy.deepcopy(module), tau, x)
    lin = LinearizedModel(module)
    lin.load_task_vector(tau)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        primal, tangent = lin.primal_and_tangent(x)
    assert rel_err(tangent.detach(), exact) < 2e-2, rel_err(tangent.detach(), exact)
    (primal.float() + tangent.float()).square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all() for p in lin.theta)
    assert not any(m._forward_pre_hooks for m in module.modules())  # the fp32 casts last for the jvp alone


# --------------------------------------------------------------------------- real architectures, tiny configs

FD_EPS = 1e-6  # on a float64 copy; tau entries are O(1e-2)
FLOAT32_TOL = 1e-3  # float32 jvp vs float64 central differences


def check_against_fd(module: nn.Module, x, *, scale=1e-2, seed=1, only=None) -> None:
    tau = random_tau(module, scale, seed=seed, only=only)
    fd = central_difference(module, tau, x, FD_EPS)
    tangent = tangent_of(copy.deepcopy(module), tau, x)
    assert tangent.shape == fd.shape
    assert fd.norm() > 0 and torch.isfinite(tangent).all()
    assert rel_err(tangent, fd) < FLOAT32_TOL, rel_err(tangent, fd)


@pytest.fixture(scope="module")
def clip_vision_tower() -> nn.Module:
    import open_clip.model as open_clip_model
    cfg = open_clip_model.CLIPVisionCfg(layers=1, width=32, patch_size=8, image_size=16, head_width=16)
    torch.manual_seed(0)
    tower = open_clip_model._build_vision_tower(embed_dim=16, vision_cfg=cfg).eval()
    assert any(isinstance(mod, nn.MultiheadAttention) for mod in tower.modules())
    return tower


def test_open_clip_vit_tangent_matches_fd(clip_vision_tower):
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    check_against_fd(clip_vision_tower, x)
    # attention parameters alone: the part that needs forward_ad_safe_attention
    check_against_fd(clip_vision_tower, x, seed=2, only=lambda n: ".attn." in n)


@pytest.fixture(scope="module")
def bert_features(tiny_bert) -> nn.Module:
    class ClsFeatures(nn.Module):
        def __init__(self, bert: nn.Module) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out = self.bert(input_ids=ids)
            return torch.cat([out.last_hidden_state[:, 0], out.pooler_output], dim=-1)

    return ClsFeatures(tiny_bert).eval()


def test_bert_tangent_matches_fd(bert_features):
    ids = torch.randint(0, 99, (3, 7), generator=torch.Generator().manual_seed(0))
    check_against_fd(bert_features, ids)
    check_against_fd(bert_features, ids, seed=2, only=lambda n: ".attention.self." in n)


def test_gpt2_tangent_matches_fd(tiny_gpt2):
    """A causal language model (tied input/output embeddings) has the same first-order expansion."""

    class Logits(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids).logits

    model = Logits(tiny_gpt2).eval()
    ids = torch.randint(0, 99, (3, 7), generator=torch.Generator().manual_seed(0))
    check_against_fd(model, ids)
    check_against_fd(model, ids, seed=2, only=lambda n: ".attn." in n)


def test_efficientnet_lite0_tangent_matches_fd():
    """Float32 central differences: float64 convolutions (depthwise) are ~100x slower on CPU."""
    from editkit.models.efficientnet import build

    torch.manual_seed(0)
    backbone = build(image_size=32, pretrained=False)
    module = backbone.module
    # Random init with identity BatchNorm stats shrinks activations ~10x per stage (output ~1e-9).
    # Calibrate each BatchNorm's running stats to the batch statistics of random images (one eval
    # forward with pre-hooks: a train-mode forward is ~30x slower here) so features are O(1);
    # then add 1 to every running variance so near-dead channels (var ~ 0, eps 1e-3) do not amplify perturbations ~30x --
    # that curvature would make float32 differences useless, not the jvp wrong.
    def calibrate(bn: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        h = inputs[0]
        dims = [0, *range(2, h.dim())]
        bn.running_mean.copy_(h.mean(dims))
        bn.running_var.copy_(h.var(dims))

    hooks = [bn.register_forward_pre_hook(calibrate) for bn in module.modules()
             if isinstance(bn, nn.modules.batchnorm._BatchNorm)]
    assert len(hooks) > 40
    with torch.no_grad():
        module(torch.randn(8, 3, 32, 32))
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for bn in module.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.running_var.add_(1.0)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert module(x).shape == (2, backbone.feature_dim)
    tau = random_tau(module, 1e-2)
    fd = central_difference(module, tau, x, eps=3e-3, dtype=None)
    tangent = tangent_of(copy.deepcopy(module), tau, x)
    assert fd.norm() > 1e-1
    assert rel_err(tangent, fd) < 5e-3, rel_err(tangent, fd)


# --------------------------------------------------------------------------- factory


def test_build_task_model_modes():
    assert type(build_task_model(mlp(torch.float32), "nonlinear")) is NonLinearModel
    assert type(build_task_model(mlp(torch.float32), "linear")) is LinearizedModel
    assert type(build_task_model(mlp(torch.float32), "taujp")) is LinearizedModel
    for bad in ("Linear", "tau-jp", "", "finetune"):
        with pytest.raises(ValueError):
            build_task_model(mlp(torch.float32), bad)
