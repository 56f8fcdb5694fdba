"""``benchmarks/gpu_step_cost.py`` (the paper's GPU step setting) runs on a CPU with a tiny CLIP: its report holds
every mode's steps, and each ratio is the median over rounds of the two modes' per-round steps, as documented.
Also: a dataset whose inputs lie on the training device is batched in this process, unpinned."""

from __future__ import annotations

import json
import statistics
import sys

import torch

from editkit.data.tasks import TensorTaskDataset
from editkit.train.loop import _held_on_device
from editkit.train.runtime import Runtime
from helpers.benchmarks import benchmark_script


def test_the_gpu_benchmark_reports_each_mode_and_its_ratios(tmp_path, monkeypatch):
    out = tmp_path / "report.json"
    monkeypatch.setattr(sys, "argv", ["gpu_step_cost.py", "--model", "editkit-tiny-clip", "--device", "cpu",
                                      "--batch", "8", "--steps", "7", "--warmup", "2", "--rounds", "2",
                                      "--modes", "nonlinear,linear,taujp", "--json", str(out)])
    benchmark_script("gpu_step_cost").main()
    report = json.loads(out.read_text())
    assert report["batch_size"] == 8 and report["reg_batch"] == 1 and report["penalty_sources"] == 7
    assert report["runtime"] == "cpu, bf16" and report["data"] == "device"
    rounds = report["seconds_per_step_rounds"]
    assert len(rounds) == 2 and all(set(r) == {"nonlinear", "linear", "taujp"} for r in rounds)
    assert report["taujp_over_linear"] == statistics.median(r["taujp"] / r["linear"] for r in rounds)
    assert report["linear_over_nonlinear"] == statistics.median(r["linear"] / r["nonlinear"] for r in rounds)
    assert "strict_over_linear" not in report  # its mode was not run
    assert all(v > 0 for v in report["seconds_per_step"].values())


def test_only_inputs_on_a_non_cpu_training_device_count_as_held_there():
    on_cpu = TensorTaskDataset(torch.zeros(4, 3), torch.zeros(4))
    elsewhere = TensorTaskDataset(torch.zeros(4, 3, device="meta"), torch.zeros(4, device="meta"))
    assert not _held_on_device(on_cpu, Runtime())
    assert not _held_on_device(elsewhere, Runtime())  # training on the CPU: nothing to gain
    assert _held_on_device(elsewhere, Runtime(device=torch.device("meta")))
    assert not _held_on_device(on_cpu, Runtime(device=torch.device("meta")))
