"""The extension registries: records, refusals, and the built-in extensions registered where they live."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from editkit.core.registry import Option, Record, Registry
from editkit.data import GENERIC_SOURCES, LABELLED_TEXTS, TASK_SOURCES, TEXT_CORPORA
from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS
from editkit.merge.ties import TIES_DEFAULT_K, ties_merge
from editkit.models import BACKBONES, HEADS
from editkit.runs.bench.config import METHODS, parse_names
from editkit.runs.bench.report import METHOD_LABELS


def builder(name: str, backbone: object, width: int = 3, scale: float = 1.0, tag: str | None = None) -> tuple:
    return name, backbone, width, scale, tag


def test_record_options_are_the_builders_parameters_with_a_default():
    record = Record.of(builder, help={"width": "features per input"})
    assert record.options == (Option("width", 3, "features per input"), Option("scale", 1.0), Option("tag", None))
    assert record.option_names == ("width", "scale", "tag")
    assert record.check is None and record.build is builder


def test_help_for_something_that_is_not_an_option_is_a_programming_error():
    with pytest.raises(ValueError, match="widht"):
        Record.of(builder, help={"widht": "typo"})
    with pytest.raises(ValueError, match="backbone"):  # supplied by the caller, never set by a user
        Record.of(builder, help={"backbone": "the model"})


def test_unknown_options_are_refused_by_name_with_the_known_ones():
    record = Record.of(builder)
    record.refuse_unknown({"width": 2, "tag": "x"}, "here")  # known ones pass
    with pytest.raises(ConfigError) as err:
        record.refuse_unknown({"widht": 2, "scale": 1.0, "zz": 0}, "[backbone] of family 'toy'")
    message = str(err.value)
    assert message.startswith("[backbone] of family 'toy': unknown options 'widht', 'zz'")
    assert message.endswith("known: width, scale, tag")
    with pytest.raises(ConfigError, match="known: none"):
        Record.of(lambda name: name).refuse_unknown({"x": 1}, "here")


def test_options_are_typed_by_their_defaults_and_refused_in_one_line():
    record = Record.of(builder)
    assert record.chosen(["width=5", "scale=0.5", "tag=x"], "here") == {"width": 5, "scale": 0.5, "tag": "x"}
    assert record.chosen({"scale": 2}, "here") == {"width": 3, "scale": 2, "tag": None}  # a mapping's values as given
    assert record.given(["scale=4"], "here") == {"scale": 4.0}  # only what was given
    assert record.chosen(["width=7"], "here", defaults={"width": 9}) == {"width": 7, "scale": 1.0, "tag": None}
    flag = Record.of(lambda name, fast=False: name)
    assert flag.chosen(["fast=true"], "here") == {"fast": True}
    for item, message in (("width=2.5", "here: width must be an integer, got '2.5'"),
                          ("scale=big", "here: scale must be a number, got 'big'"),
                          ("width", "here: options are key=value, got 'width'")):
        with pytest.raises(ConfigError) as err:
            record.chosen([item], "here")
        assert str(err.value) == message
    with pytest.raises(ConfigError, match="^here: fast must be true or false, got 'yes'$"):
        flag.chosen(["fast=yes"], "here")


def test_name_dot_key_options_across_a_registry_in_the_same_grammar():
    registry: Registry[Record] = Registry("toy family")
    registry.register("toy", Record.of(builder))
    registry.register("flat", Record.of(lambda name: name))
    assert registry.parse_params(["toy.width=4", "toy.scale=0.25"]) == {"toy": {"width": 4, "scale": 0.25}}
    assert registry.options("toy", ["width=4"]) == {"width": 4, "scale": 1.0, "tag": None}
    for values, message in ((["toy.width=x"], "toy family 'toy': width must be an integer, got 'x'"),
                            (["toy.depth=1"], "toy family 'toy': unknown option 'depth'; known: width, scale, tag"),
                            (["flat.x=1"], "toy family 'flat': unknown option 'x'; known: none"),
                            (["tooy.width=1"], "unknown toy family 'tooy'; known: flat, toy"),
                            (["width=1"], "toy family option 'width=1' is not FAMILY.OPTION=VALUE")):
        with pytest.raises(ConfigError) as err:
            registry.parse_params(values)
        assert str(err.value) == message


@dataclass(frozen=True)
class Kinded(Record):
    """A record kind with a fact of its own."""

    ordered: bool = False


def test_a_plain_record_registered_where_records_have_a_kind_takes_its_facts_at_their_defaults():
    registry: Registry[Kinded] = Registry("kinded thing", Kinded)
    plain = registry.register("plain", Record.of(builder, label="Plain", reference_url="https://example.org/p"))
    own = registry.register("own", Kinded.of(builder, ordered=True))
    assert isinstance(plain, Kinded) and not plain.ordered and own.ordered and registry["own"] is own
    assert (plain.build, plain.options, plain.label, plain.reference_url) == (builder, Record.of(builder).options,
                                                                              "Plain", "https://example.org/p")


def test_duplicate_names_are_refused_and_the_first_record_kept():
    registry: Registry[Record] = Registry("toy family")
    first = registry.register("toy", Record.of(builder))
    with pytest.raises(ConfigError, match="toy family 'toy' is already registered"):
        registry.register("toy", Record.of(lambda: None))
    assert registry["toy"] is first


def test_lookup_miss_lists_the_known_names():
    registry: Registry[Record] = Registry("toy family")
    with pytest.raises(ConfigError, match="unknown toy family 'a'; known: none"):
        registry["a"]
    for name in ("zeta", "alpha"):
        registry.register(name, Record.of(builder))
    with pytest.raises(ConfigError, match="unknown toy family 'beta'; known: alpha, zeta"):
        registry["beta"]
    with pytest.raises(ConfigError, match="unknown toy family None"):
        registry[None]
    with pytest.raises(ConfigError, match=r"unknown toy family \['a'\]"):  # a TOML array where a name belongs
        registry[["a"]]
    assert list(registry) == registry.names() == ["alpha", "zeta"]
    assert "alpha" in registry and "beta" not in registry


def test_unregister_and_labels():
    registry: Registry[Record] = Registry("merge method")
    registry.register("plain", Record.of(builder))
    registry.register("fancy", Record.of(builder, label="Fancy merging"))
    assert registry.label("plain") == "plain" and registry.label("fancy") == "Fancy merging"
    registry.unregister("plain")
    assert registry.names() == ["fancy"]
    with pytest.raises(ConfigError, match="unknown merge method 'plain'; known: fancy"):
        registry.unregister("plain")


@pytest.mark.parametrize("registry, names", [
    (BACKBONES, ["causal-lm", "clip", "efficientnet-lite0", "seq2seq-lm", "text-encoder", "torchvision"]),
    (HEADS, ["lm", "probe", "text-to-text", "zero-shot"]),
    (TASK_SOURCES, ["csv", "glue", "hf-dataset", "imagefolder", "jsonl", "labelled-text", "packaged", "parquet", "split",
                    "text", "vision8"]),
    (GENERIC_SOURCES, ["natural-crops", "text", "text-sentences"]),
    (LABELLED_TEXTS, ["harm", "party", "rt-sentiment", "rt-subjectivity"]),
    (TEXT_CORPORA, ["civil-comments-prompts", "civil-comments-toxic", "clean-books", "clean-news", "clean-reviews",
                    "clean-speeches", "toxic", "toxic-prompts", "wikitext-103"]),
    (MERGE_METHODS, ["cart", "dare", "iso-c", "iso-cts", "magmax", "opcm", "task-arithmetic", "ties", "tsv"]),
])
def test_built_in_extensions_register_themselves_once(registry, names):
    assert registry.names() == names
    assert {registry.origin(name) for name in names} == {"editkit"}
    with pytest.raises(ConfigError, match="already registered by package editkit"):
        registry.register(names[0], Record.of(builder))


def test_a_family_of_names_resolves_each_through_its_factory():
    registry: Registry[Record] = Registry("corpus")
    registry.register("news", Record.of(builder))
    made = []
    registry.register_family("file", lambda rest: made.append(rest) or Record.of(builder, label=rest), form="PATH")
    assert registry["file:/data/a.txt"].label == "/data/a.txt" and made == ["/data/a.txt"]
    assert "file:x" in registry and "file:" not in registry and "other:x" not in registry
    assert registry.names() == ["news"]  # a family's names are not listed one by one
    with pytest.raises(ConfigError, match=r"unknown corpus 'other:x'; known: news, file:PATH"):
        registry["other:x"]
    with pytest.raises(ConfigError, match="family 'file:' is already registered"):
        registry.register_family("file", lambda rest: None)


def test_built_in_records_declare_the_options_scenario_files_use():
    assert dict((o.name, o.default) for o in BACKBONES["efficientnet-lite0"].options) == {"image_size": 32,
                                                                                          "pretrained": True}
    assert BACKBONES["clip"].option_names == ("model", "pretrained", "cache_dir", "quick_gelu", "device", "seed")
    assert BACKBONES["clip"].check is not None and BACKBONES["efficientnet-lite0"].check is None
    assert TASK_SOURCES["vision8"].option_names == ("data_root", "augment", "hub_cache_dir", "download")
    assert TASK_SOURCES["packaged"].option_names == ("train_size", "test_size")
    assert dict((o.name, o.default) for o in HEADS["probe"].options) == {"shots": 5}
    assert HEADS["zero-shot"].options == ()
    assert dict((o.name, o.default) for o in GENERIC_SOURCES["natural-crops"].options) == {"size": 2000, "crop": 32}
    assert dict((o.name, o.default) for o in MERGE_METHODS["ties"].options) == {"k": TIES_DEFAULT_K}
    for registry in (BACKBONES, HEADS, TASK_SOURCES, GENERIC_SOURCES, MERGE_METHODS):
        for name in registry:
            assert all(o.help for o in registry[name].options), f"{registry.what} {name!r} has an option without help"


def test_bench_methods_and_labels_come_from_the_merge_registry_and_the_strategies():
    assert METHODS == ("cart", "dare", "iso-c", "iso-cts", "magmax", "opcm", "task-arithmetic", "ties", "tsv")
    assert METHOD_LABELS == {"pretrained": "pretrained", "cart": "CART", "dare": "DARE", "iso-c": "Iso-C",
                             "iso-cts": "Iso-CTS", "magmax": "MagMax", "opcm": "OPCM", "tsv": "TSV-Merge",
                             "task-arithmetic": "task arithmetic", "ties": "TIES-merging", "single-task": "single-task",
                             "naive": "Naive", "ewc": "EWC", "lwf": "LwF", "si": "SynapticIntelligence",
                             "replay": "Replay", "agem": "AGEM", "joint": "JointTraining"}
    known = "cart, dare, iso-c, iso-cts, magmax, opcm, task-arithmetic, ties, tsv"
    with pytest.raises(ConfigError, match=f"unknown methods 'magmaxx'; choose from {known}"):
        parse_names("ties,magmaxx", METHODS, "methods")


class CountingVectors(dict):
    """A mapping that counts how often a vector is read (the bench reads banked vectors lazily)."""

    reads = 0

    def __getitem__(self, key):
        type(self).reads += 1
        return super().__getitem__(key)

    def values(self):
        return [self[k] for k in self]


def test_merge_methods_return_what_is_scaled_by_one_coefficient():
    g = torch.Generator().manual_seed(0)
    vectors = CountingVectors({t: {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
                               for t in ("a", "b", "c")})
    summed = MERGE_METHODS["task-arithmetic"].build(vectors)
    assert summed is vectors and CountingVectors.reads == 0  # nothing read: per-vector results can be combined
    merged = MERGE_METHODS["ties"].build(vectors, k=0.5)
    assert list(merged) == ["ties"] and CountingVectors.reads == 3
    want = ties_merge([dict.__getitem__(vectors, t) for t in ("a", "b", "c")], k=0.5)
    assert all(torch.equal(merged["ties"][key], want[key]) for key in want)
    # one entry by hand: k = 1 keeps everything; signs +,+,- sum positive, so the mean of the two positives
    hand = {t: {"w": torch.tensor([v])} for t, v in zip("abc", (1.0, 3.0, -2.0))}
    assert MERGE_METHODS["ties"].build(hand, k=1.0)["ties"]["w"].item() == pytest.approx(2.0)
