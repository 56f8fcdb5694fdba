"""Extensions from other packages: distributions on the path whose ``entry_points.txt`` names a module in the
``editkit.extensions`` group.

``tiny-ext`` registers a backbone family, a task source, two merge methods and an Avalanche strategy; a stream,
merges and the strategy run through them, the merges from the command line. ``broken-ext`` fails to import and ``dup-ext`` registers a name editkit already has:
each is named in one warning line, what it registered before failing is taken back, and every other command
still runs. A fresh process shows the extension's merge method in ``editkit add --help``: extensions load
before the first registry lookup, which the CLI's option help makes.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from editkit.cli import app
from editkit.core.registry import unload_extensions
from editkit.data import TASK_SOURCES
from editkit.merge import MERGE_METHODS
from editkit.models import BACKBONES

runner = CliRunner()

TINY_EXT = '''\
"""A third-party editkit extension: a backbone family, a task source, merge methods and a strategy."""
import torch
from torch import nn

from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.data.tasks import tensor_task
from editkit.integrations.avalanche.strategies import STRATEGIES
from editkit.merge import MERGE_METHODS, MergeMethod
from editkit.models import BACKBONES
from editkit.models.backbone import Backbone

CALLS = []
STRATEGY_CALLS = []


def tiny_mlp(width: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    return Backbone(f"tiny-mlp@{width}", nn.Sequential(nn.Linear(6, width), nn.Tanh()), width)


def blobs(name, dataset, backbone, n: int = 40):
    g = torch.Generator().manual_seed(len(dataset))
    labels = torch.arange(n) % 2
    inputs = (labels.float() * 2 - 1)[:, None] + 0.5 * torch.randn(n, 6, generator=g)
    return tensor_task(name, ["minus", "plus"], inputs, labels, inputs[: n // 2], labels[: n // 2])


def halved_sum(vectors):
    CALLS.append(sorted(vectors))
    names = list(vectors)
    return {"halved-sum": {k: sum(vectors[n][k] for n in names) / 2 for k in vectors[names[0]]}}


def first_only(vectors):
    """The first vector alone: a merge whose result depends on the order of the vectors."""
    return {"first-only": dict(next(iter(vectors.values())))}


def naive_twin(marker: int = 0, **fixed):
    """Avalanche's Naive under another name, recording the option it was given."""
    from avalanche.training import Naive

    STRATEGY_CALLS.append(marker)
    return Naive(**fixed)


BACKBONES.register("tiny-mlp", Record.of(tiny_mlp))
TASK_SOURCES.register("ext-blobs", Record.of(blobs))
MERGE_METHODS.register("halved-sum", Record.of(halved_sum, label="halved sum"))
MERGE_METHODS.register("first-only", MergeMethod.of(first_only, order_dependent=True))
STRATEGIES.register("naive-twin", Record.of(naive_twin, label="NaiveTwin"))
'''
DUP_EXT = '''\
from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.models import BACKBONES

BACKBONES.register("dup-only", Record.of(lambda: None))
TASK_SOURCES.register("csv", Record.of(lambda name, dataset, backbone: None))
'''
BROKEN_EXT = 'raise ImportError("No module named \'tensorflow\'")\n'
SCENARIO = """\
name = "ext"
[backbone]
family = "tiny-mlp"
[heads]
kind = "probe"
shots = 3
[[tasks]]
name = "a"
source = "ext-blobs:ab"
[[tasks]]
name = "b"
source = "ext-blobs:abcd"
[recipe]
mode = "linear"
batch_size = 8
"""


def distribution(site: Path, package: str, module: str, source: str) -> None:
    """``site/<module>.py`` and the ``<module>-0.1.dist-info`` that declares it an editkit extension."""
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[editkit.extensions]\n{module.removesuffix('_ext')} = {module}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    distribution(site, "tiny-ext", "tiny_ext", TINY_EXT)
    distribution(site, "dup-ext", "dup_ext", DUP_EXT)
    distribution(site, "broken-ext", "broken_ext", BROKEN_EXT)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    unload_extensions()  # the next lookup loads what is on the path now
    yield site
    unload_extensions()
    for module in ("tiny_ext", "dup_ext", "broken_ext"):
        sys.modules.pop(module, None)


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_a_stream_and_a_merge_through_an_extension_package(site, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    (tmp_path / "ext.toml").write_text(SCENARIO)
    invoke("stream", "--scenario", "ext.toml", "--steps", 3, "--bank", "bank", "--run-dir", "run")
    assert BACKBONES.origin("tiny-mlp") == "tiny-ext" and MERGE_METHODS.origin("halved-sum") == "tiny-ext"
    warnings = sorted(r.getMessage() for r in caplog.records if r.name == "editkit.core.extensions")
    assert warnings == [
        "editkit extension 'broken' of package broken-ext was not loaded (ImportError: No module named "
        "'tensorflow')",
        "editkit extension 'dup' of package dup-ext was not loaded (ConfigError: task source 'csv' is already "
        "registered by package editkit (editkit.data.user_data); package dup-ext cannot register it again: pick "
        "another name)"]
    assert "dup-only" not in BACKBONES and TASK_SOURCES.origin("csv") == "editkit"  # dup-ext taken back whole

    invoke("add", "--all", "--method", "halved-sum", "--bank", "bank", "--json", "halved.json")
    assert sys.modules["tiny_ext"].CALLS == [["a", "b"]]
    invoke("add", "--all", "--alpha", "0.5", "--bank", "bank", "--json", "half.json")
    halved, half = (json.loads((tmp_path / f).read_text()) for f in ("halved.json", "half.json"))
    assert halved["per_task"] == half["per_task"]  # (tau_a + tau_b) / 2 at alpha 1 is the sum at alpha 0.5

    invoke("add", "b", "a", "--method", "first-only", "--bank", "bank", "--json", "first.json")
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["order"] == ["b", "a"] and "order" not in halved  # each method's record says whether order counts


def test_a_strategy_from_an_extension_package_runs_and_takes_options_in_the_one_grammar(site, tmp_path):
    from editkit.integrations.avalanche.strategies import STRATEGIES, run_strategy
    from editkit.scenario.build import build_scenario
    from editkit.scenario.spec import load_scenario
    from editkit.train.recipe import Recipe

    (tmp_path / "ext.toml").write_text(SCENARIO)
    built = build_scenario(load_scenario(str(tmp_path / "ext.toml")))
    recipes = [Recipe(mode="nonlinear", steps=3, batch_size=8, seed=1)] * 2
    twin = run_strategy("naive-twin", built, recipes,
                        options=STRATEGIES.parse_params(["naive-twin.marker=7"])["naive-twin"])
    assert STRATEGIES.origin("naive-twin") == "tiny-ext" and sys.modules["tiny_ext"].STRATEGY_CALLS == [7]
    assert twin.options == {"marker": 7} and twin.rows == run_strategy("naive", built, recipes).rows  # Naive's own

    result = runner.invoke(app, ["bench", "--scenario", "ext.toml", "--strategies", "naive-twin",
                                 "--strategy-params", "naive-twin.marker=x"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "strategy 'naive-twin': marker must be an integer, got 'x'" in lines[0]


def test_a_new_process_lists_what_extensions_register_and_names_the_broken_one(site):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "editkit", "add", "--help"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "halved-sum" in " ".join(done.stdout.split())
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2
    assert "editkit extension 'broken' of package broken-ext was not loaded" in lines[0]
    assert "package dup-ext cannot register it again" in lines[1]
