"""Atomic writes: all-or-nothing, no leftovers, and the permissions a plain open() would give."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from editkit.util.atomic import TMP_MARKER, atomic_dir, atomic_path, atomic_write_bytes
from editkit.bank.store import Bank


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def test_write_replaces_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_failure_keeps_the_old_file_and_removes_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            assert TMP_MARKER in tmp.name and tmp.parent == tmp_path
            raise RuntimeError("disk full")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_files_get_the_umask_permissions_not_0600(tmp_path: Path, umask_027) -> None:
    atomic_write_bytes(tmp_path / "report.json", b"{}")
    assert _mode(tmp_path / "report.json") == 0o640  # 0666 & ~027; mkstemp alone would give 0600


def test_bank_files_are_readable_by_the_group(tmp_path: Path, umask_027) -> None:
    """safetensors' save_file creates 0600 files; a bank shared by a group must stay readable."""
    bank = Bank(tmp_path / "bank")
    bank.append("a", {"w": torch.ones(2)}, task="a", mode="linear", base="sha256:" + "0" * 64)
    assert _mode(bank.root / "a.safetensors") == 0o640
    assert _mode(bank.manifest_path) == 0o640


def test_a_directory_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    target = tmp_path / "entry"
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_dir(target) as tmp:
            (tmp / "config.json").write_text("{}")
            assert not target.exists() and TMP_MARKER in tmp.name
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(target) as tmp:
        (tmp / "config.json").write_text("first")
    with atomic_dir(target) as tmp:  # another writer finished first: its copy is kept, this one dropped
        (tmp / "config.json").write_text("second")
    assert (target / "config.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
