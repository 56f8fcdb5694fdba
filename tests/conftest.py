"""Tiny-model fixtures shared by every test directory, backed by the plain factories in ``helpers.models``.

The transformer and CLIP models are module-scoped: building them costs more than the tests that
read them, and no test edits one in place (the linearization tests deep-copy before editing).
Code that cannot take a fixture (helper functions, spawned worker processes) calls the factories directly.
"""

from __future__ import annotations

import os

import pytest


def _worker_environment() -> None:
    """Under pytest-xdist (pyproject's ``-n 2``) a worker runs its tests as one process would, in its share of the
    cores. Its threads are set before torch starts its pool and inherited by the processes tests spawn: two
    workers at torch's default of every core each oversubscribe the machine, and OpenMP's spinning threads then
    slow both many times over. And it drops the 80 x 24 terminal size xdist gives it (``COLUMNS``, ``LINES``),
    which would make editkit's consoles wrap tables a run off a terminal lays out whole."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, share)
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


_worker_environment()

from helpers import models  # noqa: E402  (torch starts its threads here, after the share is set)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with slow tests first, each file's tests in their own order: the workers take whole files in
    collection order, and a long file dealt last leaves one worker running it alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(autouse=True)
def derived_cache(tmp_path_factory, monkeypatch):
    """Each test starts with nothing theta_0 computed on disk (prefix states, samples): a test that counts the
    work it causes must not find it done by another test, or by a run on this machine, and no test writes
    into the user's cache. Tests of that cache point it elsewhere themselves."""
    from editkit import settings

    monkeypatch.setenv(settings.DERIVED_CACHE_ENV, str(tmp_path_factory.mktemp("derived-cache")))


@pytest.fixture
def make_mlp():
    """The MLP factory, :func:`helpers.models.mlp`: tests pick its sizes, BatchNorm and seed."""
    return models.mlp


@pytest.fixture(scope="module")
def tiny_clip():
    """The tiny random open_clip backbone (seed 0), never downloaded."""
    return models.tiny_clip()


@pytest.fixture(scope="module")
def tiny_bert():
    """A random one-layer BERT with its pooler (seed 0), built from a config."""
    return models.bert()


@pytest.fixture(scope="module")
def tiny_gpt2():
    """A random one-layer GPT-2 language model (seed 0), built from a config."""
    return models.gpt2()
