"""A generic, unlabeled source of natural images: random crops of the photos that ship
inside scikit-image and scikit-learn.

Why: the τJp penalty keeps a task vector's effect small on inputs of *other* tasks.
In the incremental setting the first task of a stream has no earlier task to draw
such inputs from; the paper's official vision code adds ImageNet as an extra,
generic source for exactly this role. ImageNet is not available offline, so these
crops stand in for it: a few thousand varied natural-image patches (textures,
faces, animals, objects, sky) that regularize the first task and can stay in the
source pool for later ones. The images carry no labels and never should.

Registered here: the generic source ``natural-crops`` (``[generic] kind = "natural-crops"``).
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from editkit.core.registry import Record
from editkit.core.taujp import UnlabeledSource
from editkit.data import GENERIC_SOURCES
from editkit.errors import MissingResourceError

log = logging.getLogger(__name__)

_SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field")
MIN_CROP = 24
MAX_CROP = 128


@functools.lru_cache(maxsize=1)
def natural_photos() -> tuple[np.ndarray, ...]:
    """The source photos as uint8 RGB arrays (read-only), in a fixed order.

    scikit-image's astronaut, coffee, chelsea, rocket and hubble_deep_field (those
    that load from the installed package) and scikit-learn's sample images (china,
    flower).
    """
    photos: list[np.ndarray] = []
    try:
        import skimage.data

        for name in _SKIMAGE_PHOTOS:
            loader = getattr(skimage.data, name, None)
            if loader is None:
                continue
            try:
                photos.append(loader())
            except Exception as exc:  # e.g. a file this skimage version would download
                log.debug("skipping skimage.data.%s: %s", name, exc)
    except ImportError:
        log.debug("scikit-image not installed; using scikit-learn's photos only")
    try:
        from sklearn.datasets import load_sample_images

        photos.extend(load_sample_images().images)
    except Exception as exc:
        log.debug("skipping sklearn sample images: %s", exc)

    out = []
    for p in photos:
        p = np.asarray(p)
        if p.ndim == 2:
            p = np.repeat(p[..., None], 3, axis=-1)
        p = np.ascontiguousarray(p[..., :3], dtype=np.uint8)
        p.setflags(write=False)
        out.append(p)
    if not out:
        raise MissingResourceError(
            "no natural photos found: install scikit-image and/or scikit-learn "
            "(pip install scikit-image scikit-learn)"
        )
    return tuple(out)


def natural_crops(n: int = 2000, size: int = 32, seed: int = 0) -> np.ndarray:
    """``n`` random natural-image crops, uint8 ``(n, size, size, 3)``; no labels.

    Each crop: pick a photo uniformly, a square side uniformly in
    [24, min(128, photo side)], a uniform position, resize to ``size`` x ``size``
    (anti-aliased), and flip horizontally with probability 1/2. Deterministic
    given ``seed``, so drawn once a process (every scenario build wants the same
    crops: a bench on Ray builds its scenario once a unit, and 2000 resizes take
    about a second); each call gets its own copy.
    """
    if n < 0 or size < 1:
        raise ValueError(f"need n >= 0 and size >= 1, got n={n}, size={size}")
    return _drawn_crops(n, size, seed).copy()


@functools.lru_cache(maxsize=4)
def _drawn_crops(n: int, size: int, seed: int) -> np.ndarray:
    from skimage.transform import resize

    photos = natural_photos()
    rng = np.random.default_rng(seed)
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    for i in range(n):
        photo = photos[int(rng.integers(len(photos)))]
        h, w = photo.shape[:2]
        hi = min(MAX_CROP, h, w)
        side = int(rng.integers(min(MIN_CROP, hi), hi + 1))
        y = int(rng.integers(0, h - side + 1))
        x = int(rng.integers(0, w - side + 1))
        crop = photo[y : y + side, x : x + side]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        resized = resize(
            crop, (size, size), order=1, anti_aliasing=side > size, preserve_range=True
        )
        out[i] = np.clip(np.rint(resized), 0, 255).astype(np.uint8)
    out.setflags(write=False)
    return out



def _generic(backbone, seed: int, size: int = 2000, crop: int = 32) -> UnlabeledSource:
    """``size`` crops of side ``crop``, drawn with ``seed`` and preprocessed by ``backbone``."""
    images = natural_crops(n=int(size), size=int(crop), seed=seed)
    return UnlabeledSource("generic", backbone.preprocess_arrays(images), seed=seed)


GENERIC_SOURCES.register("natural-crops", Record.of(_generic, help={
    "size": "number of crops", "crop": "side of each crop in pixels, before the backbone's preprocessing"}))
