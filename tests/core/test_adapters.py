"""LoRA adapters (PEFT) in every mode, against ground truth.

Ground truth: a linear layer's weights edited by hand (W + s B A), central finite differences of a deep
copy whose adapter factors are edited directly (float64), penalties computed by hand from s dB A0 x.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from editkit.core.adapters import LoraSpec, LoraWeights, attach_lora, attached, default_targets, trainable_names
from editkit.core.linearize import LinearizedModel, NonLinearModel, build_task_model
from editkit.core.taujp import Regularizer
from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.models.backbone import state_fingerprint

from helpers import models

SPEC = LoraSpec(rank=2, alpha=3.0, seed=5)


def adapted_mlp(spec: LoraSpec = SPEC, seed: int = 0) -> nn.Module:
    module = models.mlp(4, 6, 3, seed=seed).double()
    attach_lora(module, spec)
    return module


def factors(module: nn.Module, layer: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W, A, B) of one adapted layer, read straight from the module."""
    params = dict(module.named_parameters())
    return (params[f"{layer}.base_layer.weight"], params[f"{layer}.lora_A.default.weight"],
            params[f"{layer}.lora_B.default.weight"])


def random_like(names: list[str], module: nn.Module, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = dict(module.named_parameters())
    return {n: torch.randn(params[n].shape, generator=g, dtype=torch.float64) * scale for n in names}


def central_difference(module: nn.Module, tau: dict[str, torch.Tensor], eps: float, *args, **kwargs) -> torch.Tensor:
    """(f(theta + eps tau) - f(theta - eps tau)) / 2 eps, from deep copies whose parameters are edited directly."""

    def at(sign: float) -> torch.Tensor:
        c = copy.deepcopy(module)
        with torch.no_grad():
            for n, p in c.named_parameters():
                if n in tau:
                    p.add_(sign * eps * tau[n])
            return c(*args, **kwargs)

    return (at(1) - at(-1)) / (2 * eps)


def test_attach_is_seeded_idempotent_and_leaves_the_global_generator_alone():
    a, b = models.mlp(4, 6, 3).double(), models.mlp(4, 6, 3).double()  # (the factory seeds the generator)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    attach_lora(a, SPEC)
    attach_lora(b, SPEC)
    assert torch.rand(1) == before  # A0 came from the spec's seed, not from the global stream
    assert state_fingerprint(a.state_dict()) == state_fingerprint(b.state_dict())
    other = models.mlp(4, 6, 3).double()
    attach_lora(other, LoraSpec(rank=2, alpha=3.0, seed=6))
    assert state_fingerprint(other.state_dict()) != state_fingerprint(a.state_dict())
    assert attach_lora(a, SPEC) == attached(a)  # the same spec again changes nothing
    with pytest.raises(IncompatibleVectorsError, match="already carries lora r=2"):
        attach_lora(a, LoraSpec(rank=4, seed=5))
    _, _, b0 = factors(a, "0")
    assert torch.count_nonzero(b0) == 0  # B = 0: the adapter changes nothing until trained
    x = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(a(x), models.mlp(4, 6, 3).double()(x))


def test_trainable_names_are_the_factors_and_a_task_model_trains_only_them():
    module = adapted_mlp()
    names = trainable_names(module)
    assert names == ["0.lora_A.default.weight", "0.lora_B.default.weight",
                     "2.lora_A.default.weight", "2.lora_B.default.weight"]
    assert build_task_model(module, "taujp").names == names
    assert build_task_model(module, "nonlinear").names == names


def test_default_targets_skip_layers_whose_forward_never_runs(tiny_clip):
    targets = default_targets(tiny_clip.module)
    assert "c_fc" in targets and "c_proj" in targets
    assert "out_proj" not in targets  # nn.MultiheadAttention reads its weight directly
    assert default_targets(nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.ReLU())) == ()
    with pytest.raises(ConfigError, match="no layer LoRA can adapt"):
        attach_lora(nn.Sequential(nn.Conv2d(4, 4, 3, groups=4)), LoraSpec())
    with pytest.raises(ConfigError, match="LoRA targets"):
        attach_lora(models.mlp(4, 6, 3), LoraSpec(targets=("q_proj",)))


