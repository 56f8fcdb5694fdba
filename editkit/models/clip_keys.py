"""CLIP checkpoints laid out by open_clip or by Hugging Face, read as the image tower's own parameters.

A CLIP backbone's module is open_clip's image tower (``model.visual``, see
``editkit.models.clip``), so its parameter names are open_clip's without the
``visual.`` prefix. Checkpoints fine-tuned elsewhere come in two layouts:

- **open_clip**: the whole model's state dict (``visual.*`` for the image tower, the
  text tower and ``logit_scale`` beside it), as open_clip saves it; the task_vectors and
  tangent_task_arithmetic code wraps that model as ``ImageEncoder.model``, so the state
  dict of their encoder has the same keys under ``model.``;
- **Hugging Face** ``CLIPModel`` / ``CLIPVisionModel`` / ``CLIPVisionModelWithProjection``
  (``vision_model.*``, ``visual_projection.weight``, ``text_model.*``), as FusionBench's
  fine-tuned CLIP models are published; transformers 5 saves a ``CLIPVisionModel`` without
  the ``vision_model.`` prefix (``embeddings.*``, ``encoder.*``, ...), which is read too.

Both are converted to the image tower's names here. Hugging Face keeps separate
query / key / value projections where ``nn.MultiheadAttention`` holds one fused
``in_proj_weight`` (rows: query, then key, then value) and ``in_proj_bias``; its
projection is a ``Linear`` (``out x width``) where open_clip keeps the matrix
``proj`` (``width x out``) that features are right-multiplied by, hence the
transpose. The remaining names are one-to-one renames (:data:`HF_RENAMES`,
:data:`HF_BLOCK_RENAMES`).

Each conversion says which keys belong to the rest of the CLIP model (dropped: the
text tower is not part of the backbone), which it does not know (the caller refuses
them by name), and which image-tower parameters the layout has no place for: a
``CLIPVisionModel`` has no projection, so fine-tuning one cannot have changed it.
"""

from __future__ import annotations

import re
from typing import Mapping, NamedTuple

import torch

#: Prefix of the image tower's keys in an open_clip state dict, and the wrapper an ``ImageEncoder`` adds.
OPEN_CLIP_VISUAL = "visual."
IMAGE_ENCODER_WRAPPER = "model."
#: The scalar entries OpenAI's TorchScript CLIP archives carry beside the weights.
OPENAI_SCALARS = ("input_resolution", "context_length", "vocab_size")
#: First name component of the rest of an open_clip model: text tower (``text.`` for towers from other
#: libraries), its attention mask, the contrastive temperature and bias, and OpenAI's scalars.
OPEN_CLIP_OTHER_ROOTS = frozenset({"transformer", "token_embedding", "ln_final", "positional_embedding",
                                   "text_projection", "attn_mask", "logit_scale", "logit_bias", "text",
                                   *OPENAI_SCALARS})

#: Prefix of the image tower's keys in a Hugging Face CLIP state dict, and its projection's key.
HF_VISION = "vision_model."
HF_PROJECTION = "visual_projection.weight"
#: First name component of the rest of a Hugging Face ``CLIPModel``.
HF_OTHER_ROOTS = frozenset({"text_model", "text_projection", "logit_scale"})
#: Not a weight: the patch indices older transformers versions saved with the embeddings.
HF_POSITION_IDS = "embeddings.position_ids"
#: A key every Hugging Face CLIP vision tower has (after ``vision_model.``).
HF_PATCH_EMBEDDING = "embeddings.patch_embedding.weight"

#: Hugging Face name (after ``vision_model.``) -> open_clip name, outside the encoder blocks; a name ending
#: with ``.`` renames every key it starts.
HF_RENAMES = (
    ("embeddings.class_embedding", "class_embedding"),
    ("embeddings.patch_embedding.weight", "conv1.weight"),
    ("embeddings.position_embedding.weight", "positional_embedding"),
    ("pre_layrnorm.", "ln_pre."),  # sic: transformers' spelling
    ("post_layernorm.", "ln_post."),
)
#: The same inside encoder block i (``encoder.layers.{i}.`` -> ``transformer.resblocks.{i}.``).
HF_BLOCK_RENAMES = (
    ("self_attn.out_proj.", "attn.out_proj."),
    ("layer_norm1.", "ln_1."),
    ("layer_norm2.", "ln_2."),
    ("mlp.fc1.", "mlp.c_fc."),
    ("mlp.fc2.", "mlp.c_proj."),
)
_BLOCK = re.compile(r"encoder\.layers\.(\d+)\.(.+)")
_QKV = re.compile(r"self_attn\.([qkv])_proj\.(weight|bias)")
_QKV_ORDER = ("q", "k", "v")


