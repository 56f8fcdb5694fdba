"""A user's images as a task: an image folder (``source = "imagefolder:PATH"``) or a table's image column.

Folder layouts (PATH relative to the scenario file, or absolute), first that applies:

- ``PATH/train/<class>/*`` with ``PATH/test/<class>/*`` (or ``val/``; with both, ``val/`` is the
  validation split, else validation is 10% of train as for every task);
- ``PATH/train/<class>/*`` alone, or ``PATH/<class>/*``: a test split is held out of it, per class,
  ``test_fraction`` of each class drawn with ``seed`` (:func:`~editkit.data.tasks.stratified_holdout`).

An image is any file whose suffix PIL reads (``PIL.Image.registered_extensions``), in any mode
(converted to RGB); other files and hidden ones are skipped. Class names are the train folders'
names, in sorted order; the test split uses the same indices, and a test class that train lacks is
refused.

Speed: every image is decoded once. The pixels are cached as one ``.npz`` under
``$EDITKIT_CACHE/arrays/user/`` keyed by the folder's state (file names, sizes, modification times:
:func:`~editkit.data.tables.fingerprint`), and each run preprocesses them with the backbone in
batches of equal-sized images, as the packaged sources do with their arrays; so a user's folder
costs what an embedded dataset costs per example once cached.

:func:`folder_problems` is the source's check: one line per problem (a missing path, a class folder
with no image, an unreadable image named, a test class absent from train, fewer than two classes),
reading image headers only and writing nothing.
"""

from __future__ import annotations

import functools
import io
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.data.sources import TEST_DIR_NAMES
from editkit.data.tables import file_states, fingerprint
from editkit.data.tasks import TaskData, split_roles, stratified_holdout, tensor_task
from editkit.data.text_classification import stratified_choice
from editkit.errors import DataError
from editkit.settings import cache_dir
from editkit.util.atomic import atomic_path
from editkit.util.paths import always_a_path

log = logging.getLogger(__name__)

TEST_FRACTION = 0.2
_CACHE_FORMAT = 2
#: Decoded images: one uint8 ``(N, H, W, 3)`` array when they share a shape, else a list of ``(H, W, 3)`` arrays.
Pixels = np.ndarray | list


@functools.lru_cache(maxsize=1)
def image_suffixes() -> frozenset[str]:
    """File suffixes PIL opens (lower case)."""
    from PIL import Image

    return frozenset(Image.registered_extensions())


def _visible(name: str) -> bool:
    return not name.startswith(".")


def class_dirs(directory: Path) -> list[Path]:
    """The class folders of a split folder, sorted by name."""
    return sorted(p for p in directory.iterdir() if p.is_dir() and _visible(p.name))


def split_dirs(root: Path) -> dict[str, Path]:
    """The user's split folders by name: ``train`` and any test / validation folder beside it, else the root
    itself under the name ``""`` (a test split is then held out)."""
    if not (root / "train").is_dir():
        return {"": root}
    return {"train": root / "train", **{name: root / name for name in TEST_DIR_NAMES if (root / name).is_dir()}}


@dataclass
class FolderScan:
    """An image folder as one walk of it finds it: ``files[(split, class)]`` are the image files of a class
    folder (any depth below it, sorted), ``others`` its other visible files; ``key`` identifies the folder's
    state (the pixel cache's name)."""

    root: Path
    key: str
    splits: dict[str, Path]
    classes: dict[str, list[str]]
    files: dict[tuple[str, str], list[str]]
    others: dict[tuple[str, str], list[str]]

    @property
    def roles(self) -> dict[str, str]:
        return {"train": ""} if "" in self.splits else split_roles(self.splits)


def scan_folder(root: Path) -> FolderScan:
    """Walk ``root`` once (names, sizes, times: no file is opened)."""
    states = file_states(root)
    splits = split_dirs(root)
    classes = {name: [d.name for d in class_dirs(folder)] for name, folder in splits.items()}
    files: dict[tuple[str, str], list[str]] = {(s, c): [] for s, names in classes.items() for c in names}
    others: dict[tuple[str, str], list[str]] = {key: [] for key in files}
    depth = 0 if "" in splits else 1  # where the class folder sits in a relative name
    suffixes, base = image_suffixes(), str(root)
    for name, _, _ in states:  # names as strings: a Path per file costs more than the rest of the walk
        parts = name.split(os.sep)
        key = (parts[0] if depth else "", parts[depth])
        if len(parts) < depth + 2 or key not in files or not all(_visible(part) for part in parts):
            continue
        if os.path.splitext(name)[1].lower() in suffixes:
            files[key].append(os.path.join(base, name))
        else:
            others[key].append(parts[-1])
    return FolderScan(root, fingerprint(root, states), splits, classes, files, others)


# --------------------------------------------------------------------------- checks


def _unreadable(files: Sequence[str]) -> list[tuple[str, str]]:
    """(file, reason) of every file PIL cannot identify (headers only: nothing is decoded)."""
    from PIL import Image

    bad = []
    for file in files:
        try:
            with Image.open(file):
                pass
        except Exception as exc:  # PIL raises several kinds for a file that is not an image
            bad.append((file, (str(exc).splitlines() or [type(exc).__name__])[0]))
    return bad


