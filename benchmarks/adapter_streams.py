"""LoRA adapter vectors against full vectors, in the streams users run, measured in one run.

For each scenario (default ``offline-vision`` and ``offline-text``) and each variant, one whole stream
(``editkit.runs.stream.run_scenario``, fresh bank) in a fresh process, so each variant's peak RSS is its own:

- ``full``: the scenario's recipe in ``--mode`` (default taujp), every trainable parameter;
- ``adapter``: the same recipe with a LoRA adapter (``adapter = "lora"``; in taujp mode L-LoRA + the penalty)
  at the scenario's ``lora_rank`` / ``lora_alpha`` / ``lora_lr`` (LoRA factors move the weights through a
  product of small matrices and want a larger step than full fine-tuning; the scenario files hold the
  settings chosen on the streams' own merged scores), or ``--lora-rank`` / ``--lora-alpha`` /
  ``--adapter-lr SCENARIO=LR``.

Reported per variant: absolute / normalized accuracy of the final merged model at alpha = 1 (the stream's
own), seconds per training step (mean over the experiences, each one's ``seconds_per_step``) and its ratio to
the full step, peak RSS of the process, bytes of one banked vector and its share of the full vector's.

    python benchmarks/adapter_streams.py [--scenarios offline-vision,offline-text] [--mode taujp]
                                         [--lora-rank R] [--lora-alpha A] [--adapter-lr offline-text=1e-2]
                                         [--json runs/adapter_streams.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = ("full", "adapter")


def one(scenario: str, variant: str, mode: str, rank: int | None, alpha: float | None, lr: float | None) -> dict:
    """One stream in this process; returns its record (peak RSS read at the end: the process's own peak)."""
    import editkit  # noqa: F401
    from editkit.runs.stream import run_scenario
    from editkit.util.memory import lifetime_peak_rss

    overrides: dict = {"mode": mode}
    if variant == "adapter":
        overrides.update(adapter="lora", lora_rank=rank, lora_alpha=alpha, lora_lr=lr)  # None: the scenario's
    with tempfile.TemporaryDirectory() as tmp:
        result, report = run_scenario(scenario, bank=Path(tmp) / "bank", run_dir=Path(tmp) / "run", **overrides)
        sizes = [p.stat().st_size for p in (Path(tmp) / "bank").glob("*.safetensors")]
    final = report["final"]
    return {"scenario": scenario, "variant": variant, "recipe": report["recipe"],
            "absolute": final["absolute"], "normalized": final["normalized"],
            "seconds_per_step": statistics.mean(s["seconds_per_step"] for s in report["steps"]),
            "stream_seconds": report["seconds"],
            "peak_rss_bytes": lifetime_peak_rss(),
            "vector_bytes": statistics.mean(sizes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="offline-vision,offline-text")
    parser.add_argument("--mode", default="taujp")
    parser.add_argument("--lora-rank", type=int, default=None, help="default: the scenario's lora_rank")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: the scenario's lora_alpha")
    parser.add_argument("--adapter-lr", action="append", default=[], metavar="SCENARIO=LR",
                        help="the adapter's learning rate for a scenario (default: the scenario's lora_lr)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # SCENARIO:VARIANT, in a child process
    args = parser.parse_args()
    lrs = {k: float(v) for k, _, v in (item.partition("=") for item in args.adapter_lr)}
    if args.one:
        scenario, variant = args.one.split(":")
        record = one(scenario, variant, args.mode, args.lora_rank, args.lora_alpha, lrs.get(scenario))
        print("RECORD " + json.dumps(record))
        return
    records = []
    for scenario in args.scenarios.split(","):
        for variant in VARIANTS:
            command = [sys.executable, __file__, "--one", f"{scenario}:{variant}", "--mode", args.mode,
                       *[f"--adapter-lr={k}={v}" for k, v in lrs.items()],
                       *[arg for name in ("lora_rank", "lora_alpha") if getattr(args, name) is not None
                         for arg in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]]
            done = subprocess.run(command, capture_output=True, text=True)
            line = next((l for l in done.stdout.splitlines() if l.startswith("RECORD ")), None)
            if done.returncode != 0 or line is None:
                raise SystemExit(f"{scenario} {variant} failed:\n{done.stderr[-3000:]}")
            records.append(json.loads(line[len("RECORD "):]))
            print(f"{scenario} {variant}: done in {records[-1]['stream_seconds']:.0f} s", flush=True)
    print(f"\n{'scenario':16} {'variant':8} {'abs':>6} {'norm':>6} {'s/step':>7} {'x full':>7} {'peak GB':>8} "
          f"{'vector MB':>10} {'% full':>7}")
    for r in records:
        full = next(f for f in records if f["scenario"] == r["scenario"] and f["variant"] == "full")
        r["step_ratio"] = r["seconds_per_step"] / full["seconds_per_step"]
        r["vector_share"] = r["vector_bytes"] / full["vector_bytes"]
        print(f"{r['scenario']:16} {r['variant']:8} {100 * r['absolute']:6.1f} {100 * r['normalized']:6.1f} "
              f"{r['seconds_per_step']:7.3f} {r['step_ratio']:7.2f} {r['peak_rss_bytes'] / 1e9:8.2f} "
              f"{r['vector_bytes'] / 1e6:10.2f} {100 * r['vector_share']:6.1f}%")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
