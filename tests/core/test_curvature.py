"""The data-free penalty's curvature against the exact quadratic form tau^T J^T J tau (a jvp on every input), the
penalty against hand-computed values, and the factors' files bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, jvp

from editkit.core.curvature import (Curvature, CurvatureRegularizer, compute_curvature, factor_root,
                                    mean_curvature)
from editkit.errors import ConfigError


def exact_quadratic(module: nn.Module, x: torch.Tensor, tau: dict[str, torch.Tensor]) -> float:
    """E_x ||J_x tau||^2 over the rows of ``x``, by one jvp: the form the factors approximate."""
    params = dict(module.named_parameters())
    names = list(tau)

    def f(*values):
        return functional_call(module, {**params, **dict(zip(names, values))}, (x,))

    _, tangent = jvp(f, tuple(params[n].detach() for n in names), tuple(tau[n] for n in names))
    return tangent.flatten(1).square().sum(1).mean().item()


def vector(module: nn.Module, seed: int = 0, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=p.dtype) * scale for n, p in module.named_parameters()}


def relative_error(module: nn.Module, x: torch.Tensor, *, exact: bool = True, seed: int = 0) -> float:
    module.eval()
    tau = vector(module, seed)
    curvature = compute_curvature(module, [x], exact=exact)
    want = exact_quadratic(module, x, tau)
    return abs(curvature.quadratic(tau).item() - want) / want


def batchnorm() -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm2d(3)
    norm.running_mean.normal_()
    norm.running_var.uniform_(0.5, 2.0)
    norm.weight.data.normal_()
    return nn.Sequential(norm, nn.Flatten())


class Embedded(nn.Module):
    """An embedding (no factored call: its diagonal) under a linear layer, mean over positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids)).mean(1)


# ------------------------------------------------------------------ exact where Kronecker factors are exact


@pytest.mark.parametrize("make, x", [
    (lambda: nn.Linear(5, 3), torch.randn(64, 5)),
    (lambda: nn.Linear(5, 1), torch.randn(64, 5)),
    (lambda: nn.Linear(5, 3, bias=False), torch.randn(64, 5)),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten()), torch.randn(16, 3, 6, 6)),
    (lambda: nn.Sequential(nn.Conv2d(4, 8, 3, groups=4, stride=2, padding=1), nn.Flatten()), torch.randn(16, 4, 6, 6)),
    (lambda: nn.Sequential(nn.Conv2d(4, 4, 3, groups=2, dilation=2), nn.Flatten()), torch.randn(8, 4, 7, 7)),
    (batchnorm, torch.randn(16, 3, 4, 4)),
    (lambda: nn.LayerNorm(6), torch.randn(8, 5, 6)),
], ids=["linear", "linear-1-output", "linear-no-bias", "conv", "depthwise-strided", "grouped-dilated", "batchnorm",
        "layernorm"])
def test_one_layer_on_the_features_is_exact(make, x):
    """One layer's block is the whole matrix: the factors (a convolution's per position, a norm's 2 x 2 per element)
    give tau^T J^T J tau itself."""
    torch.manual_seed(0)
    assert relative_error(make(), x) < 1e-5


def test_a_padded_convolution_is_factored_on_what_it_convolves():
    """A package's convolution that pads before calling conv2d (EfficientNet's same padding) is factored on the
    padded input, as the call sees it: exact again."""

    class SamePadded(nn.Conv2d):
        def forward(self, x):
            return nn.functional.conv2d(nn.functional.pad(x, (1, 2, 1, 2)), self.weight, self.bias, self.stride)

    torch.manual_seed(0)
    assert relative_error(nn.Sequential(SamePadded(3, 5, 4), nn.Flatten()), torch.randn(8, 3, 6, 6)) < 1e-5


def test_the_diagonal_of_a_parameter_outside_the_factored_calls_is_exact():
    """An embedding has no factored call: its curvature is the exact diagonal of J^T J, per example."""
    module = Embedded().eval()
    ids = torch.randint(0, 10, (12, 5), generator=torch.Generator().manual_seed(0))
    curvature = compute_curvature(module, [ids], names=["embed.weight"], exact=True)
    weight = module.embed.weight.detach()

    def f(w, row):
        return functional_call(module, {"embed.weight": w}, (row[None],))[0]

    want = torch.stack([jacrev(f)(weight, row).square().sum(0) for row in ids]).mean(0)
    torch.testing.assert_close(curvature.diagonal["embed.weight"], want, rtol=1e-5, atol=1e-7)
    assert set(curvature.diagonal) == {"embed.weight"} and not curvature.blocks