class TowerState(NamedTuple):
    """A checkpoint read as the image tower's parameters.

    tensors: by the tower's own (open_clip) names.
    dropped: checkpoint keys of the rest of the model (text tower, temperature, index buffers).
    unknown: checkpoint keys this layout does not know.
    not_held: tower parameters the layout has no place for (left at theta_0 by whoever saved it).
    """

    tensors: dict[str, torch.Tensor]
    dropped: list[str]
    unknown: list[str]
    not_held: tuple[str, ...] = ()


def is_open_clip(keys: list[str]) -> bool:
    return _open_clip_wrapper(keys) is not None


def _open_clip_wrapper(keys: list[str]) -> str | None:
    """The prefix before ``visual.`` (empty, or an ``ImageEncoder``'s ``model.``); None if neither occurs."""
    for wrapper in ("", IMAGE_ENCODER_WRAPPER):
        if any(k.startswith(wrapper + OPEN_CLIP_VISUAL) for k in keys):
            return wrapper
    return None


def is_hugging_face(keys: list[str]) -> bool:
    return _hf_vision_prefix(keys) is not None


def _hf_vision_prefix(keys: list[str]) -> str | None:
    """``vision_model.``, or empty for transformers 5's ``CLIPVisionModel``; None if neither layout."""
    if any(k.startswith(HF_VISION) for k in keys):
        return HF_VISION
    return "" if HF_PATCH_EMBEDDING in keys else None


def from_open_clip(state: Mapping[str, torch.Tensor]) -> TowerState:
    """The ``visual.*`` tensors of an open_clip state dict (or an ``ImageEncoder``'s), renamed to the tower's names."""
    wrapper = _open_clip_wrapper(list(state)) or ""
    tensors, dropped, unknown = {}, [], []
    for key, value in state.items():
        name = key[len(wrapper):] if key.startswith(wrapper) else None
        if name is not None and name.startswith(OPEN_CLIP_VISUAL):
            tensors[name[len(OPEN_CLIP_VISUAL):]] = value
        elif name is not None and name.split(".")[0] in OPEN_CLIP_OTHER_ROOTS:
            dropped.append(key)
        else:
            unknown.append(key)
    return TowerState(tensors, dropped, unknown)


def from_hugging_face(state: Mapping[str, torch.Tensor]) -> TowerState:
    """A Hugging Face CLIP state dict as open_clip image-tower tensors (see the module docstring).

    A block whose query, key and value projections are not all present keeps the ones
    it has among the unknown keys, so the refusal names them.
    """
    prefix = _hf_vision_prefix(list(state)) or ""
    tensors: dict[str, torch.Tensor] = {}
    dropped, unknown = [], []
    qkv: dict[tuple[str, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, value in state.items():
        if key == HF_PROJECTION:
            tensors["proj"] = value.t()
            continue
        if key.split(".")[0] in HF_OTHER_ROOTS:
            dropped.append(key)
            continue
        if not key.startswith(prefix):
            unknown.append(key)
            continue
        name = key[len(prefix):]
        if name == HF_POSITION_IDS:
            dropped.append(key)
        elif block := _BLOCK.fullmatch(name):
            index, inner = block.groups()
            if projection := _QKV.fullmatch(inner):
                which, kind = projection.groups()
                qkv.setdefault((index, kind), {})[which] = (key, value)
            elif (renamed := _rename(inner, HF_BLOCK_RENAMES)) is not None:
                tensors[f"transformer.resblocks.{index}.{renamed}"] = value
            else:
                unknown.append(key)
        elif (renamed := _rename(name, HF_RENAMES)) is not None:
            tensors[renamed] = value
        else:
            unknown.append(key)
    for (index, kind), parts in qkv.items():
        if set(parts) == set(_QKV_ORDER):
            tensors[f"transformer.resblocks.{index}.attn.in_proj_{kind}"] = torch.cat(
                [parts[which][1] for which in _QKV_ORDER])
        else:
            unknown += [key for key, _ in parts.values()]
    has_text = any(k.split(".")[0] in HF_OTHER_ROOTS for k in state)
    not_held = ("proj",) if "proj" not in tensors and not has_text else ()  # a vision-only model has no projection
    return TowerState(tensors, dropped, unknown, not_held)


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str | None:
    """``name`` under the first matching rename (exact, or a prefix ending with ``.``); None if none matches."""
    for old, new in renames:
        if name == old:
            return new
        if old.endswith(".") and name.startswith(old):
            return new + name[len(old):]
    return None
