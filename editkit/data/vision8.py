"""vision8: the eight CLIP datasets of task arithmetic and the tauJp paper.

The registry (:data:`VISION8`) holds, per dataset: class names and prompt templates
(:mod:`editkit.data.clip_templates`), the Hugging Face repositories of its canonical parquet copy, and the directory
names looked for under a data root. :data:`VISION8_ORDER` is the paper's incremental
order (Cars, DTD, EuroSAT, GTSRB, MNIST, RESISC45, SUN397, SVHN).

Where a dataset is looked for, in order (first complete copy wins):

1. ``<data root>/<dir>`` for each of the dataset's directory names (data root =
   ``data_root`` argument, else ``$EDITKIT_DATA``), in any format the dataset
   accepts: a Hugging Face parquet copy, an image-folder tree, or a torchvision
   format (MNIST idx files, SVHN ``.mat``);
2. the local Hugging Face hub cache (``HF_HOME`` / ``HF_HUB_CACHE``, or
   ``hub_cache_dir``), for each of the dataset's repositories;
3. with ``download=True`` only: a download from the hub (parquet files only).

:func:`load_task` builds a :class:`~editkit.data.tasks.TaskData` whose splits apply the
backbone's preprocessing lazily, one image per ``__getitem__``; the validation split
is carved from train by :func:`editkit.data.tasks.validation_indices` (10%, <= 5000,
seed 0).

Registered here: the task source ``vision8`` (``source = "vision8:Cars"``) and the
head kind ``zero-shot`` (class names x the dataset's prompt templates).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from torch.utils.data import Dataset

from editkit.core.registry import Record
from editkit.errors import ConfigError, MissingResourceError
from editkit.settings import DATA_ENV, data_root as resolve_data_root
from editkit.data import TASK_SOURCES
from editkit.data.tasks import TaskData, validation_indices
from editkit.models import HEADS
from editkit.models.clip import ClipBackbone, ZeroShotHead, zero_shot_head
from editkit.util.hub import hf_hub_cache

from editkit.data import clip_templates as ct
from editkit.data.sources import (
    DataSource,
    ImageSplit,
    ParquetSource,
    detect_source,
    hub_snapshot,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubRepo:
    """A Hugging Face dataset repository; ``subdir`` is its config folder (e.g. ``cropped_digits``)."""

    repo_id: str
    subdir: str | None = None

    def allow_patterns(self) -> list[str]:
        prefix = f"{self.subdir}/" if self.subdir else ""
        return [f"{prefix}*train*.parquet", f"{prefix}*test*.parquet", f"{prefix}data/*train*.parquet",
                f"{prefix}data/*test*.parquet", "README.md"]


@dataclass(frozen=True)
class VisionDataset:
    """One vision8 dataset: names, prompts and where its data may live (the paper's
    fine-tuning epochs are recipe values: they live in ``scenarios/vision8.toml``).

    name: canonical name (``"Cars"``); aliases: other accepted spellings.
    classnames: CLIP class names in label order; templates: prompt patterns (``{}``).
    hub: Hugging Face dataset repositories holding the canonical parquet copy.
    dirs: directory names tried under a data root.
    formats: on-disk formats accepted locally (see ``editkit.data.sources.FORMATS``).
    folder_names: folder names of an image-folder copy aligned with ``classnames``
        (only where they differ in more than spelling, e.g. EuroSAT's ``SeaLake``).
    """

    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    hub: tuple[HubRepo, ...]
    dirs: tuple[str, ...]
    formats: tuple[str, ...] = ("parquet", "imagefolder")
    aliases: tuple[str, ...] = ()
    folder_names: tuple[str, ...] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classnames)


def _entry(name: str, hub: tuple[HubRepo, ...], dirs: tuple[str, ...], **kw: Any) -> VisionDataset:
    return VisionDataset(name=name, classnames=ct.CLASSNAMES[name], templates=ct.TEMPLATES[name], hub=hub, dirs=dirs, **kw)


VISION8: dict[str, VisionDataset] = {
    d.name: d
    for d in (
        _entry("Cars", (HubRepo("tanganke/stanford_cars"),),
               ("stanford_cars", "cars", "Cars", "stanford-cars", "StanfordCars"),
               aliases=("stanford_cars", "stanford-cars", "stanfordcars")),
        _entry("DTD", (HubRepo("tanganke/dtd"),), ("dtd", "DTD")),
        _entry("EuroSAT", (HubRepo("tanganke/eurosat"),), ("eurosat", "EuroSAT", "EuroSAT_splits"),
               folder_names=ct.EUROSAT_FOLDERS),
        _entry("GTSRB", (HubRepo("tanganke/gtsrb"),), ("gtsrb", "GTSRB")),
        _entry("MNIST", (HubRepo("ylecun/mnist", "mnist"), HubRepo("mnist", "mnist")), ("mnist", "MNIST"),
               formats=("parquet", "imagefolder", "mnist-idx")),
        _entry("RESISC45", (HubRepo("tanganke/resisc45"),), ("resisc45", "RESISC45", "NWPU-RESISC45")),
        _entry("SUN397", (HubRepo("tanganke/sun397"),), ("sun397", "SUN397")),
        _entry("SVHN", (HubRepo("ufldl-stanford/svhn", "cropped_digits"), HubRepo("svhn", "cropped_digits"),
                HubRepo("tanganke/svhn")),
               ("svhn", "SVHN"), formats=("parquet", "imagefolder", "svhn-mat")),
    )
}

#: The paper's incremental order (its §4.3).
VISION8_ORDER: list[str] = ["Cars", "DTD", "EuroSAT", "GTSRB", "MNIST", "RESISC45", "SUN397", "SVHN"]


def get_dataset(name: str) -> VisionDataset:
    """The registry entry for ``name`` (case-insensitive; aliases accepted)."""
    key = name.strip().lower()
    for entry in VISION8.values():
        if key == entry.name.lower() or key in entry.aliases:
            return entry
    raise ConfigError(f"unknown vision8 dataset {name!r}: known are {', '.join(VISION8_ORDER)}")


# --------------------------------------------------------------------------- locating data


def _candidate_dirs(entry: VisionDataset, root: Path) -> list[Path]:
    names = list(entry.dirs) + [repo.repo_id for repo in entry.hub]
    seen, out = set(), []
    for name in names:
        path = root / name
        if path not in seen:
            seen.add(path)
            out.append(path)
    return out


def _subdir_for(entry: VisionDataset) -> str | None:
    """Config folder of the first hub repo (local parquet copies may keep it)."""
    return entry.hub[0].subdir if entry.hub else None


def _layout_hint(entry: VisionDataset) -> str:
    parts = ["a Hugging Face parquet copy (data/train-*.parquet, data/test-*.parquet)"]
    if "imagefolder" in entry.formats:
        parts.append("an image-folder tree (train/<class>/*, test/<class>/*)")
    if "mnist-idx" in entry.formats:
        parts.append("MNIST idx files (MNIST/raw/*-ubyte[.gz])")
    if "svhn-mat" in entry.formats:
        parts.append("train_32x32.mat and test_32x32.mat")
    return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]


def locate(
    name: str,
    *,
    data_root: str | os.PathLike | None = None,
    hub_cache_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> DataSource:
    """The data source of dataset ``name`` (see the module docstring for the search order).

    Raises :class:`MissingResourceError` with one line naming what was searched and
    how to provide the data.
    """
    entry = get_dataset(name)
    root = resolve_data_root(data_root)
    problems: list[str] = []
    if root is not None:
        for directory in _candidate_dirs(entry, root):
            if not directory.is_dir():
                continue
            try:
                source = detect_source(directory, formats=entry.formats, subdir=_subdir_for(entry))
            except MissingResourceError as exc:
                problems.append(str(exc))
                continue
            if source is not None:
                log.info("%s: using %s", entry.name, source.describe())
                return source
            found = sorted(p.name for p in directory.iterdir())[:6]
            problems.append(f"{directory} holds none of the accepted layouts (it has: {', '.join(found) or 'nothing'})")
    hub_root = hf_hub_cache(hub_cache_dir)
    for repo in entry.hub:
        snapshot = hub_snapshot(
            repo.repo_id, cache_dir=hub_cache_dir, download=download, allow_patterns=repo.allow_patterns()
        )
        if snapshot is None:
            continue
        if ParquetSource.detect(snapshot, subdir=repo.subdir):
            source = ParquetSource(snapshot, subdir=repo.subdir, origin=f"{repo.repo_id} in the Hugging Face cache")
            log.info("%s: using %s", entry.name, source.describe())
            return source
        problems.append(f"the cached snapshot {snapshot} of {repo.repo_id} lacks train/test parquet files")

    dir_list = "{" + ",".join(entry.dirs) + "}"
    searched = (
        f"nothing under {root}/{dir_list}" if root is not None
        else f"no data root is set (neither --data-root nor {DATA_ENV})"
    )
    repos = " / ".join(r.repo_id for r in entry.hub)
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise MissingResourceError(
        f"dataset {entry.name} not found: {searched}, and {repos} not in the Hugging Face cache "
        f"{hub_root}{detail}. Provide it with --data-root DIR (or {DATA_ENV}=DIR) where DIR/{entry.dirs[0]} "
        f"holds {_layout_hint(entry)}; or fetch the parquet copy where there is internet "
        f"(huggingface-cli download {entry.hub[0].repo_id} --repo-type dataset) and point HF_HOME at that cache"
    )


# --------------------------------------------------------------------------- class names


def _norm(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


def match_classnames(source_names: Sequence[str] | None, entry: VisionDataset, num_labels: int) -> list[str]:
    """CLIP class names in the *source's* label order.

    ``source_names[i]`` is what the source calls label ``i`` (parquet ClassLabel
    names, image-folder directory names) or None. Rules, first that applies:
    no names -> the registry's names; same names up to case/punctuation, in order ->
    the registry's; integer names (``"00007"``) -> the registry's name at that index;
    a permutation of the registry's names (or of ``folder_names``) -> mapped one by
    one; otherwise the source's own names (underscores -> spaces), with a warning.
    """
    canonical = list(entry.classnames)
    if source_names is None:
        if num_labels > len(canonical):
            raise ConfigError(
                f"{entry.name}: labels go up to {num_labels - 1} but the registry has {len(canonical)} class names"
            )
        return canonical
    names = list(source_names)
    if [_norm(n) for n in names] == [_norm(c) for c in canonical]:
        return canonical
    if names and all(n.strip().isdigit() and int(n) < len(canonical) for n in names):
        return [canonical[int(n)] for n in names]  # e.g. GTSRB folders 00000..00042
    lookup = {_norm(c): c for c in canonical}
    if entry.folder_names:
        lookup.update({_norm(f): c for f, c in zip(entry.folder_names, canonical)})
    # SUN397's own label strings look like "/a/apartment_building/outdoor"
    mapped = [lookup.get(_norm(n)) or lookup.get(_norm(re.sub(r"^/?[a-z]/", "", n))) for n in names]
    if all(m is not None for m in mapped) and len(set(mapped)) == len(mapped):
        if len(mapped) != len(canonical):
            log.warning("%s: the source has %d of the %d classes", entry.name, len(mapped), len(canonical))
        return [str(m) for m in mapped]
    log.warning(
        "%s: the source's class names do not match the CLIP class names; using the source's own names", entry.name
    )
    return [n.replace("_", " ") for n in names]


# --------------------------------------------------------------------------- task data


class TransformedSubset(Dataset):
    """``(transform(image), label)`` for ``indices`` of an :class:`ImageSplit`, computed per item.

    ``targets`` (int64 numpy array) lists the subset's labels without touching images.
    """

    def __init__(self, base: ImageSplit, indices: np.ndarray | None, transform: Callable | None) -> None:
        self.base = base
        self.indices = np.arange(len(base)) if indices is None else np.asarray(indices, dtype=np.int64)
        self.transform = transform
        self.targets = base.targets[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image, label = self.base[int(self.indices[index])]
        return (self.transform(image) if self.transform is not None else image), label

    def input(self, index: int) -> Any:
        """The transformed image of item ``index`` without its label (for unlabeled views)."""
        image = self.base.image(int(self.indices[index]))
        return self.transform(image) if self.transform is not None else image


def load_task(
    name: str,
    backbone: Any,
    *,
    data_root: str | os.PathLike | None = None,
    augment: bool = False,
    hub_cache_dir: str | os.PathLike | None = None,
    download: bool = False,
    source: DataSource | None = None,
) -> TaskData:
    """A vision8 dataset as :class:`~editkit.data.tasks.TaskData` with lazy CLIP preprocessing.

    backbone: provides ``preprocess`` (one PIL image -> tensor); a
        :class:`~editkit.models.clip.ClipBackbone` also provides ``val_preprocess``
        and ``train_preprocess``. Validation and test always use the eval transform;
        train uses the train-time augmentation when ``augment`` is true.
    source: use this data source instead of searching (see :func:`locate`).

    ``TaskData.classes`` are the CLIP class names in the source's label order.
    """
    entry = get_dataset(name)
    src = source or locate(entry.name, data_root=data_root, hub_cache_dir=hub_cache_dir, download=download)
    splits = src.splits()
    train, test = splits["train"], splits["test"]
    num_labels = int(max(train.targets.max(initial=-1), test.targets.max(initial=-1))) + 1
    classes = match_classnames(src.class_names(), entry, num_labels)
    if num_labels > len(classes):
        raise ConfigError(
            f"{entry.name} ({src.describe()}): labels go up to {num_labels - 1} but there are {len(classes)} class names"
        )
    eval_tf = getattr(backbone, "val_preprocess", None) or backbone.preprocess
    train_tf = (getattr(backbone, "train_preprocess", None) or backbone.preprocess) if augment else eval_tf
    train_idx, val_idx = validation_indices(len(train))
    log.info(
        "%s: %d train / %d validation / %d test images, %d classes (%s)",
        entry.name, len(train_idx), len(val_idx), len(test), len(classes), src.describe(),
    )
    return TaskData(
        name=entry.name,
        classes=classes,
        train=TransformedSubset(train, train_idx, train_tf),
        val=TransformedSubset(train, val_idx, eval_tf),
        test=TransformedSubset(test, None, eval_tf),
    )


GENERIC_TEMPLATES: tuple[str, ...] = ("a photo of a {}.",)


def zero_shot_head_for_task(
    backbone: ClipBackbone,
    task: Any,
    *,
    dataset: str | None = None,
    templates: Sequence[str] | None = None,
    **kwargs: Any,
) -> ZeroShotHead:
    """The frozen zero-shot head of a loaded task (``TaskData``: ``name`` and ``classes``).

    Templates: ``templates`` if given, else the vision8 registry's for ``dataset``
    (default: the task's name) when it names a vision8 dataset, else the generic
    ``"a photo of a {}."``. Keyword arguments go to :func:`zero_shot_head`
    (``cache``, ``cache_root``).
    """
    if not isinstance(backbone, ClipBackbone):
        raise ConfigError(f"zero-shot heads need a CLIP backbone, got {getattr(backbone, 'name', backbone)!r}")
    key = dataset or task.name
    if templates is None:
        try:
            entry = get_dataset(key)
            templates, key = entry.templates, entry.name
        except ConfigError:
            if key.lower() == "imagenet":
                templates = ct.imagenet_templates()
            else:
                log.info("no prompt templates registered for %r: using %r", key, GENERIC_TEMPLATES[0])
                templates = GENERIC_TEMPLATES
    return zero_shot_head(backbone, list(task.classes), list(templates), dataset=key, **kwargs)


# --------------------------------------------------------------------------- registrations


def _source(name: str, dataset: str, backbone: Any, data_root: str | None = None, augment: bool = True,
            hub_cache_dir: str | None = None, download: bool = False) -> TaskData:
    """One of the eight datasets as the scenario task ``name``, preprocessed lazily per image."""
    task = load_task(dataset, backbone, data_root=data_root, augment=bool(augment), hub_cache_dir=hub_cache_dir,
                     download=bool(download))
    return dataclasses.replace(task, name=name)


def _source_check(name: str, dataset: str, data_root: str | None = None, hub_cache_dir: str | None = None,
                  download: bool = False, **_: Any) -> list[str]:
    try:
        locate(dataset, data_root=data_root, hub_cache_dir=hub_cache_dir, download=bool(download))
    except MissingResourceError as exc:
        return [str(exc)]
    return []


TASK_SOURCES.register("vision8", Record.of(_source, check=_source_check, help={
    "data_root": f"directory holding the datasets (default ${DATA_ENV})",
    "augment": "open_clip's train-time transform on train batches (the paper's recipe)",
    "hub_cache_dir": "Hugging Face hub cache to look in (default: the hub's own)",
    "download": "fetch the parquet copy from the hub when reachable"}))


def _zero_shot_kind(backbone: ClipBackbone, task: TaskData, dataset: str, seed: int) -> ZeroShotHead:
    return zero_shot_head_for_task(backbone, task, dataset=dataset)


HEADS.register("zero-shot", Record.of(_zero_shot_kind))
