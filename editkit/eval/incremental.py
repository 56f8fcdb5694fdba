"""A linearized stream's scores after each experience, computing only what the new vector changes.

For linearized vectors the merged model is f_lin(x; sum_k tau_k) = f(x; theta_0) + sum_k J tau_k(x):
the tangent is linear in the vectors. So each seen task keeps two cached vectors per test input,
theta_0's features f0 and the running tangent sum S = sum_{k<t} J tau_k(x), and after experience t:

- every earlier task i needs one jvp pass of the new vector tau_t alone: S_i += J tau_t(x_i);
- the new task needs the jvp of tau_t, whose primal is f0 (the pretrained score) and whose tangent
  gives the single-task score, plus, from the second experience on, one jvp of the earlier vectors'
  sum (kept in memory) for its share of the merged model;
- the merged scores are the scorers' own tallies of f0 + S on each task.

That is t + 2 jvp passes over one task's test split at experience t (one at the first), against
t + 2 jvps, a plain pass for theta_0 and a re-merge of every banked vector when each score is
computed from scratch. The passes that remain are the floor: the merged model changes on every
seen task, and each seen task's inputs must see the new vector once.

Numbers equal the direct evaluation's up to float summation order (sum of tangents instead of
the tangent of the sum), which can flip an argmax only at an exact tie. Only scorers whose score
is a function of the features (:attr:`~editkit.eval.accuracy.SplitScorer.scores_features`) are
cached; the cache's tensors stay in memory up to a budget and spill to disk past it
(:class:`~editkit.util.spill.SpillingTensors`). A resumed stream rebuilds the cache from the bank:
one jvp pass of the banked vectors' sum per seen task.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from editkit.core.linearize import LinearizedModel
from editkit.eval.accuracy import SplitScorer
from editkit.eval.features import outputs_over
from editkit.train.runtime import Runtime
from editkit.util.progress import NullProgress, Progress
from editkit.util.spill import SpillingTensors

Vector = Mapping[str, torch.Tensor]


def cacheable(scorers: Sequence[SplitScorer], linearized: bool, runtime: Runtime) -> bool:
    """Whether a stream can be scored incrementally: linearized vectors, feature-decided scores, one process
    (under torchrun each process scores a slice of every split; the direct evaluation handles that)."""
    return linearized and runtime.world_size == 1 and all(s.scores_features for s in scorers)


class IncrementalScores:
    """Cached features and tangent sums of a linearized stream's seen tasks (see the module docstring).

    scorer: experience index -> its task's scorer (test split, fixed head, batching).
    earlier_sum: ``t`` -> the sum of the vectors of experiences 0..t-1 as banked (None for none); asked
        only when the cache does not hold it already (a resumed stream, or a fresh one's first call).
    keep_tangents: also keep each new vector's own tangents on the tasks it is scored on
        (:meth:`vector_tangents`), for a caller that scores the same vectors again (``editkit bench``).
    """

    def __init__(self, module: nn.Module, scorer: Callable[[int], SplitScorer],
                 earlier_sum: Callable[[int], Vector | None], *, store: SpillingTensors, batch_size: int,
                 runtime: Runtime, progress: Progress | None = None, keep_tangents: bool = False) -> None:
        self.module = module
        self.scorer, self.earlier_sum = scorer, earlier_sum
        self.store, self.batch_size, self.runtime = store, batch_size, runtime
        self.progress = progress or NullProgress()
        self.labels: dict[int, torch.Tensor] = {}
        self.accounted = 0  # the cached sums S_i hold the vectors of experiences 0..accounted-1
        self.total: dict[str, torch.Tensor] | None = None  # their sum (None: no vector yet)
        self.merged_scores: dict[int, dict[str, float]] = {}
        self._kept: dict[int, dict[int, torch.Tensor]] | None = {} if keep_tangents else None

    # -- what the stream asks ------------------------------------------------------------------
    def add_vector(self, t: int, tau: Vector) -> tuple[float, float]:
        """Account experience ``t``'s new vector; returns (its single-task score, theta_0's score) on task t
        and keeps the merged scores of tasks 0..t for :meth:`merged`."""
        self._catch_up(t)
        scorer = self.scorer(t)
        earlier = [i for i in range(t) if self._cached(i)]
        missing = [i for i in range(t) if not self._cached(i)]
        new = [t, t] if self.total is not None else [t]  # tau_t's pass, then the earlier vectors' sum's
        with self.progress.task(f"{scorer.name}: single-task, pretrained, merged 0..{t}",
                                total=self._batches([*earlier, *new, *missing])) as bar:
            model = self._linearized(tau)
            for i in earlier:
                self.store[f"S{i}"] = self.store[f"S{i}"] + self._keep(t, i, self._map(model.tangent, i, bar))
            f0, tangent = self._map(model.primal_and_tangent, t, bar)
            self._keep(t, t, tangent)
            single, pretrained = self._score(t, f0 + tangent), self._score(t, f0)
            if self.total is not None:
                model.load_task_vector(self._on_device(self.total))
                tangent = tangent + self._map(model.tangent, t, bar)
            self.store[f"f{t}"], self.store[f"S{t}"] = f0, tangent
            self._add_to_total(tau)
            if missing:  # the cache lost them (a resume): the full sum, 0..t, in one pass each
                self._rebuild(model, missing, bar)
        self.accounted = t + 1
        self.merged_scores[t] = self._merged_now(t)
        return single, pretrained

    def merged(self, t: int) -> dict[str, float]:
        """Scores of theta_0 + tau_0 + ... + tau_t on tasks 0..t, by task name."""
        if t not in self.merged_scores:  # the vectors were banked before this process: rebuild from the bank
            self._catch_up(t + 1)
            todo = [i for i in range(t + 1) if not self._cached(i)]
            with self.progress.task(f"merged 0..{t} (rebuilding the cache)", total=self._batches(todo)) as bar:
                self._rebuild(self._linearized({}), todo, bar)
            self.merged_scores[t] = self._merged_now(t)
        return self.merged_scores[t]

    def vector_tangents(self) -> dict[str, dict[str, torch.Tensor]]:
        """What ``keep_tangents`` kept: ``{task of the vector: {task scored: J tau(x) on its test inputs}}``, for
        the vectors this process trained (experience t's on tasks 0..t; a resumed stream's banked ones have none)."""
        return {self.scorer(t).name: {self.scorer(i).name: tangent for i, tangent in scored.items()}
                for t, scored in (self._kept or {}).items()}

    def close(self) -> None:
        self.store.close()

    # -- the cache -----------------------------------------------------------------------------
    def _catch_up(self, count: int) -> None:
        """Make the running sum hold the vectors of experiences 0..count-1, from the bank when it does not."""
        if self.accounted == count:
            return
        earlier = self.earlier_sum(count)
        self.total = dict(earlier) if earlier is not None else None
        self.accounted = count
        self.store.clear()  # every cached sum was of another set of vectors

    def _keep(self, t: int, i: int, tangent: torch.Tensor) -> torch.Tensor:
        """Keep experience ``t``'s vector's tangent on task ``i`` when asked to; returns it."""
        if self._kept is not None:
            self._kept.setdefault(t, {})[i] = tangent
        return tangent

    def _cached(self, i: int) -> bool:
        return f"S{i}" in self.store

    def _rebuild(self, model: LinearizedModel, tasks: Sequence[int], bar) -> None:
        """f0 and S of each task for the current running sum, in one jvp pass each."""
        model.load_task_vector(self._on_device(self.total or {}))
        for i in tasks:
            self.store[f"f{i}"], self.store[f"S{i}"] = self._map(model.primal_and_tangent, i, bar)

    def _add_to_total(self, tau: Vector) -> None:
        """The running sum plus ``tau`` (new tensors: neither the sum nor the vector is changed in place)."""
        tau = {n: v.detach().cpu() for n, v in tau.items()}
        self.total = tau if self.total is None else {n: self.total[n] + v for n, v in tau.items()}

    def _merged_now(self, t: int) -> dict[str, float]:
        """Scores of the cached merged model (f0 + S) on tasks 0..t, by task name."""
        return {self.scorer(i).name: self._score(i, self.store[f"f{i}"] + self.store[f"S{i}"]) for i in range(t + 1)}

    # -- passes and scores ---------------------------------------------------------------------
    def _linearized(self, tau: Vector) -> LinearizedModel:
        """A linearized model of theta_0 at ``tau``, built for one scoring call and dropped after it: it holds a
        copy of theta, which should not stay in memory beside the next fine-tuning's."""
        model = self.runtime.place(LinearizedModel(self.module)).eval()
        model.load_task_vector(self._on_device(tau))
        return model

    def _on_device(self, tau: Vector) -> dict[str, torch.Tensor]:
        return {n: v.to(self.runtime.device) for n, v in tau.items()}

    def _map(self, fn, i: int, bar):
        scorer = self.scorer(i)
        labels: list[torch.Tensor] | None = [] if i not in self.labels else None
        out = outputs_over(fn, scorer.dataset, batch_size=self.batch_size, batching=scorer.batching,
                           runtime=self.runtime, bar=bar, labels=labels)
        if labels is not None:
            self.labels[i] = torch.cat(labels)
        return out

    def _batches(self, indices: Sequence[int]) -> int:
        return sum(self.scorer(i).batches(self.batch_size, 1) for i in indices)

    @torch.no_grad()
    def _score(self, i: int, features: torch.Tensor) -> float:
        """The scorer's own tally of the features, in the batches it would use, and its finish."""
        scorer, labels, device = self.scorer(i), self.labels[i], self.runtime.device
        head = scorer.head.to(device)
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for j in range(0, len(features), self.batch_size):
            chunk, truth = features[j : j + self.batch_size].to(device), labels[j : j + self.batch_size].to(device)
            totals += scorer.tally(head(chunk), truth).double()
        return scorer.finish(*totals.tolist())