def test_a_deeper_network_is_approximated_and_the_error_is_measured():
    """Across layers (blocks taken as independent) and inside one (E[a a^T] (x) E[g g^T] for E[(a a^T) (x) (g g^T)])
    the factors approximate; measured with the output Jacobian exact, and with one Gaussian probe per example."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(512, 5)
    assert relative_error(mlp, x) < 0.05  # 0.022 measured
    assert relative_error(mlp, x, exact=False) < 0.25  # one probe per example: noisier


def test_a_linear_layer_with_one_probe_approaches_the_exact_form():
    """E_s[s s^T] = I: with enough examples one Gaussian probe each estimates G = I."""
    torch.manual_seed(0)
    assert relative_error(nn.Linear(4, 2), torch.randn(4096, 4), exact=False) < 0.05


def test_the_probes_are_seeded():
    torch.manual_seed(0)
    mlp, x = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(32, 3)
    a, b = (compute_curvature(mlp, [x], seed=1).to_tensors() for _ in range(2))
    c = compute_curvature(mlp, [x], seed=2).to_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)


def test_the_module_is_left_as_it_was():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).train()
    for p in mlp.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in mlp.state_dict().items()}
    compute_curvature(mlp, [torch.randn(8, 3)])
    assert mlp.training and not any(p.requires_grad or p.grad is not None for p in mlp.parameters())
    assert all(torch.equal(before[k], v) for k, v in mlp.state_dict().items())


# ------------------------------------------------------------------ roots, means, the penalty


def test_a_root_holds_its_matrix_and_energy_keeps_that_share_of_the_trace():
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    values = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    matrix = (basis * values) @ basis.T
    root = factor_root(matrix[None])
    assert root.shape == (1, 6, 4)  # the zero eigenvalues dropped
    torch.testing.assert_close((root @ root.transpose(1, 2))[0].double(), matrix, rtol=1e-5, atol=1e-5)
    kept = factor_root(matrix[None], energy=0.8)  # 8 + 4 = 12 of 15: the second eigenvalue crosses 80%
    assert kept.shape == (1, 6, 2)
    assert torch.allclose((kept.double() ** 2).sum(), torch.tensor(12.0, dtype=torch.float64), atol=1e-4)


def two_tasks() -> tuple[nn.Module, list[Curvature]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.LayerNorm(2))
    return mlp, [compute_curvature(mlp, [torch.randn(64, 3) + shift], exact=True) for shift in (0.0, 2.0)]


def test_apart_is_the_mean_of_the_tasks_forms_and_sum_uses_the_mean_factors():
    mlp, (c1, c2) = two_tasks()
    tau = vector(mlp)
    apart = CurvatureRegularizer([c1, c2], lam=1.0, squared=True, combine="apart")
    torch.testing.assert_close(apart.loss_of(tau), (c1.quadratic(tau) + c2.quadratic(tau)) / 2)
    summed = CurvatureRegularizer([c1, c2], lam=1.0, squared=True, combine="sum")
    hand = 0.0
    for name, block in c1.blocks.items():  # tr(mean G  dW  mean A  dW^T), from the full factors
        a = (block.A @ block.A.mT + c2.blocks[name].A @ c2.blocks[name].A.mT) / 2
        g = (block.G @ block.G.mT + c2.blocks[name].G @ c2.blocks[name].G.mT) / 2
        w = block.view(tau)
        hand += torch.trace(g[0] @ w[0] @ a[0] @ w[0].T)
    for scale, (shift, m) in c1.pairs.items():
        v = torch.stack([tau[scale], tau[shift]], -1)
        hand += (v[:, None, :] @ ((m + c2.pairs[scale][1]) / 2) @ v[:, :, None]).sum()
    torch.testing.assert_close(summed.loss_of(tau), hand, rtol=1e-4, atol=1e-6)


def test_the_penalty_is_lambda_times_the_root_of_the_form_and_flat_at_zero():
    mlp, curvatures = two_tasks()
    tau = {n: t.requires_grad_() for n, t in vector(mlp).items()}
    form = CurvatureRegularizer(curvatures, lam=1.0, squared=True).loss_of(tau)
    torch.testing.assert_close(CurvatureRegularizer(curvatures, lam=0.3).loss_of(tau), 0.3 * form.sqrt())
    zero = {n: torch.zeros_like(t, requires_grad=True) for n, t in tau.items()}
    CurvatureRegularizer(curvatures, lam=0.3).loss_of(zero).backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in zero.values())  # a norm's gradient at zero


def test_no_curvature_is_an_inactive_penalty_and_an_unknown_combine_is_refused():
    assert not CurvatureRegularizer([], lam=0.1).active
    with pytest.raises(ConfigError, match="combine"):
        CurvatureRegularizer([], lam=0.1, combine="max")


def test_the_mean_of_one_curvature_is_itself():
    _, (c1, _) = two_tasks()
    mean = mean_curvature([c1]).to_tensors()
    assert all(torch.equal(mean[k], v) for k, v in c1.to_tensors().items())


# ------------------------------------------------------------------ files and shapes


def test_tensors_and_header_round_trip_bit_for_bit():
    mlp, (c1, _) = two_tasks()
    back = Curvature.from_tensors(c1.to_tensors(), c1.header())
    assert back.examples == c1.examples and back.header() == c1.header()
    assert all(torch.equal(back.to_tensors()[k], v) for k, v in c1.to_tensors().items())
    tau = vector(mlp)
    assert torch.equal(back.quadratic(tau), c1.quadratic(tau))


def test_another_format_is_refused_by_name():
    _, (c1, _) = two_tasks()
    with pytest.raises(ConfigError, match="kfac-0"):
        Curvature.from_tensors(c1.to_tensors(), {**c1.header(), "format": "kfac-0"})


def test_factors_that_do_not_fit_the_model_are_refused_naming_the_layer():
    mlp, (c1, _) = two_tasks()
    shapes = {n: tuple(p.shape) for n, p in mlp.named_parameters()}
    c1.check_fits(shapes, "task a")
    with pytest.raises(ConfigError, match=r"task a: layer 2\.weight"):
        c1.check_fits({**shapes, "2.weight": (3, 4)}, "task a")
    with pytest.raises(ConfigError, match=r"task a: parameter 3\.weight"):
        c1.check_fits({**shapes, "3.weight": (5,)}, "task a")
    with pytest.raises(ConfigError, match=r"layer 0\.weight has curvature but the model has no such parameter"):
        c1.check_fits({k: v for k, v in shapes.items() if k != "0.weight"}, "task a")


def test_a_string_padding_is_refused_by_name():
    conv = nn.Sequential(nn.Conv2d(2, 2, 3, padding="same"), nn.Flatten())
    with pytest.raises(ConfigError, match="padding='same'"):
        compute_curvature(conv, [torch.randn(2, 2, 5, 5)])


class MixedNet(nn.Module):
    """Repeated and distinct shapes, grouped convolutions, norms and an embedding's diagonal."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 6, 3, groups=6),
                                   nn.Conv2d(6, 6, 1), nn.Conv2d(6, 6, 1, bias=False))
        self.embed = nn.Embedding(4, 6)
        self.head = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Linear(6, 6))

    def forward(self, x):
        return self.head(self.convs(x).mean((2, 3)) + self.embed.weight[0])


