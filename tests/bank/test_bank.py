"""Task-vector bank: bit-exact round trips, refusals that leave the bank unchanged,
hand-computed merges, damaged files, crash injection and concurrent appends."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from editkit.models.backbone import state_fingerprint
from editkit.bank.store import Bank, VectorEntry
from editkit.core.modes import Family, Mode, mode_family
from editkit.errors import BankError, CorruptVectorError, IncompatibleVectorsError

REPO = Path(__file__).resolve().parents[2]
BASE = state_fingerprint(nn.Linear(3, 2).state_dict())
OTHER_BASE = "sha256:" + "f" * 64


def vector(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A small deterministic 'task vector' with a fixed layout."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g).to(dtype),
        "b": torch.randn(4, generator=g).to(dtype),
        "s": torch.randn((), generator=g).to(dtype),
    }


def add(bank: Bank, name: str, seed: int = 0, mode: str = "nonlinear", base: str = BASE, **kw) -> VectorEntry:
    return bank.append(name, vector(seed, kw.pop("dtype", torch.float32)), task=f"task-{name}",
                       mode=mode, base=base, **kw)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file in the bank directory except the lock, byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != ".lock"}


@pytest.fixture
def bank(tmp_path: Path) -> Bank:
    return Bank(tmp_path / "bank")


# --------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_exact_for_every_dtype(bank: Bank) -> None:
    g = torch.Generator().manual_seed(1)
    tensors = {
        "f32": torch.randn(5, 7, generator=g),
        "f16": torch.randn(3, 2, generator=g).half(),
        "bf16": torch.randn(6, generator=g).bfloat16(),
        "i64": torch.randint(-2**40, 2**40, (4, 2), generator=g),
        "scalar": torch.tensor(-3.25),
        "strided": torch.randn(4, 5, generator=g).t(),  # non-contiguous input
        "grad": torch.randn(2, 2, generator=g, requires_grad=True),
    }
    expected = {k: v.detach().clone() for k, v in tensors.items()}
    entry = bank.append("rt", tensors, task="t", mode="taujp", base=BASE, scenario="s1", step=3,
                        recipe={"lr": 1e-3, "lam": [0.1, 0.2]}, metrics={"acc": 0.5})

    loaded = Bank(bank.root).load("rt", base=BASE)  # a fresh handle: nothing is cached
    assert set(loaded) == set(expected)
    for key, want in expected.items():
        got = loaded[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
        assert not got.requires_grad

    raw = (bank.root / "rt.safetensors").read_bytes()
    assert entry.checksum == "sha256:" + hashlib.sha256(raw).hexdigest()
    manifest = json.loads((bank.root / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["base"] == BASE
    assert manifest["vectors"][0]["file"] == "rt.safetensors"
    again = Bank(bank.root).get("rt")
    assert again == entry
    assert (again.task, again.mode, again.scenario, again.step) == ("t", "taujp", "s1", 3)
    assert again.recipe == {"lr": 1e-3, "lam": [0.1, 0.2]} and again.metrics == {"acc": 0.5}
    assert again.created.endswith("+00:00")
    assert VectorEntry.from_json(json.loads(json.dumps(entry.to_json()))) == entry


def test_queries_on_a_bank_that_does_not_exist_create_nothing(tmp_path: Path) -> None:
    bank = Bank(tmp_path / "absent")
    assert not bank.exists() and len(bank) == 0 and bank.entries() == [] and bank.base is None
    assert "x" not in bank and bank.verify() == []
    with pytest.raises(BankError):
        bank.remove("x")
    assert not bank.root.exists()


def test_entries_keep_append_order_and_queries_agree(bank: Bank) -> None:
    for i, name in enumerate(["c", "a", "b"]):
        add(bank, name, seed=i)
    assert bank.names() == ["c", "a", "b"] and len(bank) == 3 and "a" in bank and "z" not in bank
    assert [e.name for e in bank.entries()] == ["c", "a", "b"]
    assert bank.exists() and bank.base == BASE


# --------------------------------------------------------------------------- refusals


def test_duplicate_name_is_refused_and_says_to_remove_it(bank: Bank) -> None:
    add(bank, "v", seed=0)
    before = snapshot(bank.root)
    with pytest.raises(BankError, match="remove it first"):
        add(bank, "v", seed=1)
    assert snapshot(bank.root) == before


def test_base_mismatch_is_refused_and_bank_unchanged(bank: Bank) -> None:
    add(bank, "v", seed=0)
    before = snapshot(bank.root)
    with pytest.raises(IncompatibleVectorsError) as info:
        add(bank, "w", seed=1, base=OTHER_BASE)
    assert BASE[:19] in str(info.value) and OTHER_BASE[:19] in str(info.value)
    assert snapshot(bank.root) == before
    assert bank.names() == ["v"]


@pytest.mark.parametrize("name", ["", ".hidden", "../escape", "a/b", "a b", "-x", "é", "x" * 201])
def test_unsafe_names_are_refused(bank: Bank, name: str) -> None:
    with pytest.raises(BankError, match="invalid vector name"):
        add(bank, name)
    assert not bank.root.exists() or bank.names() == []


def test_unknown_mode_and_bad_metadata_are_refused(bank: Bank) -> None:
    with pytest.raises(BankError, match="unknown vector mode"):
        add(bank, "v", mode="tangent")
    with pytest.raises(BankError, match="JSON"):
        add(bank, "v", metrics={"obj": object()})
    with pytest.raises(BankError, match="no tensors"):
        bank.append("v", {}, task="t", mode="linear", base=BASE)
    # what a manifest would refuse to read back is refused when appended
    with pytest.raises(BankError, match="vector 'v': step must be an integer or null"):
        add(bank, "v", step="3")
    with pytest.raises(BankError, match="vector 'v': scenario must be a string or null"):
        add(bank, "v", scenario=["s"])
    with pytest.raises(BankError, match=r"unknown entry field\(s\) \['stpe'\]"):
        add(bank, "v", stpe=3)
    assert bank.names() == []


def test_missing_name_lists_the_known_names(bank: Bank) -> None:
    add(bank, "alpha", seed=0)
    add(bank, "beta", seed=1)
    for call in (bank.get, bank.load, bank.remove, lambda n: bank.merge({n: 1.0})):
        with pytest.raises(BankError, match=r"'gamma'.*alpha, beta"):
            call("gamma")


# --------------------------------------------------------------------------- modes and merging


def test_mode_families() -> None:
    assert Mode("linear").linearized and Mode("taujp").linearized and not Mode("nonlinear").linearized
    assert mode_family("taujp") == "linearized" and mode_family("nonlinear") == "nonlinear"
    assert mode_family("linear") is Family.LINEARIZED and Mode.TAUJP.penalized and not Mode.LINEAR.penalized
    with pytest.raises(ValueError):
        mode_family("other")
    # a str enum: manifests and reports keep the plain strings
    assert Mode("taujp") == "taujp" and f"{Mode.LINEAR}" == "linear" and json.dumps([Mode.NONLINEAR]) == '["nonlinear"]'


def test_mixing_nonlinear_and_linearized_is_refused(bank: Bank) -> None:
    add(bank, "plain", seed=0, mode="nonlinear")
    add(bank, "lin", seed=1, mode="linear")
    with pytest.raises(IncompatibleVectorsError) as info:
        bank.merge({"plain": 1.0, "lin": 1.0})
    message = str(info.value)
    assert "plain (nonlinear)" in message and "lin (linear)" in message


def test_linear_and_taujp_merge_and_match_hand_computation(bank: Bank) -> None:
    add(bank, "lin", seed=0, mode="linear")
    add(bank, "tjp", seed=1, mode="taujp")
    t1, t2 = vector(0), vector(1)
    merged = bank.merge({"lin": 0.3, "tjp": -1.7}, base=BASE)
    assert set(merged) == set(t1)
    for key in t1:
        want = 0.3 * t1[key].double() + -1.7 * t2[key].double()
        assert merged[key].dtype == torch.float32 and merged[key].shape == t1[key].shape
        assert torch.allclose(merged[key].double(), want, rtol=1e-6, atol=1e-6), key


def test_negation_is_exact(bank: Bank) -> None:
    add(bank, "v", seed=4, mode="nonlinear")
    merged = bank.merge({"v": -1.0})
    for key, tau in vector(4).items():
        assert torch.equal(merged[key], -tau), key


def test_low_precision_merge_accumulates_in_float32_and_keeps_dtype(bank: Bank) -> None:
    add(bank, "a", seed=0, mode="taujp", dtype=torch.bfloat16)
    add(bank, "b", seed=1, mode="taujp", dtype=torch.bfloat16)
    merged = bank.merge({"a": 0.5, "b": 0.25})
    a, b = vector(0, torch.bfloat16), vector(1, torch.bfloat16)
    for key in a:
        want = (0.5 * a[key].float() + 0.25 * b[key].float()).bfloat16()
        assert merged[key].dtype == torch.bfloat16
        assert torch.equal(merged[key], want), key


def test_merge_refuses_empty_selection_and_wrong_base(bank: Bank) -> None:
    add(bank, "v", seed=0)
    with pytest.raises(BankError, match="empty"):
        bank.merge({})
    with pytest.raises(IncompatibleVectorsError):
        bank.merge({"v": 1.0}, base=OTHER_BASE)
    with pytest.raises(IncompatibleVectorsError):
        bank.load("v", base=OTHER_BASE)


def test_merge_refuses_different_layouts(bank: Bank) -> None:
    bank.append("a", {"w": torch.ones(2, 2), "b": torch.ones(2)}, task="t", mode="linear", base=BASE)
    bank.append("b", {"w": torch.ones(2, 2), "c": torch.ones(2)}, task="t", mode="linear", base=BASE)
    bank.append("c", {"w": torch.ones(2, 3), "b": torch.ones(2)}, task="t", mode="linear", base=BASE)
    with pytest.raises(BankError, match="different parameters"):
        bank.merge({"a": 1.0, "b": 1.0})
    with pytest.raises(BankError, match=r"'w' has shape \(2, 2\)"):
        bank.merge({"a": 1.0, "c": 1.0})


# --------------------------------------------------------------------------- damage


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_is_caught_by_load_merge_and_verify(bank: Bank, monkeypatch) -> None:
    add(bank, "good", seed=0)
    add(bank, "bad", seed=1)
    assert bank.verify() == []
    flip_last_byte(bank.root / "bad.safetensors")
    with pytest.raises(CorruptVectorError, match="bad.safetensors.*checksum mismatch"):
        bank.load("bad")
    import editkit.bank.summing as bank_module

    def must_not_sum(*args, **kwargs):
        raise AssertionError("merge summed before verifying every checksum")

    monkeypatch.setattr(bank_module, "merge_key", must_not_sum)
    with pytest.raises(CorruptVectorError, match="checksum mismatch"):
        bank.merge({"good": 1.0, "bad": 1.0})
    problems = bank.verify()
    assert len(problems) == 1 and "bad.safetensors" in problems[0]
    assert torch.equal(bank.load("good")["w"], vector(0)["w"])


def test_truncated_and_missing_files_are_corrupt(bank: Bank) -> None:
    add(bank, "cut", seed=0)
    add(bank, "gone", seed=1)
    path = bank.root / "cut.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    (bank.root / "gone.safetensors").unlink()
    with pytest.raises(CorruptVectorError, match="cut.safetensors.*truncated or unreadable"):
        bank.load("cut")
    with pytest.raises(CorruptVectorError, match="gone.safetensors.*missing"):
        bank.load("gone")
    with pytest.raises(CorruptVectorError):
        bank.merge({"cut": 1.0})
    problems = bank.verify()
    assert len(problems) == 2


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]",
                                     b'{"format": 2, "base": null, "vectors": []}',
                                     b'{"format": 1, "base": null, "vectors": [{"name": "x"}]}'])
def test_damaged_manifest_is_a_bank_error_naming_the_file(bank: Bank, content: bytes) -> None:
    add(bank, "v")
    (bank.root / "manifest.json").write_bytes(content)
    with pytest.raises(BankError, match="manifest.json"):
        bank.entries()
    with pytest.raises(BankError, match="manifest.json"):
        add(bank, "w", seed=1)
    assert (bank.root / "manifest.json").read_bytes() == content
    assert bank.verify() and "manifest.json" in bank.verify()[0]


# --------------------------------------------------------------------------- remove and metrics


def test_remove(bank: Bank) -> None:
    add(bank, "a", seed=0)
    add(bank, "b", seed=1)
    bank.remove("a")
    assert bank.names() == ["b"] and not (bank.root / "a.safetensors").exists()
    assert torch.equal(bank.load("b")["w"], vector(1)["w"]) and bank.verify() == []
    before = snapshot(bank.root)
    with pytest.raises(BankError, match="'a'"):
        bank.remove("a")
    assert snapshot(bank.root) == before
    bank.remove("b")
    assert len(bank) == 0 and bank.base is None
    add(bank, "c", base=OTHER_BASE)  # an emptied bank accepts any base
    assert bank.base == OTHER_BASE


def test_update_metrics_merges(bank: Bank) -> None:
    add(bank, "a", metrics={"acc": 0.1, "loss": 2.0})
    add(bank, "b", seed=1)
    updated = bank.update_metrics("a", {"acc": 0.9, "forgetting": 0.05})
    assert updated.metrics == {"acc": 0.9, "loss": 2.0, "forgetting": 0.05}
    assert Bank(bank.root).get("a").metrics == updated.metrics
    assert Bank(bank.root).get("a").checksum == updated.checksum
    with pytest.raises(BankError, match="'zzz'"):
        bank.update_metrics("zzz", {"acc": 1.0})


def test_provenance_is_stored_apart_from_metrics_and_survives_metric_updates(bank: Bank) -> None:
    provenance = {"scenario_file": "/scenarios/mini.toml", "build": {"backbone": {"model": "ViT-B-32"}, "tasks": {}}}
    add(bank, "a", metrics={"acc": 0.1}, provenance=provenance)
    bank.update_metrics("a", {"acc": 0.9})
    entry = Bank(bank.root).get("a")
    assert entry.provenance == provenance and entry.metrics == {"acc": 0.9}
    stored = json.loads(bank.manifest_path.read_text())["vectors"][0]
    assert stored["provenance"] == provenance and "build" not in stored["metrics"]


def test_manifest_written_before_provenance_existed_is_understood(bank: Bank) -> None:
    """Older streams kept the scenario file and the build options inside ``metrics``."""
    add(bank, "a")
    manifest = json.loads(bank.manifest_path.read_text())
    old = {key: value for key, value in manifest["vectors"][0].items() if key != "provenance"}
    build = {"backbone": {"pretrained": "/weights/clip.pt"}, "tasks": {"data_root": "/data"}}
    old["metrics"] = {"single_task": 0.8, "scenario_file": "/scenarios/mini.toml", "build": build}
    manifest["vectors"] = [old]
    bank.manifest_path.write_text(json.dumps(manifest))

    entry = bank.get("a")
    assert entry.provenance == {"scenario_file": "/scenarios/mini.toml", "build": build}
    assert entry.metrics == {"single_task": 0.8}
    assert torch.equal(bank.load("a")["w"], vector(0)["w"]) and bank.verify() == []
    bank.update_metrics("a", {"merged": 0.7})  # a rewrite stores the new layout
    stored = json.loads(bank.manifest_path.read_text())["vectors"][0]
    assert stored["provenance"]["build"] == build and stored["metrics"] == {"single_task": 0.8, "merged": 0.7}


# --------------------------------------------------------------------------- crash injection


def child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)


CHILD_PRELUDE = """
    import os, signal, sys, time, torch
    from editkit.bank.store import Bank

    def vector(seed):
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g),
                "s": torch.randn((), generator=g)}
