"""The edited weights in the family's own format, and the heads beside them.

These are theta_0 + delta as ordinary weights: for non-linear vectors the model that was scored; for linearized
vectors (``linear``, ``taujp``) the ordinary network at the linearized model's weights, which is not f_lin (the
program is; the card puts both models' accuracy side by side). Written into the export directory:

- **transformers** backbones (causal LMs, text encoders, seq2seq LMs): the directory itself is a Hugging Face
  model directory, the *whole* model (prefix, tail and head) by ``save_pretrained``, with its tokenizer:
  ``AutoModelForCausalLM`` / ``AutoModel`` / ``AutoModelForSeq2SeqLM.from_pretrained(DIR)`` (:data:`AUTO_CLASSES`);
- **open_clip**: ``open_clip_model.safetensors``, the whole CLIP model (the image tower edited), which
  ``open_clip.create_model_and_transforms(arch, pretrained=PATH)`` loads;
- **torchvision**: ``weights.safetensors``, the whole torchvision model's state dict (its classification layer as
  it came), which ``torchvision.models.get_model(arch).load_state_dict`` loads;
- **efficientnet**: ``weights.safetensors``, the package network's state dict (ImageNet classifier included), which
  ``EfficientNet.from_name("efficientnet-lite0").load_state_dict`` loads;
- any other family: ``weights.safetensors``, the backbone module's state dict (``module.load_state_dict``).

A module carrying editkit's LoRA adapter is written as the plain model (each adapted weight W + s B A under its own
name). ``heads.safetensors`` holds each task's fixed head (``<task>.weight`` / ``<task>.bias``; its header says each
head's kind and a zero-shot head's logit scale): logits = features @ weight.T + bias (``linear``), or
scale * normalize(features) @ weight.T (``cosine``, CLIP's zero-shot heads).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors.torch import save_file
from torch import nn

from editkit.core.adapters import attached, without_adapter
from editkit.errors import BankError, ConfigError
from editkit.models.backbone import Backbone
from editkit.models.blocks import whole_model
from editkit.models.heads import LinearHead, ZeroShotHead
from editkit.models.lm_weights import quiet_transformers
from editkit.models.torchvision_models import TorchvisionBackbone, torchvision_state

TRANSFORMERS, OPEN_CLIP, TORCHVISION, EFFICIENTNET, STATE_DICT = (
    "transformers", "open_clip", "torchvision", "efficientnet", "state-dict")
#: Backbone family -> the transformers auto class that reads its export.
AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "text-encoder": "AutoModel",
                "seq2seq-lm": "AutoModelForSeq2SeqLM"}
OPEN_CLIP_FILE, WEIGHTS_FILE, HEADS_FILE = "open_clip_model.safetensors", "weights.safetensors", "heads.safetensors"
LINEAR, COSINE, IDENTITY = "linear", "cosine", "identity"


def loads(backbone: Backbone, fmt: str) -> str:
    """What loads a ``weights.safetensors`` of the format (``safetensors.torch.load_file`` reads it)."""
    if fmt == TORCHVISION:
        return f"`torchvision.models.get_model({backbone.arch!r}).load_state_dict`"
    if fmt == EFFICIENTNET:
        return "`efficientnet_lite_pytorch.EfficientNet.from_name(\"efficientnet-lite0\").load_state_dict`"
    return f"the backbone module's `load_state_dict` (`{type(backbone.module).__name__}`)"


def native_format(backbone: Backbone) -> str:
    """The format a built backbone's edited weights are written in."""
    if hasattr(backbone, "clip_model"):
        return OPEN_CLIP
    if isinstance(backbone, TorchvisionBackbone):
        return TORCHVISION
    if getattr(backbone, "network", None) is not None:
        return EFFICIENTNET
    try:
        whole_model(backbone)
    except ConfigError:  # a family of its own: the module's state dict
        return STATE_DICT
    return TRANSFORMERS


@contextlib.contextmanager
def edited(module: nn.Module, delta: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters (shared with the whole model) at theta_0 + delta inside the block, restored
    exactly afterwards. The sum is the one :class:`~editkit.core.linearize.NonLinearModel` computes."""
    params = dict(module.named_parameters(remove_duplicate=False))
    unknown = [key for key in delta if key not in params]
    if unknown:
        raise BankError(f"the vector has parameters the backbone lacks: {', '.join(unknown[:5])}")
    saved: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for key, value in delta.items():
                saved[key] = params[key].detach().clone()
                params[key].add_(value.to(params[key]))
        yield
    finally:
        with torch.no_grad():
            for key, value in saved.items():
                params[key].copy_(value)


def plain_state(backbone: Backbone, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as the model without editkit's LoRA adapter holds it (each adapted weight W + s B A under its own
    name), or as it is when the backbone carries none: what is written is a plain model of its family."""
    state = {key: value.detach().to("cpu").clone().contiguous() for key, value in state.items()}
    return without_adapter(backbone.module, state)


def _whole_state(backbone: Backbone, fmt: str) -> dict[str, torch.Tensor]:
    """The state dict the format holds, read inside :func:`edited`."""
    if fmt == OPEN_CLIP:
        return plain_state(backbone, whole_model(backbone).state_dict())
    if fmt == TORCHVISION:
        return torchvision_state(backbone, plain_state(backbone, backbone.module.state_dict()))
    if fmt == EFFICIENTNET:
        return plain_state(backbone, backbone.network.state_dict())
    return plain_state(backbone, backbone.module.state_dict())


def write_weights(backbone: Backbone, delta: Mapping[str, torch.Tensor], directory: Path,
                  provenance: Mapping[str, Any]) -> list[str]:
    """Write theta_0 + delta into ``directory`` in the backbone's format; returns the files written."""
    fmt = native_format(backbone)
    if fmt == TRANSFORMERS:
        model = whole_model(backbone)
        before = set(p.name for p in directory.iterdir())
        with edited(backbone.module, delta), quiet_transformers():
            state = plain_state(backbone, model.state_dict()) if attached(backbone.module) is not None else None
            model.save_pretrained(directory, safe_serialization=True, state_dict=state)
        tokenizer = getattr(backbone, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)
        return sorted(p.name for p in directory.iterdir() if p.name not in before)
    with edited(backbone.module, delta):
        state = _whole_state(backbone, fmt)
    name = OPEN_CLIP_FILE if fmt == OPEN_CLIP else WEIGHTS_FILE
    save_file(state, str(directory / name), metadata={"format": "pt", "editkit": json.dumps(provenance, default=str)})
    return [name]


def head_kind(head: nn.Module) -> str:
    if isinstance(head, ZeroShotHead):
        return COSINE
    if isinstance(head, LinearHead):
        return LINEAR
    return IDENTITY


def write_heads(heads: Mapping[str, nn.Module], path: Path) -> dict[str, dict[str, Any]]:
    """Each task's head tensors in one safetensors file (see the module docstring); returns each head's
    description (kind, logit scale), which the file's header holds too."""
    tensors: dict[str, torch.Tensor] = {}
    described: dict[str, dict[str, Any]] = {}
    for task, head in heads.items():
        kind = head_kind(head)
        described[task] = {"kind": kind}
        if kind == COSINE:
            described[task]["logit_scale"] = float(head.logit_scale)
        for key in ("weight", "bias"):
            value = getattr(head, key, None)
            if isinstance(value, torch.Tensor):
                tensors[f"{task}.{key}"] = value.detach().to("cpu").contiguous()
    if tensors:
        save_file(tensors, str(path), metadata={"heads": json.dumps(described)})
    return described