def _class_problems(directory: Path, files: list[str], others: list[str], *, headers: bool) -> list[str]:
    if not files:
        return [f"class folder {directory} holds no image file (it holds: {', '.join(sorted(others)[:5]) or 'nothing'})"]
    bad = _unreadable(files) if headers else []
    if not bad:
        return []
    more = f"; {len(bad) - 1} more unreadable image(s) in {directory}" if len(bad) > 1 else ""
    return [f"{bad[0][0]} is not a readable image ({bad[0][1]}){more}"]


def folder_problems(root: str | Path, scan: FolderScan | None = None) -> list[str]:
    """One line per problem of the image folder ``root`` (see the module docstring); empty when it makes a
    task. Image headers are read unless the folder's pixels are cached already (decoded before)."""
    root = Path(root)
    if not root.is_dir():
        return [f"image folder {root} does not exist" if not root.exists() else f"{root} is not a folder"]
    scan = scan or scan_folder(root)
    headers = not _cache_path(scan.key).is_file()
    problems = [line for (split, name), files in scan.files.items()
                for line in _class_problems(scan.splits[split] / name, files, scan.others[(split, name)],
                                            headers=headers)]
    roles = scan.roles
    train = scan.classes[roles["train"]]
    if len(train) < 2:
        problems.append(f"image folder {scan.splits[roles['train']]} has {len(train)} class folder(s) "
                        f"({', '.join(train) or 'none'}): a task needs two or more")
    for role in ("val", "test"):
        if role in roles:
            problems += [f"class {c!r} of {scan.splits[roles[role]]} is not a class of train "
                         f"(train's classes: {', '.join(train)})" for c in scan.classes[roles[role]] if c not in train]
    return problems


# --------------------------------------------------------------------------- decoding and the cache


def decode(image: Any, base: Path | None = None) -> np.ndarray:
    """One image as uint8 RGB ``(H, W, 3)``: a file path (relative to ``base``), ``{"bytes", "path"}`` as
    Hugging Face stores images, raw bytes, or a PIL image. A file PIL cannot read is refused by name."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    source = io.BytesIO(image) if isinstance(image, bytes) else Path(base or ".") / str(image)
    try:
        with Image.open(source) as opened:
            return np.asarray(opened.convert("RGB"))
    except Exception as exc:  # unreadable or truncated file
        what = source if isinstance(source, Path) else "an image's bytes"
        raise DataError(f"{what} is not a readable image ({(str(exc).splitlines() or [''])[0]})") from None


def _cache_path(key: str) -> Path:
    return cache_dir() / "arrays" / "user" / f"{key}.npz"


def _as_pixels(decoded: list[np.ndarray]) -> Pixels:
    """One ``(N, H, W, 3)`` array when every image has one shape (the common case), else the list."""
    return np.stack(decoded) if decoded and len({image.shape for image in decoded}) == 1 else decoded


def _save_pixels(path: Path, pixels: Pixels) -> None:
    """The array as it is; a list flattened end to end, with each image's shape."""
    arrays = ({"images": pixels} if isinstance(pixels, np.ndarray) else
              {"shapes": np.array([p.shape for p in pixels], dtype=np.int64).reshape(-1, 3),
               "pixels": np.concatenate([p.reshape(-1) for p in pixels])})
    with atomic_path(path, durable=False) as tmp, open(tmp, "wb") as handle:
        np.savez(handle, format=np.int64(_CACHE_FORMAT), **arrays)


def _load_pixels(path: Path, count: int) -> Pixels | None:
    try:
        with np.load(path, allow_pickle=False) as cached:
            if int(cached["format"]) != _CACHE_FORMAT:
                return None
            if "images" in cached:
                images = cached["images"]
                return images if len(images) == count else None
            shapes, flat = cached["shapes"], cached["pixels"]
    except Exception as exc:  # a damaged cache file is decoded again, never fatal
        log.warning("ignoring unreadable cache file %s (%s)", path, exc)
        return None
    if len(shapes) != count:
        return None
    ends = np.cumsum([int(np.prod(s)) for s in shapes])
    return [flat[end - int(np.prod(s)):end].reshape(s) for s, end in zip(shapes, ends)]


def cached_pixels(key: str, images: Sequence[Any], base: Path | None = None) -> Pixels:
    """Every image of ``images`` decoded (:func:`decode`), read from the cache file of ``key`` when it holds
    them, else decoded once and cached: one array when the images share a shape, else a list."""
    path = _cache_path(key)
    if path.is_file() and (pixels := _load_pixels(path, len(images))) is not None:
        log.debug("read %d decoded images from %s", len(pixels), path)
        return pixels
    log.info("decoding %d images (once; cached as %s)", len(images), path)
    pixels = _as_pixels([decode(image, base) for image in images])
    _save_pixels(path, pixels)
    return pixels


