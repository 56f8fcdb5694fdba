"""Where image-classification data comes from: on-disk formats as (PIL image, label) splits.

Every source exposes ``splits() -> {"train": ImageSplit, "test": ImageSplit}`` whose
items are ``(PIL.Image, int)`` (decoded lazily, one image per ``__getitem__``) and
``class_names()`` (the names the source itself gives its labels, or None). Formats:

``ParquetSource``
    The Hugging Face parquet layout (what ``datasets.push_to_hub`` writes and what
    FusionBench's ``tanganke/<name>`` copies use): ``data/train-*.parquet``,
    ``data/test-*.parquet`` (also ``<split>-*.parquet``, ``<split>/*.parquet`` or
    ``*-<split>.parquet``, optionally below a config sub-directory such as
    ``cropped_digits/``), an image column (struct ``{bytes, path}``) and an integer
    label column. Class names come from the ``huggingface`` schema metadata
    (``ClassLabel`` names) when present. Read with pyarrow; image bytes stay in Arrow
    memory (no per-image Python objects) until an item is asked for.
``ImageFolderSource``
    ``root/train/<class>/*.png|jpg``, ``root/test/<class>/*`` (``val/`` accepted when
    there is no ``test/``), read the way torchvision's ``ImageFolder`` reads it (its
    ``make_dataset`` and RGB ``default_loader``); the test split uses the train split's
    class order, so a class missing from test cannot shift labels.
``MnistIdxSource``
    MNIST idx files (torchvision's layout ``root/MNIST/raw/`` or the four files in
    one directory; ``.gz`` or not), read by :func:`read_idx`, the one idx reader
    (Fashion-MNIST's packaged copy goes through it too).
``SvhnMatSource``
    SVHN's ``train_32x32.mat`` / ``test_32x32.mat`` (torchvision's layout; label 10 -> 0).

:func:`hub_snapshot` finds a dataset repository in the local Hugging Face hub cache
(never touching the network unless ``download=True``); :func:`detect_source` tells
which format a directory holds. Nothing here knows about particular datasets: the
vision8 registry (``editkit.data.vision8``) maps names to places and formats.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset

from editkit.errors import MissingResourceError
from editkit.settings import offline_mode
from editkit.util.hub import hf_endpoint, hf_hub_cache, host_reachable

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
IMAGE_COLUMNS = ("image", "img", "images", "pixel_values")
LABEL_COLUMNS = ("label", "labels", "fine_label", "target", "class")
TEST_DIR_NAMES = ("test", "val", "validation")


class ImageSplit(Dataset):
    """One split: ``(PIL.Image, int)`` items, labels up front in ``targets`` (int64 array).

    ``get_image(i)`` decodes image ``i``; ``source`` says where the split lives.
    """

    def __init__(self, targets: np.ndarray, get_image: Callable[[int], Any], *, source: str) -> None:
        self.targets = np.asarray(targets, dtype=np.int64)
        self._get_image = get_image
        self.source = source

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        index = self._check(index)
        return self._get_image(index), int(self.targets[index])

    def image(self, index: int) -> Any:
        """Image ``index`` alone (its label is not read)."""
        return self._get_image(self._check(index))

    def _check(self, index: int) -> int:
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return index

    def __repr__(self) -> str:
        return f"ImageSplit({len(self)} images from {self.source})"


class DataSource(ABC):
    """A dataset on disk in one format. ``splits()`` loads lazily and caches.

    Each format says once, in :meth:`problem`, what a complete copy needs; that one
    check both tells formats apart (:meth:`detect`) and refuses an incomplete copy at
    construction. ``layout`` is what a format needs besides the directory to find
    its files (the parquet config sub-directory and split names).
    """

    kind: str = "?"

    def __init__(self, location: str | os.PathLike, **layout: Any) -> None:
        self.location = Path(location)
        problem = self.problem(self.location, **layout)
        if problem is not None:
            raise MissingResourceError(problem)
        self._splits: dict[str, ImageSplit] | None = None

    @classmethod
    @abstractmethod
    def problem(cls, root: Path, **layout: Any) -> str | None:
        """Why ``root`` holds no complete copy in this format (train and test), or None if it does."""

    @classmethod
    def detect(cls, root: str | os.PathLike, **layout: Any) -> bool:
        """Whether ``root`` holds a complete copy in this format."""
        return cls.problem(Path(root), **layout) is None

    def splits(self) -> dict[str, ImageSplit]:
        """``{"train": ImageSplit, "test": ImageSplit}``, loaded on first call."""
        if self._splits is None:
            self._splits = self._load()
        return self._splits

    def class_names(self) -> list[str] | None:
        """Label names as the source stores them (index = label), or None if it has none."""
        return None

    def describe(self) -> str:
        return f"{self.kind} data at {self.location}"

    @abstractmethod
    def _load(self) -> dict[str, ImageSplit]: ...


# --------------------------------------------------------------------------- parquet


def parquet_files(root: Path, split: str, subdir: str | None = None) -> list[Path]:
    """The parquet files of ``split`` under ``root`` in the Hugging Face layouts (sorted)."""
    bases = ([root / subdir, root / subdir / "data"] if subdir else []) + [root / "data", root]
    patterns = (f"{split}-*.parquet", f"{split}.parquet", f"{split}/*.parquet", f"*-{split}.parquet", f"*-{split}-*.parquet")
    for base in bases:
        if not base.is_dir():
            continue
        for pattern in patterns:
            found = sorted(p for p in base.glob(pattern) if p.is_file())
            if found:
                return found
    return []


def _hf_label_names(metadata: dict[bytes, bytes] | None, label_column: str) -> list[str] | None:
    """ClassLabel names of ``label_column`` from the ``huggingface`` schema metadata."""
    if not metadata or b"huggingface" not in metadata:
        return None
    try:
        info = json.loads(metadata[b"huggingface"].decode())
    except (ValueError, UnicodeDecodeError):
        return None
    features = (info.get("info") or {}).get("features") or info.get("features") or {}
    feature = features.get(label_column) or {}
    names = feature.get("names")
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        return names
    return None


class _ChunkedBinary:
    """Random access into a (possibly multi-chunk, > 2 GiB) Arrow binary column."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks])

    def __getitem__(self, index: int) -> Any:
        chunk = int(np.searchsorted(self.starts, index, side="right") - 1)
        return self.chunks[chunk][index - int(self.starts[chunk])].as_py()


