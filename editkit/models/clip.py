"""CLIP image encoders through open_clip, and their zero-shot heads.

``build_clip(model_name, pretrained)`` returns a :class:`ClipBackbone`: its
``module`` is the open_clip image tower (``model.visual``), so features are image
embeddings *before* normalization (what the tauJp penalty measures); the text tower
and tokenizer ride along for building zero-shot heads (:func:`zero_shot_head`).

Where the weights come from (``pretrained``):

- an open_clip tag (``"openai"``, ``"laion2b_s34b_b79k"``, ...): looked up in the
  local caches first (the Hugging Face hub cache for ``hf_hub`` entries, open_clip's
  ``~/.cache/clip`` for URL entries; ``cache_dir`` / ``$EDITKIT_CLIP_CACHE`` replace
  both). If absent, they are downloaded only when the hub answers a 3-second probe
  and ``HF_HUB_OFFLINE`` / ``EDITKIT_OFFLINE`` are not set; otherwise
  :class:`MissingResourceError` says what was looked for, where, and how to provide
  it. Nothing here can hang on a dead network.
- a local checkpoint file (open_clip state dict: ``.pt``/``.bin``/``.safetensors``)
  or a directory (an open_clip ``local-dir`` with ``open_clip_config.json``, or any
  directory holding one checkpoint).
- ``None`` (or ``"random"``): random initialisation (tests, benchmarks).

OpenAI weights were trained with QuickGELU: for the ``openai`` tag it is switched on
from the tag's config; for a local file, pass ``quick_gelu=True`` (or use the
``<name>-quickgelu`` model name) unless the file name contains ``openai``.

Tests use :data:`TINY_MODEL_NAME`, a registered open_clip config (ViT width 32, one
layer, 32x32 images; a one-layer text tower over the real 49408-token BPE vocabulary
that ships inside open_clip, so the tokenizer needs no download).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import urlparse

import torch
from torch import nn
from torch.nn import functional as F

from editkit.core.registry import Record
from editkit.util.atomic import atomic_path
from editkit.errors import ConfigError, MissingResourceError
from editkit.settings import CLIP_CACHE_ENV, cache_dir, clip_cache_dir, offline_mode
from editkit.util.hub import hf_endpoint, hf_hub_cache, host_reachable
from editkit.util.paths import always_a_path
from editkit.models import BACKBONES
from editkit.models.heads import ZeroShotHead
from editkit.models.backbone import Backbone, NativeWeights, state_fingerprint
from editkit.models.inputs import ON_PIL, image_spec
from editkit.models.clip_keys import OPENAI_SCALARS

log = logging.getLogger(__name__)

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
RANDOM_TAGS = ("", "none", "random", "scratch")

TINY_MODEL_NAME = "editkit-tiny-clip"
TINY_CLIP_CONFIG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}

_registered: dict[str, str] = {}  # model name -> json of its config, registered in this process


# --------------------------------------------------------------------------- configs


def register_model_config(name: str, config: dict[str, Any]) -> str:
    """Make ``name`` an open_clip model name for ``config`` in this process; return ``name``.

    ``config`` is an open_clip model config (``embed_dim``, ``vision_cfg``,
    ``text_cfg``, ...). ``open_clip.add_model_config`` reads it from a file, once: the file
    is written to a temporary directory that is removed right after (open_clip keeps the
    config it read, and skips files that are gone when it rescans). Registering the same
    name twice with the same config is a no-op; with a different config it replaces the
    earlier one.
    """
    import open_clip

    if not all(key in config for key in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ConfigError(f"open_clip model config {name!r} needs embed_dim, vision_cfg and text_cfg")
    text = json.dumps(config, sort_keys=True)
    if _registered.get(name) == text and name in open_clip.list_models():
        return name
    with tempfile.TemporaryDirectory(prefix="editkit-open-clip-config-") as directory:
        path = Path(directory) / f"{name}.json"
        path.write_text(text)
        open_clip.add_model_config(path)
    _registered[name] = text
    log.debug("registered open_clip model config %s", name)
    return name


def register_tiny_clip() -> str:
    """Register :data:`TINY_CLIP_CONFIG` as :data:`TINY_MODEL_NAME` (idempotent)."""
    return register_model_config(TINY_MODEL_NAME, TINY_CLIP_CONFIG)


def _ensure_model_name(model_name: str) -> str:
    """Resolve editkit's built-in names and ``*.json`` config files to open_clip names."""
    import open_clip

    if model_name == TINY_MODEL_NAME:
        return register_tiny_clip()
    if model_name.endswith(".json") and Path(model_name).expanduser().is_file():
        path = Path(model_name).expanduser()
        return register_model_config(path.stem, json.loads(path.read_text()))
    if model_name.startswith(("hf-hub:", "local-dir:")):
        return model_name
    if model_name.replace("/", "-") not in open_clip.list_models():
        raise ConfigError(
            f"unknown open_clip model {model_name!r}: use a name from open_clip.list_models() "
            f"(e.g. ViT-B-32, ViT-B-16, ViT-L-14), a model config .json file, or "
            f"'local-dir:/path' with an open_clip_config.json"
        )
    return model_name.replace("/", "-")


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class ResolvedWeights:
    """Where a model's weights come from, after resolution (nothing loaded yet).

    kind: ``random``, ``file`` (a checkpoint file), ``local-dir`` (an open_clip
        directory with its own config) or ``tag`` (an open_clip tag, now a cached file).
    path: the checkpoint file or directory (None for ``random``).
    tag: the open_clip tag when ``kind == "tag"``.
    quick_gelu: whether the weights expect QuickGELU activations.
    preprocess: the tag's preprocessing overrides (mean, std, interpolation, resize_mode).
    """

    kind: str
    path: Path | None = None
    tag: str | None = None
    quick_gelu: bool = False
    preprocess: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Short human id used in backbone names: the tag, the file name or ``random``."""
        if self.kind == "tag":
            return str(self.tag)
        if self.path is not None:
            return self.path.name
        return "random"


def _hf_candidates(hf_hub: str) -> tuple[str, list[str]]:
    """(repo_id, file names open_clip would try, in order) for a tag's ``hf_hub`` entry."""
    from open_clip.constants import HF_SAFE_WEIGHTS_NAME, HF_WEIGHTS_NAME

    repo_id, filename = os.path.split(hf_hub)
    filename = filename or HF_WEIGHTS_NAME
    names = []
    if filename == HF_WEIGHTS_NAME:
        names.append(HF_SAFE_WEIGHTS_NAME)
    elif filename.endswith((".bin", ".pth")):
        names.append(filename[:-4] + ".safetensors")
    names.append(filename)
    return repo_id, names


