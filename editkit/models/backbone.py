"""What every backbone family provides to the rest of editkit.

A backbone is a plain ``nn.Module`` that maps a batch of *preprocessed* inputs
to feature vectors ``(N, D)`` (or per-token outputs ``(N, T, D)``): the quantity
the tauJp penalty is measured on (CLIP: image embeddings before normalization;
EfficientNet: pooled pre-activation features). Its parameters are theta_0; heads
sit on top, fixed.

The backbone also owns how its inputs are batched (:attr:`Backbone.batching`):
collating examples, concatenating a task batch with reg batches, the module's
call arguments, splitting outputs and the output mask. Training and evaluation
go through it, so an image backbone and a sequence backbone share one loop.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from editkit.core.batching import Batching, TensorBatching
from editkit.errors import ExportError
from editkit.models.inputs import IMAGE, ProgramInputs, image_inputs


@dataclass(frozen=True)
class NativeWeights:
    """How a family's edited weights are written in its own format (:mod:`editkit.io.native` writes them; no
    code outside the family names it).

    format: the manifest's name for it (``transformers``, ``open_clip``, ``torchvision``...).
    module: the whole model whose parameters are written (it holds the backbone module's own parameter objects, so
        an edit of the backbone is an edit of it).
    loads: what loads it, as code a user types (the model card shows it).
    file: the safetensors file its state dict goes into; None: the family's library writes the directory itself
        (``save_pretrained``), with ``tokenizer`` beside it.
    to_format: the state dict as the family's loader expects it (names, parts the backbone leaves out).
    """

    format: str
    module: nn.Module
    loads: str
    file: str | None = "weights.safetensors"
    tokenizer: Any = None
    to_format: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None


@dataclass
class Backbone:
    """A feature extractor plus what is needed to feed it and to recognise it.

    name: human-readable id, e.g. ``efficientnet-lite0@32`` or ``clip:ViT-B-32/openai``.
    module: maps preprocessed inputs to features ``(N, feature_dim)``; kept in eval mode
        (BatchNorm statistics and dropout are part of theta_0 and never change).
    feature_dim: D.
    preprocess: turns one raw example into the input the module expects (images: a
        PIL image / numpy array into a tensor); datasets apply it.
    batch_preprocess: optional vectorised version for a uint8 array of images
        ``(N,H,W)`` / ``(N,H,W,3)``; without it images go one by one through PIL.
    batching: collates preprocessed inputs into batches, concatenates and splits them,
        and says how the module is called and which outputs are padding
        (:class:`~editkit.core.batching.TensorBatching` for images,
        :class:`~editkit.core.batching.SequenceBatching` for token sequences).
    input_spec: what the module's inputs are, as data (:mod:`editkit.models.inputs`): an image family builds its
        ``preprocess`` from it, and an exported program records it, so ``editkit predict`` makes the same inputs.
    """

    name: str
    module: nn.Module
    feature_dim: int
    preprocess: Callable = field(repr=False, default=lambda x: x)
    batch_preprocess: Callable[[np.ndarray], torch.Tensor] | None = field(repr=False, default=None)
    batching: Batching = field(repr=False, default_factory=TensorBatching)
    input_spec: dict[str, Any] | None = field(repr=False, default=None)

    def __post_init__(self) -> None:
        self.module.eval()

    def fingerprint(self) -> str:
        """Identity of theta_0: any change to a parameter or buffer changes it."""
        return state_fingerprint(self.module.state_dict())

    @torch.no_grad()
    def features(self, inputs: Any, batch_size: int = 256) -> torch.Tensor:
        """The module's outputs on a batch of preprocessed inputs, computed ``batch_size`` examples at a time."""
        outputs = []
        for i in range(0, len(inputs), batch_size):
            outputs.append(self.batching.run(self.module, inputs[i : i + batch_size]))
        return torch.cat(outputs)

    def program_inputs(self) -> ProgramInputs | None:
        """How a program of this backbone is traced and called: an image backbone's module reads the pixels of its
        ``input_spec``; families of other inputs override this (a text encoder's program reads token ids; a causal
        LM returns None: its own Hugging Face directory is the model to take away)."""
        if self.input_spec is not None and self.input_spec.get("kind") == IMAGE:
            return image_inputs(self.module, self.input_spec)
        raise ExportError(f"backbone {self.name} does not say what inputs a program of it takes (no image "
                          "input_spec, no program_inputs of its family): its edited model cannot be written as a "
                          "program")

    def native_weights(self) -> NativeWeights:
        """The family's own format of its weights; a family that names none: the module's state dict, which the
        module's class loads."""
        return NativeWeights("state-dict", self.module, f"`{type(self.module).__name__}.load_state_dict`")

    def program_batch(self, dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """The program's inputs for examples ``indices`` of a task split (an image split holds them already)."""
        return (torch.stack([dataset[i][0] for i in indices]),)

    def preprocess_arrays(self, images: np.ndarray) -> torch.Tensor:
        """Input tensors for a uint8 array of images (image backbones only)."""
        if self.batch_preprocess is not None:
            return self.batch_preprocess(images)
        from PIL import Image

        return torch.stack([self.preprocess(Image.fromarray(image)) for image in images])


def names_in(whole: nn.Module, part: nn.Module) -> dict[str, str]:
    """``part``'s parameter names -> their names in ``whole``, a module holding the same parameter objects (a text
    encoder's whole model around the blocks its backbone module holds), matched through the parameters
    themselves, so no family needs a table of its own."""
    by_tensor = {id(p): name for name, p in whole.named_parameters(remove_duplicate=False)}
    return {name: by_tensor[id(p)] for name, p in part.named_parameters(remove_duplicate=False)}


def state_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order; prefixed ``sha256:``."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return "sha256:" + digest.hexdigest()
