"""split-mnist / split-fmnist: Avalanche's split protocol over the packaged files, checked against the packaged
arrays themselves (which images, which labels) and Avalanche's documented class order for seed 1234."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from editkit.data.packaged import load_packaged
from editkit.data.sources import encode_idx, parse_idx
from editkit.data.split import split_benchmark, split_task
from editkit.errors import ConfigError


class Raw:
    """A backbone stand-in whose preprocessing keeps the pixels, so tasks can be compared with the arrays."""

    def preprocess_arrays(self, images: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(images.astype(np.int64))


def test_idx_bytes_round_trip_bit_exactly():
    images = np.random.default_rng(0).integers(0, 256, (7, 28, 28), dtype=np.uint8)
    assert np.array_equal(parse_idx(encode_idx(images)), images)
    labels = np.arange(10, dtype=np.uint8)
    data = encode_idx(labels)
    assert data[:8] == bytes([0, 0, 8, 1, 0, 0, 0, 10]) and np.array_equal(parse_idx(data), labels)
    with pytest.raises(ValueError, match="uint8"):
        encode_idx(labels.astype(np.int64))


@pytest.mark.parametrize("dataset", ["mnist", "fashion-mnist"])
def test_avalanches_class_order_for_seed_1234(dataset):
    benchmark = split_benchmark(dataset)
    assert [sorted(e.classes_in_this_experience) for e in benchmark.train_stream] == [
        [4, 5], [2, 8], [6, 9], [1, 7], [0, 3]]
    assert [e.task_label for e in benchmark.train_stream] == [0, 1, 2, 3, 4]


def test_each_experience_holds_exactly_its_classes_images_labelled_from_zero():
    packaged = load_packaged("mnist")
    for experience, (first, second) in enumerate([(5, 4), (8, 2), (6, 9), (1, 7), (0, 3)]):
        task = split_task(f"e{experience}", "mnist", Raw(), experience=experience)
        assert task.classes == [str(first), str(second)]
        for split, arrays in (("test", packaged.test), ("train", packaged.train)):
            held = [task.test] if split == "test" else [task.train, task.val]
            x = torch.cat([d.inputs for d in held]).numpy()
            y = torch.cat([d.targets for d in held]).numpy()
            for label, original in enumerate((first, second)):
                want = arrays.images[arrays.labels == original].astype(np.int64)
                got = x[y == label]
                assert len(got) == len(want) and got.sum() == want.sum()  # the same images, none lost
            assert set(y.tolist()) == {0, 1}


def test_an_experience_outside_the_split_is_refused_by_name():
    with pytest.raises(ConfigError, match="task 'late': experience 5 is not one of the split's 0..4"):
        split_task("late", "mnist", Raw(), experience=5)
    with pytest.raises(ConfigError, match="unknown split dataset 'kmnist'"):
        split_task("k", "kmnist", Raw())
