"""Every merge method's accuracy matrix (``bench --matrices``): the method's merge of the vectors banked so far,
scored after each step, so its rows get ACC, BWT and forgetting as the streams' and the strategies' do.

A stream scores only its own merge after each step (the sum at alpha = 1; MagMax over ``sequential``). A merge
method's table row is its merge of every vector; what it leaves of task ``i`` once ``t`` tasks are merged is
another merge each step: ``MERGE_METHODS[m]`` over the first ``t`` vectors, with its options for ``t`` vectors,
at coefficient 1, on the test split of the tasks seen. The last row is the table's "1.0" row itself, not merged
again. A continual merge (OPCM, MagMax) over the first ``t`` vectors is exactly what it held after step ``t``.

Cost: in a linearized mode each step's merged vector needs one jvp per test input of the tasks seen
(about ``T / 2`` passes over every test split per method), which is why it is asked for, not the default.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from editkit.eval.continual import ContinualMetrics, continual_metrics
from editkit.eval.sweep import ModeEvaluator
from editkit.merge import MERGE_METHODS, LazyVectors
from editkit.util.progress import Progress


def method_matrices(ev: ModeEvaluator, methods: Sequence[str], tasks: Sequence[str], rows: Sequence[Mapping[str, Any]],
                    options_for: Callable[[int], Mapping[str, Mapping[str, Any]]],
                    progress: Progress) -> dict[str, ContinualMetrics]:
    """{method: its continual numbers} for each of ``methods`` over ``ev``'s vectors of ``tasks`` (stream order);
    ``rows``: the mode's addition rows (their "1.0" rows end each matrix); ``options_for(t)``: every method's
    options for ``t`` vectors."""
    out = {}
    for method in methods:
        final = next(r for r in rows if r["method"] == method and r["coefficient"] == "1.0")
        scores = []
        with progress.task(f"{ev.label}: {MERGE_METHODS.label(method)} after each step", total=len(tasks) - 1) as bar:
            for t in range(1, len(tasks)):
                scores.append(prefix_scores(ev, method, tasks[:t], options_for(t)[method]))
                bar.advance(1)
        out[method] = continual_metrics(tasks, [*scores, final["per_task"]])
    return out


def prefix_scores(ev: ModeEvaluator, method: str, seen: Sequence[str], options: Mapping[str, Any]) -> dict[str, float]:
    """Test accuracy on each of ``seen`` of ``method``'s merge of their vectors at coefficient 1; the vectors the
    merge made are dropped afterwards (their memoised predictions stay, under keys naming the method and step, so
    two methods that name their merged vector alike never share them)."""
    merged = MERGE_METHODS[method].build(LazyVectors(list(seen), ev.vector), **options)
    made = {f"{method}: {name} of {len(seen)}": merged[name] for name in merged if name not in seen}
    for key, tensors in made.items():
        ev.add_vector(key, tensors)
    try:
        if made and ev.linearized:
            ev.compute_tangents(list(made), splits=("test",), names=seen)
        return ev.accuracies({key: 1.0 for key in (made or seen)}, "test", seen)
    finally:
        for key in made:
            ev.discard(key)
