"""Peak memory of each merge method over plain-LoRA vectors, against the memory rule the merges keep.

Plain-LoRA vectors are merged as weight updates s·B·A (``editkit.core.adapters.LoraWeights``), computed one
layer at a time when a method reads them; a method that also reads layer by layer then holds, besides its
merged vector (one model's worth of updates, M), one layer's update per vector (T·m). That is the rule:
peak ≈ M + T·m, whatever the number of vectors, where holding every vector's updates would cost T·M.

Each method runs in a fresh process on T random plain-LoRA vectors (rank r on L square layers of width d,
factors in memory: a few MB); the peak RSS above the process's level before the merge is reported in units
of M, with T·M beside it. The process runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``),
so every large tensor is its own mapping, returned when freed, and RSS follows the live tensors (with the
default, moving threshold, freed blocks are reused from the heap and its fragmentation inflates the peak).
The structured merges (TSV, Iso-C/CTS, CART) work one layer at a time over every vector by design and can
be measured the same way (``--methods``).

    python benchmarks/merge_memory.py [--layers 24] [--width 1024] [--rank 8] [--tasks 8]
                                      [--methods ties,dare,magmax,opcm] [--json runs/merge_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 2**20
#: Environment of a measuring process: large tensors mapped and unmapped one by one (see the docstring).
MEASURING = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}


def lora_vectors(tasks: int, layers: int, width: int, rank: int) -> list[dict]:
    """T plain-LoRA vectors (A, B per layer, random, seeded), as a bank stores them."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [{**{f"layers.{i}.lora_A.default.weight": torch.randn(rank, width, generator=generator) / width**0.5
                for i in range(layers)},
             **{f"layers.{i}.lora_B.default.weight": torch.randn(width, rank, generator=generator) / rank**0.5
                for i in range(layers)}}
            for _ in range(tasks)]


def measure(method: str, args: argparse.Namespace) -> dict:
    """Run ``method`` once in this process over lazy weight-update views; its peak RSS above the start."""
    import editkit  # noqa: F401  (its import sets up torch as every editkit process does)
    from editkit.core.adapters import LoraWeights
    from editkit.merge import MERGE_METHODS, LazyVectors, method_options
    from editkit.util.memory import lifetime_peak_rss, release_freed_memory

    def views(layers: int, width: int) -> LazyVectors:
        factors = lora_vectors(args.tasks, layers, width, args.rank)
        names = [f"t{i}" for i in range(args.tasks)]
        return LazyVectors(names, lambda name: LoraWeights(factors[names.index(name)], 2.0))

    build = MERGE_METHODS[method].build
    build(views(2, 64), **method_options(method, {}))  # warm-up: thread pools and BLAS buffers are not the merge's
    vectors = views(args.layers, args.width)
    release_freed_memory()
    before = lifetime_peak_rss()
    merged = build(vectors, **method_options(method, {}))
    peak = lifetime_peak_rss() - before
    model = args.layers * args.width**2 * 4  # M: one model's worth of float32 updates
    return {"method": method, "peak_bytes": peak, "model_bytes": model, "layer_bytes": args.width**2 * 4,
            "peak_in_models": peak / model, "outputs": len(merged)}


def run_child(method: str, shape: list[str]) -> dict:
    """:func:`measure` of ``method`` in a fresh process (``shape``: the command line's size options)."""
    done = subprocess.run([sys.executable, __file__, "--one", method, *shape], capture_output=True, text=True,
                          env={**os.environ, **MEASURING})
    line = next((l for l in done.stdout.splitlines() if l.startswith("RECORD ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RECORD "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--methods", default="ties,dare,magmax,opcm",
                        help="also tsv, iso-c, iso-cts, cart (an SVD per layer and vector: minutes at these sizes)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a method, in a child process
    args = parser.parse_args()
    shape = ["--layers", str(args.layers), "--width", str(args.width), "--rank", str(args.rank),
             "--tasks", str(args.tasks)]
    if args.one:
        print("RECORD " + json.dumps(measure(args.one, args)))
        return
    records = [run_child(method, shape) for method in args.methods.split(",")]
    model, layer = records[0]["model_bytes"], records[0]["layer_bytes"]
    print(f"{args.tasks} plain-LoRA vectors, rank {args.rank}, {args.layers} layers of {args.width}²: "
          f"M = {model / MIB:.0f} MiB of updates, one layer m = {layer / MIB:.0f} MiB, "
          f"M + T·m = {(model + args.tasks * layer) / MIB:.0f} MiB, T·M = {args.tasks * model / MIB:.0f} MiB")
    print(f"{'method':10} {'peak MiB':>9} {'× M':>6}")
    for r in records:
        print(f"{r['method']:10} {r['peak_bytes'] / MIB:9.0f} {r['peak_in_models']:6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"shape": vars(args) | {"json": str(args.json)}, "records": records}, indent=2))


if __name__ == "__main__":
    main()
