"""CLIP backbones through open_clip, on a tiny random config (no download ever).

The tiny model (``editkit-tiny-clip``) is a registered open_clip config: a one-layer
ViT over 32x32 images and a one-layer text tower over the real BPE vocabulary that
ships inside open_clip, so tokenizing needs no network.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import editkit  # noqa: F401  (torchvision shim before open_clip)
from editkit.models import clip
from editkit.models.clip import TINY_MODEL_NAME, build_clip, check_weights, resolve_weights, zero_shot_head
from editkit.errors import ConfigError, MissingResourceError
from editkit.models.heads import ZeroShotHead
from editkit.core.linearize import LinearizedModel

from helpers.vision import make_image


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """No test may reach a network or the user's caches."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("EDITKIT_CACHE", str(tmp_path / "editkit-cache"))
    monkeypatch.delenv("EDITKIT_CLIP_CACHE", raising=False)


def _batch(backbone, n=4):
    return torch.stack([backbone.preprocess(make_image(i % 3, i, size=40)) for i in range(n)])


# --------------------------------------------------------------------------- backbone


def test_tiny_backbone_features_are_unnormalized_image_embeddings(tiny_clip):
    assert tiny_clip.module is tiny_clip.clip_model.visual
    assert tiny_clip.name == f"clip:{TINY_MODEL_NAME}/random"
    x = _batch(tiny_clip)
    assert x.shape == (4, 3, 32, 32)
    feats = tiny_clip.features(x)
    assert feats.shape == (4, tiny_clip.feature_dim) == (4, 16)
    with torch.no_grad():
        expected = tiny_clip.clip_model.encode_image(x, normalize=False)
    torch.testing.assert_close(feats, expected)
    assert not torch.allclose(feats.norm(dim=-1), torch.ones(4))  # before normalization


def test_preprocess_handles_grayscale_and_train_augment(tiny_clip):
    gray = make_image(1, 0, mode="L", size=28)
    assert tiny_clip.preprocess(gray).shape == (3, 32, 32)
    assert tiny_clip.val_preprocess is tiny_clip.preprocess
    augmented = build_clip(TINY_MODEL_NAME, None, train_augment=True)
    assert augmented.preprocess is augmented.train_preprocess
    assert "RandomResizedCrop" in repr(augmented.train_preprocess)


def test_fingerprint_is_stable_and_tracks_parameters(tiny_clip):
    first = tiny_clip.fingerprint()
    assert first == tiny_clip.fingerprint() and first.startswith("sha256:")
    other = copy.deepcopy(tiny_clip.module)
    with torch.no_grad():
        next(other.parameters()).add_(1e-3)
    assert clip.state_fingerprint(other.state_dict()) != first


def test_local_checkpoint_file_round_trips(tiny_clip, tmp_path):
    path = tmp_path / "tiny.pt"
    torch.save(tiny_clip.clip_model.state_dict(), path)
    loaded = build_clip(TINY_MODEL_NAME, pretrained=str(path))
    assert loaded.fingerprint() == tiny_clip.fingerprint()
    assert loaded.model_fingerprint() == tiny_clip.model_fingerprint()
    assert loaded.weights.kind == "file" and loaded.name.endswith("/tiny.pt")
    # a directory holding one checkpoint works too
    assert build_clip(TINY_MODEL_NAME, pretrained=str(tmp_path)).fingerprint() == tiny_clip.fingerprint()