def _find_cached_tag(cfg: dict[str, Any], cache_dir: Path | None) -> tuple[Path | None, list[str]]:
    """(cached checkpoint or None, human descriptions of where we looked)."""
    looked: list[str] = []
    if cfg.get("file"):
        path = Path(cfg["file"]).expanduser()
        looked.append(str(path))
        return (path if path.is_file() else None), looked
    if cfg.get("hf_hub"):
        from huggingface_hub import try_to_load_from_cache

        repo_id, names = _hf_candidates(cfg["hf_hub"])
        hub_cache = hf_hub_cache(cache_dir)
        for name in names:
            found = try_to_load_from_cache(repo_id, name, cache_dir=str(hub_cache))
            if isinstance(found, str) and Path(found).is_file():
                return Path(found), looked
        looked.append(f"{' or '.join(names)} of {repo_id} in the Hugging Face cache {hub_cache}")
    if cfg.get("url"):
        url_dir = cache_dir if cache_dir is not None else Path("~/.cache/clip").expanduser()
        target = url_dir / os.path.basename(cfg["url"])
        if target.is_file():
            return target, looked
        looked.append(str(target))
    return None, looked


def _how_to_provide(model_name: str) -> str:
    return (
        f"provide them with --pretrained /path/to/checkpoint (an open_clip .pt/.bin/.safetensors "
        f"file, or a directory holding one, of {model_name}), or set {CLIP_CACHE_ENV} or HF_HOME to a "
        f"cache that holds them, or run once with internet access to fill the cache"
    )


