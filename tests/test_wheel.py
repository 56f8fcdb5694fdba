"""The wheel is what a user installs: build it, read its file list, install it, run it.

The checkout hides packaging mistakes (a subpackage missing from the distribution, a
scenario file not shipped as package data, an import of the top-level ``cli`` face):
everything imports fine from the source tree. So the wheel is built from a copy of the
tree, installed into a fresh virtual environment, and the ``editkit`` command is run from
a directory outside the checkout: it lists the built-in scenarios and streams the default
scenario (reduced: two steps, small splits), offline.

The fresh environment borrows the test environment's dependencies (torch & co) through a
``.pth`` file listing its site-packages directories. ``venv --system-site-packages`` would
not do: when the tests run inside a virtual environment, the "system" packages it exposes
are the base interpreter's, without torch. A ``.pth`` line that names a directory only
adds it to ``sys.path``; ``.pth`` files inside it are not run, so the test environment's
editable install of editkit cannot take over (the ``editkit.__file__`` check proves it).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from editkit.bank.store import Bank

pytestmark = pytest.mark.slow  # builds, installs and runs the wheel
REPO = Path(__file__).resolve().parent.parent
#: Build and run output that may sit in a working checkout and must not reach the build.
NOT_SOURCE = {".git", "build", "dist", "runs", "banks", ".venv", "venv", ".pytest_cache", ".hypothesis"}
TASKS = ["mnist", "digits", "fashion", "animal"]


def _ignore(directory: str, names: list[str]) -> set[str]:
    top = Path(directory) == REPO
    return {n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (top and n in NOT_SOURCE)}


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{args}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def _toml_line(key: str, value) -> str:
    return f"{key} = {json.dumps(value)}"  # strings, numbers, booleans: JSON and TOML spell them alike


def reduced_default_scenario(path: Path) -> Path:
    """The built-in ``offline-vision`` (its backbone, heads, tasks and recipe) with small splits."""
    data = tomllib.loads((REPO / "scenarios" / "offline-vision.toml").read_text())
    data["name"] = "offline-vision-wheel"
    data["generic"]["size"] = 32
    for task in data["tasks"]:
        task.update(train_size=64, test_size=40)
    lines = [_toml_line(k, v) for k, v in data.items() if not isinstance(v, (dict, list))]
    for key, value in data.items():
        tables = [value] if isinstance(value, dict) else value if isinstance(value, list) else []
        for table in tables:
            lines.append(f"[{key}]" if isinstance(value, dict) else f"[[{key}]]")
            lines += [_toml_line(k, v) for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout (a build writes ``build/`` and egg-info next to its sources)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_ignore)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", root / "dist", source, cwd=root)
    (built,) = (root / "dist").glob("editkit-*.whl")
    return built


def test_wheel_holds_the_package_and_the_scenarios_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    # every module of the tree, so no subpackage can be left out of the distribution
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "editkit").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert "editkit/cli/app.py" in names
    # the top-level scenarios/ folder, installed as the package editkit.scenarios
    scenarios = {f"editkit/scenarios/{p.name}" for p in (REPO / "scenarios").iterdir() if p.suffix in (".toml", ".py")}
    assert {"editkit/scenarios/offline-vision.toml", "editkit/scenarios/__init__.py"} <= scenarios <= names
    # nothing else at the top: no `cli` module (the root cli.py is the checkout's face), no tests
    tops = {name.split("/")[0] for name in names}
    (dist_info,) = tops - {"editkit"}
    assert dist_info.startswith("editkit-") and dist_info.endswith(".dist-info")
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    assert "editkit = editkit.cli:run" in entry_points


def test_installed_wheel_lists_scenarios_and_streams_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    paths = json.loads(_run(python, "-c", "import json, sysconfig; print(json.dumps(sysconfig.get_paths()))",
                            cwd=tmp_path))
    borrowed = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (Path(paths["purelib"]) / "test_environment.pth").write_text("\n".join(borrowed) + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDITKIT_SCENARIOS")}
    env["EDITKIT_OFFLINE"] = "1"
    _run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=outside, env=env)

    where = Path(_run(python, "-c", "import editkit; print(editkit.__file__)", cwd=outside, env=env).strip())
    assert where.is_relative_to(venv), f"imported {where}, not the installed wheel"
    assert not where.is_relative_to(REPO)

    editkit = Path(paths["scripts"]) / "editkit"
    listing = _run(editkit, "scenarios", cwd=outside, env=env)
    assert "offline-vision" in listing and "vision8" in listing

    scenario = reduced_default_scenario(tmp_path / "offline-vision-wheel.toml")
    _run(editkit, "stream", "--scenario", scenario, "--steps", "2", cwd=outside, env=env)
    # default places, relative to the working directory
    bank = Bank(outside / "banks" / "offline-vision-wheel-taujp")
    assert bank.names() == TASKS
    assert all(bank.get(name).recipe["steps"] == 2 for name in TASKS)
    report = json.loads((outside / "runs" / "offline-vision-wheel-taujp" / "report.json").read_text())
    assert [step["task"] for step in report["steps"]] == TASKS
