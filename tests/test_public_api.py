"""The declared public API: ``editkit.__all__``, its lazy imports, the renamed-name aliases and docs/api.md.

A script imports these names from ``editkit``; the tests fail when one stops resolving, when the API
page and ``__all__`` disagree, or when ``import editkit`` starts importing torch (the command line
imports it to answer ``--help``).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import editkit

REPO = Path(__file__).resolve().parents[1]
API_PAGE = REPO / "docs" / "api.md"
PUBLIC = [name for name in editkit.__all__ if name != "__version__"]


def documented() -> dict[str, str]:
    """Each ``::: module.Name`` of the API page, as ``{Name: module}``."""
    found = re.findall(r"^::: (editkit(?:\.\w+)*)\.(\w+)\s*$", API_PAGE.read_text(encoding="utf-8"), flags=re.M)
    names = [name for _, name in found]
    assert len(names) == len(set(names)), f"documented twice: {sorted({n for n in names if names.count(n) > 1})}"
    return {name: module for module, name in found}


def test_import_editkit_imports_no_torch():
    code = "import sys, editkit; print(sorted(m for m in ('torch', 'torchvision', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_resolves_to_its_module(name):
    module = importlib.import_module(editkit._PUBLIC[name])
    assert hasattr(module, name), f"{name} is no longer in {module.__name__}: update editkit._PUBLIC"
    assert getattr(editkit, name) is getattr(module, name)


def test_api_page_documents_exactly_the_public_names():
    pages = documented()
    assert sorted(pages) == sorted(PUBLIC), (
        f"in __all__ but not on docs/api.md: {sorted(set(PUBLIC) - set(pages))}; "
        f"on docs/api.md but not in __all__: {sorted(set(pages) - set(PUBLIC))}")
    moved = {n: (m, editkit._PUBLIC[n]) for n, m in pages.items() if m != editkit._PUBLIC[n]}
    assert not moved, f"docs/api.md names another module than editkit._PUBLIC (page, code): {moved}"


def test_dir_lists_the_public_names_and_unknown_names_fail():
    assert set(PUBLIC) <= set(dir(editkit))
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        editkit.NoSuchThing  # noqa: B018


def test_renamed_name_keeps_working_for_a_release_with_a_warning(monkeypatch):
    monkeypatch.setitem(editkit._MOVED, "TaskVectorBank", "Bank")
    with pytest.warns(DeprecationWarning, match=r"editkit\.TaskVectorBank is now editkit\.Bank"):
        from editkit import TaskVectorBank
    assert TaskVectorBank is editkit.Bank
    with pytest.warns(DeprecationWarning):  # every use warns: the old name is never cached
        assert editkit.TaskVectorBank is editkit.Bank
    assert "TaskVectorBank" not in editkit.__all__