def _looks_like_path(value: str) -> bool:
    return os.sep in value or value.startswith((".", "~")) or value.lower().endswith(CHECKPOINT_SUFFIXES)


def pretrained_is_path(pretrained: str, exists: bool) -> bool:
    """Whether ``pretrained`` names a checkpoint file or directory (:data:`~editkit.util.paths.PathRule`): one that
    exists, or a name that looks like a path; a random tag and an open_clip tag (``openai``) do not."""
    return pretrained.strip().lower() not in RANDOM_TAGS and (exists or _looks_like_path(pretrained))


def config_is_path(model: str, exists: bool) -> bool:
    """Whether the model name ``model`` is an open_clip config file (``*.json``) rather than a model name."""
    return model.endswith(".json")


def is_torchscript_archive(path: Path) -> bool:
    """Whether ``path`` is a TorchScript archive (OpenAI's original ``ViT-B-32.pt`` files are)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/constants.pkl") or "/code/" in name for name in archive.namelist())


def _state_dict_from_torchscript(path: Path) -> Path:
    """Save the tensors of a TorchScript CLIP archive as a plain state dict (temporary file).

    torch.load refuses TorchScript with ``weights_only=True``; torch.jit.load reads it
    without unpickling arbitrary Python. The scalar entries OpenAI's archives carry
    (``input_resolution``, ``context_length``, ``vocab_size``) and attention masks
    (buffers, not weights) are dropped, as open_clip's own OpenAI loader does.
    """
    state = torch.jit.load(str(path), map_location="cpu").state_dict()
    state = {k: v for k, v in state.items() if k not in OPENAI_SCALARS and not k.endswith("attn_mask")}
    fd, tmp = tempfile.mkstemp(prefix="editkit-clip-", suffix=".pt")
    os.close(fd)
    torch.save(state, tmp)
    log.info("converted TorchScript archive %s to a state dict", path)
    return Path(tmp)


def _find_checkpoint_in_dir(directory: Path) -> Path | None:
    preferred = (
        "open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
        "open_clip_pytorch_model.bin", "model.safetensors", "pytorch_model.bin", "model.pt",
    )
    for name in preferred:
        if (directory / name).is_file():
            return directory / name
    found = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)
    if len(found) > 1:
        log.warning("several checkpoints in %s; using %s", directory, found[0].name)
    return found[0] if found else None


def resolve_weights(
    model_name: str,
    pretrained: str | os.PathLike | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    allow_download: bool = True,
    quick_gelu: bool | None = None,
) -> ResolvedWeights:
    """Find the weights ``build_clip`` would load, downloading them only if allowed and reachable.

    Raises :class:`MissingResourceError` (weights absent and not downloadable, or a
    checkpoint path that does not exist) or :class:`ConfigError` (an unknown tag).
    """
    if model_name.startswith("local-dir:"):
        directory = Path(model_name[len("local-dir:"):]).expanduser()
        if not (directory / "open_clip_config.json").is_file():
            raise MissingResourceError(
                f"CLIP model {model_name}: {directory / 'open_clip_config.json'} does not exist"
            )
        return ResolvedWeights(kind="local-dir", path=directory, quick_gelu=bool(quick_gelu))
    if model_name.startswith("hf-hub:"):
        return _resolve_hf_hub_model(model_name, cache_dir=cache_dir, allow_download=allow_download,
                                     quick_gelu=quick_gelu)
    if pretrained is None or str(pretrained).strip().lower() in RANDOM_TAGS:
        return ResolvedWeights(kind="random", quick_gelu=bool(quick_gelu))
    value = str(pretrained)
    path = Path(value).expanduser()
    local = _local_weights(path, quick_gelu)
    if local is not None:
        return local

    from open_clip.pretrained import get_pretrained_cfg, list_pretrained_tags_by_model

    name = model_name.replace("/", "-")
    cfg = get_pretrained_cfg(name, value)
    if not cfg:
        if _looks_like_path(value):
            raise MissingResourceError(
                f"CLIP weights for {model_name}: checkpoint {path} does not exist; "
                f"{_how_to_provide(model_name)}"
            )
        tags = list_pretrained_tags_by_model(name)
        raise ConfigError(
            f"unknown pretrained tag {value!r} for open_clip model {model_name}: known tags are "
            f"{', '.join(tags) if tags else 'none (pass a checkpoint path)'}"
        )
    preprocess = {k: cfg[k] for k in ("mean", "std", "interpolation", "resize_mode") if k in cfg}
    qg = bool(cfg.get("quick_gelu", False)) if quick_gelu is None else quick_gelu
    cache = clip_cache_dir(cache_dir)
    cached, looked = _find_cached_tag(cfg, cache)
    if cached is not None:
        log.info("CLIP weights %s/%s found in cache: %s", model_name, value, cached)
        return ResolvedWeights(kind="tag", path=cached, tag=value, quick_gelu=qg, preprocess=preprocess)

    downloaded = _download_tag(cfg, f"{model_name}/{value}", model_name, cache, "; ".join(looked),
                               allow_download=allow_download)
    return ResolvedWeights(kind="tag", path=downloaded, tag=value, quick_gelu=qg, preprocess=preprocess)


def _local_weights(path: Path, quick_gelu: bool | None) -> ResolvedWeights | None:
    """Weights at a local ``path``: a checkpoint file, an open_clip model directory, or a directory holding one
    checkpoint; None when nothing is there. QuickGELU, unless forced, follows ``openai`` in the file's name."""
    if path.is_file():
        qg = quick_gelu if quick_gelu is not None else "openai" in path.name.lower()
        return ResolvedWeights(kind="file", path=path, quick_gelu=bool(qg))
    if not path.is_dir():
        return None
    if (path / "open_clip_config.json").is_file():
        return ResolvedWeights(kind="local-dir", path=path, quick_gelu=bool(quick_gelu))
    ckpt = _find_checkpoint_in_dir(path)
    if ckpt is None:
        raise MissingResourceError(
            f"CLIP weights: directory {path} holds no checkpoint (*.safetensors, *.bin, *.pt, "
            f"*.pth) and no open_clip_config.json"
        )
    qg = quick_gelu if quick_gelu is not None else "openai" in str(ckpt).lower()
    return ResolvedWeights(kind="file", path=ckpt, quick_gelu=bool(qg))


