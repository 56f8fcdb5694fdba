"""Every environment variable and default path editkit reads, in one place.

Library code asks these functions instead of reading ``os.environ`` itself, so a
user can see here everything that changes editkit's behaviour from outside:

| variable | meaning | default |
|---|---|---|
| ``EDITKIT_CACHE`` | pinned downloads, dataset caches, cached heads | ``~/.cache/editkit`` |
| ``EDITKIT_DERIVED_CACHE`` | what theta_0 alone computed: prefix states, sampled continuations | ``$EDITKIT_CACHE`` |
| ``EDITKIT_DATA`` | root of on-disk datasets (vision8, ImageNet) | unset |
| ``EDITKIT_IMAGENET`` | a local ImageNet validation copy | unset |
| ``EDITKIT_CLIP_CACHE`` | CLIP weights | open_clip's (HF hub cache) |
| ``EDITKIT_SCENARIOS`` | extra scenario directories (``os.pathsep``-separated), searched first | unset |
| ``EDITKIT_OFFLINE`` / ``HF_HUB_OFFLINE`` | never try the network | off |
| ``EDITKIT_EVAL_CACHE_MB`` | memory a stream's evaluation cache keeps before it spills to the run directory | 2048 |
| ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` | set by torchrun | one process |
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EDITKIT_CACHE"
DERIVED_CACHE_ENV = "EDITKIT_DERIVED_CACHE"
DATA_ENV = "EDITKIT_DATA"
IMAGENET_ENV = "EDITKIT_IMAGENET"
CLIP_CACHE_ENV = "EDITKIT_CLIP_CACHE"
SCENARIOS_ENV = "EDITKIT_SCENARIOS"
OFFLINE_ENV = "EDITKIT_OFFLINE"
EVAL_CACHE_ENV = "EDITKIT_EVAL_CACHE_MB"
EVAL_CACHE_MB = 2048

BANKS_DIR = Path("banks")
RUNS_DIR = Path("runs")
#: The scenario ``editkit stream`` and ``editkit bench`` run when none is named.
DEFAULT_SCENARIO = "offline-vision"
#: Training inputs per class a task's class prototypes average at most (a seeded choice where a class has more):
#: a class mean is well estimated long before a large train split is exhausted, so a big split costs little.
PROTOTYPE_EXAMPLES_PER_CLASS = 512
#: Shrinkage of the class-incremental head's pooled covariance towards a multiple of the identity (0: the pooled
#: covariance itself, 1: the Euclidean nearest-class-mean head). Strong, because an earlier task's statistics were
#: taken before the later vectors were added, and a weakly shrunk inverse amplifies whatever those vectors still
#: move on its inputs (:mod:`editkit.core.prototypes`); chosen on validation splits (docs: the class protocol).
CLASS_HEAD_SHRINKAGE = 0.5


def _path(variable: str) -> Path | None:
    value = os.environ.get(variable)
    return Path(value).expanduser() if value else None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """The cache root (created on demand): ``$EDITKIT_CACHE`` if set and non-empty, else ``~/.cache/editkit``."""
    root = _path(CACHE_ENV) or Path.home() / ".cache" / "editkit"
    root.mkdir(parents=True, exist_ok=True)
    return root


def derived_cache_dir() -> Path:
    """Where what theta_0 alone computed is kept (``editkit.core.derived_cache``): ``$EDITKIT_DERIVED_CACHE`` if set
    and non-empty, else the cache root. Apart from the downloads, so it can be cleared, or kept per test, alone."""
    root = _path(DERIVED_CACHE_ENV) or cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


def downloads_dir() -> Path:
    """Where fetched artifacts are kept: ``cache_dir()/"downloads"`` (created on demand)."""
    path = cache_dir() / "downloads"
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_root(root: str | os.PathLike | None = None) -> Path | None:
    """The data root: ``root`` if given, else ``$EDITKIT_DATA``, else None."""
    return Path(root).expanduser() if root else _path(DATA_ENV)


def imagenet_dir() -> Path | None:
    """``$EDITKIT_IMAGENET``: a local ImageNet validation copy, if set."""
    return _path(IMAGENET_ENV)


def clip_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """CLIP weights: ``cache_dir``, else ``$EDITKIT_CLIP_CACHE``, else None (open_clip's defaults)."""
    return Path(cache_dir).expanduser() if cache_dir else _path(CLIP_CACHE_ENV)


def extra_scenario_dirs() -> list[Path]:
    """Directories of ``$EDITKIT_SCENARIOS``, searched before the built-in scenarios."""
    return [Path(p) for p in os.environ.get(SCENARIOS_ENV, "").split(os.pathsep) if p]


def offline_mode() -> bool:
    """True when downloads are switched off (``HF_HUB_OFFLINE`` or ``EDITKIT_OFFLINE``)."""
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get(OFFLINE_ENV)):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:  # pragma: no cover - a dependency of open_clip
        return False


def eval_cache_bytes() -> int:
    """Bytes of cached features and tangents a stream keeps in memory (``$EDITKIT_EVAL_CACHE_MB``, default
    2048 MiB); what does not fit is written to disk. Refused when not a non-negative whole number."""
    value = os.environ.get(EVAL_CACHE_ENV, "").strip() or str(EVAL_CACHE_MB)
    if not value.isdigit():
        raise ValueError(f"{EVAL_CACHE_ENV} must be a whole number of MiB, got {value!r}")
    return int(value) << 20


def torchrun_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) for a plain process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0)
    local = int(os.environ.get("LOCAL_RANK", str(rank)) or 0)
    return rank, world, local


def default_bank_dir(scenario: str, mode: str, *, root: str | os.PathLike = BANKS_DIR) -> Path:
    """``<root>/<scenario>-<mode>`` (root ``banks/``): where a stream banks its vectors unless told otherwise."""
    return Path(root) / f"{scenario}-{mode}"


def default_run_dir(scenario: str, what: str) -> Path:
    """``runs/<scenario>-<what>``: report.json and plots of a run (``what`` = mode, or ``bench``)."""
    return RUNS_DIR / f"{scenario}-{what}"
