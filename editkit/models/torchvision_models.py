"""A torchvision classification model by name as the backbone family ``torchvision``, weights from a local file.

::

    [backbone]
    family = "torchvision"
    model = "resnet18"          # any of torchvision.models.list_models(module=torchvision.models)
    weights = "resnet18.pth"    # a state dict of the whole model (.pth / .pt torch file or .safetensors)
    image_size = 224

``weights`` is a file path (in a scenario file, relative to the file's folder), a torchvision weights
name (``IMAGENET1K_V1``, ``DEFAULT``) read from the torch hub cache only (never downloaded), or
``random`` (initialised from ``seed``): :func:`weights_is_path` tells them apart. Features are the
input of the model's last ``nn.Linear`` (its classification layer, replaced by an identity), so a probe
head sits on top as on the other non-CLIP backbones; the replaced layer's weights are kept aside, so
``editkit add --out`` and ``editkit negate --out`` write a state dict the torchvision model loads whole
(:meth:`TorchvisionBackbone.native_weights`). Images are resized to ``image_size`` and ImageNet-normalized, as the
EfficientNet family does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from editkit.core.registry import Record
from editkit.errors import ConfigError, MissingResourceError
from editkit.models import BACKBONES
from editkit.models.backbone import Backbone, NativeWeights
from editkit.models.inputs import image_spec, images_to_tensor

RANDOM = "random"


@dataclass
class TorchvisionBackbone(Backbone):
    """A torchvision model without its classification layer; ``classifier`` holds that layer's state under
    the model's own names, ``arch`` the model's torchvision name."""

    arch: str = ""
    classifier: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def native_weights(self) -> NativeWeights:
        """The whole torchvision model's state dict, its classification layer as it came."""
        return NativeWeights("torchvision", self.module, f"`torchvision.models.get_model({self.arch!r}).load_state_dict`",
                             to_format=lambda state: torchvision_state(self, state))


def _known_models() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def _hub_weights_path(model: str, weights: str) -> Path:
    """Where torchvision caches the weights ``weights`` of ``model`` (the torch hub checkpoints folder)."""
    import torchvision

    try:
        enum = torchvision.models.get_model_weights(model)
        value = enum[weights] if weights != "DEFAULT" else enum.DEFAULT
    except (KeyError, ValueError):
        raise ConfigError(f"torchvision's {model} has no weights {weights!r}") from None
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(value.url).name


def weights_is_path(weights: str, exists: bool) -> bool:
    """Whether ``weights`` names a file (:data:`~editkit.util.paths.PathRule`): one that exists, or a name with a
    file suffix or a folder in it; ``random`` and torchvision weights names (``IMAGENET1K_V1``) do not."""
    return weights.lower() != RANDOM and (exists or bool(Path(weights).suffix) or "/" in weights)


def _is_name(weights: str) -> bool:
    """Whether ``weights`` is a torchvision weights name (``IMAGENET1K_V1``) rather than a file path."""
    return not weights_is_path(weights, Path(weights).expanduser().exists())


def weights_path(model: str, weights: str) -> Path | None:
    """The file ``weights`` names (None: random weights)."""
    if weights.lower() == RANDOM:
        return None
    return _hub_weights_path(model, weights) if _is_name(weights) else Path(weights).expanduser()


def check(model: str = "resnet18", weights: str = RANDOM, image_size: int = 224, seed: int = 0) -> list[str]:
    """One line per missing piece: an unknown model name, a weights file that is not there."""
    if model not in _known_models():
        return [f"torchvision has no classification model {model!r} (e.g. resnet18, mobilenet_v3_small, "
                "efficientnet_b0, vit_b_16; torchvision.models.list_models() lists them)"]
    try:
        path = weights_path(model, weights)
    except ConfigError as exc:
        return [str(exc)]
    if path is None or path.is_file():
        return []
    if _is_name(weights):
        return [f"torchvision's {model} weights {weights} are not in the torch hub cache ({path}): on a machine "
                f"with internet run torchvision.models.{model}(weights={weights!r}) and copy that file there, or "
                "give weights = a local state dict file"]
    return [f"the {model} weights file {path} does not exist: give weights = a state dict file of the whole model"]


def _load_state(path: Path) -> dict[str, Any]:
    """The state dict in ``path``; a file that is not one is refused in one line of editkit's (the readers' own
    errors speak of zip archives and pickles: chained, not shown)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch, zip, pickle and safetensors readers raise their own types
        raise ConfigError(f"the weights file {path} is truncated or not a state dict saved by torch.save or "
                          f"safetensors ({type(exc).__name__})") from exc
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ConfigError(f"the weights file {path} holds a {type(state).__name__}, not a state dict")
    return state


def _misfit(net: nn.Module, state: dict[str, Any]) -> str:
    """What of ``state`` does not fit ``net`` in editkit's words ('' when it all does): the names one of them lacks
    and the tensors of other shapes (torch's own message lists every name, across lines)."""
    own = net.state_dict()
    shapes = [f"{k} {list(getattr(state[k], 'shape', []))} (the model's {list(v.shape)})" for k, v in own.items()
              if k in state and list(getattr(state[k], "shape", [])) != list(v.shape)]
    kinds = (("the model lacks", [k for k in state if k not in own]), ("missing", [k for k in own if k not in state]),
             ("of other shapes", shapes))
    return "; ".join(f"{len(names)} tensors {what}: {_first_names(names)}" for what, names in kinds if names)


def _first_names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names) - shown} more)" if len(names) > shown else "")


def _last_linear(net: nn.Module) -> str:
    names = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    if not names:
        raise ConfigError(f"{type(net).__name__} has no linear classification layer to take features before")
    return names[-1]


def build(model: str = "resnet18", weights: str = RANDOM, image_size: int = 224, seed: int = 0) -> TorchvisionBackbone:
    """The torchvision ``model`` at ``weights``, its classification layer taken off (see the module docstring)."""
    if problems := check(model, weights, image_size, seed):
        raise MissingResourceError("\n".join(problems))
    import torchvision

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = torchvision.models.get_model(model, weights=None)
    path = weights_path(model, weights)
    if path is not None:
        state = _load_state(path)
        if misfit := _misfit(net, state):
            raise ConfigError(f"the weights {path} do not fit torchvision's {model}: {misfit}")
        net.load_state_dict(state)
    name = _last_linear(net)
    layer = net.get_submodule(name)
    classifier = {f"{name}.{key}": value.detach().clone() for key, value in layer.state_dict().items()}
    net.set_submodule(name, nn.Identity())
    spec = image_spec(image_size)
    return TorchvisionBackbone(
        name=f"torchvision:{model}@{image_size}" + (f"/{path.name}" if path is not None else f"/random{seed}"),
        module=net, feature_dim=layer.in_features,
        preprocess=lambda image: images_to_tensor(np.asarray(image.convert("RGB"))[None], spec)[0],
        batch_preprocess=lambda images: images_to_tensor(images, spec), input_spec=spec,
        arch=model, classifier=classifier)


def torchvision_state(backbone: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (the backbone module's) with the classification layer put back: what the torchvision model
    loads whole."""
    return {**state, **backbone.classifier}


BACKBONES.register("torchvision", Record.of(build, check=check, help={
    "model": "torchvision classification model name (resnet18, mobilenet_v3_small, vit_b_16, ...)",
    "weights": "state dict file of the whole model, a torchvision weights name in the torch hub cache "
               "(IMAGENET1K_V1, DEFAULT), or 'random'",
    "image_size": "input side in pixels (images are resized to it)",
    "seed": "seed of random weights"}, paths={"weights": weights_is_path}))