def _download_tag(cfg: dict[str, Any], what: str, model_name: str, cache: Path | None, where: str, *,
                  allow_download: bool) -> Path:
    """The file of a tag's weights (``cfg``, open_clip's pretrained config) downloaded into ``cache``; refused
    with one line saying how to provide them when downloads are off, the host is unreachable or it fails."""
    if not allow_download or offline_mode():
        reason = "downloads are off (HF_HUB_OFFLINE / EDITKIT_OFFLINE)" if offline_mode() else "downloads not allowed"
        raise MissingResourceError(
            f"CLIP weights {what} are not in the local cache (looked for {where}) and "
            f"{reason}: {_how_to_provide(model_name)}"
        )
    probe_url = hf_endpoint() if cfg.get("hf_hub") else cfg.get("url", "")
    if not host_reachable(probe_url):
        raise MissingResourceError(
            f"CLIP weights {what} are not in the local cache (looked for {where}) and "
            f"{urlparse(probe_url).hostname or probe_url} is unreachable: {_how_to_provide(model_name)}"
        )
    from open_clip.pretrained import download_pretrained

    log.info("downloading CLIP weights %s", what)
    try:
        downloaded = download_pretrained(cfg, cache_dir=str(cache) if cache else None)
    except Exception as exc:  # network/HTTP errors of several libraries
        raise MissingResourceError(
            f"CLIP weights {what} could not be downloaded ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): {_how_to_provide(model_name)}"
        ) from exc
    if not downloaded or not Path(downloaded).is_file():
        raise MissingResourceError(
            f"CLIP weights {what}: the download produced no file; {_how_to_provide(model_name)}"
        )
    return Path(downloaded)


