"""ImageNet-1k validation, when it is on local disk: the negation control set.

The paper measures what negating a task vector costs on ImageNet (control
accuracy). editkit never downloads ImageNet; it uses a local copy if one is found,
in this order:

1. ``path`` (``editkit negate --control-data DIR``), else ``$EDITKIT_IMAGENET``;
2. ``<data root>/{imagenet,ImageNet,imagenet-1k,ILSVRC2012}`` (data root =
   ``--data-root`` / ``$EDITKIT_DATA``);
3. the Hugging Face hub cache (``ILSVRC/imagenet-1k``), local files only.

Accepted layouts in such a directory: the Hugging Face parquet copy
(``data/validation-*.parquet`` with an image column and integer labels, as
``ILSVRC/imagenet-1k``), or an image-folder tree of the 1000 WordNet-id class
directories (``val/n01440764/*.JPEG`` ..., or the class directories directly);
sorted WordNet ids are the standard label order. Class names and the 80 prompt
templates are open_clip's (``editkit.data.clip_templates``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from editkit.errors import MissingResourceError

from editkit.data.sources import ImageSplit, ParquetSource, _FileImages, hub_snapshot
from editkit.settings import data_root as resolve_data_root, imagenet_dir

log = logging.getLogger(__name__)

DIRS = ("imagenet", "ImageNet", "imagenet-1k", "ILSVRC2012", "ilsvrc2012")
HUB_REPOS = ("ILSVRC/imagenet-1k", "imagenet-1k")
VAL_SPLITS = ("validation", "val")
NUM_CLASSES = 1000


def _parquet_split(directory: Path) -> ImageSplit | None:
    for split in VAL_SPLITS:
        if ParquetSource.detect(directory, split_names=(split,)):
            source = ParquetSource(directory, split_names=(split,))
            return source.splits()[split]
    return None


def _folder_split(directory: Path) -> ImageSplit | None:
    for root in [directory / name for name in VAL_SPLITS] + [directory]:
        if not root.is_dir():
            continue
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("n") and p.name[1:].isdigit())
        if not classes:
            continue
        if len(classes) != NUM_CLASSES:
            raise MissingResourceError(
                f"ImageNet image folder {root} has {len(classes)} WordNet-id class directories, not {NUM_CLASSES}: "
                "labels would not line up with the class names"
            )
        from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, make_dataset

        samples = make_dataset(str(root), {c: i for i, c in enumerate(classes)}, extensions=IMG_EXTENSIONS)
        return ImageSplit(np.asarray([label for _, label in samples]), _FileImages([p for p, _ in samples], default_loader),
                          source=f"ImageNet image folder {root}")
    return None


def candidates(path: str | os.PathLike | None = None, data_root: str | os.PathLike | None = None) -> list[Path]:
    """Directories searched, in order (only ``path`` when it is given)."""
    if path:
        return [Path(path).expanduser()]
    out: list[Path] = []
    if imagenet_dir() is not None:
        out.append(imagenet_dir())
    root = resolve_data_root(data_root)
    if root is not None:
        out += [root / name for name in DIRS]
    return out


def load_imagenet_val(
    path: str | os.PathLike | None = None,
    data_root: str | os.PathLike | None = None,
    *,
    hub_cache_dir: str | os.PathLike | None = None,
) -> ImageSplit | None:
    """The ImageNet validation split as ``(PIL image, label)`` items, or None when there is no local copy.

    Raises :class:`MissingResourceError` when ``path`` is given but holds no usable copy.
    """
    if path and not Path(path).expanduser().is_dir():
        raise MissingResourceError(f"ImageNet control data {path} does not exist (or is not a directory)")
    hub_repos = () if path else HUB_REPOS
    for directory in candidates(path, data_root):
        if not directory.is_dir():
            continue
        split = _parquet_split(directory) or _folder_split(directory)
        if split is not None:
            log.info("ImageNet validation: %d images (%s)", len(split), split.source)
            return split
        if path:
            raise MissingResourceError(
                f"{directory} holds no ImageNet validation copy: expected data/validation-*.parquet or "
                f"val/<wordnet id>/*.JPEG for the {NUM_CLASSES} classes"
            )
    for repo in hub_repos:
        snapshot = hub_snapshot(repo, cache_dir=hub_cache_dir)
        if snapshot is not None:
            split = _parquet_split(snapshot)
            if split is not None:
                return split
    return None
