"""The data-free penalty in a stream: each task's curvature banked beside its vector (checksummed, read back bit
for bit, never an input), later tasks penalised by it alone, and its recipe fields stale like any other."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from editkit.bank.store import Bank
from editkit.core.curvature import CurvatureRegularizer, compute_curvature
from editkit.errors import BankError, ConfigError, CorruptVectorError
from editkit.runs.stream import StreamRunner
from editkit.train.recipe import Recipe, recipe_differences

from helpers.streams import NAMES, data, network, stream

KFAC = {"penalty": "kfac", "curvature_examples": 20, "lam": 1.0}


def test_each_vector_is_banked_with_its_tasks_curvature_and_no_input(tmp_path):
    stream(tmp_path / "bank", recipe_fields=KFAC)
    bank = Bank(tmp_path / "bank")
    files = sorted(p.name for p in (tmp_path / "bank").iterdir() if not p.name.startswith("."))
    assert files == sorted(["manifest.json", *(f"{n}.{kind}safetensors" for n in NAMES
                                               for kind in ("", "curvature.", "prototypes-2."))])
    sets, _ = data()
    for i, name in enumerate(NAMES):
        entry = bank.get(name)
        assert entry.recipe["penalty"] == "kfac" and entry.curvature["examples"] == 20
        banked = bank.curvature(name)
        # ground truth: the curvature of theta_0 on the task's first 20 inputs in its source's seeded order
        order = torch.randperm(50, generator=torch.Generator().manual_seed(0 + 1 + i)).tolist()
        index = [order.pop() for _ in range(20)]
        want = compute_curvature(network(), [sets[name].inputs[index]], seed=0).to_tensors()
        assert banked.to_tensors().keys() == want.keys()
        assert all(torch.equal(banked.to_tensors()[k], want[k]) for k in want)
        stored = {k for f in ("safetensors", "curvature.safetensors", "prototypes-2.safetensors")
                  for k in __import__("safetensors").safe_open(str(tmp_path / "bank" / f"{name}.{f}"), "pt").keys()}
        assert not any(k.startswith(("input", "x")) for k in stored)  # parameters, factors and class statistics only
    assert bank.verify() == []


def test_later_tasks_are_penalised_by_the_earlier_curvatures_and_not_the_first(tmp_path):
    result = stream(tmp_path / "kfac", recipe_fields=KFAC)
    plain = stream(tmp_path / "linear", mode="linear")
    kfac, linear = Bank(tmp_path / "kfac"), Bank(tmp_path / "linear")
    assert torch.equal(kfac.load("a")["0.weight"], linear.load("a")["0.weight"])  # nothing to protect yet
    assert not torch.equal(kfac.load("b")["0.weight"], linear.load("b")["0.weight"])
    assert result.steps and plain.steps


def test_the_penalty_reads_the_banked_curvature_not_the_inputs(tmp_path, monkeypatch):
    """Task c's penalty is built from a and b's banked factors: loading them is all the stream does with a and b."""
    stream(tmp_path / "bank", names=NAMES[:2], recipe_fields=KFAC)
    seen: list = []
    original = StreamRunner.compute_curvature

    def recording(self, index, recipe):
        seen.append(index)
        return original(self, index, recipe)

    monkeypatch.setattr(StreamRunner, "compute_curvature", recording)
    stream(tmp_path / "bank", resume=True, recipe_fields=KFAC)
    assert seen == [2, 3]  # the new tasks' own, after training each; never a or b's


def test_runs_sharing_a_memo_compute_each_curvature_once_and_bank_the_same_factors(tmp_path, monkeypatch):
    """--tune's trials differ in lr and lambda: over one memo a task's curvature (and the generic source's) is
    computed by the first run only, and a later run banks the very factors theta_0 gives on its inputs; a field a
    curvature depends on computes it anew: the seed of its probes (the generic source's order does not move with
    it) and its examples."""
    import editkit.runs.stream as stream_module
    from editkit.core.taujp import UnlabeledSource

    computed: list[str] = []
    original = stream_module.source_curvature

    def counting(module, source, **kwargs):
        computed.append(source.name)
        return original(module, source, **kwargs)

    monkeypatch.setattr(stream_module, "source_curvature", counting)
    generic = torch.randn(30, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    memo: dict = {}

    def run(name: str, **fields) -> Bank:
        stream(tmp_path / name, recipe_fields={**KFAC, "generic": True, **fields}, curvatures=memo,
               generic=UnlabeledSource("generic", generic, seed=5))
        return Bank(tmp_path / name)

    once = ["generic", *NAMES]
    first = run("first")
    assert computed == once
    second = run("second", lr=1e-2, lam=0.1)
    assert computed == once  # none again
    sets, _ = data()
    for i, name in enumerate(NAMES):  # ground truth, as the banking test reads it: theta_0 on the seeded inputs
        order = torch.randperm(50, generator=torch.Generator().manual_seed(0 + 1 + i)).tolist()
        want = compute_curvature(network(), [sets[name].inputs[[order.pop() for _ in range(20)]]], seed=0).to_tensors()
        got = second.curvature(name).to_tensors()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(second.load("b")["0.weight"], first.load("b")["0.weight"])
    run("seed", seed=1)
    run("fewer", curvature_examples=10)
    assert computed == once * 3


def test_a_corrupt_curvature_file_is_refused_by_name(tmp_path):
    stream(tmp_path / "bank", names=NAMES[:2], recipe_fields=KFAC)
    path = tmp_path / "bank" / "a.curvature.safetensors"
    data_ = bytearray(path.read_bytes())
    data_[-3] ^= 0xFF
    path.write_bytes(bytes(data_))
    bank = Bank(tmp_path / "bank")
    with pytest.raises(CorruptVectorError, match="a.curvature.safetensors"):
        bank.curvature("a")
    assert any("a.curvature.safetensors" in problem for problem in bank.verify())
    with pytest.raises(CorruptVectorError):
        stream(tmp_path / "bank", resume=True, recipe_fields=KFAC)


def test_a_curvature_file_of_another_format_is_refused_as_corrupt_by_name(tmp_path):
    """A file whose checksum holds but whose header is another editkit's factor format: refused as the bank's
    corruption, naming the file, like a damaged one (not as a setting the user could change)."""
    import hashlib

    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    stream(tmp_path / "bank", names=NAMES[:2], recipe_fields=KFAC)
    path = tmp_path / "bank" / "a.curvature.safetensors"
    with safe_open(str(path), "pt") as f:
        header = f.metadata()
    save_file(load_file(str(path)), str(path), metadata={**header, "format": "kfac-0"})
    manifest = tmp_path / "bank" / "manifest.json"
    entries = json.loads(manifest.read_text())
    [entry] = [e for e in entries["vectors"] if e["name"] == "a"]
    entry["curvature"]["checksum"] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(entries))
    with pytest.raises(CorruptVectorError, match="a.curvature.safetensors.*'kfac-0'"):
        Bank(tmp_path / "bank").curvature("a")


def test_removing_a_vector_removes_its_curvature(tmp_path):
    stream(tmp_path / "bank", names=NAMES[:2], recipe_fields=KFAC)
    bank = Bank(tmp_path / "bank")
    bank.remove("a")
    assert not (tmp_path / "bank" / "a.curvature.safetensors").exists() and bank.orphans() == []
    assert bank.curvature("b") is not None


def test_a_resume_with_other_curvature_fields_is_refused_by_field(tmp_path):
    stream(tmp_path / "bank", names=NAMES[:2], recipe_fields=KFAC)
    with pytest.raises(BankError, match="curvature_examples 20 banked, 30 now"):
        stream(tmp_path / "bank", resume=True, recipe_fields={**KFAC, "curvature_examples": 30})
    with pytest.raises(BankError, match="penalty 'kfac' banked, None now"):
        stream(tmp_path / "bank", resume=True)


def test_a_vector_banked_without_curvature_is_left_out_with_a_warning(tmp_path, caplog):
    """An imported vector has no factors: the penalty lacks that task, and says so."""
    stream(tmp_path / "bank", names=NAMES[:1], recipe_fields=KFAC)
    manifest = json.loads((tmp_path / "bank" / "manifest.json").read_text())
    del manifest["vectors"][0]["curvature"]
    (tmp_path / "bank" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "bank" / "a.curvature.safetensors").unlink()
    with caplog.at_level(logging.WARNING):
        stream(tmp_path / "bank", names=NAMES[:2], resume=True, recipe_fields=KFAC)
    assert "vector a was banked without its curvature" in caplog.text
    assert "task b has no earlier curvature" in caplog.text


def test_factors_of_another_model_are_refused_naming_the_layer(tmp_path):
    stream(tmp_path / "bank", names=NAMES[:1], recipe_fields=KFAC)
    bank = Bank(tmp_path / "bank")
    curvature = bank.curvature("a")
    name = next(iter(curvature.blocks))
    block = curvature.blocks[name]
    block.A = torch.cat([block.A, block.A[:, :1]], dim=1)  # one input too many
    with pytest.raises(ConfigError, match=f"layer {name}"):
        curvature.check_fits({n: p.shape for n, p in network().named_parameters()}, "a")


def test_the_recipe_records_the_data_free_fields_only_with_it():
    assert "penalty" not in Recipe().to_dict() and "curvature_examples" not in Recipe().to_dict()
    fields = Recipe(penalty="kfac").to_dict()
    assert fields["penalty"] == "kfac" and fields["curvature_combine"] == "sum"
    assert Recipe(penalty="kfac").label == "taujp-kfac" and Recipe(penalty="kfac", mode="linear").label == "linear"
    assert Recipe(penalty="kfac", penalty_on="logits").penalty_on == "logits"  # a language model's: its stream checks
    with pytest.raises(ConfigError, match="curvature_energy"):
        Recipe(curvature_energy=0)
    regularizer = Recipe(penalty="kfac", curvature_combine="apart").curvature_regularizer([])
    assert isinstance(regularizer, CurvatureRegularizer) and regularizer.combine == "apart"
    assert Recipe(penalty="kfac", reg_within_batch=True).labelled_rows(regularizer) == 32  # draws no rows


def test_bf16_products_are_another_recipe_and_fp32_is_what_banks_before_the_field_recorded():
    """A kfac bank written before ``curvature_precision`` existed multiplied in fp32: it omits the field, as an fp32
    recipe does, and compares equal; bf16 trains another vector, so its bank is from another recipe."""
    fp32, bf16 = Recipe(penalty="kfac"), Recipe(penalty="kfac", curvature_precision="bf16")
    assert "curvature_precision" not in fp32.to_dict() and bf16.to_dict()["curvature_precision"] == "bf16"
    assert recipe_differences(fp32.to_dict(), bf16.to_dict()) == ["curvature_precision"]
    assert bf16.curvature_regularizer([]).precision == "bf16"
    with pytest.raises(ConfigError, match="curvature_precision"):
        Recipe(penalty="kfac", curvature_precision="fp16")