def _resolve_hf_hub_model(
    model_name: str, *, cache_dir: str | os.PathLike | None, allow_download: bool, quick_gelu: bool | None
) -> ResolvedWeights:
    """An ``hf-hub:org/repo`` model as the local snapshot directory (config + weights)."""
    from huggingface_hub import snapshot_download

    repo_id = model_name[len("hf-hub:"):]
    hub_cache = hf_hub_cache(clip_cache_dir(cache_dir))
    kwargs: dict[str, Any] = dict(cache_dir=str(hub_cache))
    try:
        snapshot = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except Exception:  # not cached
        snapshot = None
    if snapshot is not None and (snapshot / "open_clip_config.json").is_file():
        return ResolvedWeights(kind="local-dir", path=snapshot, quick_gelu=bool(quick_gelu))
    where = f"{repo_id} (open_clip_config.json and weights) in the Hugging Face cache {hub_cache}"
    if not allow_download or offline_mode() or not host_reachable(hf_endpoint()):
        raise MissingResourceError(
            f"CLIP model {model_name} is not available offline: looked for {where}; {_how_to_provide(model_name)}"
        )
    try:
        snapshot = Path(snapshot_download(repo_id, **kwargs))
    except Exception as exc:
        raise MissingResourceError(
            f"CLIP model {model_name} could not be downloaded ({type(exc).__name__}); {_how_to_provide(model_name)}"
        ) from exc
    return ResolvedWeights(kind="local-dir", path=snapshot, quick_gelu=bool(quick_gelu))


def check_weights(
    model_name: str,
    pretrained: str | os.PathLike | None,
    *,
    cache_dir: str | os.PathLike | None = None,
    probe_network: bool = True,
) -> str | None:
    """None if :func:`build_clip` can get these weights, else one line saying what is missing.

    Never downloads. With ``probe_network`` a tag that is not cached counts as
    available when the hub answers a short probe (``build_clip`` will download it).
    """
    try:
        model_name = _ensure_model_name(model_name)
        resolve_weights(model_name, pretrained, cache_dir=cache_dir, allow_download=False)
        return None
    except MissingResourceError as exc:
        if probe_network and not offline_mode() and model_name.startswith("hf-hub:"):
            return None if host_reachable(hf_endpoint()) else str(exc)
        if probe_network and not offline_mode() and pretrained is not None:
            from open_clip.pretrained import get_pretrained_cfg

            cfg = get_pretrained_cfg(model_name.replace("/", "-"), str(pretrained))
            if cfg:
                url = hf_endpoint() if cfg.get("hf_hub") else cfg.get("url", "")
                if url and host_reachable(url):
                    return None
        return str(exc)
    except ConfigError as exc:
        return str(exc)


# --------------------------------------------------------------------------- backbone


@dataclass(eq=False)
class ClipBackbone(Backbone):
    """An open_clip image tower as a :class:`Backbone`, plus what zero-shot heads need.

    module: ``clip_model.visual`` (features = image embeddings before normalization).
    preprocess: open_clip's eval transform, or its train transform when built with
        ``train_augment=True``; both are also kept as ``val_preprocess`` / ``train_preprocess``.
    clip_model: the whole open_clip model (text tower, ``logit_scale``), kept in eval mode.
    tokenizer: open_clip's tokenizer for this model.
    weights: where theta_0 came from (:class:`ResolvedWeights`).
    """

    clip_model: nn.Module | None = field(default=None, repr=False)
    tokenizer: Callable | None = field(default=None, repr=False)
    train_preprocess: Callable | None = field(default=None, repr=False)
    val_preprocess: Callable | None = field(default=None, repr=False)
    model_name: str = ""
    weights: ResolvedWeights | None = None
    _model_fingerprint: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_model is not None:
            self.clip_model.eval()

    def native_weights(self) -> NativeWeights:
        """The whole open_clip model (text tower included, the image tower edited), as open_clip loads it."""
        return NativeWeights("open_clip", self.clip_model,
                             f"open_clip.create_model_and_transforms({self.model_name!r}, pretrained=PATH)",
                             file="open_clip_model.safetensors")

    @property
    def logit_scale(self) -> float:
        """The multiplier applied to cosine similarities: ``exp(model.logit_scale)`` (100 for OpenAI CLIP)."""
        return float(self.clip_model.logit_scale.detach().float().exp().item())

    def _text_device(self) -> torch.device:
        for name, param in self.clip_model.named_parameters():
            if not name.startswith("visual."):
                return param.device
        return torch.device("cpu")

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str], *, batch_size: int = 256) -> torch.Tensor:
        """Text embeddings ``(len(texts), embed_dim)``, float32 on CPU, *not* normalized."""
        device = self._text_device()
        out = []
        for start in range(0, len(texts), batch_size):
            tokens = self.tokenizer(list(texts[start:start + batch_size])).to(device)
            out.append(self.clip_model.encode_text(tokens).float().cpu())
        if not out:
            raise ValueError("encode_text needs at least one text")
        return torch.cat(out)

    def model_fingerprint(self) -> str:
        """Identity of the whole CLIP model (both towers and ``logit_scale``), computed once.

        Heads depend on the text tower, which :meth:`fingerprint` (image tower only)
        does not cover; the head cache keys on this instead.
        """
        if self._model_fingerprint is None:
            self._model_fingerprint = state_fingerprint(self.clip_model.state_dict())
        return self._model_fingerprint


