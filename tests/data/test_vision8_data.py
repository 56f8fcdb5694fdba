"""vision8 data: registry, the on-disk formats, the split rule and the offline errors.

All data is generated in the real layouts (Hugging Face parquet with PNG bytes and
ClassLabel metadata, the hub cache, image-folder trees, MNIST idx, SVHN .mat).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import editkit  # noqa: F401  (torchvision shim)
from editkit.data import clip_templates as ct
from editkit.data import sources, vision8
from editkit.data.vision8 import VISION8, VISION8_ORDER, get_dataset, load_task, locate
from editkit.errors import ConfigError, MissingResourceError
from editkit.data.tasks import validation_indices
from editkit.scenario.spec import load_scenario

from helpers.vision import (
    decode_marks,
    write_hf_cache,
    write_hf_parquet,
    write_image_folder,
    write_mnist_idx,
    write_svhn_mat,
)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No network, no user caches, no data root unless a test gives one."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("EDITKIT_CACHE", str(tmp_path / "editkit-cache"))
    monkeypatch.delenv("EDITKIT_DATA", raising=False)
    monkeypatch.delenv("EDITKIT_CLIP_CACHE", raising=False)


@pytest.fixture
def hub(tmp_path):
    """An empty Hugging Face hub cache."""
    path = tmp_path / "hub"
    path.mkdir()
    return path


class Marks:
    """A stand-in backbone whose preprocess returns the marks an image carries, and counts calls."""

    def __init__(self):
        self.calls = 0

    def preprocess(self, image):
        self.calls += 1
        label, index = decode_marks(image)
        return torch.tensor([label, index])


def _labels_and_marks(dataset):
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(xs), np.asarray(ys)


# --------------------------------------------------------------------------- registry


def test_registry_matches_the_paper():
    assert VISION8_ORDER == ["Cars", "DTD", "EuroSAT", "GTSRB", "MNIST", "RESISC45", "SUN397", "SVHN"]
    spec = load_scenario("vision8")
    assert spec.task_names == VISION8_ORDER
    assert {t.name: t.recipe["epochs"] for t in spec.tasks} == {"Cars": 35, "DTD": 76, "EuroSAT": 12, "GTSRB": 11,
                                                               "MNIST": 5, "RESISC45": 15, "SUN397": 14, "SVHN": 4}
    sizes = {name: VISION8[name].num_classes for name in VISION8_ORDER}
    assert sizes == {"Cars": 196, "DTD": 47, "EuroSAT": 10, "GTSRB": 43, "MNIST": 10,
                     "RESISC45": 45, "SUN397": 397, "SVHN": 10}
    n_templates = {name: len(VISION8[name].templates) for name in VISION8_ORDER}
    assert n_templates == {"Cars": 8, "DTD": 8, "EuroSAT": 3, "GTSRB": 3, "MNIST": 1,
                           "RESISC45": 18, "SUN397": 2, "SVHN": 1}
    for entry in VISION8.values():
        assert len(set(entry.classnames)) == len(entry.classnames)
        assert all(t.count("{}") == 1 for t in entry.templates)
    assert get_dataset("stanford_cars").name == "Cars" and get_dataset("sun397").name == "SUN397"
    assert ct.GTSRB_TEMPLATES[0].format("stop") == 'a zoomed in photo of a "stop" traffic sign.'
    with pytest.raises(ConfigError, match="ImageNet"):
        get_dataset("ImageNet")
    assert len(ct.imagenet_classnames()) == 1000 and len(ct.imagenet_templates()) == 80


def test_split_rule():
    train, val = validation_indices(1000)
    assert len(val) == 100 and len(train) == 900
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(1000))
    assert np.array_equal(val, validation_indices(1000)[1])  # seeded
    assert len(validation_indices(73_257)[1]) == 5000  # SVHN-sized train: capped


# --------------------------------------------------------------------------- parquet


def test_hf_parquet_copy_under_data_root(tmp_path):
    root = tmp_path / "data"
    labels = write_hf_parquet(root / "dtd", sizes={"train": 40, "test": 12}, num_classes=5,
                              class_names=list(ct.DTD_CLASSES[:5]), shards=2)
    marks = Marks()
    task = load_task("DTD", marks, data_root=root)
    assert task.name == "DTD" and task.classes == list(ct.DTD_CLASSES[:5])
    assert marks.calls == 0, "preprocessing must be lazy"
    assert (len(task.train), len(task.val), len(task.test)) == (36, 4, 12)
    train_idx, val_idx = validation_indices(40)
    for split, indices, data in (("train", train_idx, task.train), ("train", val_idx, task.val),
                                 ("test", np.arange(12), task.test)):
        x, y = _labels_and_marks(data)
        assert np.array_equal(y, labels[split][indices])
        assert np.array_equal(data.targets, y)
        assert np.array_equal(x[:, 0].numpy(), y)  # the image carries its label
        assert np.array_equal(x[:, 1].numpy(), indices % 256)  # and its row
    assert marks.calls == 52


def test_parquet_with_clip_preprocess_and_a_dataloader(tmp_path, tiny_clip):
    write_hf_parquet(tmp_path / "mnist", subdir="mnist", sizes={"train": 20, "test": 6}, num_classes=10,
                     class_names=[str(i) for i in range(10)], mode="L", size=28)
    backbone = tiny_clip
    task = load_task("MNIST", backbone, data_root=tmp_path)
    x, y = next(iter(DataLoader(task.train, batch_size=8)))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert backbone.features(x).shape == (8, 16)
    head = vision8.zero_shot_head_for_task(backbone, task)
    assert head.weight.shape == (10, 16)
    augmented = load_task("MNIST", backbone, data_root=tmp_path, augment=True)
    assert augmented.train.transform is backbone.train_preprocess
    assert augmented.val.transform is backbone.val_preprocess is augmented.test.transform


def test_parquet_label_names_in_another_order_are_mapped(tmp_path):
    folder_order = list(ct.EUROSAT_FOLDERS)[::-1]  # labels named by folder, reversed
    write_hf_parquet(tmp_path / "eurosat", sizes={"train": 20, "test": 10}, num_classes=10, class_names=folder_order)
    task = load_task("EuroSAT", Marks(), data_root=tmp_path)
    assert task.classes == list(ct.EUROSAT_CLASSES)[::-1]


def test_hf_hub_cache_is_used_without_network(tmp_path, hub):
    labels = {}

    def fill(snapshot):
        labels.update(write_hf_parquet(snapshot, sizes={"train": 30, "test": 8}, num_classes=6,
                                       class_names=list(ct.GTSRB_CLASSES[:6])))

    write_hf_cache(hub, "tanganke/gtsrb", fill)
    source = locate("GTSRB", hub_cache_dir=hub)
    assert isinstance(source, sources.ParquetSource) and "tanganke/gtsrb" in source.describe()
    task = load_task("GTSRB", Marks(), hub_cache_dir=hub)
    assert task.classes == list(ct.GTSRB_CLASSES[:6])
    assert np.array_equal(task.test.targets, labels["test"])


def test_original_sun397_label_strings_map_to_clip_names():
    names = ["/a/abbey", "/a/apartment_building/outdoor", "/y/youth_hostel"]
    assert vision8.match_classnames(names, get_dataset("SUN397"), 3) == [
        "abbey", "apartment building outdoor", "youth hostel"]


def test_parquet_without_label_metadata_uses_registry_names(tmp_path):
    write_hf_parquet(tmp_path / "resisc45", sizes={"train": 10, "test": 5}, num_classes=3)
    task = load_task("RESISC45", Marks(), data_root=tmp_path)
    assert task.classes == list(ct.RESISC45_CLASSES)


# --------------------------------------------------------------------------- other formats


def test_image_folder_tree(tmp_path):
    classes = ["SeaLake", "AnnualCrop", "Forest", "River"]
    files = write_image_folder(tmp_path / "eurosat", classes, train_per_class=5, test_per_class=2,
                               skip_test=("Forest",))
    task = load_task("EuroSAT", Marks(), data_root=tmp_path)
    lookup = dict(zip(ct.EUROSAT_FOLDERS, ct.EUROSAT_CLASSES))
    assert task.classes == [lookup[c] for c in sorted(classes)]
    assert (len(task.train) + len(task.val), len(task.test)) == (20, 6)
    x, y = _labels_and_marks(task.test)
    assert np.array_equal(x[:, 0].numpy(), y)  # labels agree with the train split's order
    assert sorted(y.tolist()) == sorted(label for _, label in files["test"])
    assert 1 not in y.tolist()  # "Forest" (label 1) has no test folder


def test_image_folder_numeric_class_folders(tmp_path):
    write_image_folder(tmp_path / "gtsrb", [f"{i:05d}" for i in range(4)], train_per_class=3, test_per_class=1)
    task = load_task("GTSRB", Marks(), data_root=tmp_path)
    assert task.classes == list(ct.GTSRB_CLASSES[:4])


def test_mnist_idx_torchvision_layout(tmp_path):
    labels = write_mnist_idx(tmp_path / "mnist", n_train=30, n_test=10, gz=True)
    source = locate("MNIST", data_root=tmp_path)
    assert isinstance(source, sources.MnistIdxSource)
    image, label = source.splits()["test"][3]
    assert image.mode == "L" and image.size == (28, 28) and label == labels["test"][3]
    task = load_task("MNIST", Marks(), data_root=tmp_path)
    x, y = _labels_and_marks(task.test)
    assert np.array_equal(y, labels["test"]) and np.array_equal(x[:, 0].numpy(), y)
    assert task.classes == [str(i) for i in range(10)]


def test_mnist_idx_truncated_file_is_a_missing_resource(tmp_path):
    write_mnist_idx(tmp_path / "mnist", n_train=30, n_test=10, gz=False)
    images = tmp_path / "mnist" / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1])  # a half-written copy must not pass as data
    with pytest.raises(MissingResourceError, match="MNIST test .* unreadable"):
        locate("MNIST", data_root=tmp_path).splits()


def test_svhn_mat(tmp_path):
    labels = write_svhn_mat(tmp_path / "svhn", n_train=20, n_test=10)
    task = load_task("SVHN", Marks(), data_root=tmp_path)
    x, y = _labels_and_marks(task.test)
    assert np.array_equal(y, labels["test"]) and np.array_equal(x[:, 0].numpy(), y)
    assert 0 in y.tolist() and 10 not in y.tolist()


@pytest.mark.parametrize("fmt, write, remove, message", [
    ("imagefolder", lambda root: write_image_folder(root, ["a", "b"], train_per_class=1, test_per_class=1),
     "test", r"lacks test/ \(or val/\)"),
    ("mnist-idx", lambda root: write_mnist_idx(root, n_train=4, n_test=2, gz=False),
     "MNIST/raw/t10k-labels-idx1-ubyte", "no MNIST idx files"),
    ("svhn-mat", lambda root: write_svhn_mat(root, n_train=4, n_test=2), "test_32x32.mat", "no test_32x32.mat in"),
    ("parquet", lambda root: write_hf_parquet(root, sizes={"train": 4, "test": 2}, num_classes=2),
     "data/test-00000-of-00001.parquet", "no test parquet files under"),
])
def test_one_completeness_check_detects_and_refuses(tmp_path, fmt, write, remove, message):
    root = tmp_path / fmt
    write(root)
    cls = sources.FORMATS[fmt]
    assert cls.detect(root) and cls.problem(root) is None and type(sources.detect_source(root)) is cls
    target = root / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    assert not cls.detect(root) and sources.detect_source(root, formats=(fmt,)) is None
    with pytest.raises(MissingResourceError, match=message) as info:
        cls(root)
    assert str(info.value) == cls.problem(root)


def test_env_var_data_root(tmp_path, monkeypatch):
    write_hf_parquet(tmp_path / "sun397", sizes={"train": 10, "test": 4}, num_classes=3)
    monkeypatch.setenv("EDITKIT_DATA", str(tmp_path))
    assert load_task("SUN397", Marks()).classes == list(ct.SUN397_CLASSES)


# --------------------------------------------------------------------------- missing pieces


def test_missing_dataset_names_what_was_searched_and_how_to_provide_it(tmp_path, hub):
    (tmp_path / "data" / "dtd").mkdir(parents=True)
    (tmp_path / "data" / "dtd" / "README.md").write_text("empty")
    with pytest.raises(MissingResourceError) as info:
        load_task("DTD", Marks(), data_root=tmp_path / "data", hub_cache_dir=hub)
    message = str(info.value)
    for piece in ("DTD", str(tmp_path / "data"), "tanganke/dtd", str(hub), "--data-root", "EDITKIT_DATA",
                  "README.md", "train/<class>"):
        assert piece in message, piece
    assert "\n" not in message


def test_missing_test_split_is_reported(tmp_path, hub):
    write_hf_parquet(tmp_path / "cars", sizes={"train": 6}, num_classes=3)
    with pytest.raises(MissingResourceError, match="Cars"):
        locate("Cars", data_root=tmp_path, hub_cache_dir=hub)
