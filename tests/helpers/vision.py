"""Generated stand-ins for the vision8 data, in the real on-disk formats.

Every image encodes its own label and index, so a test can check that the right
picture arrives with the right label: pixel (0, 0) holds ``label * 20`` in every
channel and pixel (0, 1) holds ``index % 256``.
"""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image


def make_image(label: int, index: int, *, size: int = 12, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A small noisy image carrying ``label`` and ``index`` in two known pixels."""
    rng = np.random.default_rng(seed * 100003 + index)
    channels = 3 if mode == "RGB" else 1
    pixels = rng.integers(0, 256, size=(size, size, channels), dtype=np.uint8)
    pixels[0, 0, :] = label * 20
    pixels[0, 1, :] = index % 256
    return Image.fromarray(pixels if channels == 3 else pixels[..., 0], mode=mode)


def decode_marks(image: Image.Image) -> tuple[int, int]:
    """(label, index % 256) read back from an image made by :func:`make_image`."""
    pixels = np.asarray(image.convert("L"))
    return int(round(pixels[0, 0] / 20)), int(pixels[0, 1])


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def labels_for(n: int, num_classes: int, seed: int = 0) -> np.ndarray:
    """Every class at least once (when n allows), then seeded random labels."""
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.arange(min(n, num_classes)), rng.integers(0, num_classes, max(0, n - num_classes))])
    return rng.permutation(labels).astype(np.int64)


def write_hf_parquet(
    root: Path,
    *,
    sizes: dict[str, int],
    num_classes: int,
    class_names: list[str] | None = None,
    subdir: str = "data",
    shards: int = 1,
    mode: str = "RGB",
    size: int = 12,
) -> dict[str, np.ndarray]:
    """``root/<subdir>/<split>-0000i-of-0000n.parquet`` as ``datasets`` writes them.

    Columns: ``image`` (struct ``{bytes: binary, path: string}``, PNG bytes) and
    ``label`` (int64); schema metadata ``huggingface`` carries the ClassLabel names
    when ``class_names`` is given. Returns the labels of each split, in row order.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    features: dict = {"image": {"_type": "Image"}, "label": {"dtype": "int64", "_type": "Value"}}
    if class_names is not None:
        features["label"] = {"names": list(class_names), "_type": "ClassLabel"}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("image", image_type), ("label", pa.int64())], metadata=metadata)
    out_dir = root / subdir if subdir else root
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {}
    for split_no, (split, n) in enumerate(sizes.items()):
        labels = labels_for(n, num_classes, seed=split_no)
        result[split] = labels
        bounds = np.linspace(0, n, shards + 1).astype(int)
        for shard in range(shards):
            rows = range(bounds[shard], bounds[shard + 1])
            images = [{"bytes": png_bytes(make_image(int(labels[i]), i, mode=mode, size=size, seed=split_no)),
                       "path": f"{split}_{i}.png"} for i in rows]
            table = pa.table(
                {"image": pa.array(images, type=image_type), "label": pa.array(labels[list(rows)], type=pa.int64())},
                schema=schema,
            )
            pq.write_table(table, out_dir / f"{split}-{shard:05d}-of-{shards:05d}.parquet")
    return result


def write_hf_cache(cache_root: Path, repo_id: str, writer, *, commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """A dataset repository in the Hugging Face hub cache layout; ``writer(snapshot_dir)`` fills it."""
    repo_dir = cache_root / ("datasets--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    writer(snapshot)
    return snapshot


def write_image_folder(
    root: Path, classes: list[str], *, train_per_class: int, test_per_class: int, skip_test: tuple[str, ...] = ()
) -> dict[str, list[tuple[str, int]]]:
    """``root/{train,test}/<class>/<i>.png``; returns (file name, class index) per split.

    Classes in ``skip_test`` get no test folder (a test split missing a class).
    """
    out: dict[str, list[tuple[str, int]]] = {"train": [], "test": []}
    ordered = sorted(classes)
    for split, per_class in (("train", train_per_class), ("test", test_per_class)):
        index = 0
        for name in classes:
            if split == "test" and name in skip_test:
                continue
            directory = root / split / name
            directory.mkdir(parents=True, exist_ok=True)
            label = ordered.index(name)
            for _ in range(per_class):
                make_image(label, index).save(directory / f"{index:05d}.png")
                out[split].append((f"{index:05d}.png", label))
                index += 1
    return out


def _idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_mnist_idx(root: Path, *, n_train: int, n_test: int, gz: bool = True) -> dict[str, np.ndarray]:
    """torchvision's MNIST layout ``root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        labels = labels_for(n, 10, seed=7 if split == "train" else 8)
        images = np.stack([np.asarray(make_image(int(labels[i]), i, mode="L", size=28)) for i in range(n)])
        for stem, array in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels.astype(np.uint8))):
            data = _idx_bytes(array)
            if gz:
                (raw / (stem + ".gz")).write_bytes(gzip.compress(data))
            else:
                (raw / stem).write_bytes(data)
        out[split] = labels
    return out


def write_svhn_mat(root: Path, *, n_train: int, n_test: int) -> dict[str, np.ndarray]:
    """torchvision's SVHN layout: ``root/{train,test}_32x32.mat`` with X (32,32,3,N), y (N,1), 10 for digit 0."""
    from scipy.io import savemat

    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = labels_for(n, 10, seed=3 if split == "train" else 4)
        images = np.stack([np.asarray(make_image(int(labels[i]), i, size=32)) for i in range(n)], axis=-1)
        stored = np.where(labels == 0, 10, labels).reshape(-1, 1).astype(np.uint8)
        savemat(str(root / f"{split}_32x32.mat"), {"X": images, "y": stored})
        out[split] = labels
    return out