def test_plain_lora_is_the_hand_edited_weight():
    """NonLinearModel at tau = (A, B) computes W + s B A for every adapted layer (s = alpha / r)."""
    module = adapted_mlp()
    tau = random_like(trainable_names(module), module, seed=1)
    model = NonLinearModel(module)
    model.load_task_vector(tau)
    hand = copy.deepcopy(models.mlp(4, 6, 3).double())
    s = 3.0 / 2
    with torch.no_grad():
        for index in ("0", "2"):
            a, b = tau[f"{index}.lora_A.default.weight"], tau[f"{index}.lora_B.default.weight"]
            hand[int(index)].weight += s * b @ a
    x = torch.randn(7, 4, dtype=torch.float64)
    torch.testing.assert_close(model(x), hand(x), rtol=1e-12, atol=1e-12)
    assert torch.equal(model.task_vector()["0.lora_A.default.weight"], tau["0.lora_A.default.weight"])
    updates = LoraWeights(tau, s)  # the same edit as weight updates, scored over the base weights
    assert list(updates) == ["0.base_layer.weight", "2.base_layer.weight"]
    assert updates.shapes["0.base_layer.weight"] == (6, 4)
    weights = NonLinearModel(module, list(updates))
    weights.load_task_vector(dict(updates))
    torch.testing.assert_close(weights(x), hand(x), rtol=1e-12, atol=1e-12)


def test_rank_stabilized_scaling():
    assert LoraSpec(rank=4, alpha=8.0).scaling == 2.0
    assert LoraSpec(rank=4, alpha=8.0, rslora=True).scaling == 4.0


def test_llora_jvp_matches_finite_differences():
    """f_lin(phi_0 + tau) - f(phi_0) against central differences of the adapter edited directly."""
    module = adapted_mlp()
    names = trainable_names(module)
    with torch.no_grad():  # a point with B != 0, so the tangent of A is not zero either
        for n, p in module.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9)))
    tau = random_like(names, module, seed=2)
    model = LinearizedModel(module)
    model.load_task_vector(tau)
    x = torch.randn(5, 4, dtype=torch.float64)
    primal, tangent = model.primal_and_tangent(x)
    torch.testing.assert_close(tangent, central_difference(module, tau, 1e-6, x), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(primal, module(x))


def test_at_initialisation_llora_learns_b_against_the_fixed_random_a():
    """B0 = 0 makes the tangent of A zero: f_lin's change is s dB A0 x, a linear model in dB."""
    module = adapted_mlp()
    names = trainable_names(module)
    tau = random_like(names, module, seed=3)
    only_a = {n: (t if ".lora_A." in n else torch.zeros_like(t)) for n, t in tau.items()}
    model = LinearizedModel(module)
    model.load_task_vector(only_a)
    x = torch.randn(4, 4, dtype=torch.float64)
    assert torch.count_nonzero(model.tangent(x)) == 0


def test_penalty_on_the_adapter_tangent_by_hand():
    """One adapted linear layer: J tau = s dB A0 x; lambda * mean ||.|| by hand, for L-LoRA and plain LoRA."""
    module = nn.Sequential(nn.Linear(3, 2)).double()
    attach_lora(module, LoraSpec(rank=2, alpha=4.0, seed=1, targets=("0",)))
    _, a0, _ = factors(module, "0")
    db = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    x = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 1.0, 0.5]], dtype=torch.float64)
    hand = [math.sqrt(sum(v * v for v in row)) for row in (2.0 * (db @ a0 @ x.T)).T.tolist()]
    regularizer = Regularizer([], lam=0.1)
    linear = LinearizedModel(module)
    linear.load_task_vector({"0.lora_B.default.weight": db})
    assert regularizer.loss([linear.tangent(x)]).item() == pytest.approx(0.1 * sum(hand) / 2, rel=1e-12)
    plain = NonLinearModel(module)  # taujp-nonlinear: the tangent at phi_0 of the adapter's move phi - phi_0
    plain.load_task_vector({"0.lora_A.default.weight": a0.detach().clone(), "0.lora_B.default.weight": db})
    assert regularizer.loss([plain.tangent(x)]).item() == pytest.approx(0.1 * sum(hand) / 2, rel=1e-12)


