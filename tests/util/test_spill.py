"""SpillingTensors: what fits the budget stays in memory, the rest round-trips through disk bit for bit."""

from __future__ import annotations

import torch

from editkit.util.spill import SpillingTensors


def test_tensors_past_the_budget_spill_and_come_back_bit_exact(tmp_path):
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(10, 7, generator=g) for _ in range(3))  # 280 bytes each
    store = SpillingTensors(600, tmp_path)
    store["a"], store["b"], store["c"] = a, b, c
    assert store.held_bytes == 560 and store.spilled == ["c"]
    assert all(torch.equal(store[k], v) for k, v in {"a": a, "b": b, "c": c}.items())
    assert store["c"] is not c  # read back from its file
    assert len(list(tmp_path.rglob("*.safetensors"))) == 1


def test_replacing_and_popping_free_their_place(tmp_path):
    store = SpillingTensors(0, tmp_path)
    store["s"] = torch.ones(3)
    store["s"] = torch.full((3,), 2.0)  # the old file goes
    assert torch.equal(store["s"], torch.full((3,), 2.0)) and len(list(tmp_path.rglob("*.safetensors"))) == 1
    store.pop("s")
    assert "s" not in store and list(tmp_path.rglob("*.safetensors")) == []
    store.pop("never")  # no error


def test_close_removes_what_it_made_and_nothing_else(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    store = SpillingTensors(0, tmp_path)
    store["x"] = torch.arange(4.0)
    store.close()
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"] and "x" not in store


def test_nothing_is_written_while_everything_fits(tmp_path):
    store = SpillingTensors(1 << 20, tmp_path / "spill")
    store["x"] = torch.zeros(100)
    store.close()
    assert not (tmp_path / "spill").exists()