class _ParquetImages:
    """Decodes row ``i`` of a parquet image column (embedded bytes, else a relative path)."""

    def __init__(self, data: _ChunkedBinary, paths: _ChunkedBinary | None, base: Path) -> None:
        self.data, self.paths, self.base = data, paths, base

    def __call__(self, index: int) -> Any:
        from PIL import Image

        raw = self.data[index]
        if raw is None and self.paths is not None and self.paths[index]:
            return Image.open(self.base / self.paths[index])
        return Image.open(io.BytesIO(raw))


class _ArrayImages:
    """Image ``i`` of a uint8 array ``(N, H, W[, C])`` as a PIL image."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __call__(self, index: int) -> Any:
        from PIL import Image

        return Image.fromarray(self.array[index])


class _FileImages:
    """Image ``i`` of a list of files, read with ``loader`` (torchvision's RGB PIL loader)."""

    def __init__(self, paths: list[str], loader: Callable[[str], Any]) -> None:
        self.paths, self.loader = paths, loader

    def __call__(self, index: int) -> Any:
        return self.loader(self.paths[index])


class ParquetSource(DataSource):
    """A Hugging Face parquet copy of an image dataset (see the module docstring)."""

    kind = "parquet"

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        subdir: str | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
        origin: str | None = None,
        split_names: tuple[str, ...] = SPLITS,
    ) -> None:
        super().__init__(root, subdir=subdir, split_names=split_names)
        self.subdir = subdir
        self.image_column = image_column
        self.label_column = label_column
        self.origin = origin
        self.split_names = tuple(split_names)
        self.files = {split: parquet_files(self.location, split, subdir) for split in self.split_names}
        self._names: list[str] | None = None
        self._columns: tuple[str, str] | None = None

    @classmethod
    def problem(cls, root: Path, subdir: str | None = None, split_names: tuple[str, ...] = SPLITS) -> str | None:
        missing = [split for split in split_names if not parquet_files(root, split, subdir)]
        if not missing:
            return None
        return (f"no {' / '.join(missing)} parquet files under {root}{f'/{subdir}' if subdir else ''} "
                "(expected data/<split>-*.parquet)")

    def describe(self) -> str:
        where = self.origin or str(self.location)
        return f"parquet ({where})"

    def _resolve_columns(self) -> tuple[str, str]:
        if self._columns is not None:
            return self._columns
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pq.read_schema(self.files[self.split_names[0]][0])
        names = schema.names
        image = self.image_column or next((c for c in IMAGE_COLUMNS if c in names), None)
        if image is None:
            image = next(
                (f.name for f in schema if pa.types.is_struct(f.type) and f.type.get_field_index("bytes") >= 0), None
            )
        label = self.label_column or next((c for c in LABEL_COLUMNS if c in names), None)
        if label is None:
            label = next((f.name for f in schema if pa.types.is_integer(f.type)), None)
        if image is None or label is None or image not in names or label not in names:
            raise MissingResourceError(
                f"parquet files under {self.location} have columns {names}: need an image column "
                f"(struct with bytes, e.g. 'image') and an integer label column (e.g. 'label')"
            )
        self._columns = (image, label)
        self._names = _hf_label_names(schema.metadata, label)
        return self._columns

    def class_names(self) -> list[str] | None:
        self._resolve_columns()
        return self._names

    def _load_split(self, split: str) -> ImageSplit:
        import pyarrow as pa
        import pyarrow.parquet as pq

        image_col, label_col = self._resolve_columns()
        files = self.files[split]
        tables = [pq.read_table(f, columns=[image_col, label_col], memory_map=True) for f in files]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        labels = table.column(label_col).to_numpy()
        images = table.column(image_col)
        if pa.types.is_struct(images.type):
            data = _ChunkedBinary([c.field("bytes") for c in images.chunks])
            paths = (
                _ChunkedBinary([c.field("path") for c in images.chunks])
                if images.type.get_field_index("path") >= 0 else None
            )
        else:
            data, paths = _ChunkedBinary(list(images.chunks)), None
        get_image = _ParquetImages(data, paths, files[0].parent)
        log.debug("read %d %s rows from %d parquet file(s) under %s", len(labels), split, len(files), self.location)
        return ImageSplit(labels, get_image, source=f"{self.describe()} {split}")

    def _load(self) -> dict[str, ImageSplit]:
        return {split: self._load_split(split) for split in self.split_names}


