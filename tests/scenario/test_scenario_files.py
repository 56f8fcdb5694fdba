"""Scenario files: every table validated when loaded, and extensions registered from outside scenario/.

The test-only backbone family and task source below are registered from this file and
built through ``editkit.scenario.build.build_scenario``: the scenario layer needed no edit
to run them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from editkit.core.batching import IGNORE_INDEX
from editkit.core.registry import Record
from editkit.data import TASK_SOURCES
from editkit.data.natural import natural_crops
from editkit.data.tasks import tensor_task
from editkit.errors import ConfigError
from editkit.eval.toxicity import TOXICITY_SCORERS
from editkit.models import BACKBONES
from editkit.models.backbone import Backbone
from editkit.models.heads import probe_head
from editkit.scenario.build import build_scenario, check_scenario
from editkit.scenario.options import BuildOptions
from editkit.scenario.spec import SCENARIO_DIR, load_scenario
from editkit.train import runtime as runtime_module
from editkit.train.runtime import native_bf16, resolve_precision
from helpers.scenarios import write_language_scenario, write_toml
from helpers.text import registered_corpora

CROP = 2
INPUT_DIM = CROP * CROP * 3  # a crop, flattened


def toy_backbone(width: int = 3, seed: int = 0) -> Backbone:
    """Flattened uint8 images (scaled to [0, 1]) through a seeded linear map to ``width`` features."""
    torch.manual_seed(seed)
    return Backbone(name=f"toy@{width}", module=nn.Linear(INPUT_DIM, width), feature_dim=width,
                    batch_preprocess=lambda images: torch.from_numpy(np.asarray(images)).float().reshape(len(images), -1) / 255)


def toy_check(width: int = 3, seed: int = 0) -> list[str]:
    return [] if width > 0 else [f"toy family: width must be positive, got {width}"]


def blobs_task(name: str, dataset: str, backbone: Backbone, n: int = 20, spread: float = 0.1, data_root: str | None = None):
    """Two Gaussian blobs (class 0 around -1, class 1 around +1), seeded by the dataset name's length."""
    g = torch.Generator().manual_seed(len(dataset))
    labels = torch.arange(n) % 2
    inputs = (labels.float() * 2 - 1)[:, None] + spread * torch.randn(n, INPUT_DIM, generator=g)
    return tensor_task(name, ["minus", "plus"], inputs, labels, inputs[: n // 2], labels[: n // 2])


def blobs_check(name: str, dataset: str, n: int = 20, spread: float = 0.1, data_root: str | None = None) -> list[str]:
    return [] if dataset != "missing" else [f"task {name!r}: blobs {dataset!r} are not on disk"]


@pytest.fixture
def toy_extensions():
    BACKBONES.register("toy", Record.of(toy_backbone, check=toy_check,
                                        help={"width": "features per input", "seed": "initialisation seed"}))
    TASK_SOURCES.register("blobs", Record.of(blobs_task, check=blobs_check, help={
        "n": "train examples", "spread": "blob standard deviation", "data_root": "unused; taken as vision8's is"}))
    try:
        yield
    finally:
        BACKBONES.unregister("toy")
        TASK_SOURCES.unregister("blobs")


TOY = """\
name = "toy"
[backbone]
family = "toy"
width = 4
[heads]
kind = "probe"
shots = 3
[generic]
kind = "natural-crops"
size = 6
crop = 2
[data]
spread = 0.2
[control]
kind = "imagenet"
[[tasks]]
name = "first"
source = "blobs:ab"
n = 30
steps = 2
[[tasks]]
name = "second"
source = "blobs:abcd"
recipe = { lr = 1e-3 }
[recipe]
mode = "linear"
steps = 5
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "toy.toml"
    path.write_text(text)
    return path


def test_a_family_and_a_source_registered_outside_scenario_are_built_from_a_file(tmp_path, toy_extensions):
    spec = load_scenario(write(tmp_path, TOY))
    built = build_scenario(spec, seed=1)
    assert built.backbone.name == "toy@4"
    want = toy_backbone(width=4)
    assert all(torch.equal(p, q) for p, q in zip(built.backbone.module.parameters(), want.module.parameters()))
    # each task: the [data] default, its own keys, the dataset after the colon
    first, second = built.tasks
    assert (first.name, second.name) == ("first", "second")
    assert len(first.train) + len(first.val) == 30 and len(second.train) + len(second.val) == 20
    expected = blobs_task("first", "ab", want, n=30, spread=0.2)
    assert torch.equal(first.train.inputs, expected.train.inputs) and torch.equal(first.test.inputs, expected.test.inputs)
    # heads: the probe kind with the file's shots, as probe_head fits it
    head = probe_head(built.backbone, first, shots=3, seed=1)
    assert torch.equal(built.heads["first"].weight, head.weight) and torch.equal(built.heads["first"].bias, head.bias)
    # the generic source: natural crops of the file's size and side, through the backbone's preprocessing
    crops = natural_crops(n=6, size=2, seed=1)
    assert torch.equal(built.generic.inputs, built.backbone.preprocess_arrays(crops))


def test_checks_and_overrides_reach_the_registered_extensions(tmp_path, toy_extensions):
    spec = load_scenario(write(tmp_path, TOY.replace('"blobs:abcd"', '"blobs:missing"')))
    assert check_scenario(spec) == ["task 'second': blobs 'missing' are not on disk"]
    narrow = load_scenario(write(tmp_path, TOY.replace('"blobs:abcd"', '"blobs:missing"').replace("width = 4", "width = 0")))
    assert check_scenario(narrow) == [
        "toy family: width must be positive, got 0", "task 'second': blobs 'missing' are not on disk"]
    with pytest.raises(ConfigError, match="backbone family 'toy': unknown option 'model'; known: width, seed"):
        check_scenario(spec, BuildOptions(model="ViT-B-32"))


def test_task_overrides_reach_only_sources_that_take_them(tmp_path, toy_extensions):
    from editkit.scenario.build import task_options

    text = TOY + '[[tasks]]\nname = "digits"\nsource = "packaged:digits"\ntest_size = 7\n'
    spec = load_scenario(write(tmp_path, text.replace("[data]\nspread = 0.2\n", "")))
    first, second, digits = spec.tasks
    build = BuildOptions(data_root="/data")
    assert task_options(spec, first, build) == {"n": 30, "data_root": "/data"}
    assert task_options(spec, second, build) == {"data_root": "/data"}
    assert task_options(spec, digits, build) == {"test_size": 7}  # packaged data has no data root


@pytest.mark.parametrize("table, edit, bad, known", [
    ("top level", ("[backbone]", "seeed = 3\n[backbone]"), "seeed", "name, description, backbone"),
    ("[backbone]", ("width = 4", "width = 4\nwidht = 5"), "widht", "width, seed"),
    ("[heads]", ("shots = 3", "shotz = 50"), "shotz", "shots"),
    ("[generic]", ("size = 6", "sise = 10"), "sise", "size, crop"),
    ("[data]", ("spread = 0.2", "spreed = 0.2"), "spreed", "n, spread, data_root"),
    ("[control]", ('kind = "imagenet"', 'kind = "imagenet"\ndata = "x"'), "data", "kind"),
    ("[[tasks]]", ("n = 30", "m = 30"), "m", "n, spread, data_root"),
    ("[recipe]", ('mode = "linear"', 'mode = "linear"\nlr_decay = 0.5'), "lr_decay", "lr"),
    ("task recipe", ("recipe = { lr = 1e-3 }", "recipe = { lrr = 1e-3 }"), "lrr", "lr"),
])
def test_an_unknown_key_in_any_table_is_refused_by_name_when_loaded(tmp_path, toy_extensions, table, edit, bad, known):
    assert TOY.count(edit[0]) == 1
    with pytest.raises(ConfigError) as err:
        load_scenario(write(tmp_path, TOY.replace(*edit)))
    message = str(err.value)
    assert repr(bad) in message, message
    assert known in message, message


def test_the_reported_defect_no_longer_runs_with_defaults(tmp_path):
    """`shotz = 50` under [heads] and `sise = 10` under [generic] used to run with shots 5 and 2000 crops."""
    text = (SCENARIO_DIR / "offline-vision.toml").read_text()
    text = text.replace("shots = 5", "shotz = 50")
    with pytest.raises(ConfigError, match=r"\[heads\] of kind 'probe': unknown option 'shotz'; known: shots"):
        load_scenario(write(tmp_path, text))
    text = text.replace("shotz = 50", "shots = 5").replace("size = 2000", "sise = 10")
    with pytest.raises(ConfigError, match=r"\[generic\] of kind 'natural-crops': unknown option 'sise'; known: size, crop"):
        load_scenario(write(tmp_path, text))


@pytest.mark.parametrize("edit, message", [
    (('family = "toy"', 'family = "resnet"'), "[backbone]: unknown backbone family 'resnet'; known: causal-lm, clip, efficientnet-lite0, seq2seq-lm, text-encoder, torchvision, toy"),
    (('kind = "probe"', 'kind = "knn"'), "[heads]: unknown head kind 'knn'; known: lm, probe, text-to-text, zero-shot"),
    (('kind = "natural-crops"', 'kind = "noise"'), "[generic]: unknown generic source 'noise'; known: natural-crops, text"),
    (('"blobs:ab"', '"blob:ab"'), "task 'first': unknown task source 'blob'; known: blobs, csv, glue, hf-dataset, imagefolder, jsonl, labelled-text, packaged, parquet, split, text, vision8"),
])
def test_unknown_extension_names_list_the_registered_ones(tmp_path, toy_extensions, edit, message):
    with pytest.raises(ConfigError) as err:
        load_scenario(write(tmp_path, TOY.replace(*edit)))
    assert message in str(err.value)


def test_a_merge_table_names_the_streams_merge_method_and_its_options(tmp_path, toy_extensions):
    spec = load_scenario(write(tmp_path, TOY + '[merge]\nmethod = "iso-cts"\ncommon = 0.5\n'))
    assert (spec.merge.method, spec.merge.options) == ("iso-cts", {"common": 0.5})
    assert load_scenario(write(tmp_path, TOY)).merge is None  # the mode's own merge
    for table, message in (('method = "tsvv"', "[merge]: unknown merge method 'tsvv'"),
                           ('method = "cart"\nrank = 0.1', "[merge]: merge method 'cart': unknown option 'rank'; "
                                                            "known: rank_ratio, lam"),
                           ("common = 0.5", "[merge] needs method = one of cart, dare")):
        with pytest.raises(ConfigError) as err:
            load_scenario(write(tmp_path, TOY + f"[merge]\n{table}\n"))
        assert message in str(err.value)


def test_a_scenarios_precision_is_what_auto_resolves_to_and_a_misspelt_one_is_refused(tmp_path, toy_extensions,
                                                                                        monkeypatch):
    spec = load_scenario(write(tmp_path, 'precision = "bf16"\n' + TOY))
    assert spec.precision == "bf16" and load_scenario(write(tmp_path, TOY)).precision is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(runtime_module, "native_bf16", lambda device: True)  # a CPU with AVX512-BF16 or AMX
    assert resolve_precision(None, cpu, spec.precision) == "bf16" and resolve_precision("auto", cpu, None) == "fp32"
    assert resolve_precision("fp32", cpu, "bf16") == "fp32"  # the user's --precision wins
    assert resolve_precision(None, cuda, None) == "bf16" and resolve_precision(None, cuda, "fp32") == "fp32"
    with pytest.raises(ConfigError, match="precision 'fp16' is not one of bf16, fp32"):
        load_scenario(write(tmp_path, 'precision = "fp16"\n' + TOY))


def test_auto_runs_a_bf16_scenario_in_fp32_where_bf16_is_emulated_and_says_so(monkeypatch, caplog):
    """A CPU without AVX512-BF16 or AMX emulates bf16 products, slower than fp32: ``auto`` then takes fp32 for a
    scenario that prefers bf16, with one warning; a bf16 the user names is still bf16."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not native_bf16(cpu) and native_bf16(torch.device("cuda"))
    with caplog.at_level("WARNING", logger="editkit.train.runtime"):
        assert resolve_precision(None, cpu, "bf16") == "fp32"
    assert [r.getMessage() for r in caplog.records] == [
        "the scenario runs in bf16, but this CPU has no native bf16 (neither AVX512-BF16 nor AMX), where it is "
        "slower than fp32: running fp32 (--precision bf16 forces bf16)"]
    assert resolve_precision("bf16", cpu, "bf16") == "bf16" and resolve_precision(None, cpu, None) == "fp32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert native_bf16(cpu) and resolve_precision(None, cpu, "bf16") == "bf16"

def test_a_file_without_heads_gets_five_shot_probes(tmp_path, toy_extensions):
    spec = load_scenario(write(tmp_path, TOY.replace("[heads]\nkind = \"probe\"\nshots = 3\n", "")))
    assert spec.heads == {"kind": "probe"}
    built = build_scenario(spec, seed=0)
    head = probe_head(built.backbone, built.tasks[0], shots=5, seed=0)
    assert torch.equal(built.heads["first"].weight, head.weight)


@pytest.mark.parametrize("name", ["offline-vision", "offline-text", "vision8", "toxic", "toxic-gpt2"])
def test_the_built_in_scenarios_pass_validation(name):
    assert load_scenario(name).name == name


def test_a_generic_list_of_corpora_has_each_file_resolved_against_the_scenario_folder(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "keep.txt").write_text("a text to keep\n")
    path = write(folder, """\
name = "forget"
[backbone]
family = "causal-lm"
model = "smollm2-135m-instruct"
[heads]
kind = "lm"
[generic]
kind = "text"
corpus = ["file:keep.txt", "clean-news"]
[[tasks]]
name = "forget"
source = "text:toxic"
""")
    assert load_scenario(str(path)).generic["corpus"] == [f"file:{folder / 'keep.txt'}", "clean-news"]


class WordListScorer:
    """1.0 for a text that is one of ``words``, else 0.0: a toxicity scorer flagging known single words."""

    threshold = 0.5

    def __init__(self, name: str, words: set[str]) -> None:
        self.name, self.words = name, words

    def score(self, texts):
        return np.array([float(text in self.words) for text in texts])


def test_focus_words_name_a_toxicity_scorer_whose_flags_pick_the_train_targets(tmp_path):
    """``focus_words = "dumbness"`` in a task: the train targets are the characters of "dumb" (one token each), the
    validation text keeps every target; the scorer's check joins the scenario's; an unknown scorer is refused
    when the file is loaded, by name."""
    corpus = {"train": ["you dumb ass", "a nice day"], "val": ["ok you dumb"], "test": ["fine"]}
    record = Record.of(lambda threshold=0.5: WordListScorer("dumbness", {"dumb"}),
                       check=lambda threshold=0.5: ["dumbness: its word list is missing (test)"])
    TOXICITY_SCORERS.register("dumbness", record)
    try:
        with registered_corpora({"focus-text": corpus}):
            path, _ = write_language_scenario(tmp_path, "focus", task_corpus="focus-text", control="focus-text",
                                              prompts="focus-text", scorer="profanity", steps=1, lr=1e-3,
                                              max_length=32)
            data = tomllib.loads(path.read_text())
            data["tasks"][0]["focus_words"] = "dumbness"
            spec = load_scenario(str(write_toml(data, path)))
            assert "dumbness: its word list is missing (test)" in check_scenario(spec)
            built = build_scenario(spec)
    finally:
        TOXICITY_SCORERS.unregister("dumbness")
    train, val = built.task("rude").train, built.task("rude").val
    assert [i for i, t in enumerate(train[0][1].tolist()) if t != IGNORE_INDEX] == [4, 5, 6, 7]
    assert val[0][1].tolist() == val.ids[0].tolist()
    data["tasks"][0]["focus_words"] = "nope"
    with pytest.raises(ConfigError, match="task 'rude', focus_words: unknown toxicity scorer 'nope'"):
        load_scenario(str(write_toml(data, path)))