"""

CRASHES = {
    # dies while the tensor file is still a temp file (its first fsync)
    "during-tensor-write": """
        os.fsync = lambda fd: os._exit(1)
    """,
    # tensor file renamed into place, killed before the manifest is touched
    "after-tensor-rename": """
        real = os.replace
        def replace(src, dst, *a, **k):
            real(src, dst, *a, **k)
            if str(dst).endswith(".safetensors"):
                os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace
    """,
    # new manifest fully written to its temp file, dies instead of renaming it
    "before-manifest-rename": """
        real = os.replace
        def replace(src, dst, *a, **k):
            if str(dst).endswith("manifest.json"):
                os._exit(1)
            return real(src, dst, *a, **k)
        os.replace = replace
    """,
}


@pytest.mark.parametrize("stage", list(CRASHES))
def test_crash_mid_append_leaves_previous_bank(bank: Bank, stage: str) -> None:
    add(bank, "v1", seed=1)
    before = (bank.root / "manifest.json").read_bytes()
    code = CHILD_PRELUDE + textwrap.indent(textwrap.dedent(CRASHES[stage]), "    ") + """
    Bank(sys.argv[1]).append("v2", vector(2), task="t", mode="nonlinear", base=sys.argv[2])
    sys.exit(0)
    """
    result = run_child(code, str(bank.root), BASE)
    assert result.returncode != 0, "the crash was not injected"

    reopened = Bank(bank.root)
    assert (bank.root / "manifest.json").read_bytes() == before
    assert reopened.verify() == []
    assert reopened.names() == ["v1"]
    assert torch.equal(reopened.load("v1")["w"], vector(1)["w"])
    assert reopened.orphans(), "the interrupted write should have left an (ignored) orphan"

    add(reopened, "v2", seed=2)
    assert reopened.names() == ["v1", "v2"] and reopened.verify() == []
    assert all(torch.equal(reopened.load("v2")[k], v) for k, v in vector(2).items())


# --------------------------------------------------------------------------- concurrency


def test_two_processes_appending_at_once_all_land(bank: Bank) -> None:
    bank.root.mkdir(parents=True)
    code = CHILD_PRELUDE + """
    root, base, worker = sys.argv[1], sys.argv[2], int(sys.argv[3])
    bank = Bank(root)
    open(os.path.join(root, f"ready{worker}"), "w").close()
    while not os.path.exists(os.path.join(root, "go")):
        time.sleep(0.001)
    for i in range(5):
        seed = 10 * worker + i
        bank.append(f"w{worker}-{i}", vector(seed), task=f"t{seed}", mode="linear", base=base)
    """
    children = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(bank.root), BASE, str(w)],
                                 cwd=REPO, env=child_env(), stderr=subprocess.PIPE, text=True) for w in (1, 2)]
    try:
        deadline = time.monotonic() + 60
        while not all((bank.root / f"ready{w}").exists() for w in (1, 2)):
            assert time.monotonic() < deadline and all(c.poll() is None for c in children)
            time.sleep(0.01)
        (bank.root / "go").touch()
        for child in children:
            _, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for marker in ("ready1", "ready2", "go"):
        (bank.root / marker).unlink()

    reopened = Bank(bank.root)
    assert reopened.verify() == [] and reopened.orphans() == []
    assert sorted(reopened.names()) == sorted(f"w{w}-{i}" for w in (1, 2) for i in range(5))
    for w in (1, 2):
        names = [n for n in reopened.names() if n.startswith(f"w{w}-")]
        assert names == [f"w{w}-{i}" for i in range(5)]  # each writer's order is kept
        for i in range(5):
            loaded = reopened.load(f"w{w}-{i}", base=BASE)
            assert all(torch.equal(loaded[k], v) for k, v in vector(10 * w + i).items())


def test_shapes_read_the_header_and_stay_inside_the_bank(bank: Bank, tmp_path: Path) -> None:
    add(bank, "v", seed=3)
    assert bank.shapes("v") == {"w": (4, 3), "b": (4,), "s": ()}
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((bank.root / "v.safetensors").read_bytes())
    manifest = json.loads(bank.manifest_path.read_text())
    manifest["vectors"][0]["file"] = "../outside.safetensors"  # a hand-edited manifest pointing out of the bank
    bank.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(BankError, match="unsafe file"):
        bank.shapes("v")


# --------------------------------------------------------------------------- class prototypes


def prototypes(seed: int = 0, classes: int = 3, dim: int = 5):
    from helpers.prototypes import random_prototypes

    return random_prototypes(classes, dim, seed)


def same_prototypes(a, b) -> bool:
    return all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.to_tensors().values(),
                                                                           b.to_tensors().values()))


def test_prototypes_round_trip_bit_exact_beside_their_vector(bank: Bank) -> None:
    stored = prototypes()
    entry = add(bank, "a", prototypes=stored)
    assert entry.prototypes["file"] == "a.prototypes-2.safetensors" and entry.prototypes["checksum"].startswith("sha256:")
    assert {k: entry.prototypes[k] for k in ("format", "classes", "features", "examples")} == stored.describe()
    assert same_prototypes(Bank(bank.root).prototypes("a"), stored)
    assert Bank(bank.root).get("a").prototypes == entry.prototypes  # the manifest keeps the record
    add(bank, "b", seed=1)
    assert bank.prototypes("b") is None and "prototypes" not in bank.get("b").to_json()
    assert bank.verify() == [] and bank.orphans() == []


def test_set_prototypes_fills_in_an_entry_banked_without_them_and_touches_nothing_else(bank: Bank) -> None:
    add(bank, "a")
    add(bank, "b", seed=1, prototypes=prototypes(1))
    before = snapshot(bank.root)
    stored = prototypes(2)
    entry = bank.set_prototypes("a", stored)
    after = snapshot(bank.root)
    assert set(after) - set(before) == {"a.prototypes-2.safetensors"}
    assert all(after[name] == before[name] for name in before if name != "manifest.json")
    assert same_prototypes(bank.prototypes("a"), stored) and bank.get("a") == entry
    assert {k: v for k, v in entry.to_json().items() if k != "prototypes"} == {
        k: v for k, v in json.loads(before["manifest.json"])["vectors"][0].items()}
    with pytest.raises(BankError, match="vector 'a' of bank .* already has its class prototypes"):
        bank.set_prototypes("a", prototypes(3))
    with pytest.raises(BankError, match="no vector named 'zz'"):
        bank.set_prototypes("zz", stored)
    assert snapshot(bank.root) == after


def test_removing_a_vector_removes_its_prototypes(bank: Bank) -> None:
    add(bank, "a", prototypes=prototypes())
    add(bank, "b", seed=1)
    bank.remove("a")
    assert not (bank.root / "a.prototypes-2.safetensors").exists() and bank.orphans() == []


def test_damaged_prototype_files_are_refused_by_name(bank: Bank) -> None:
    add(bank, "a", prototypes=prototypes())
    path = bank.root / "a.prototypes-2.safetensors"
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[-3] ^= 0xFF
    path.write_bytes(bytes(damaged))
    with pytest.raises(CorruptVectorError, match="a.prototypes-2.safetensors: checksum mismatch"):
        bank.prototypes("a")
    assert any("a.prototypes-2.safetensors" in problem for problem in bank.verify())
    path.write_bytes(original[: len(original) // 2])
    with pytest.raises(CorruptVectorError, match="a.prototypes-2.safetensors is truncated or unreadable"):
        bank.prototypes("a")
    path.unlink()
    with pytest.raises(CorruptVectorError, match="a.prototypes-2.safetensors of 'a' is missing"):
        bank.prototypes("a")


def rewrite_with_checksum(bank: Bank, name: str, tensors: dict, header: dict) -> None:
    """Replace an entry's prototype file and its manifest checksum alike: what only a bug or a hand edit does."""
    from safetensors.torch import save_file

    path = bank.root / f"{name}.prototypes-2.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=header)
    manifest = json.loads(bank.manifest_path.read_text())
    manifest["vectors"][0]["prototypes"]["checksum"] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    bank.manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "counts": t["counts"][:2]}, "one count per class"),
    (lambda t: {**t, "pretrained": t["pretrained"][:, :4]}, "one count per class"),
    (lambda t: {k: v for k, v in t.items() if k != "merged"}, "lack tensor.s. merged"),
    (lambda t: {k: v if k.endswith("scatter") else v[:2] for k, v in t.items()},
     "holds .*'classes': 2.*, its manifest entry says .*'classes': 3"),
])
def test_prototypes_of_the_wrong_shape_are_refused_by_file_even_with_a_matching_checksum(bank, change, message):
    stored = prototypes()
    add(bank, "a", prototypes=stored)
    rewrite_with_checksum(bank, "a", change(stored.to_tensors()), stored.header())
    with pytest.raises(CorruptVectorError, match=f"prototype file .*a.prototypes-2.safetensors of 'a' .*{message}"):
        bank.prototypes("a")


def test_prototypes_of_another_format_are_refused(bank: Bank) -> None:
    stored = prototypes()
    add(bank, "a", prototypes=stored)
    rewrite_with_checksum(bank, "a", stored.to_tensors(), {"format": "prototypes-0"})
    with pytest.raises(CorruptVectorError, match="is not what editkit wrote .prototype format 'prototypes-0'"):
        bank.prototypes("a")