def mixed_curvatures() -> tuple[nn.Module, Curvature, Curvature]:
    """MixedNet and its curvature at full rank (the step multiplies the factors out: dense) and at a third of each
    factor's trace (the step keeps the roots)."""
    net = MixedNet().eval()
    x = torch.randn(8, 3, 7, 7, generator=torch.Generator().manual_seed(1))
    full, low = compute_curvature(net, [x]), compute_curvature(net, [x], energy=0.3)
    assert full.diagonal and full.pairs and len(full.blocks) == 6
    return net, full, low


def test_the_step_s_packed_form_is_the_curvature_s_quadratic():
    """The penalty stacks blocks of one shape and flattens diagonals and norm blocks, and multiplies full-rank
    factors out with a gradient of its own: the same form and the same gradient, full rank and low rank."""
    net, full, low = mixed_curvatures()
    for curvatures, routes in (([full], {"dense"}), ([low], {"G first", "A first"}), ([full, low], None)):
        tau = {n: t.requires_grad_() for n, t in vector(net).items()}
        for combine in ("sum", "apart"):
            penalty = CurvatureRegularizer(curvatures, lam=1.0, squared=True, combine=combine)
            packed = penalty.loss_of(tau)
            # the reference: the roots' form term by term, its gradient by autograd
            want = torch.stack([c.quadratic(tau) for c in penalty.curvatures]).mean()
            torch.testing.assert_close(packed, want, rtol=1e-5, atol=1e-7)
            got, expected = (torch.autograd.grad(v, list(tau.values())) for v in (packed, want))
            for name, g, e in zip(tau, got, expected):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6, msg=f"{name}, {combine}")
            if routes is not None:
                assert {route for route, *_ in penalty._packed.kron} <= routes