# --------------------------------------------------------------------------- image folders


def _find_test_dir(root: Path) -> Path | None:
    return next((root / name for name in TEST_DIR_NAMES if (root / name).is_dir()), None)


class ImageFolderSource(DataSource):
    """``root/train/<class>/*`` and ``root/test/<class>/*`` (torchvision ``ImageFolder``)."""

    kind = "imagefolder"

    def __init__(self, root: str | os.PathLike) -> None:
        super().__init__(root)
        self._classes: list[str] | None = None

    @classmethod
    def problem(cls, root: Path) -> str | None:
        train, missing = root / "train", []
        if not train.is_dir():
            missing.append("train/")
        elif not any(p.is_dir() for p in train.iterdir()):
            missing.append("class directories in train/")
        if _find_test_dir(root) is None:
            missing.append("test/ (or val/)")
        return f"image folder {root} lacks {' and '.join(missing)}" if missing else None

    def class_names(self) -> list[str]:
        if self._classes is None:
            self._classes = sorted(p.name for p in (self.location / "train").iterdir() if p.is_dir())
        return self._classes

    def _load(self) -> dict[str, ImageSplit]:
        from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, make_dataset

        classes = self.class_names()
        mapping = {name: i for i, name in enumerate(classes)}
        out = {}
        test_dir = _find_test_dir(self.location)
        for split, directory in (("train", self.location / "train"), ("test", test_dir)):
            # the train split's class order for both splits, so labels agree
            samples = make_dataset(str(directory), mapping, extensions=IMG_EXTENSIONS, allow_empty=True)
            if not samples:
                raise MissingResourceError(f"image folder {directory} holds no images")
            out[split] = ImageSplit(
                np.asarray([label for _, label in samples]),
                _FileImages([path for path, _ in samples], default_loader),
                source=f"image folder {directory}",
            )
        if test_dir.name != "test":
            log.info("%s has no test/ directory: using %s/ as the test split", self.location, test_dir.name)
        return out