def _create_model(create_name: str, weights: ResolvedWeights, model_name: str, cache: Path | None,
                  device: str | torch.device) -> tuple[nn.Module, Any, Any]:
    """open_clip's (model, train transform, eval transform) with ``weights`` loaded (a TorchScript archive through
    a temporary state dict, removed after); a checkpoint that does not fit is refused by name."""
    import open_clip

    kwargs: dict[str, Any] = dict(device=device, force_quick_gelu=weights.quick_gelu, pretrained_text=False)
    pp = weights.preprocess
    if pp:
        kwargs.update(
            image_mean=pp.get("mean"), image_std=pp.get("std"),
            image_interpolation=pp.get("interpolation"), image_resize_mode=pp.get("resize_mode"),
        )
    if cache is not None:
        kwargs["cache_dir"] = str(cache)
    create_pretrained = str(weights.path) if weights.path is not None and weights.kind != "local-dir" else None
    converted: Path | None = None
    if create_pretrained is not None and is_torchscript_archive(weights.path):
        converted = _state_dict_from_torchscript(weights.path)
        create_pretrained = str(converted)
    quiet = _QuietRandomInit() if weights.kind == "random" else None
    root = logging.getLogger()
    if quiet:
        root.addFilter(quiet)
    try:
        return open_clip.create_model_and_transforms(create_name, pretrained=create_pretrained, **kwargs)
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if weights.path is not None:
            # torch's RuntimeError (reading the file, loading its state dict) speaks of torch's internals: not shown
            why = "torch cannot load it into this model" if isinstance(exc, RuntimeError) else message
            raise ConfigError(
                f"cannot load CLIP weights {weights.path} into {model_name}: {why} "
                f"(is it an open_clip checkpoint of this architecture?)"
            ) from exc
        raise ConfigError(f"cannot build open_clip model {model_name}: {message}") from exc
    finally:
        if quiet:
            root.removeFilter(quiet)
        if converted is not None:
            converted.unlink(missing_ok=True)


def _tokenizer(create_name: str, model_name: str, cache: Path | None) -> Any:
    """open_clip's tokenizer of the model, or one line saying how to provide it offline."""
    import open_clip

    try:
        return open_clip.get_tokenizer(create_name, cache_dir=str(cache) if cache else None)
    except Exception as exc:  # HF tokenizers may need a download
        raise MissingResourceError(
            f"the tokenizer of CLIP model {model_name} is not available offline ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); run once with internet access or set HF_HOME "
            f"to a cache that holds it"
        ) from exc


def _feature_dim(visual: nn.Module, device: str | torch.device) -> int:
    """The image tower's output width: its ``output_dim``, else measured on one blank image."""
    feature_dim = int(getattr(visual, "output_dim", 0) or 0)
    if not feature_dim:
        size = visual.image_size if isinstance(visual.image_size, (tuple, list)) else (visual.image_size,) * 2
        with torch.no_grad():
            feature_dim = int(visual(torch.zeros(1, 3, *size, device=device)).shape[-1])
    return feature_dim