@pytest.mark.parametrize("rank", ["full", "low"])
def test_bf16_factors_give_the_form_and_its_gradient_to_bf16_rounding(rank):
    """``precision = bf16`` multiplies the factors in bfloat16: the value and gradient of the fp32 roots' form to
    about 1e-2 (bfloat16 keeps 8 bits), and not the fp32 step's bit for bit, so the products really ran in bf16."""
    net, full, low = mixed_curvatures()
    curvature = full if rank == "full" else low
    tau = {n: t.requires_grad_() for n, t in vector(net).items()}
    bf16, fp32 = (CurvatureRegularizer([curvature], lam=1.0, squared=True, precision=p).loss_of(tau)
                  for p in ("bf16", "fp32"))
    want = curvature.quadratic(tau)
    assert bf16.dtype == torch.float32 and not torch.equal(bf16, fp32)
    torch.testing.assert_close(bf16, want, rtol=2e-2, atol=0)
    got, expected = (torch.cat([g.flatten() for g in torch.autograd.grad(v, list(tau.values()))]) for v in (bf16, want))
    assert (got - expected).norm() / expected.norm() < 2e-2
    with pytest.raises(ConfigError, match="precision 'fp16'"):
        CurvatureRegularizer([curvature], lam=1.0, precision="fp16")


class SelfAttention(nn.Module):
    """nn.MultiheadAttention over a sequence, its output flattened as the features; a causal mask and padded
    keys where asked."""

    def __init__(self, batch_first: bool, masked: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=batch_first)
        self.batch_first, self.masked = batch_first, masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, length, 6)
        seq = x if self.batch_first else x.transpose(0, 1)
        length = x.shape[1]
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool), 1) if self.masked else None
        padded = (torch.arange(length) >= length - 1 - torch.arange(x.shape[0])[:, None] % 2) if self.masked else None
        out = self.attn(seq, seq, seq, attn_mask=causal, key_padding_mask=padded)[0]
        return (out if self.batch_first else out.transpose(0, 1)).flatten(1)


@pytest.mark.parametrize("batch_first, masked", [(True, False), (False, False), (True, True)])
def test_a_fused_attention_s_projections_are_factored_and_its_out_projection_exactly(batch_first, masked):
    """Self-attention through nn.MultiheadAttention: its fused in-projection (q, k, v) and its out-projection get
    Kronecker blocks, not diagonals. The out-projection alone is one linear layer on the features, so its block is
    exact: it holds only if the attention the mode runs is the module's own (heads, scale, both masks)."""
    module = SelfAttention(batch_first, masked).eval()
    x = torch.randn(16, 5, 6, generator=torch.Generator().manual_seed(1))
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the exact form's jvp: torch's fused kernel has no forward AD
    try:
        check_attention(module, x)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def check_attention(module: nn.Module, x: torch.Tensor) -> None:
    tau = vector(module)
    out_only = {n: tau[n] for n in ("attn.out_proj.weight", "attn.out_proj.bias")}
    curvature = compute_curvature(module, [x], names=list(out_only), exact=True)
    assert set(curvature.blocks) == {"attn.out_proj.weight"} and not curvature.diagonal
    want = exact_quadratic(module, x, out_only)
    assert abs(curvature.quadratic(out_only).item() - want) / want < 1e-5
    whole = compute_curvature(module, [x], exact=True)
    assert set(whole.blocks) == {"attn.in_proj_weight", "attn.out_proj.weight"} and not whole.diagonal
    error = abs(whole.quadratic(tau).item() - exact_quadratic(module, x, tau)) / exact_quadratic(module, x, tau)
    print(f"whole attention: relative error {error:.3f}")
    assert error < 0.5, error  # the in-projection's block is an approximation (softmax between it and the output)


def test_an_attention_the_mode_cannot_run_as_linear_calls_takes_the_diagonal():
    """Separate key and value: the call runs as it is, and its weights get the exact diagonal (per example)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(4, 1, batch_first=True, kdim=3, vdim=3).eval()

    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attn

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x[..., :4], x[..., 4:], x[..., 4:])[0].flatten(1)

    curvature = compute_curvature(Cross(), [torch.randn(4, 3, 7)], exact=True)
    assert not curvature.blocks and "attn.q_proj_weight" in curvature.diagonal