def test_lora_weights_refuse_what_is_not_an_adapter():
    with pytest.raises(IncompatibleVectorsError, match="not a LoRA vector"):
        LoraWeights({"0.weight": torch.zeros(2, 2)}, 1.0)
    conv = {"c.lora_A.default.weight": torch.ones(2, 3, 3, 3), "c.lora_B.default.weight": torch.ones(5, 2, 1, 1)}
    update = LoraWeights(conv, 0.5)["c.base_layer.weight"]
    assert update.shape == (5, 3, 3, 3) and torch.all(update == 0.5 * 2)


def test_a_written_module_is_the_plain_module_with_the_updates_merged():
    """``--out`` of a backbone without a format of its own writes the module's state dict: without the adapter,
    each adapted weight W + s B A (plain LoRA merged as weight updates), loadable into the plain module."""
    from editkit.models.backbone import Backbone
    from editkit.io.native import edited, plain_state

    module = adapted_mlp()
    tau = random_like(trainable_names(module), module, seed=4)
    updates = dict(LoraWeights(tau, 1.5))
    with edited(module, updates):
        state = plain_state(Backbone("mlp", module, 3), module.state_dict())
    plain = models.mlp(4, 6, 3).double()
    assert sorted(state) == sorted(plain.state_dict())
    hand = {k: v.clone() for k, v in plain.state_dict().items()}
    hand["0.weight"] += 1.5 * tau["0.lora_B.default.weight"] @ tau["0.lora_A.default.weight"]
    hand["2.weight"] += 1.5 * tau["2.lora_B.default.weight"] @ tau["2.lora_A.default.weight"]
    for key, value in hand.items():
        torch.testing.assert_close(state[key], value, rtol=1e-12, atol=1e-12)


def _clip():
    import copy as _copy

    backbone = _copy.deepcopy(models.tiny_clip())
    return backbone.module.double(), (torch.randn(3, 3, 32, 32, dtype=torch.float64),), {}


def _t5():
    from editkit.models.seq2seq import seq2seq_backbone

    module = seq2seq_backbone(models.t5().double(), None, trainable_blocks=1).module
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 30, (2, 5), generator=g), "attention_mask": torch.ones(2, 5, dtype=torch.long),
              "decoder_input_ids": torch.randint(1, 30, (2, 3), generator=g),
              "decoder_attention_mask": torch.ones(2, 3, dtype=torch.long)}
    return module, (), inputs


def _llama():
    from editkit.models.causal_lm import causal_lm_backbone

    module = causal_lm_backbone(models.llama().double(), None, trainable_blocks=1).module
    return module, (torch.randn(2, 4, 16, dtype=torch.float64),), {}


# T5's and Llama's norms take their variance in float32 even in float64 models: steps large enough that this
# rounding, divided by the step, stays under the tolerance (Llama's: 3e-4 of the tangent at 1e-2, 3e-3 at 1e-3)
@pytest.mark.parametrize("family, eps", [(_clip, 1e-4), (_t5, 1e-3), (_llama, 1e-2)], ids=["open_clip", "t5", "llama"])
def test_llora_on_real_architectures_starts_at_theta0_and_its_jvp_matches_finite_differences(family, eps):
    """Default targets of open_clip's ViT, T5's decoder block and Llama's tail: theta_0 unchanged by the adapter
    at initialisation, and the L-LoRA tangent of a move of both factors against central differences."""
    module, args, kwargs = family()
    with torch.no_grad():
        before = module(*args, **kwargs)
    attach_lora(module, LoraSpec(rank=2, alpha=4.0, seed=1))
    names = trainable_names(module)
    assert names and all(".lora_" in n for n in names)
    model = LinearizedModel(module)
    tau = random_like(names, module, seed=5, scale=0.1)
    model.load_task_vector(tau)
    primal, tangent = model.primal_and_tangent(*args, **kwargs)
    torch.testing.assert_close(primal, before)
    finite = central_difference(module, tau, eps, *args, **kwargs)
    assert torch.linalg.vector_norm(finite) > 1e-4  # dB moves the output: the check has teeth
    error = torch.linalg.vector_norm(tangent - finite) / torch.linalg.vector_norm(finite)
    assert error < 1e-3