def preprocess(backbone: Any, pixels: Pixels, indices: Sequence[int]) -> torch.Tensor:
    """The backbone's inputs for images ``indices`` of ``pixels``: images of one size go through its batch
    preprocessing together (``Backbone.preprocess_arrays``), so mixed sizes cost no per-image pass."""
    if isinstance(pixels, np.ndarray):
        return backbone.preprocess_arrays(pixels[np.asarray(indices, dtype=np.int64)])
    groups: dict[tuple[int, ...], list[int]] = {}
    for place, index in enumerate(indices):
        groups.setdefault(pixels[index].shape, []).append(place)
    out: torch.Tensor | None = None
    for places in groups.values():
        inputs = backbone.preprocess_arrays(np.stack([pixels[indices[p]] for p in places]))
        if out is None:
            out = inputs.new_empty((len(indices), *inputs.shape[1:]))
        out[torch.tensor(places)] = inputs
    if out is None:
        raise DataError("no images to preprocess")
    return out


# --------------------------------------------------------------------------- the task


def image_task(name: str, backbone: Any, images: Sequence[Any], labels: Sequence[int], roles: Mapping[str, list[int]],
               classes: list[str], *, key: str, base: Path | None = None, train_size: int | None = None,
               eval_size: int | None = None, seed: int = 0) -> TaskData:
    """The task of ``images`` (what :func:`decode` reads) labelled ``labels`` (indices into ``classes``):
    ``roles`` gives each split's indices (``train``, ``test``, optionally ``val``); ``train_size`` /
    ``eval_size`` keep at most that many of the train / each evaluation split, classes in proportion."""
    pixels = cached_pixels(key, images, base)
    sizes = {"train": train_size, "val": eval_size, "test": eval_size}
    splits = {}
    for role, members in roles.items():
        kept = [members[i] for i in stratified_choice([labels[m] for m in members], sizes[role], seed)]
        splits[role] = (preprocess(backbone, pixels, kept),
                        torch.tensor([labels[i] for i in kept], dtype=torch.long))
    log.info("%s: %s images, %d classes", name, " / ".join(f"{len(y)} {r}" for r, (_, y) in splits.items()),
             len(classes))
    return tensor_task(name, classes, *splits["train"], *splits["test"], val=splits.get("val"))


def held_out_roles(roles: Mapping[str, list[int]], labels: Sequence[int], test_fraction: float,
                   seed: int) -> dict[str, list[int]]:
    """``roles`` with a test split held out of train when it has none (stratified, seeded)."""
    if "test" in roles:
        return dict(roles)
    train = roles["train"]
    kept, held = stratified_holdout([labels[i] for i in train], test_fraction, seed)
    return {"train": [train[i] for i in kept], "test": [train[i] for i in held]}


def folder_listing(scan: FolderScan) -> tuple[list[str], list[int], dict[str, list[int]], list[str]]:
    """(files, labels, indices by role, classes) of an image folder that :func:`folder_problems` accepts."""
    roles = scan.roles
    classes = scan.classes[roles["train"]]
    files: list[str] = []
    labels: list[int] = []
    by_role: dict[str, list[int]] = {}
    for role, split in roles.items():
        by_role[role] = []
        for label, class_name in enumerate(classes):
            found = scan.files.get((split, class_name), [])
            by_role[role] += range(len(files), len(files) + len(found))
            files += found
            labels += [label] * len(found)
    return files, labels, by_role, classes


def _refuse_problems(problems: list[str]) -> None:
    if problems:
        raise DataError("\n".join(problems))


def _folder_task(name: str, dataset: str, backbone: Any, test_fraction: float = TEST_FRACTION, seed: int = 0,
                 train_size: int | None = None, eval_size: int | None = None) -> TaskData:
    """The image folder ``dataset`` as the task ``name``, decoded once and preprocessed up front."""
    root = Path(dataset)
    scan = scan_folder(root) if root.is_dir() else None
    _refuse_problems(folder_problems(root, scan))
    files, labels, roles, classes = folder_listing(scan)
    return image_task(name, backbone, files, labels, held_out_roles(roles, labels, test_fraction, seed), classes,
                      key=scan.key, train_size=train_size, eval_size=eval_size, seed=seed)


def _folder_check(name: str, dataset: str, test_fraction: float = TEST_FRACTION, seed: int = 0,
                  train_size: int | None = None, eval_size: int | None = None) -> list[str]:
    return [f"task {name!r}: {line}" for line in folder_problems(Path(dataset))]


#: Options every user image source takes (an image folder, a table's image column).
IMAGE_HELP = {"test_fraction": "share of each class held out as the test split when the data has none",
              "seed": "seed of that held-out split and of the size limits' draws",
              "train_size": "at most this many train images, classes in proportion (default: all)",
              "eval_size": "at most this many validation / test images each, classes in proportion (default: all)"}
TASK_SOURCES.register("imagefolder", Record.of(_folder_task, check=_folder_check, help=IMAGE_HELP,
                                               paths={"dataset": always_a_path}))