def build_clip(
    model_name: str = "ViT-B-32",
    pretrained: str | os.PathLike | None = "openai",
    *,
    cache_dir: str | os.PathLike | None = None,
    train_augment: bool = False,
    quick_gelu: bool | None = None,
    device: str | torch.device = "cpu",
    allow_download: bool = True,
) -> ClipBackbone:
    """An open_clip CLIP model as a :class:`ClipBackbone` (image tower = ``module``).

    model_name: an open_clip model name (``ViT-B-32``, ``ViT-B-16``, ``ViT-L-14``, ...),
        :data:`TINY_MODEL_NAME`, a model config ``.json`` file, or ``local-dir:/path``.
    pretrained: an open_clip tag, a checkpoint file or directory, or None for random init.
    cache_dir: where tag weights are cached (default ``$EDITKIT_CLIP_CACHE``, else
        open_clip's / Hugging Face's own caches).
    train_augment: ``preprocess`` is open_clip's train-time transform (random resized
        crop) instead of the eval one.
    quick_gelu: force QuickGELU on/off; None decides from the tag (or ``openai`` in a file name).
    allow_download: fetch a tag's weights that are not cached (only if the hub is reachable).

    Raises :class:`MissingResourceError` when the weights are unavailable offline and
    :class:`ConfigError` for an unknown model name or tag, or a checkpoint that does
    not fit the architecture.
    """
    import open_clip

    name = _ensure_model_name(model_name)
    weights = resolve_weights(
        name, pretrained, cache_dir=cache_dir, allow_download=allow_download, quick_gelu=quick_gelu
    )
    cache = clip_cache_dir(cache_dir)
    create_name = f"local-dir:{weights.path}" if weights.kind == "local-dir" else name
    model, train_tf, val_tf = _create_model(create_name, weights, model_name, cache, device)
    tokenizer = _tokenizer(create_name, model_name, cache)
    model.eval()
    visual = model.visual
    feature_dim = _feature_dim(visual, device)
    cfg = open_clip.get_model_preprocess_cfg(model)  # what val_tf does, as data
    spec = image_spec(cfg["size"], mean=cfg["mean"], std=cfg["std"], on=ON_PIL, interpolation=cfg["interpolation"],
                      resize_mode=cfg["resize_mode"], fill_color=cfg["fill_color"])
    backbone = ClipBackbone(
        name=f"clip:{model_name}/{weights.label}",
        module=visual,
        feature_dim=feature_dim,
        preprocess=train_tf if train_augment else val_tf,
        input_spec=spec,
        clip_model=model,
        tokenizer=tokenizer,
        train_preprocess=train_tf,
        val_preprocess=val_tf,
        model_name=model_name,
        weights=weights,
    )
    log.info("built %s (feature dim %d, quick_gelu=%s)", backbone.name, feature_dim, weights.quick_gelu)
    return backbone