# --------------------------------------------------------------------------- MNIST idx

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def parse_idx(data: bytes) -> np.ndarray:
    """Decode an idx file (the MNIST format): magic ``00 00 <type> <ndim>``, then
    ``ndim`` big-endian uint32 sizes, then the values row-major.

    Images have magic 2051 (ubyte, 3 dims), labels 2049 (ubyte, 1 dim). Returns a
    writable array in native byte order. Raises ValueError on anything malformed,
    a truncated payload included (a half-downloaded file must not pass as data).
    """
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"not an idx file (magic bytes {data[:4]!r})")
    dtype, ndim = _IDX_DTYPES[data[2]], data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError("idx header truncated")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    count = int(np.prod(dims, dtype=np.int64))
    if len(data) - header != count * dtype.itemsize:
        raise ValueError(
            f"idx payload is {len(data) - header} bytes, dims {dims} need {count * dtype.itemsize}"
        )
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def encode_idx(array: np.ndarray) -> bytes:
    """An unsigned-byte array as an idx file's bytes (what :func:`parse_idx` reads back), the layout
    torchvision's MNIST-family datasets read from ``<root>/<Name>/raw/``."""
    if array.dtype != np.uint8 or not 1 <= array.ndim <= 255:
        raise ValueError(f"idx files here hold uint8 arrays of 1 to 255 dimensions, got {array.dtype} {array.shape}")
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + np.ascontiguousarray(array).tobytes()


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an idx file, gzip-compressed if its name ends in ``.gz`` (see :func:`parse_idx`)."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return parse_idx(raw)


def _idx_file(directory: Path, stem: str) -> Path | None:
    return next((directory / name for name in (stem, stem + ".gz") if (directory / name).is_file()), None)


class MnistIdxSource(DataSource):
    """MNIST idx files: ``root/MNIST/raw/``, ``root/raw/`` or directly in ``root``."""

    kind = "mnist-idx"

    def __init__(self, root: str | os.PathLike) -> None:
        super().__init__(root)
        self.raw_dir = self.find_dir(self.location)

    @staticmethod
    def find_dir(root: Path) -> Path | None:
        """The first of ``root/MNIST/raw``, ``root/raw`` and ``root`` holding all four files."""
        candidates = (root / "MNIST" / "raw", root / "raw", root)
        stems = [stem for pair in MNIST_FILES.values() for stem in pair]
        return next((d for d in candidates if all(_idx_file(d, stem) for stem in stems)), None)

    @classmethod
    def problem(cls, root: Path) -> str | None:
        if cls.find_dir(root) is not None:
            return None
        wanted = ", ".join(stem for pair in MNIST_FILES.values() for stem in pair)
        return f"no MNIST idx files ({wanted}, optionally .gz) in {root}[/MNIST]/raw"

    def class_names(self) -> list[str]:
        return [str(i) for i in range(10)]

    def _load(self) -> dict[str, ImageSplit]:
        out = {}
        for split, (images_stem, labels_stem) in MNIST_FILES.items():
            images_path, labels_path = _idx_file(self.raw_dir, images_stem), _idx_file(self.raw_dir, labels_stem)
            try:
                images, labels = read_idx(images_path), read_idx(labels_path).astype(np.int64)
            except (OSError, ValueError, EOFError) as exc:
                raise MissingResourceError(f"MNIST {split} in {self.raw_dir} is unreadable ({exc})") from exc
            if images.dtype != np.uint8:
                raise MissingResourceError(f"{images_path} holds {images.dtype} values, not unsigned-byte images")
            if len(images) != len(labels):
                raise MissingResourceError(f"MNIST {split} in {self.raw_dir}: {len(images)} images but {len(labels)} labels")
            out[split] = ImageSplit(labels, _ArrayImages(images), source=f"MNIST idx {self.raw_dir} {split}")
        return out


