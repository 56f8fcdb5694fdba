"""The addition table's numbers for one mode: every merge method's vector, its coefficient searched on the
validation splits and scored at 1 and at the chosen one on the test splits, task-incremental and, under the class
protocol, class-incremental (the class prototypes banked beside each vector, one head over every class); the
single-task row; the merged model's class-incremental accuracy matrix; the bank's merging time. Exact for
linearized vectors (one cached tangent per vector and input, :class:`~editkit.eval.sweep.ModeEvaluator`)."""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from editkit.eval.accuracy import AdditionSummary, addition_summary
from editkit.eval.continual import ContinualMetrics, continual_metrics
from editkit.eval.sweep import SPLITS, ModeEvaluator
from editkit.merge import MERGE_METHODS, LazyVectors
from editkit.merge.coefficients import search_alpha
from editkit.runs.bench.config import METHODS, BenchConfig
from editkit.runs.bench.matrices import method_matrices
from editkit.runs.bench.report import METHOD_LABELS, addition_row, class_incremental
from editkit.util.progress import Progress


def _single_task(ev: ModeEvaluator, tasks: Sequence[str], split: str) -> dict[str, float]:
    """Each task's accuracy under the model its fine-tuning ended at: theta_0 plus its vector, or, fine-tuned beside
    the vectors before it in the stream (``from_sum``; ``tasks`` in stream order), plus their sum and its vector."""
    beside = any(ev.bank.get(ev.vector_names[t]).recipe.get("from_sum") for t in tasks)
    ended = [tasks[: i + 1] if beside else [t] for i, t in enumerate(tasks)]
    return {t: ev.accuracies(dict.fromkeys(own, 1.0), split, [t])[t] for t, own in zip(tasks, ended)}


def class_matrix(ev: ModeEvaluator, tasks: Sequence[str]) -> ContinualMetrics:
    """The merged model's class-incremental numbers after every step: theta_0 plus the first k vectors at
    coefficient 1, each seen task's test inputs classified among the seen tasks' classes (their prototypes)."""
    rows = [ev.class_incremental_accuracies({t: 1.0 for t in tasks[: k + 1]}, "test", tasks[: k + 1],
                                            among=tasks[: k + 1]) for k in range(len(tasks))]
    return continual_metrics(tasks, rows)


def evaluate_mode(ev: ModeEvaluator, config: BenchConfig, tasks: Sequence[str],
                  pretrained: Mapping[str, Mapping[str, float]], control: Any,
                  progress: Progress, protocols: Sequence[str]) -> dict[str, Any]:
    """One mode's rows (each merge method at coefficient 1 and tuned, single-task), its coefficient searches,
    the methods' seconds, under the class protocol its class-incremental matrix and, with ``config.matrices``,
    the methods' accuracy matrices."""
    mode, alphas = ev.label, list(config.alphas)
    among = "class" in protocols

    def class_incremental_of(combo: dict[str, float]) -> dict[str, Any]:
        """A row's class-incremental numbers under the class protocol (None without it)."""
        if not among:
            return {"class_incremental": None, "class_incremental_per_task": None}
        return class_incremental(ev.class_incremental_accuracies(combo, "test", tasks))

    if ev.linearized:
        with progress.task(f"{mode}: tangents J·tau (one jvp per input)", total=ev.tangent_batches(tasks)) as bar:
            ev.compute_tangents(tasks, bar=bar)
    out: dict[str, Any] = {"alpha_search": {}, "rows": [], "merge_seconds": None, "method_seconds": {}}
    single = {s: _single_task(ev, tasks, s) for s in SPLITS}
    out["single"] = single

    def addition(method: str, combo_of: Callable[[float], dict[str, float]]) -> None:
        summaries: list[AdditionSummary] = []

        def validation_absolute(a: float) -> float:
            summaries.append(addition_summary(ev.accuracies(combo_of(a), "val", tasks), single["val"]))
            bar.advance(1)
            return summaries[-1]["absolute"]

        with progress.task(f"{mode}: {METHOD_LABELS[method]} — coefficient search on validation", total=len(alphas)) as bar:
            chosen, val_abs = search_alpha(alphas, validation_absolute)
        val_norm = [s["normalized"] for s in summaries]
        out["alpha_search"][method] = {"alphas": alphas, "val_absolute": val_abs, "val_normalized": val_norm,
                                       "chosen": chosen}
        for coefficient, a in (("1.0", 1.0), ("tuned", chosen)):
            per_task = ev.accuracies(combo_of(a), "test", tasks)
            val = addition_summary(ev.accuracies(combo_of(a), "val", tasks), single["val"])
            out["rows"].append(addition_row(
                method, ev, coefficient, a, per_task, single["test"], val_absolute=val["absolute"],
                val_normalized=val["normalized"], **class_incremental_of(combo_of(a))))

    for method in (m for m in METHODS if m in config.methods):  # registry order, whatever order they were named in
        start = time.perf_counter()
        merged = MERGE_METHODS[method].build(LazyVectors(tasks, ev.vector),
                                             **config.method_options(len(tasks))[method])
        built = [name for name in merged if name not in tasks]  # vectors the method made (TIES...: its merged one)
        for name in built:
            ev.add_vector(name, merged[name])
        out["method_seconds"][method] = time.perf_counter() - start
        if built and ev.linearized:
            with progress.task(f"{mode}: tangents of the {METHOD_LABELS[method]} vector",
                               total=ev.tangent_batches(built)) as bar:
                ev.compute_tangents(built, bar=bar)
        names = built or list(tasks)
        addition(method, lambda a, names=names: {n: a for n in names})
    out["continual"] = method_matrices(ev, [m for m in METHODS if m in config.methods], tasks, out["rows"],
                                       config.method_options, progress) if config.matrices else {}
    # one model per task, each scored on its own task: there is no single model to classify among every class
    out["rows"].append(addition_row("single-task", ev, None, 1.0, single["test"], single["test"],
                                    val_absolute=addition_summary(single["val"], None)["absolute"],
                                    class_incremental=None, class_incremental_per_task=None))
    out["pretrained_class_incremental"] = class_incremental_of({})
    out["continual_class_incremental"] = class_matrix(ev, tasks) if among else None

    # merging time: the bank's streamed sum of every vector (median of 3)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        ev.bank.merge({t: 1.0 for t in tasks}, base=ev.base)
        times.append(time.perf_counter() - start)
    out["merge_seconds"] = float(np.median(times))
    return out