class _QuietRandomInit(logging.Filter):
    """Drops open_clip's root-logger warning about random init when random init was asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()


# --------------------------------------------------------------------------- zero-shot heads


@torch.no_grad()
def zero_shot_weights(backbone: ClipBackbone, classnames: Sequence[str], templates: Sequence[str]) -> torch.Tensor:
    """Class embeddings ``(C, D)``: per class, the text embeddings of every template,
    each normalized, averaged, and the mean renormalized (the CLIP / task-vector recipe)."""
    if not classnames:
        raise ConfigError("zero-shot head needs at least one class name")
    if not templates:
        raise ConfigError("zero-shot head needs at least one prompt template")
    prompts = [template.format(c) for c in classnames for template in templates]
    emb = backbone.encode_text(prompts).reshape(len(classnames), len(templates), -1)
    emb = F.normalize(emb, dim=-1).mean(dim=1)
    return F.normalize(emb, dim=-1)


def head_cache_key(backbone: ClipBackbone, classnames: Sequence[str], templates: Sequence[str]) -> str:
    """Hex sha256 of (whole-model fingerprint, class names, templates)."""
    payload = json.dumps(
        {"model": backbone.model_fingerprint(), "classnames": list(classnames), "templates": list(templates)},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def _safe(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)[:64] or "head"


def zero_shot_head(
    backbone: ClipBackbone,
    classnames: Sequence[str],
    templates: Sequence[str],
    *,
    dataset: str | None = None,
    cache: bool = True,
    cache_root: str | os.PathLike | None = None,
) -> ZeroShotHead:
    """A frozen :class:`~editkit.models.heads.ZeroShotHead` from class names x prompt templates.

    logits = ``exp(logit_scale)`` * normalize(features) @ W^T with W from
    :func:`zero_shot_weights`. With ``cache`` the head is stored as safetensors under
    ``cache_root`` (default ``editkit.settings.cache_dir()/"heads"``), named
    ``<dataset>-<key16>.safetensors`` where the key hashes the whole CLIP model, the
    class names and the templates; a later call returns the identical tensors.
    """
    from safetensors.torch import load_file, save_file

    templates = list(templates)
    classnames = list(classnames)
    path: Path | None = None
    if cache:
        if cache_root is None:
            root = cache_dir() / "heads"
        else:
            root = Path(cache_root)
        root.mkdir(parents=True, exist_ok=True)
        key = head_cache_key(backbone, classnames, templates)
        path = root / f"{_safe(dataset or 'head')}-{key[:16]}.safetensors"
        if path.is_file():
            try:
                tensors = load_file(str(path))
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as fh:
                    meta = fh.metadata() or {}
                if meta.get("key") == key and tensors["weight"].shape[0] == len(classnames):
                    log.debug("zero-shot head %s from cache %s", dataset, path)
                    head = ZeroShotHead(tensors["weight"], float(meta["logit_scale"]))
                    head.weight.copy_(tensors["weight"])  # bit-identical to the stored head
                    return head
                log.warning("head cache %s does not match its key; rebuilding it", path)
            except Exception as exc:  # damaged file: rebuild
                log.warning("head cache %s unreadable (%s); rebuilding it", path, exc)

    weight = zero_shot_weights(backbone, classnames, templates)
    scale = backbone.logit_scale
    head = ZeroShotHead(weight, scale)
    if path is not None:
        meta = {
            "format": "1", "key": key, "model": backbone.name, "dataset": dataset or "",
            "logit_scale": repr(scale), "num_classes": str(len(classnames)), "num_templates": str(len(templates)),
        }
        with atomic_path(path, durable=False) as tmp:
            save_file({"weight": head.weight.contiguous()}, str(tmp), metadata=meta)
        log.info("zero-shot head %s (%d classes x %d templates) cached at %s", dataset, len(classnames), len(templates), path)
    return head


# --------------------------------------------------------------------------- the "clip" backbone family


def _family(
    model: str = "ViT-B-32",
    pretrained: str | None = "openai",
    cache_dir: str | None = None,
    quick_gelu: bool | None = None,
    device: str | None = None,
    seed: int = 0,
) -> ClipBackbone:
    """:func:`build_clip` on the CPU, then moved to ``device``.

    ``pretrained = "random"``: random weights drawn from ``seed`` (the same in every
    process and every run, so banks, resumes and torchrun ranks agree on theta_0).
    """
    with torch.random.fork_rng(devices=[]):
        if pretrained is None or str(pretrained).strip().lower() in RANDOM_TAGS:
            torch.manual_seed(seed)
        backbone = build_clip(model, pretrained, cache_dir=cache_dir, quick_gelu=quick_gelu)
    if device and device != "cpu":
        backbone.clip_model.to(device)
    return backbone


def _family_check(model: str = "ViT-B-32", pretrained: str | None = "openai", cache_dir: str | None = None,
                  **_: Any) -> list[str]:
    problem = check_weights(model, pretrained, cache_dir=cache_dir)
    return [problem] if problem else []


BACKBONES.register("clip", Record.of(_family, check=_family_check, help={
    "model": "open_clip model name (ViT-B-32, ViT-B-16, ViT-L-14, ...), a config .json or local-dir:/path",
    "pretrained": "open_clip tag, checkpoint file or directory; 'random' for random weights",
    "cache_dir": "where tag weights are cached (default: settings' CLIP cache)",
    "quick_gelu": "force QuickGELU on/off (default: decided from the tag or file name)",
    "device": "device the model is moved to after building on the CPU",
    "seed": "seed of random weights when pretrained = 'random'"},
    paths={"model": config_is_path, "pretrained": pretrained_is_path, "cache_dir": always_a_path}))
