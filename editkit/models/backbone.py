"""What every backbone family provides to the rest of editkit.

A backbone is a plain ``nn.Module`` that maps a batch of *preprocessed* inputs
to feature vectors ``(N, D)``: the quantity the tauJp penalty is measured on
(CLIP: image embeddings before normalization; EfficientNet: pooled pre-activation
features). Its parameters are theta_0; heads sit on top, fixed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn


@dataclass
class Backbone:
    """A feature extractor plus what is needed to feed it and to recognise it.

    name: human-readable id, e.g. ``efficientnet-lite0@32`` or ``clip:ViT-B-32/openai``.
    module: maps preprocessed inputs to features ``(N, feature_dim)``; kept in eval mode
        (BatchNorm statistics and dropout are part of theta_0 and never change).
    feature_dim: D.
    preprocess: turns one raw example (PIL image / numpy array) into the input tensor
        the module expects; datasets apply it.
    batch_preprocess: optional vectorised version for a uint8 array of images
        ``(N,H,W)`` / ``(N,H,W,3)``; without it images go one by one through PIL.
    """

    name: str
    module: nn.Module
    feature_dim: int
    preprocess: Callable = field(repr=False, default=lambda x: x)
    batch_preprocess: Callable[[np.ndarray], torch.Tensor] | None = field(repr=False, default=None)

    def __post_init__(self) -> None:
        self.module.eval()

    def fingerprint(self) -> str:
        """Identity of theta_0: any change to a parameter or buffer changes it."""
        return state_fingerprint(self.module.state_dict())

    @torch.no_grad()
    def features(self, inputs: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        return torch.cat([self.module(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)])

    def preprocess_arrays(self, images: np.ndarray) -> torch.Tensor:
        """Input tensors for a uint8 array of images."""
        if self.batch_preprocess is not None:
            return self.batch_preprocess(images)
        from PIL import Image

        return torch.stack([self.preprocess(Image.fromarray(image)) for image in images])


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order; prefixed ``sha256:``."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return "sha256:" + digest.hexdigest()
