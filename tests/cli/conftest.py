"""Fixtures of the end-to-end command tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from editkit import settings
from helpers.hub import empty_caches

#: The scenario files of this checkout (the installed package may point elsewhere).
SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Empty caches, this checkout's scenarios, a working directory of its own; returns the hub cache."""
    hub = empty_caches(tmp_path, monkeypatch)
    monkeypatch.setenv(settings.SCENARIOS_ENV, str(SCENARIOS))
    monkeypatch.delenv(settings.DATA_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    return hub
