"""What a backbone's inputs are, written as data, and the preprocessing that data describes.

An edited model leaves editkit as a program (``model.pt2``) whose inputs are already preprocessed: image
pixels normalized to a fixed size, or token ids. ``editkit.json`` says how to make them (its ``input``: the
*spec*), and ``editkit predict`` makes them from that spec alone. So each image family declares its spec once,
and its own preprocessing is built from it (:func:`images_to_tensor`, :func:`image_transform`): the file says
what the model was trained on, by construction.

Two image paths, as the families preprocess:

- ``"on": "tensor"`` (EfficientNet, torchvision): the uint8 image (grayscale repeated to three channels) / 255,
  resized whole to ``size`` by ``torch.nn.functional.interpolate`` (``interpolation``, ``antialias``), then
  normalized by ``mean`` / ``std``;
- ``"on": "PIL"`` (open_clip): open_clip's evaluation transform of its preprocessing config (``resize_mode``
  shortest side then a centre crop, ``interpolation`` by PIL, RGB, normalized).

A text spec names the tokenizer saved beside the program (a directory relative to it), the inputs (``input_ids``, ``attention_mask``) and
how texts are cut (``max_length``) and padded (right, with the tokenizer's pad id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE, TEXT, TEXT_TO_TEXT = "image", "text", "text-to-text"
#: Where an image spec's preprocessing runs (see the module docstring).
ON_TENSOR, ON_PIL = "tensor", "PIL"


def batch_dim() -> Any:
    """The batch dimension of a program's inputs: any size."""
    return torch.export.Dim("batch", min=1)


def image_spec(size: int | tuple[int, int], *, mean=IMAGENET_MEAN, std=IMAGENET_STD, on: str = ON_TENSOR,
               interpolation: str = "bilinear", **more: Any) -> dict[str, Any]:
    """An image input: ``(N, 3, H, W)`` float32 pixels, RGB, made from a picture as ``on`` says."""
    height, width = (size, size) if isinstance(size, int) else size
    spec = {"kind": IMAGE, "names": ["pixels"], "shape": ["batch", 3, height, width], "dtype": "float32",
            "size": [height, width], "channels": "RGB", "layout": "NCHW", "on": on, "interpolation": interpolation,
            "mean": [float(m) for m in mean], "std": [float(s) for s in std]}
    if on == ON_TENSOR:
        spec.update(scale="1/255", resize="the whole image to size (aspect ratio not kept)", antialias=True,
                    grayscale="repeated to three channels")
    return {**spec, **more}


def images_to_tensor(images: np.ndarray, spec: Mapping[str, Any]) -> torch.Tensor:
    """uint8 ``(N, H, W)`` or ``(N, H, W, 3)`` -> float ``(N, 3, *size)`` by an ``"on": "tensor"`` spec."""
    size = tuple(spec["size"])
    images = np.ascontiguousarray(images)
    if not images.flags.writeable:  # a picture's read-only buffer (np.asarray of a PIL image): torch wants its own
        images = images.copy()
    x = torch.from_numpy(images).float().div_(255.0)
    x = x.unsqueeze(1).expand(-1, 3, -1, -1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    if x.shape[-2:] != size:
        x = F.interpolate(x, size=size, mode=spec["interpolation"], antialias=spec["antialias"], align_corners=False)
    mean = torch.tensor(spec["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(spec["std"]).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous()


def image_transform(spec: Mapping[str, Any]) -> Callable[[Any], torch.Tensor]:
    """One PIL image -> ``(3, *size)`` pixels as the spec says (see the module docstring)."""
    if spec["on"] == ON_PIL:
        from open_clip.transform import image_transform as open_clip_transform

        return open_clip_transform(tuple(spec["size"]), is_train=False, mean=tuple(spec["mean"]),
                                   std=tuple(spec["std"]), resize_mode=spec["resize_mode"],
                                   interpolation=spec["interpolation"], fill_color=spec.get("fill_color", 0))
    return lambda image: images_to_tensor(np.array(image.convert("RGB"))[None], spec)[0]


def text_spec(tokenizer: Any, *, max_length: int | None = None, pad_id: int = 0,
              names: tuple[str, ...] = ("input_ids", "attention_mask")) -> dict[str, Any]:
    """A text input: token ids and their mask ``(N, T)`` int64, padded on the right with ``pad_id``."""
    return {"kind": TEXT, "names": list(names), "shape": ["batch", "length"], "dtype": "int64",
            "tokenizer": ".", "special_tokens": True, "truncation": max_length is not None,
            "max_length": max_length, "padding": "right", "pad_id": int(pad_id),
            "tokenizer_class": type(tokenizer).__name__}


def pad_right(sequences: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id sequences -> (ids, mask) ``(N, T)``, padded on the right to the longest."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    return ids, mask


@dataclass(frozen=True)
class ProgramInputs:
    """How a program of a backbone is traced and called.

    module: maps the program's inputs to the backbone's features, sharing the backbone module's parameters (its
        own names may differ: a text encoder's whole model, where the backbone module holds its last blocks);
    example: inputs to trace with (a batch of 2: a batch of 1 would be taken for a fixed size);
    dynamic: each input's dimensions that vary (``torch.export`` dynamic shapes);
    spec: how a user makes the inputs (``editkit.json``'s ``input``).
    """

    module: nn.Module
    example: tuple[torch.Tensor, ...]
    dynamic: tuple[dict[int, Any], ...]
    spec: dict[str, Any]


def image_inputs(module: nn.Module, spec: Mapping[str, Any]) -> ProgramInputs:
    """The program inputs of an image backbone whose module reads the pixels ``spec`` describes."""
    device = next(module.parameters()).device
    height, width = spec["size"]
    return ProgramInputs(module, (torch.zeros(2, 3, height, width, device=device),), ({0: batch_dim()},), dict(spec))