# --------------------------------------------------------------------------- SVHN .mat


class SvhnMatSource(DataSource):
    """SVHN cropped digits ``train_32x32.mat`` / ``test_32x32.mat`` (label 10 means digit 0)."""

    kind = "svhn-mat"

    @classmethod
    def problem(cls, root: Path) -> str | None:
        missing = [f"{s}_32x32.mat" for s in SPLITS if not (root / f"{s}_32x32.mat").is_file()]
        return f"no {' / '.join(missing)} in {root}" if missing else None

    def class_names(self) -> list[str]:
        return [str(i) for i in range(10)]

    def _load(self) -> dict[str, ImageSplit]:
        from scipy.io import loadmat

        out = {}
        for split in SPLITS:
            mat = loadmat(str(self.location / f"{split}_32x32.mat"))
            images = np.ascontiguousarray(np.transpose(mat["X"], (3, 0, 1, 2)))
            labels = mat["y"].astype(np.int64).reshape(-1)
            labels[labels == 10] = 0
            out[split] = ImageSplit(labels, _ArrayImages(images), source=f"SVHN .mat {self.location} {split}")
        return out


# --------------------------------------------------------------------------- discovery

FORMATS: dict[str, type[DataSource]] = {
    "parquet": ParquetSource,
    "imagefolder": ImageFolderSource,
    "mnist-idx": MnistIdxSource,
    "svhn-mat": SvhnMatSource,
}


def detect_source(
    directory: str | os.PathLike, *, formats: tuple[str, ...] = tuple(FORMATS), subdir: str | None = None
) -> DataSource | None:
    """The first of ``formats`` whose files ``directory`` holds complete (train and test), else None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for name in formats:
        layout = {"subdir": subdir} if name == "parquet" else {}
        if FORMATS[name].detect(directory, **layout):
            return FORMATS[name](directory, **layout)
    return None


def hub_snapshot(
    repo_id: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    revision: str | None = None,
    download: bool = False,
    allow_patterns: list[str] | None = None,
) -> Path | None:
    """The local snapshot directory of dataset ``repo_id`` in the hub cache, or None.

    Looks only at the local cache (``local_files_only=True``). With ``download`` and
    when not offline, a missing repository is fetched (only ``allow_patterns``).
    """
    from huggingface_hub import snapshot_download

    kwargs: dict[str, Any] = dict(repo_type="dataset", cache_dir=str(hf_hub_cache(cache_dir)), revision=revision)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
    except Exception as exc:  # LocalEntryNotFoundError and friends
        log.debug("%s not in the hub cache: %s", repo_id, exc)
    if not download:
        return None
    if offline_mode() or not host_reachable(hf_endpoint()):
        return None
    log.info("downloading dataset %s from the Hugging Face hub", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns, **kwargs))
    except Exception as exc:
        log.warning("download of %s failed: %s", repo_id, exc)
        return None
