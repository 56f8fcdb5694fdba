"""The edited weights in the family's own format, and the heads beside them.

These are theta_0 + delta as ordinary weights: for non-linear vectors the model that was scored; for linearized
vectors (``linear``, ``taujp``) the ordinary network at the linearized model's weights, which is not f_lin (the
program is; the card puts both models' accuracy side by side). Each backbone family says what its format is
(:meth:`~editkit.models.backbone.Backbone.native_weights`: the whole model to write, the file, what loads it), so a
family from another package writes its own format too; this module writes it:

- a family whose library writes its own directory (transformers: causal LMs, text encoders, seq2seq LMs): the
  export directory itself is the model's directory, the *whole* model by ``save_pretrained``, with its tokenizer;
- any other: one safetensors file of the whole model's state dict (open_clip: ``open_clip_model.safetensors``;
  torchvision: the model with its classification layer as it came; EfficientNet: the package network, ImageNet
  classifier included; a family that says nothing: the backbone module's state dict, ``weights.safetensors``).

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
from editkit.errors import BankError
from editkit.models.backbone import Backbone
from editkit.models.heads import LinearHead, ZeroShotHead
from editkit.models.lm_weights import quiet_transformers

#: The format names the model card shows code of its own for.
TRANSFORMERS, OPEN_CLIP = "transformers", "open_clip"
LINEAR, COSINE, IDENTITY = "linear", "cosine", "identity"


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


def write_weights(backbone: Backbone, delta: Mapping[str, torch.Tensor], directory: Path,
                  provenance: Mapping[str, Any]) -> dict[str, Any]:
    """Write theta_0 + delta into ``directory`` in the backbone family's format; returns the manifest's ``weights``
    (format, files written, what loads them)."""
    native = backbone.native_weights()
    before = set(p.name for p in directory.iterdir())
    with edited(backbone.module, delta):
        if native.file is None:
            with quiet_transformers():
                state = plain_state(backbone, native.module.state_dict()) if attached(backbone.module) is not None else None
                native.module.save_pretrained(directory, safe_serialization=True, state_dict=state)
                if native.tokenizer is not None:
                    native.tokenizer.save_pretrained(directory)
        else:
            state = plain_state(backbone, native.module.state_dict())
            state = native.to_format(state) if native.to_format is not None else state
            save_file(state, str(directory / native.file),
                      metadata={"format": "pt", "editkit": json.dumps(provenance, default=str)})
    files = sorted(p.name for p in directory.iterdir() if p.name not in before)
    return {"format": native.format, "files": files, "loads": native.loads}


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
