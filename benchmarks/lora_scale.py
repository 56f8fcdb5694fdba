"""How the cost of one training step grows with a causal LM's size: L-LoRA tauJp against full linearization.

Builds randomly initialised Llama-style models (``transformers.LlamaConfig`` + ``LlamaForCausalLM``, fp32,
tied embeddings; nothing is downloaded) of the sizes named by ``--sizes`` and, for each size, trains every
decoder block (``causal_lm_backbone(..., trainable_blocks="all")``: the embeddings are the frozen prefix,
the tied LM head the fixed head) for ``--steps`` steps of ``editkit.train.loop.fine_tune`` in each variant:

- ``llora-taujp``: a LoRA adapter (``--rank``, ``--alpha``, on ``--targets`` of every block), the model
  linearized in the adapter's factors, plus the tauJp penalty (L-LoRA tauJp);
- ``full-taujp``: no adapter, every parameter of the blocks (and the final norm) linearized, plus the penalty;
- ``llora-nonlinear``: plain LoRA, the cheap reference; ``full-nonlinear`` (not run by default): plain
  fine-tuning of every block.

A step is ``--batch`` sequences of ``--seq`` random tokens plus, in the penalized variants, ``--reg-batch``
unlabeled sequences of the same length for the penalty (lambda 0.1, on the final hidden states), which ride
in the same jvp. The prefix's hidden states are computed before the timed window, as a run caches them.

Each (size, variant) runs in a fresh process of this script (``--one SIZE:VARIANT``), so its peak RSS is its
own and a crash loses nothing else. Reported per run:

- s/step: median seconds of the steps after the first ``--warmup``, each timed from one optimizer step to the
  next (a global ``torch.optim`` step hook; step 0 is timed from the first forward call and reported apart, as
  are the seconds before it: building the task model, i.e. cloning theta);
- peak RSS: the process's peak over its whole life (``ru_maxrss``), **model construction included**; the
  model's own RSS (after building it, less the process's RSS after its imports) and the peak of the training
  window alone (``editkit.util.memory.PeakRSS``, absolute, so it includes the model too) are given apart;
- trainable parameters, and the banked vector's bytes (numel x 4, fp32).

Before a run, its peak RSS is estimated: the process and its libraries (~0.5 GiB), the model's weights,
5 x 4 bytes per trained parameter (theta, its gradient, AdamW's two moments, and the tangent tau = theta -
theta_0, or after the last step the vector), saved activations (a rough per-block count, doubled for a jvp)
and the logits. A variant whose estimate exceeds ``--max-rss-gb`` is skipped, with its estimate printed;
a run that goes past ``--abort-rss-gb`` anyway (default 1.25 x the budget) is stopped by a watchdog and
reported as aborted, rather than exhausting the machine's memory. The allocator is tuned as editkit
commands tune it on a CPU (``keep_freed_memory``).

``--dry-run`` prints the sizes' parameter counts and every run's estimate, and runs nothing. On a host whose
cores are shared with other work, torch's threads wait for each other in every parallel region (on a busy
2-core host a tiny model's plain LoRA step took 0.44 s with 2 threads, 0.012 s with 1): run on an idle host,
or give ``--threads 1``; each run records the load average it started under.

Prints a table and, per variant, how s/step and peak RSS grow per doubling of the model's parameters (a
least-squares slope in log-log over the sizes that ran), and writes everything as JSON.

    python benchmarks/lora_scale.py [--sizes 135m,400m,1b] [--variants llora-taujp,full-taujp,llora-nonlinear]
        [--steps 4] [--warmup 1] [--batch 2] [--seq 64] [--reg-batch 2] [--rank 8] [--alpha 16]
        [--max-rss-gb 12] [--json runs/lora_scale.json]
    python benchmarks/lora_scale.py --dry-run                                  # estimates only
    python benchmarks/lora_scale.py --sizes tiny --steps 2 --warmup 1        # a smoke test, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

GIB = 2**30
MIB = 2**20

#: Llama-style configurations by name (vocabulary 49152, SmolLM2's tokenizer, unless said otherwise; tied
#: embeddings). Parameter counts are computed, not assumed: 135m is 134.5M, 400m 415.3M, 1b 1.074B, 1.2b 1.236B.
SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000),
    # SmolLM2-135M's shape
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, vocab_size=49152),
    "400m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=4096, vocab_size=49152),
    # Llama-3.2-1B's blocks with SmolLM2's vocabulary
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=49152),
    # Llama-3.2-1B's shape, vocabulary included (the blocks are 1b's: only the frozen embeddings and logits grow)
    "1.2b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=8192, vocab_size=128256),
}

#: variant -> (editkit mode, LoRA adapter or not)
VARIANTS: dict[str, tuple[str, bool]] = {
    "llora-taujp": ("taujp", True),
    "full-taujp": ("taujp", False),
    "llora-nonlinear": ("nonlinear", True),
    "full-nonlinear": ("nonlinear", False),
}

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: RSS of a process that has imported torch, transformers, peft and editkit, and run a step's machinery.
BASE_RSS = 0.5 * GIB

#: Options a parent passes on to each ``--one`` child unchanged.
PASSED = ("steps", "warmup", "batch", "seq", "reg_batch", "rank", "alpha", "targets", "lam", "attn", "threads",
          "seed", "abort_rss_gb")


# --------------------------------------------------------------------------------------------- sizes, estimates


def llama_config(size: str, attn: str):
    import editkit  # noqa: F401  (its torchvision shim must run before transformers is imported)
    import transformers

    return transformers.LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=True,
                                    bos_token_id=0, eos_token_id=0, attn_implementation=attn)


def size_info(size: str, targets: tuple[str, ...], rank: int) -> dict:
    """Parameter counts of a size, from the model built on the meta device (no memory, no init)."""
    import torch
    import transformers
    from torch import nn

    config = llama_config(size, "sdpa")
    with torch.device("meta"):
        lm = transformers.LlamaForCausalLM(config)
    total = sum(p.numel() for p in lm.parameters())
    blocks = sum(p.numel() for p in lm.model.layers.parameters()) + sum(p.numel() for p in lm.model.norm.parameters())
    lora = sum(rank * (m.in_features + m.out_features) for name, m in lm.model.layers.named_modules()
               if isinstance(m, nn.Linear) and name.rpartition(".")[2] in targets)
    return {"config": SIZES[size], "params": total, "block_params": blocks, "lora_params": lora}


def estimate(info: dict, variant: str, args: argparse.Namespace) -> dict:
    """Peak RSS a run should reach, in bytes, by part (see the module docstring; activations are rough)."""
    mode, lora = VARIANTS[variant]
    cfg = info["config"]
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, vocab = cfg["num_attention_heads"], cfg["vocab_size"]
    kv = h // heads * cfg["num_key_value_heads"]
    linearized = mode == "taujp"
    rows = args.batch + (args.reg_batch if linearized else 0)
    tokens = rows * args.seq
    # tensors a block keeps for its backward, per token: norms, q/k/v (+ rotary), attention output and its
    # projection, residuals, the MLP's gate, up, activation and product; and the attention probabilities.
    per_token = 10 * h + 2 * kv + 4 * i + 2 * heads * args.seq
    activations = 4 * tokens * layers * per_token * (2 if linearized else 1)
    logits = 4 * args.batch * args.seq * vocab * 3  # logits, their log-softmax, their gradient
    trained = info["lora_params"] if lora else info["block_params"]
    parts = {"process": BASE_RSS, "model": 4 * (info["params"] + (info["lora_params"] if lora else 0)),
             "trained_state": 5 * 4 * trained, "activations": activations, "logits": logits}
    return {"parts": parts, "total": sum(parts.values()), "trained": trained}


# --------------------------------------------------------------------------------------------- one run (child)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _watchdog(limit: int, result: Path, record: dict) -> None:
    """Stop this process (exit 3) when its RSS passes ``limit`` bytes, writing why into ``result`` first."""

    def watch() -> None:
        while True:
            rss = _rss()
            if rss > limit:
                record.update(status="aborted", note=f"RSS passed the abort limit: {rss / GIB:.2f} GiB > "
                                                     f"{limit / GIB:.2f} GiB", peak_rss_gb=rss / GIB)
                result.write_text(json.dumps(record, indent=2) + "\n")
                os._exit(3)
            time.sleep(0.05)

    threading.Thread(target=watch, name="rss-watchdog", daemon=True).start()


def run_one(args: argparse.Namespace) -> None:
    size, _, variant = args.one.partition(":")
    result = Path(args.result)
    record: dict = {"size": size, "variant": variant, "status": "failed"}
    if args.abort_rss_gb > 0:
        _watchdog(int(args.abort_rss_gb * GIB), result, record)
    try:
        record.update(_measure(size, variant, args), status="ok")
    except BaseException as exc:  # recorded for the parent, then raised for the traceback
        record["note"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
        result.write_text(json.dumps(record, indent=2) + "\n")
        raise
    result.write_text(json.dumps(record, indent=2) + "\n")


def _measure(size: str, variant: str, args: argparse.Namespace) -> dict:
    import editkit  # noqa: F401
    import torch
    from transformers import LlamaForCausalLM  # imported before the baseline RSS: the model's RSS is its own

    from editkit.core.taujp import UnlabeledSource
    from editkit.models.causal_lm import causal_lm_backbone
    from editkit.train.loop import fine_tune
    from editkit.train.recipe import Recipe, attach_adapter
    from editkit.util.memory import PeakRSS, lifetime_peak_rss, keep_freed_memory
    from torch.optim.optimizer import register_optimizer_step_post_hook

    mode, lora = VARIANTS[variant]
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    rss_imports = _rss()

    began = time.perf_counter()
    torch.manual_seed(args.seed)
    lm = LlamaForCausalLM(llama_config(size, args.attn)).eval()  # fp32, random
    build_seconds = time.perf_counter() - began
    params = sum(p.numel() for p in lm.parameters())
    rss_model = _rss()

    backbone = causal_lm_backbone(lm, None, trainable_blocks="all", name=f"llama-{size}")
    recipe = Recipe(mode=mode, steps=args.steps, batch_size=args.batch, lr=1e-4, warmup=0.0, lam=args.lam,
                    reg_batch=args.reg_batch, adapter="lora" if lora else "none", lora_rank=args.rank,
                    lora_alpha=args.alpha, lora_targets=args.targets, seed=args.seed)
    spec = attach_adapter(backbone.module, [recipe])

    # Random token sequences of full length (no padding: one call per step), their prefix states computed now.
    batching = backbone.batching
    g = torch.Generator().manual_seed(args.seed)
    n_train, n_reg = args.batch * args.steps, args.reg_batch * args.steps
    ids = torch.randint(1, lm.config.vocab_size, (n_train + n_reg, args.seq), generator=g)
    states = backbone.prefix(ids, torch.ones_like(ids))
    train = [(states[k], ids[k]) for k in range(n_train)]
    reg_inputs = batching.collate([states[k] for k in range(n_train, n_train + n_reg)])
    regularizer = recipe.regularizer([UnlabeledSource("generic", reg_inputs, seed=args.seed)])

    ends: list[float] = []
    forwards: list[float] = []
    post = register_optimizer_step_post_hook(lambda *_: ends.append(time.perf_counter()))
    pre = backbone.module.register_forward_pre_hook(lambda *_: forwards.append(time.perf_counter()))
    try:
        with PeakRSS(interval=0.01) as rss:
            called = time.perf_counter()
            out = fine_tune(backbone.module, backbone.head, train, recipe, regularizer, batching=batching)
            window_peak = rss.window()
    finally:
        post.remove()
        pre.remove()
    if len(ends) != args.steps or not forwards:
        raise RuntimeError(f"timing hooks saw {len(ends)} optimizer steps for {args.steps} steps")
    durations = [ends[0] - forwards[0]] + [b - a for a, b in zip(ends, ends[1:])]
    timed = durations[args.warmup:]
    numel = sum(t.numel() for t in out.task_vector.values())
    vector_bytes = sum(t.numel() * t.element_size() for t in out.task_vector.values())
    last = out.history[-1]
    if not all(math.isfinite(last[k]) for k in ("ce", "penalty")):
        raise RuntimeError(f"non-finite losses at the last step: {last}")
    return {
        "mode": mode, "adapter": spec.describe() if spec is not None else "none",
        "params": params, "trainable": numel, "vector_mb": vector_bytes / MIB,
        "seconds_per_step": statistics.median(timed), "steps_timed": len(timed), "step_seconds": durations,
        "setup_seconds": forwards[0] - called, "build_seconds": build_seconds,
        "forward_calls_per_step": len(forwards) / args.steps,
        "model_rss_gb": (rss_model - rss_imports) / GIB, "imports_rss_gb": rss_imports / GIB,
        "train_window_peak_rss_gb": window_peak / GIB, "peak_rss_gb": lifetime_peak_rss() / GIB,
        "last_step": {k: last[k] for k in ("ce", "penalty", "grad_norm")},
        "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
    }


# --------------------------------------------------------------------------------------------- the sweep (parent)


def run_child(size: str, variant: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="lora_scale-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--one", f"{size}:{variant}", "--result", str(result)]
        for name in PASSED:
            value = getattr(args, name)
            command += [f"--{name.replace('_', '-')}", ",".join(value) if isinstance(value, tuple) else str(value)]
        began = time.perf_counter()
        try:
            rc = subprocess.run(command, timeout=args.timeout or None).returncode
        except subprocess.TimeoutExpired:
            return {"size": size, "variant": variant, "status": "timeout",
                    "note": f"stopped after {args.timeout} s (--timeout)"}
        record = json.loads(result.read_text()) if result.exists() else {
            "size": size, "variant": variant, "status": "failed",
            "note": f"exit code {rc} without a result (killed by signal {-rc})" if rc < 0 else f"exit code {rc}"}
        record["wall_seconds"] = time.perf_counter() - began
        record.setdefault("returncode", rc)
        return record


def per_doubling(points: list[tuple[float, float]]) -> float | None:
    """Factor y grows by when x doubles: 2 ** (least-squares slope of log2 y on log2 x); None below 2 points."""
    if len(points) < 2:
        return None
    xs = [math.log2(x) for x, _ in points]
    ys = [math.log2(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return 2 ** slope


def growth(report: dict) -> dict:
    out = {}
    for variant in report["variants"]:
        rows = [r for r in report["runs"] if r["variant"] == variant and r["status"] == "ok"]
        out[variant] = {
            "sizes": [r["size"] for r in rows],
            "seconds_per_step_per_doubling": per_doubling([(r["params"], r["seconds_per_step"]) for r in rows]),
            "peak_rss_per_doubling": per_doubling([(r["params"], r["peak_rss_gb"]) for r in rows]),
        }
    return out


def table(report: dict):
    from rich.table import Table

    out = Table(title=f"training step cost by model size — {report['batch']} x {report['seq']} tokens "
                      f"(+ {report['reg_batch']} reg sequences when penalized), {report['torch_threads']} threads, "
                      f"budget {report['max_rss_gb']:g} GiB", title_justify="left")
    out.caption = ("s/step: median after warm-up; step 0: the first step alone; model: the weights' RSS; peak: "
                   "the run's process peak, model construction included; est.: the estimate runs are skipped by; "
                   "vector: trained parameters x 4 bytes")
    out.caption_justify = "left"
    for column in ("size", "params", "variant", "trainable", "vector MiB", "s/step", "step 0 s", "model GiB",
                   "peak GiB", "est. GiB", "status"):
        out.add_column(column, justify="left" if column in ("size", "variant", "status") else "right")
    previous = None
    for row in report["runs"]:
        if previous is not None and row["size"] != previous:
            out.add_section()
        previous = row["size"]
        ok = row["status"] == "ok"
        params = report["sizes"][row["size"]]["params"]
        out.add_row(row["size"], _count(params), row["variant"], f"{row['estimate']['trained']:,}",
                    f"{row['estimate']['trained'] * 4 / MIB:.1f}",
                    f"{row['seconds_per_step']:.3f}" if ok else "-",
                    f"{row['step_seconds'][0]:.3f}" if ok else "-",
                    f"{row['model_rss_gb']:.2f}" if ok else "-",
                    f"{row['peak_rss_gb']:.2f}" if "peak_rss_gb" in row else "-",
                    f"{row['estimate']['total'] / GIB:.2f}", row["status"])
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def summary(report: dict) -> list[str]:
    lines = []
    for variant, g in report["growth"].items():
        if g["seconds_per_step_per_doubling"] is None:
            lines.append(f"{variant}: fewer than two sizes ran ({', '.join(g['sizes']) or 'none'}), no growth rate")
            continue
        lines.append(f"{variant}: per doubling of parameters ({' -> '.join(g['sizes'])}), s/step x"
                     f"{g['seconds_per_step_per_doubling']:.2f}, peak RSS x{g['peak_rss_per_doubling']:.2f}")
    largest = max(report["sizes"], key=lambda s: report["sizes"][s]["params"])
    params = _count(report["sizes"][largest]["params"])
    for row in (r for r in report["runs"] if r["size"] == largest):
        if row["status"] == "ok":
            verdict = "fits" if row["peak_rss_gb"] <= report["max_rss_gb"] else "does NOT fit"
            lines.append(f"{largest} ({params} params) {row['variant']}: peak RSS {row['peak_rss_gb']:.2f} GiB, "
                         f"{verdict} in {report['max_rss_gb']:g} GiB; {row['seconds_per_step']:.2f} s/step")
        else:
            lines.append(f"{largest} ({params} params) {row['variant']}: {row['status']} "
                         f"({row.get('note', '')})")
    return lines


def sweep(args: argparse.Namespace) -> None:
    from rich.console import Console

    import torch

    console = Console(width=None if sys.stdout.isatty() else 150)
    budget = args.max_rss_gb * GIB
    report: dict = {"sizes": {}, "variants": args.variants, "steps": args.steps, "warmup": args.warmup,
                    "batch": args.batch, "seq": args.seq, "reg_batch": args.reg_batch, "lam": args.lam,
                    "lora": {"rank": args.rank, "alpha": args.alpha, "targets": list(args.targets)},
                    "attn": args.attn, "max_rss_gb": args.max_rss_gb, "abort_rss_gb": args.abort_rss_gb,
                    "torch_threads": args.threads or torch.get_num_threads(), "torch": torch.__version__,
                    "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor()},
                    "runs": []}
    for size in args.sizes:
        info = size_info(size, args.targets, args.rank)
        report["sizes"][size] = info
        console.print(f"[bold]{size}[/]: {info['params']:,} parameters ({info['block_params']:,} in the blocks, "
                      f"{info['lora_params']:,} LoRA factors at rank {args.rank})")
        for variant in args.variants:
            est = estimate(info, variant, args)
            parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in est["parts"].items())
            if args.dry_run:
                console.print(f"  {variant}: estimated {est['total'] / GIB:.2f} GiB "
                              f"({'over' if est['total'] > budget else 'within'} budget; {parts})")
                continue
            if est["total"] > budget:
                note = f"estimated {est['total'] / GIB:.1f} GiB > budget {args.max_rss_gb:g} GiB ({parts})"
                console.print(f"  {variant}: skipped, {note}")
                report["runs"].append({"size": size, "variant": variant, "status": "skipped", "note": note,
                                       "estimate": est})
                continue
            console.print(f"  {variant}: running (estimated peak {est['total'] / GIB:.2f} GiB: {parts})")
            row = run_child(size, variant, args)
            row["estimate"] = est
            report["runs"].append(row)
            if row["status"] == "ok":
                console.print(f"  {variant}: {row['seconds_per_step']:.3f} s/step, peak RSS {row['peak_rss_gb']:.2f} "
                              f"GiB (model {row['model_rss_gb']:.2f}, training window "
                              f"{row['train_window_peak_rss_gb']:.2f}), {row['trainable']:,} trained, "
                              f"last ce {row['last_step']['ce']:.3f} penalty {row['last_step']['penalty']:.4g}")
            else:
                console.print(f"  {variant}: [red]{row['status']}[/]: {row.get('note', '')}")
    if args.dry_run:
        return
    report["growth"] = growth(report)
    report["summary"] = summary(report)
    console.print(table(report))
    for row in report["runs"]:
        if row["status"] != "ok":
            console.print(f"{row['size']} {row['variant']} {row['status']}: {row.get('note', '')}")
    for line in report["summary"]:
        console.print(line)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"written {args.json}")


# --------------------------------------------------------------------------------------------- command line


def _names(known: dict):
    def parse(value: str) -> list[str]:
        names = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(known)}")
        return names

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_names(SIZES), default=["135m", "400m", "1b"], help="comma-separated sizes")
    parser.add_argument("--variants", type=_names(VARIANTS), default=["llora-taujp", "full-taujp", "llora-nonlinear"])
    parser.add_argument("--steps", type=int, default=4, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of s/step")
    parser.add_argument("--batch", type=int, default=2, help="labelled sequences per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--reg-batch", type=int, default=2, help="unlabeled sequences per step for the penalty")
    parser.add_argument("--lam", type=float, default=0.1, help="tauJp lambda")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    parser.add_argument("--targets", type=lambda v: tuple(t.strip() for t in v.split(",") if t.strip()),
                        default=LLAMA_LINEARS, help="LoRA target layers, comma-separated")
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention implementation")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-rss-gb", type=float, default=12.0, help="skip variants estimated above this (GiB)")
    parser.add_argument("--abort-rss-gb", type=float, default=None,
                        help="stop a run whose RSS passes this (GiB; default 1.25 x --max-rss-gb; 0: never)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run before it is stopped (0: none)")
    parser.add_argument("--json", type=Path, default=Path("runs/lora_scale.json"))
    parser.add_argument("--dry-run", action="store_true", help="print parameter counts and estimates, run nothing")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # SIZE:VARIANT, the child's one run
    parser.add_argument("--result", help=argparse.SUPPRESS)  # where the child writes its record
    args = parser.parse_args()
    if args.steps - args.warmup < 1 or args.warmup < 0:
        parser.error("need 0 <= warmup < steps (at least one timed step)")
    if min(args.batch, args.seq, args.reg_batch, args.rank) < 1:
        parser.error("--batch, --seq, --reg-batch and --rank must be >= 1")
    if args.abort_rss_gb is None:
        args.abort_rss_gb = 1.25 * args.max_rss_gb
    if args.one:
        size, _, variant = args.one.partition(":")
        if size not in SIZES or variant not in VARIANTS or not args.result:
            parser.error(f"--one takes SIZE:VARIANT with --result PATH, not {args.one!r}")
        run_one(args)
        return
    sweep(args)


if __name__ == "__main__":
    main()
