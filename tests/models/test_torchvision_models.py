"""The ``torchvision`` backbone family: a classification model by name, its weights from a local file.

Ground truth is torchvision's own model at the same weights: its logits are the backbone's features through
the classification layer the backbone keeps aside.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from editkit.errors import ConfigError, MissingResourceError
from editkit.models import BACKBONES

FAMILY = BACKBONES["torchvision"]


def saved_weights(path, model="resnet18", seed=3):
    torch.manual_seed(seed)
    net = torchvision.models.get_model(model, weights=None).eval()
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    else:
        torch.save(net.state_dict(), path)
    return net


@pytest.mark.parametrize("model, suffix", [("resnet18", ".pth"), ("mobilenet_v3_small", ".safetensors")])
def test_features_through_the_kept_classifier_are_the_models_logits(tmp_path, model, suffix):
    net = saved_weights(tmp_path / f"w{suffix}", model)
    backbone = FAMILY.build(model=model, weights=str(tmp_path / f"w{suffix}"), image_size=32)
    images = np.random.default_rng(0).integers(0, 256, size=(3, 20, 24, 3), dtype=np.uint8)
    inputs = backbone.preprocess_arrays(images)
    assert inputs.shape == (3, 3, 32, 32)
    features = backbone.features(inputs)
    name = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)][-1]
    weight, bias = backbone.classifier[f"{name}.weight"], backbone.classifier[f"{name}.bias"]
    with torch.no_grad():
        logits = net(inputs)
    assert features.shape == (3, backbone.feature_dim) and backbone.feature_dim == weight.shape[1]
    torch.testing.assert_close(features @ weight.T + bias, logits, rtol=1e-4, atol=1e-4)
    # theta_0 is the file's weights: without the classifier, every other tensor as saved
    saved = net.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in backbone.module.state_dict().items())
    assert set(saved) == set(backbone.module.state_dict()) | set(backbone.classifier)


def test_random_weights_follow_the_seed():
    a, b, c = (FAMILY.build(model="resnet18", image_size=32, seed=s) for s in (1, 1, 2))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


def test_missing_pieces_one_line_each(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    assert FAMILY.check(model="resnet99") == [
        "torchvision has no classification model 'resnet99' (e.g. resnet18, mobilenet_v3_small, efficientnet_b0, "
        "vit_b_16; torchvision.models.list_models() lists them)"]
    assert FAMILY.check(model="resnet18", weights=str(tmp_path / "w.pth")) == [
        f"the resnet18 weights file {tmp_path}/w.pth does not exist: give weights = a state dict file of the whole "
        "model"]
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert FAMILY.check(model="resnet18", weights="IMAGENET1K_V1") == [
        f"torchvision's resnet18 weights IMAGENET1K_V1 are not in the torch hub cache ({cached}): on a machine with "
        "internet run torchvision.models.resnet18(weights='IMAGENET1K_V1') and copy that file there, or give "
        "weights = a local state dict file"]
    with pytest.raises(MissingResourceError, match="resnet99"):
        FAMILY.build(model="resnet99")
    cached.parent.mkdir(parents=True)
    saved_weights(cached)  # the hub cache's file: found by its weights name, no download
    assert FAMILY.check(model="resnet18", weights="IMAGENET1K_V1") == []
    assert FAMILY.build(model="resnet18", weights="IMAGENET1K_V1", image_size=32).feature_dim == 512


def refusal(tmp_path) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        FAMILY.build(model="resnet18", weights=str(tmp_path / "w.pth"))
    assert "\n" not in str(err.value)
    return err.value


def test_weights_of_another_model_are_refused_in_one_line_of_editkits_words(tmp_path):
    """What does not fit, named by editkit; torch's own load_state_dict message never shown."""
    saved_weights(tmp_path / "w.pth", "resnet34")  # 8 blocks more than resnet18 (3-4-6-3 to 2-2-2-2), 12 tensors each
    assert str(refusal(tmp_path)) == (
        f"the weights {tmp_path}/w.pth do not fit torchvision's resnet18: 96 tensors the model lacks: "
        "layer1.2.conv1.weight, layer1.2.bn1.weight, layer1.2.bn1.bias, ... (93 more)")
    torch.manual_seed(0)
    torch.save(torchvision.models.get_model("resnet18", num_classes=10).state_dict(), tmp_path / "w.pth")
    refused = refusal(tmp_path)
    assert str(refused) == (f"the weights {tmp_path}/w.pth do not fit torchvision's resnet18: 2 tensors of other "
                            "shapes: fc.weight [10, 512] (the model's [1000, 512]), fc.bias [10] (the model's [1000])")
    with pytest.raises(RuntimeError) as torchs:
        torchvision.models.get_model("resnet18").load_state_dict(torch.load(tmp_path / "w.pth"))
    assert not any(line.strip() in str(refused) for line in str(torchs.value).splitlines())


def test_a_file_that_is_no_state_dict_is_refused_in_editkits_words(tmp_path):
    saved_weights(tmp_path / "w.pth")
    (tmp_path / "w.pth").write_bytes((tmp_path / "w.pth").read_bytes()[:1000])  # truncated
    refused = refusal(tmp_path)
    assert str(refused) == (f"the weights file {tmp_path}/w.pth is truncated or not a state dict saved by torch.save "
                            "or safetensors (RuntimeError)")
    assert str(refused.__cause__) not in str(refused)  # torch's "PytorchStreamReader failed ...": kept as the cause
    torch.save([torch.zeros(2)], tmp_path / "w.pth")
    assert str(refusal(tmp_path)) == f"the weights file {tmp_path}/w.pth holds a list, not a state dict"