def test_torchscript_archive_like_openai_originals_loads(tiny_clip, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.script(copy.deepcopy(tiny_clip.clip_model)).save(str(tmp_path / "ViT-tiny.pt"))
        loaded = build_clip(TINY_MODEL_NAME, pretrained=str(tmp_path / "ViT-tiny.pt"))
    assert clip.is_torchscript_archive(tmp_path / "ViT-tiny.pt")
    assert loaded.fingerprint() == tiny_clip.fingerprint()


def test_hf_hub_model_from_the_local_cache(tiny_clip, tmp_path):
    import json

    from safetensors.torch import save_file

    repo = tmp_path / "models--someone--tiny-clip"
    snapshot = repo / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    (snapshot / "open_clip_config.json").write_text(json.dumps({"model_cfg": clip.TINY_CLIP_CONFIG}))
    save_file({k: v.contiguous() for k, v in tiny_clip.clip_model.state_dict().items()},
              str(snapshot / "open_clip_model.safetensors"))
    loaded = build_clip("hf-hub:someone/tiny-clip", None, cache_dir=tmp_path)
    assert loaded.weights.kind == "local-dir" and loaded.fingerprint() == tiny_clip.fingerprint()
    with pytest.raises(MissingResourceError, match="someone/other"):
        build_clip("hf-hub:someone/other", None, cache_dir=tmp_path)


def test_checkpoint_of_another_architecture_is_a_config_error_in_editkits_words(tmp_path):
    torch.save({"visual.conv1.weight": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(ConfigError) as refused:
        build_clip(TINY_MODEL_NAME, pretrained=str(tmp_path / "wrong.pt"))
    assert str(refused.value) == (f"cannot load CLIP weights {tmp_path / 'wrong.pt'} into {TINY_MODEL_NAME}: torch "
                                  "cannot load it into this model (is it an open_clip checkpoint of this architecture?)")
    torchs = refused.value.__cause__  # "Error(s) in loading state_dict for CLIP: ...": kept as the cause, not shown
    assert isinstance(torchs, RuntimeError) and str(torchs).splitlines()[0] not in str(refused.value)


# --------------------------------------------------------------------------- zero-shot heads


def test_zero_shot_head_equals_hand_computation(tiny_clip, tmp_path):
    classnames = ["cat", "dog", "red and white circle 20 kph speed limit"]
    templates = ["a photo of a {}.", 'a zoomed in photo of a "{}" traffic sign.']
    head = zero_shot_head(tiny_clip, classnames, templates, dataset="toy", cache_root=tmp_path)
    assert isinstance(head, ZeroShotHead)

    with torch.no_grad():
        rows = []
        for name in classnames:
            tokens = tiny_clip.tokenizer([t.format(name) for t in templates])
            emb = tiny_clip.clip_model.encode_text(tokens)
            emb = emb / emb.norm(dim=-1, keepdim=True)
            emb = emb.mean(dim=0)
            rows.append(emb / emb.norm())
        weights = torch.stack(rows)
        scale = tiny_clip.clip_model.logit_scale.exp()
        x = _batch(tiny_clip)
        feats = tiny_clip.clip_model.encode_image(x)
        expected = scale * (feats / feats.norm(dim=-1, keepdim=True)) @ weights.T

    torch.testing.assert_close(head.weight, weights, rtol=1e-5, atol=1e-6)
    assert head.logit_scale == pytest.approx(float(scale))
    torch.testing.assert_close(head(tiny_clip.features(x)), expected, rtol=1e-4, atol=1e-5)


def test_head_cache_returns_the_identical_head(tiny_clip, tmp_path):
    names, templates = ["0", "1", "2"], ['a photo of the number: "{}".']
    first = zero_shot_head(tiny_clip, names, templates, dataset="MNIST", cache_root=tmp_path)
    files = list(tmp_path.glob("MNIST-*.safetensors"))
    assert len(files) == 1
    calls = []
    original = tiny_clip.encode_text
    tiny_clip.encode_text = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        second = zero_shot_head(tiny_clip, names, templates, dataset="MNIST", cache_root=tmp_path)
    finally:
        del tiny_clip.encode_text
    assert not calls, "a cached head must not run the text tower"
    assert torch.equal(first.weight, second.weight) and first.logit_scale == second.logit_scale
    # other templates -> another key, another file
    zero_shot_head(tiny_clip, names, ['a photo of "{}".'], dataset="MNIST", cache_root=tmp_path)
    assert len(list(tmp_path.glob("MNIST-*.safetensors"))) == 2


def test_default_head_cache_lives_under_editkit_cache(tiny_clip, tmp_path):
    zero_shot_head(tiny_clip, ["a", "b"], ["{}"], dataset="toy")
    assert list((tmp_path / "editkit-cache" / "heads").glob("toy-*.safetensors"))


# --------------------------------------------------------------------------- linearization


def test_jvp_through_the_clip_image_tower(tiny_clip):
    x = _batch(tiny_clip, n=3)
    model = LinearizedModel(copy.deepcopy(tiny_clip.module))
    assert torch.count_nonzero(model.tangent(x)) == 0  # tau = 0
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.theta:
            p.add_(1e-2 * torch.randn_like(p))
    primal, tangent = model.primal_and_tangent(x)
    assert torch.isfinite(tangent).all() and tangent.abs().sum() > 0
    torch.testing.assert_close(primal, tiny_clip.features(x))
    # gradients reach theta through the jvp
    (primal + tangent).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.theta)


def test_jvp_matches_finite_differences_in_float64(tiny_clip):
    module = copy.deepcopy(tiny_clip.module).double()
    x = _batch(tiny_clip, n=2).double()
    model = LinearizedModel(module)
    torch.manual_seed(2)
    tau = {n: 1e-2 * torch.randn_like(p) for n, p in zip(model.names, model.theta)}
    model.load_task_vector(tau)
    tangent = model.tangent(x).detach()
    h = 1e-4
    plus = torch.func.functional_call(module, {n: model.theta0[n] + h * tau[n] for n in model.names}, (x,))
    minus = torch.func.functional_call(module, {n: model.theta0[n] - h * tau[n] for n in model.names}, (x,))
    torch.testing.assert_close(tangent, (plus - minus) / (2 * h), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- offline errors


def test_missing_tag_weights_offline_is_a_clear_error(tmp_path):
    cache = tmp_path / "clip-cache"
    start = time.monotonic()
    with pytest.raises(MissingResourceError) as info:
        build_clip("ViT-B-32", "openai", cache_dir=cache)
    assert time.monotonic() - start < 5
    message = str(info.value)
    for piece in ("ViT-B-32", "openai", str(cache), "timm/vit_base_patch32_clip_224.openai",
                  "--pretrained", "EDITKIT_CLIP_CACHE", "HF_HOME", "internet"):
        assert piece in message, piece
    assert "\n" not in message


def test_unreachable_hub_is_a_clear_error_without_waiting(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(clip, "offline_mode", lambda: False)
    probed = []
    monkeypatch.setattr(clip, "host_reachable", lambda url, timeout=3.0: probed.append(url) or False)
    with pytest.raises(MissingResourceError, match="unreachable"):
        build_clip("ViT-B-16", "openai", cache_dir=tmp_path)
    assert probed and "huggingface" in probed[0]


def test_cached_tag_is_found_in_the_hf_cache_layout(tmp_path):
    snapshot = tmp_path / "models--timm--vit_base_patch32_clip_224.openai" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "open_clip_model.safetensors").write_bytes(b"")
    (tmp_path / "models--timm--vit_base_patch32_clip_224.openai" / "refs").mkdir()
    (tmp_path / "models--timm--vit_base_patch32_clip_224.openai" / "refs" / "main").write_text("a" * 40)
    resolved = resolve_weights("ViT-B-32", "openai", cache_dir=tmp_path, allow_download=False)
    assert resolved.kind == "tag" and resolved.path == snapshot / "open_clip_model.safetensors"
    assert resolved.quick_gelu is True  # OpenAI weights were trained with QuickGELU
    assert resolved.preprocess["interpolation"] == "bicubic"
    assert check_weights("ViT-B-32", "openai", cache_dir=tmp_path) is None


def test_missing_checkpoint_path_unknown_tag_and_unknown_model(tmp_path):
    with pytest.raises(MissingResourceError, match="nope.pt"):
        build_clip(TINY_MODEL_NAME, pretrained=str(tmp_path / "nope.pt"))
    with pytest.raises(ConfigError, match="laion2b_s34b_b79k"):
        build_clip("ViT-B-32", "no-such-tag")
    with pytest.raises(ConfigError, match="ViT-Q-99"):
        build_clip("ViT-Q-99", None)


def test_check_weights_lines():
    assert check_weights(TINY_MODEL_NAME, None) is None
    line = check_weights("ViT-B-32", "openai")
    assert line and "ViT-B-32/openai" in line and "\n" not in line


def test_a_registered_config_leaves_no_file_behind_and_can_be_replaced(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the registration's temporary files go
    config = copy.deepcopy(clip.TINY_CLIP_CONFIG)
    clip.register_model_config("editkit-test-replaced", config)
    assert build_clip("editkit-test-replaced", pretrained=None).module.conv1.out_channels == 32
    config["vision_cfg"]["width"] = 48
    clip.register_model_config("editkit-test-replaced", config)
    assert build_clip("editkit-test-replaced", pretrained=None).module.conv1.out_channels == 48
    assert list(tmp_path.iterdir()) == []
