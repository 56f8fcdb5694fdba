"""Cost of one training step per mode, measured in one process.

Runs ``editkit.train.loop.fine_tune`` for each mode on the same task, batch and
sources; takes every step's own duration from the run (``FineTuneResult.times``; median after
warm-up) and samples the process's resident memory while each mode runs. Prints ratios
against the plain (non-linear) step and writes them as JSON.

- classification scenarios (default ``offline-vision``; ``offline-text`` too): nonlinear, linear,
  taujp (the scenario's own penalty recipe), the paper's cyclic and strict schedules (batch / 8 reg rows
  beside a full batch), mixed (``--mixed-reg-batch`` rows beside a full batch), taujp-nonlinear
  (cyclic: plain steps plus the penalty's jvp on the reg batch only) and the data-free penalty (``kfac``, the
  sources' curvature summed or apart, computed once before the timed runs; ``taujp_kfac_energy``: summed, each
  factor cut to ``--curvature-energy`` of its trace, default 0.9; ``taujp_kfac_bf16``: summed, the step's products in
  bfloat16) and the scenario's penalty beside earlier vectors
  (``taujp_from_sum``), on the first task with the others
  (and the generic source) as penalty sources; ``--labels`` times some of them only;
- language scenarios (``--scenario toxic``): nonlinear, linear and taujp for each
  number of trainable decoder blocks in ``--blocks`` (default 1, 4 and all), with the
  scenario's batch (8 x 64 tokens) and reg batch (4 sequences); the frozen prefix's
  hidden states are computed before the timed steps, as a run caches them.

The allocator is tuned as ``editkit`` commands tune it on a CPU (freed memory kept for
reuse, ``editkit.util.memory.keep_freed_memory``), and each mode's memory window starts
with the freed memory handed back, so the modes' peaks do not carry each other's.
``--channels-last`` runs every mode with the backbone's weights channels-last (the runtime
option of the same name). ``--rounds R`` (classification scenarios, default 3) runs the modes in turn
R times; each ratio is the median over rounds of the ratio of the two modes' median steps in that round,
so the two steps compared ran minutes apart at most and a slow spell of the host spoils one round, not
the result (the rounds' ratios are printed, so a spread shows). ``--threads`` pins torch's threads (default:
the cores torch sees), recorded with the results. ``--flops`` (classification scenarios) runs each recipe once
more under torch's FLOP counter and adds FLOPs per step and their ratios (``flops_ratios``, the same names),
and the scenario's own penalty against ``linear`` over every task of a stream (``stream_taujp_over_linear_flops``):
a cost the host's slow spells do not move, beside the timed one they do.

    python benchmarks/step_cost.py [--scenario toxic] [--steps 30] [--warmup 5] [--rounds 3] [--threads N]
                                   [--channels-last] [--mixed-reg-batch N] [--curvature-energy E] [--flops]
                                   [--json runs/step_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import time

import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from editkit.core.adapters import trainable_names
from editkit.core.curvature import Curvature, source_curvature
from editkit.util.memory import PeakRSS, keep_freed_memory
from editkit.train.recipe import Recipe
from editkit.scenario.spec import load_scenario
from editkit.scenario.build import build_scenario
from editkit.core.taujp import UnlabeledSource, unlabeled_source
from editkit.train.loop import fine_tune
from editkit.train.runtime import Runtime

RATIOS = {  # name -> (label over label), each the median over rounds of the round's ratio
    "linear_over_nonlinear": ("linear", "nonlinear"),
    "taujp_over_linear": ("taujp", "linear"),
    "cyclic_over_linear": ("taujp_cyclic", "linear"),
    "strict_over_linear": ("taujp_strict", "linear"),
    "mixed_over_linear": ("taujp_mixed", "linear"),
    "taujp_nonlinear_over_nonlinear": ("taujp_nonlinear", "nonlinear"),
    "kfac_over_linear": ("taujp_kfac", "linear"),
    "kfac_apart_over_linear": ("taujp_kfac_apart", "linear"),
    "kfac_energy_over_linear": ("taujp_kfac_energy", "linear"),
    "kfac_bf16_over_linear": ("taujp_kfac_bf16", "linear"),
    "from_sum_over_taujp": ("taujp_from_sum", "taujp"),
}


def variants(recipe: Recipe, mixed_reg_batch: int | None, energy: float) -> dict[str, Recipe]:
    """label -> the recipe its runs train with. ``taujp`` is the scenario's own penalty (its schedule, reg rows
    and where they ride); beside it the paper's schedules, batch // 8 reg rows beside a full batch (``mixed``:
    ``mixed_reg_batch`` rows, default the scenario's reg batch); ``taujp_nonlinear`` penalises as cyclic does;
    ``taujp_kfac_energy`` keeps ``energy`` of each factor's trace (the cheaper, lossy curvature), ``taujp_kfac_bf16``
    multiplies the factors in bfloat16;
    ``taujp_from_sum`` is the scenario's penalty fine-tuned beside earlier vectors (the reg rows' jvp apart from the
    task rows')."""
    paper = {"reg_batch": max(1, recipe.batch_size // 8), "reg_within_batch": False}
    return {
        "nonlinear": recipe.with_overrides(mode="nonlinear"),
        "linear": recipe.with_overrides(mode="linear"),
        "taujp": recipe.with_overrides(mode="taujp"),
        "taujp_cyclic": recipe.with_overrides(mode="taujp", schedule="cyclic", **paper),
        "taujp_strict": recipe.with_overrides(mode="taujp", schedule="strict", **paper),
        "taujp_mixed": recipe.with_overrides(mode="taujp", schedule="mixed", reg_within_batch=False,
                                             reg_batch=mixed_reg_batch or recipe.reg_batch_size),
        "taujp_nonlinear": recipe.with_overrides(mode="taujp-nonlinear", schedule="cyclic", **paper),
        "taujp_kfac": recipe.with_overrides(mode="taujp", penalty="kfac"),
        "taujp_kfac_apart": recipe.with_overrides(mode="taujp", penalty="kfac", curvature_combine="apart"),
        "taujp_kfac_energy": recipe.with_overrides(mode="taujp", penalty="kfac", curvature_energy=energy),
        "taujp_kfac_bf16": recipe.with_overrides(mode="taujp", penalty="kfac", curvature_precision="bf16"),
        "taujp_from_sum": recipe.with_overrides(mode="taujp", from_sum=True),
    }


def train(built, recipe: Recipe, sources: list[UnlabeledSource], runtime: Runtime, task=None):
    """One fine-tune of ``task`` (default the first), the reg batches drawn from the start (every run draws the
    same ones); with the data-free penalty, the sources' curvature instead; with ``from_sum``, beside a zero sum
    of earlier vectors (a step costs what it costs whatever their values)."""
    task = task or built.tasks[0]
    for source in sources:
        source.restart()
    penalty = (recipe.curvature_regularizer(curvatures(built, recipe, sources)) if recipe.penalty == "kfac"
               else recipe.regularizer(sources))
    module = built.backbone.module
    beside = ({n: torch.zeros_like(p) for n, p in module.named_parameters() if n in trainable_names(module)}
              if recipe.from_sum else None)
    return fine_tune(module, built.heads[task.name], task.train, recipe, penalty,
                     batching=built.backbone.batching, runtime=runtime, beside=beside)


#: (id of the source, examples, energy) -> its curvature: computed once, before the runs that read it
_CURVATURES: dict[tuple[int, int, float], Curvature] = {}


def curvatures(built, recipe: Recipe, sources: list[UnlabeledSource]) -> list[Curvature]:
    """The sources' curvature at theta_0, as a stream banks a task's (its first ``curvature_examples`` inputs)."""
    module = built.backbone.module
    for source in sources:
        key = (id(source), recipe.curvature_examples, recipe.curvature_energy)
        if key not in _CURVATURES:
            start = time.perf_counter()
            _CURVATURES[key] = source_curvature(module, source, examples=recipe.curvature_examples,
                                                batching=built.backbone.batching, names=trainable_names(module),
                                                seed=recipe.seed, energy=recipe.curvature_energy)
            print(f"curvature of {source.name}: {time.perf_counter() - start:.1f} s, "
                  f"{_CURVATURES[key].nbytes / 2**20:.1f} MiB", flush=True)
    return [_CURVATURES[(id(s), recipe.curvature_examples, recipe.curvature_energy)] for s in sources]


def measure(built, recipe: Recipe, sources: list[UnlabeledSource], warmup: int,
            runtime: Runtime) -> tuple[list[float], float]:
    """(seconds of each timed step, peak RSS in MB) of one fine-tune of the first task."""
    with PeakRSS() as rss:
        result = train(built, recipe, sources, runtime)
        peak = rss.window()
    return result.times.steps[warmup:], peak / 2**20


def count_flops(built, recipe: Recipe, sources: list[UnlabeledSource], runtime: Runtime, task=None) -> float:
    """Floating-point operations per step of one fine-tune of ``task`` (default the first), as torch's FLOP
    counter counts them (matrix products and convolutions: the forward, the jvp's tangents and the backward).
    A count no slow spell of the host moves: where timed rounds spread by more than the gap being measured,
    it says what the extra rows cost the arithmetic. Elementwise work and the optimizer are not counted."""
    with flop_counter() as counter:
        train(built, recipe, sources, runtime, task)
    return counter.get_total_flops() / recipe.steps


def stream_flops(built, recipe: Recipe, runtime: Runtime) -> float:
    """FLOPs per step over every task of the stream in order, each penalised on the sources a stream (scope
    ``seen``) gives it: the tasks before it and the generic source. Text tasks differ in length, so the first
    task's ratio is not the stream's."""
    collate = built.backbone.batching.collate
    seen = [unlabeled_source(t.name, t.train, collate=collate) for t in built.tasks]
    generic = [built.generic] if built.generic is not None else []
    total = sum(count_flops(built, recipe, seen[:i] + generic, runtime, task) for i, task in enumerate(built.tasks))
    return total / len(built.tasks)


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter with a convolution's backward counted per group. torch's own formula leaves the groups
    out of the input gradient, so a depthwise convolution's backward counts as a dense one's: on EfficientNet-Lite0
    the backward read 40 times the forward (20.5 GFLOPs against 0.5 a step)."""
    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: conv_backward_flops})


def conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                        _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """Each gradient a convolution's backward computes (input, weight) multiplies as many pairs as its forward:
    the forward's count, whose weight shape already holds the per-group input channels, once per gradient."""
    forward = conv_flop_count(list(x_shape), list(w_shape), list(grad_out_shape), transposed=transposed)
    return forward * (int(output_mask[0]) + int(output_mask[1]))


def measure_language(spec, built, args) -> dict:
    """s/step and peak RSS per (K, mode) on a language scenario, with ratios per K."""
    from editkit.data.text import corpus_split, sequences
    from editkit.core.taujp import LazyUnlabeledSource
    from editkit.models.causal_lm import causal_lm_backbone

    lm, tokenizer = built.backbone.lm, built.backbone.tokenizer
    recipe0 = spec.recipe
    length = max(len(ids) for ids in built.tasks[0].train.ids)
    generic = spec.generic or {}
    results = {}
    for blocks in args.blocks.split(","):
        k = blocks if blocks == "all" else int(blocks)
        backbone = causal_lm_backbone(lm, tokenizer, trainable_blocks=k)
        train = sequences(backbone, corpus_split(spec.tasks[0].dataset, "train"), length,
                          limit=recipe0.batch_size * args.steps)
        clean = sequences(backbone, corpus_split(generic.get("corpus", "clean-news"), "train"), length,
                          limit=recipe0.reg_batch_size * args.steps)
        source = LazyUnlabeledSource("clean", clean, collate=backbone.batching.collate)
        per_mode = {}
        for mode in ("nonlinear", "linear", "taujp"):
            recipe = recipe0.with_overrides(mode=mode, steps=args.steps)
            regularizer = recipe.regularizer([source])
            with PeakRSS() as rss:
                result = fine_tune(backbone.module, backbone.head, train, recipe, regularizer,
                                   batching=backbone.batching)
                peak = rss.window()
            durations = result.times.steps[args.warmup:]
            per_mode[mode] = {"seconds_per_step": statistics.median(durations), "peak_rss_mb": peak / 2**20}
            print(f"K={blocks:>3} {mode:>9}: {per_mode[mode]['seconds_per_step']:.3f} s/step  "
                  f"peak RSS {per_mode[mode]['peak_rss_mb']:.0f} MB", flush=True)
        sec = {m: v["seconds_per_step"] for m, v in per_mode.items()}
        mem = {m: v["peak_rss_mb"] for m, v in per_mode.items()}
        results[blocks] = {"modes": per_mode, "linear_over_nonlinear": sec["linear"] / sec["nonlinear"],
                           "taujp_over_linear": sec["taujp"] / sec["linear"],
                           "memory_over_nonlinear": {m: v / mem["nonlinear"] for m, v in mem.items()}}
    return {"scenario": spec.name, "batch_size": recipe0.batch_size, "tokens": length,
            "reg_batch": recipe0.reg_batch_size, "torch_threads": torch.get_num_threads(), "blocks": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="offline-vision")
    parser.add_argument("--steps", type=int, default=30, help="steps per mode, warm-up included")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--blocks", default="1,4,all", help="language scenarios: trainable decoder blocks to measure")
    parser.add_argument("--rounds", type=int, default=3, help="times every mode runs, in turn (classification)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, pinned")
    parser.add_argument("--channels-last", action="store_true", help="the backbone's 4-D weights channels-last")
    parser.add_argument("--mixed-reg-batch", type=int, default=None,
                        help="the mixed run's reg rows per step, beside a full batch (default: the scenario's reg batch)")
    parser.add_argument("--flops", action="store_true",
                        help="also count each recipe's FLOPs per step (one more untimed run each) and their ratios")
    parser.add_argument("--curvature-energy", type=float, default=0.9,
                        help="share of each factor's trace the taujp_kfac_energy run keeps (default 0.9)")
    parser.add_argument("--labels", default=None,
                        help="comma-separated recipes to time (default: all of them; nonlinear and linear always run)")
    parser.add_argument("--json", type=Path, default=Path("runs/step_cost.json"))
    args = parser.parse_args()
    if args.steps - args.warmup < 5:
        parser.error("need at least 5 timed steps (steps - warmup >= 5)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    torch.set_num_threads(args.threads)
    keep_freed_memory()

    spec = load_scenario(args.scenario)
    built = build_scenario(spec)
    if spec.negation is not None:
        report = measure_language(spec, built, args)
        print(json.dumps({k: {r: v[r] for r in ("linear_over_nonlinear", "taujp_over_linear")}
                          for k, v in report["blocks"].items()}, indent=2))
        _write(args.json, report)
        return
    sources = [unlabeled_source(t.name, t.train, collate=built.backbone.batching.collate) for t in built.tasks[1:]]
    if built.generic is not None:
        sources.append(built.generic)
    # One untimed pass first: the process's first training steps pay one-off costs (allocator, kernels'
    # first calls) that the per-mode warm-up alone does not absorb.
    runtime = Runtime(channels_last=args.channels_last)
    measure(built, spec.recipe.with_overrides(mode="taujp", steps=args.warmup + 1), sources, args.warmup, runtime)
    recipes = variants(spec.recipe.with_overrides(steps=args.steps), args.mixed_reg_batch, args.curvature_energy)
    if args.labels:
        wanted = {"nonlinear", "linear", *args.labels.split(",")}
        if unknown := sorted(wanted - set(recipes)):
            parser.error(f"unknown labels {unknown}; known: {', '.join(recipes)}")
        recipes = {label: recipe for label, recipe in recipes.items() if label in wanted}
    rounds: list[dict[str, float]] = []  # per round, each mode's median step
    durations: dict[str, list[float]] = {label: [] for label in recipes}
    peaks: dict[str, list[float]] = {label: [] for label in recipes}
    for _ in range(args.rounds):
        rounds.append({})
        for label, recipe in recipes.items():
            timed, peak = measure(built, recipe, sources, args.warmup, runtime)
            rounds[-1][label] = statistics.median(timed)
            durations[label] += timed
            peaks[label].append(peak)
    ratios = {name: pair for name, pair in RATIOS.items() if set(pair) <= set(recipes)}
    results = {label: {"seconds_per_step": statistics.median(durations[label]), "steps_timed": len(durations[label]),
                       "peak_rss_mb": max(peaks[label])} for label in recipes}
    for label, result in results.items():
        print(f"{label:>15}: {result['seconds_per_step']:.3f} s/step  peak RSS {result['peak_rss_mb']:.0f} MB")

    mem = {k: v["peak_rss_mb"] for k, v in results.items()}
    report = {
        "scenario": spec.name,
        "batch_size": spec.recipe.batch_size,
        "recipes": {label: {"mode": str(r.mode), "schedule": r.schedule, "reg_batch": r.reg_batch_size,
                            "reg_within_batch": r.reg_within_batch} for label, r in recipes.items()},
        "n_sources_strict": len(sources),
        "curvature_energy": args.curvature_energy,
        "torch_threads": torch.get_num_threads(),
        "runtime": runtime.describe(),
        "rounds": args.rounds,
        "seconds_per_step": {k: v["seconds_per_step"] for k, v in results.items()},
        "seconds_per_step_rounds": rounds,
        **{name: statistics.median(r[top] / r[bottom] for r in rounds) for name, (top, bottom) in ratios.items()},
        "ratio_rounds": {name: [r[top] / r[bottom] for r in rounds] for name, (top, bottom) in ratios.items()},
        "peak_rss_mb": mem,
        "memory_over_nonlinear": {k: v / mem["nonlinear"] for k, v in mem.items()},
    }
    if args.flops:
        flops = {label: count_flops(built, recipe, sources, runtime) for label, recipe in recipes.items()}
        report["flops_per_step"] = flops
        report["flops_ratios"] = {name: flops[top] / flops[bottom] for name, (top, bottom) in ratios.items()}
        print("FLOPs per step (G): " + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in flops.items()))
        print("FLOP ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in report["flops_ratios"].items()))
        stream = {label: stream_flops(built, recipes[label], runtime) for label in ("linear", "taujp")}
        report["stream_flops_per_step"] = stream
        report["stream_taujp_over_linear_flops"] = stream["taujp"] / stream["linear"]
        print(f"over the stream's tasks (scope seen): taujp / linear {report['stream_taujp_over_linear_flops']:.3f}")
    print(json.dumps({k: report[k] for k in ratios}, indent=2))
    print("per round: " + "; ".join(f"{k} " + " / ".join(f"{v:.3f}" for v in values)
                                    for k, values in report["ratio_rounds"].items()))
    _write(args.json, report)


def _write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written {path}")


if __name__ == "__main__":
    main()
