"""The memory rule of the merges, measured: over plain-LoRA vectors (weight updates computed one layer at a time
when read) TIES, DARE, MagMax and OPCM hold their merged vector plus about one layer per vector, never every
vector's updates. Each method runs in a fresh process (``benchmarks/merge_memory.py --one``), whose peak
resident memory above its level before the merge is compared with the sizes involved."""

from __future__ import annotations

import pytest

from helpers.benchmarks import benchmark_script

TASKS, LAYERS, WIDTH = 8, 8, 1024
MODEL = LAYERS * WIDTH**2 * 4  # M: the merged vector's float32 updates (32 MiB)
LAYER = WIDTH**2 * 4  # m: one layer's (4 MiB)


@pytest.mark.parametrize("method", ["ties", "dare", "magmax", "opcm"])
def test_a_merge_holds_one_model_plus_about_one_layer_per_vector(method):
    arguments = ["--layers", str(LAYERS), "--width", str(WIDTH), "--rank", "4", "--tasks", str(TASKS)]
    record = benchmark_script("merge_memory").run_child(method, arguments)
    assert record["model_bytes"] == MODEL and record["outputs"] == 1
    # M for the merged vector, M more for TIES' one-vector threshold pass (the two never coexist, but the
    # allocator's high-water mark may keep both), T layers and a few layers of float64 work: 3M + T m = 128 MiB,
    # where holding every vector's updates would take T M = 256 MiB before any work
    assert record["peak_bytes"] < 3 * MODEL + TASKS * LAYER, record
