"""The tauJp regularizer: keep a task vector silent on other tasks' inputs.

penalty(tau) = mean over unlabeled x_o of || J_theta0 f(x_o) . tau ||  (backbone features)

For per-token outputs (sequence backbones) the norm runs over the example's real
positions only: padding is an artefact of batching, so it never counts.

Sources are *unlabeled* views of other tasks' train splits: ``UnlabeledSource``
holds an inputs tensor only, so the penalty path has no way to read a label.
``LazyUnlabeledSource`` serves datasets too big to hold in memory (vision8): it
samples indices the same way and loads and preprocesses only the sampled items,
through an inputs-only accessor. Schedules (:data:`ROWS_PER_SOURCE`; paper Eq. 10/11):
``cyclic`` draws one batch from source ``step % n_sources`` per step; ``strict``
draws one batch from every source and averages their penalties; ``mixed`` spreads
the rows of one batch over every source (row ``j`` of step ``s`` from source
``(s * batch + j) % n_sources``) and averages their penalties: strict's every-task
signal at cyclic's row count.

Under data parallelism (see ``editkit.train.runtime``) every process draws the same
global reg batch and keeps its contiguous slice (``shard=(rank, world_size)``);
the penalty of a slice is weighted so that averaging gradients over processes
gives the single-process penalty.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import Dataset

from editkit.core.batching import TensorBatching
from editkit.errors import ConfigError
from editkit.util.sharding import shard_bounds

log = logging.getLogger(__name__)

Shard = tuple[int, int]  # (rank, world size)


def _cyclic_rows(step: int, sources: int, size: int) -> list[int]:
    return [size if i == step % sources else 0 for i in range(sources)]


def _strict_rows(step: int, sources: int, size: int) -> list[int]:
    return [size] * sources


def _mixed_rows(step: int, sources: int, size: int) -> list[int]:
    rows = [0] * sources
    for j in range(size):
        rows[(step * size + j) % sources] += 1
    return rows


#: Each schedule's rows per source at a step: ``f(step, n_sources, batch_size) -> [rows of source i]``.
ROWS_PER_SOURCE: dict[str, Callable[[int, int, int], list[int]]] = {
    "cyclic": _cyclic_rows, "strict": _strict_rows, "mixed": _mixed_rows}


def _shard(index: list[int], shard: Shard | None) -> list[int]:
    if shard is None or shard[1] == 1:
        return index
    start, stop = shard_bounds(len(index), *shard)
    return index[start:stop]


class UnlabeledSource:
    """Inputs of one source, sampled in seeded random order without replacement.

    inputs: anything with ``len`` that a list of indices selects a batch from: an
        image tensor, or a :class:`~editkit.core.batching.SequenceBatch`.
    """

    lazy = False

    def __init__(self, name: str, inputs: Any, *, seed: int = 0) -> None:
        if len(inputs) == 0:
            raise ValueError(f"unlabeled source {name!r} is empty")
        self.name = name
        self.inputs = inputs
        self._seed = seed
        self.restart()

    @property
    def seed(self) -> int:
        """The seed of its order: with its name, which of its inputs a given draw reads."""
        return self._seed

    def restart(self) -> None:
        """Back to the seed's first batch: a second run over the same source samples what the first did."""
        self._generator = torch.Generator().manual_seed(self._seed)
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.inputs)

    def next_indices(self, size: int) -> list[int]:
        """The next ``size`` indices of the seeded order (a fresh permutation each time one runs out)."""
        index = []
        while len(index) < size:
            if not self._order:
                self._order = torch.randperm(len(self), generator=self._generator).tolist()
            index.append(self._order.pop())
        return index

    def load(self, index: list[int]) -> Any:
        """Inputs at ``index`` as one batch."""
        return self.inputs[index]

    def upcoming(self, sizes: Iterable[int]) -> list[int]:
        """The indices the next draws, of ``sizes`` each, will take, without taking them: the seeded order
        is replayed and put back, so the draws themselves are unchanged."""
        state, order = self._generator.get_state(), list(self._order)
        try:
            return [i for size in sizes for i in self.next_indices(size)]
        finally:
            self._generator.set_state(state)
            self._order = order

    def prepare(self, index: Iterable[int]) -> None:
        """Make loading ``index`` cheap before it is drawn; an eager source holds its inputs already."""

    def next_batch(self, size: int, *, shard: Shard | None = None) -> Any:
        """The next ``size`` inputs; with ``shard=(rank, world)`` only this rank's slice of them."""
        return self.load(_shard(self.next_indices(size), shard))


def input_accessor(dataset: Dataset) -> Callable[[int], Any]:
    """A function ``i -> input`` of a dataset that avoids labels where the dataset allows.

    Datasets with an ``input(i)`` method (``editkit.data.vision8.TransformedSubset``)
    or an ``inputs`` tensor are read without touching labels; otherwise item ``i``'s
    element 0 is taken (the dataset builds the pair; the label is dropped at once).
    """
    method = getattr(dataset, "input", None)
    if callable(method):
        return method
    inputs = getattr(dataset, "inputs", None)
    if isinstance(inputs, torch.Tensor):
        return inputs.__getitem__
    return lambda i: dataset[i][0]


class LazyUnlabeledSource(UnlabeledSource):
    """Like :class:`UnlabeledSource` over a dataset that is never loaded whole.

    Samples indices exactly as ``UnlabeledSource`` does (same seed, same batches) and
    loads and preprocesses only the sampled items via :func:`input_accessor`.
    ``collate`` makes them one batch: stacked tensors by default, a backbone's
    ``batching.collate`` for inputs of different lengths.
    """

    def __init__(self, name: str, dataset: Dataset, *, seed: int = 0,
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        if len(dataset) == 0:
            raise ValueError(f"unlabeled source {name!r} is empty")
        self.name = name
        self.dataset = dataset
        self._get = input_accessor(dataset)
        self._collate = collate or TensorBatching().collate
        self._size = len(dataset)
        self._seed = seed
        self.restart()

    @property
    def inputs(self) -> torch.Tensor:  # pragma: no cover - guard
        raise AttributeError("a LazyUnlabeledSource never holds all its inputs; use next_batch")

    def __len__(self) -> int:
        return self._size

    def load(self, index: list[int]) -> Any:
        return self._collate([self._get(i) for i in index])

    @property
    def lazy(self) -> bool:
        """Whether a draw loads data worth loading in a thread beside the step (decoding images): not where the
        dataset encodes ahead (:func:`precompute`), whose draws then only collate what :meth:`prepare`
        computed. There a second thread only competes with the step for the cores: on offline-text's 2-core
        CPU the tauJp stream's steady step was 1.46x the linear one's with it, 1.19x drawn in the loop."""
        return not callable(getattr(self.dataset, "precompute", None))

    def prepare(self, index: Iterable[int]) -> None:
        """Encode ahead what loading ``index`` derives, where the dataset can (:func:`precompute`)."""
        precompute(self.dataset, index)


def precompute(dataset: Dataset, index: Iterable[int]) -> None:
    """Let ``dataset`` compute and keep now what reading items ``index`` derives, if it offers to
    (``dataset.precompute(index)``: a text's frozen-prefix states, :class:`editkit.data.text.TokenSequences`).

    A training run calls it before its first step with the items its steps will read. Encoded lazily
    instead, a step that reads an item first pays for encoding it, and the reg batches are loaded in a
    thread beside the step (:func:`editkit.train.loop.reg_batch_stream`), which on a CPU competes with
    the step for the cores: measured on offline-text, that made a tauJp step ~1.5x a linear one."""
    method = getattr(dataset, "precompute", None)
    if callable(method):
        method(index)


def unlabeled_source(name: str, dataset: Dataset, *, seed: int = 0,
                     collate: Callable[[list[Any]], Any] | None = None) -> UnlabeledSource:
    """Eager for datasets that already hold an inputs tensor, lazy for the rest (same batches either way)."""
    inputs = getattr(dataset, "inputs", None)
    if isinstance(inputs, torch.Tensor):
        return UnlabeledSource(name, inputs, seed=seed)
    return LazyUnlabeledSource(name, dataset, seed=seed, collate=collate)


def penalty(tangent: torch.Tensor, *, squared: bool = False, mask: torch.Tensor | None = None,
            over_sequence: bool = False) -> torch.Tensor:
    """Mean over the batch of the per-example L2 norm (or squared norm) of J.tau.

    mask: which positions are real, shaped like the tangent's leading dimensions
        (``(N, T)`` for per-token tangents ``(N, T, D)``); the others are zeroed
        before the norm, so a padded position never counts however it was computed.
    over_sequence: for per-token tangents ``(N, T, V)``, the norm runs over the sequence
        axis only and is averaged over examples and the last axis (the paper's text code,
        on logits).
    """
    if mask is not None:
        mask = mask.bool().reshape(*mask.shape, *(1,) * (tangent.dim() - mask.dim()))
        tangent = torch.where(mask, tangent, 0.0)
    norms = (torch.linalg.vector_norm(tangent, dim=1) if over_sequence
             else torch.linalg.vector_norm(tangent.flatten(1), dim=1))
    return (norms.square() if squared else norms).mean()


def distribution_penalty(logits: torch.Tensor, tangent: torch.Tensor, *, squared: bool = False,
                         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the batch of the per-example norm of the tangent of the next-token log-probabilities, each
    position's vocabulary weighted by theta_0's own probabilities there.

    Per position, with p = softmax(logits) and t the logits' tangent, the squared norm is
    sum_v p_v (t_v - sum_w p_w t_w)^2: twice the second-order KL(p_theta0 || p_theta0+tau), so the penalty
    measures how far tau moves the *distribution* the model samples from. A token the model finds unlikely
    in that context (a slur after a news sentence) barely counts; the tokens it would write count most. The
    L2 norm of :func:`penalty` on logits weighs all vocabulary rows alike instead.

    logits, tangent: ``(N, T, V)``; mask: ``(N, T)``, which positions are real (the others never count).
    """
    if mask is not None:  # a padded position's values never reach the arithmetic (nor its gradient)
        real = mask.bool()[..., None]
        logits, tangent = torch.where(real, logits, 0.0), torch.where(real, tangent, 0.0)
    probs = logits.softmax(-1)
    centred = tangent - (probs * tangent).sum(-1, keepdim=True)
    weighted = probs.sqrt() * centred  # its squared L2 norm over the vocabulary is the variance above
    norms = torch.linalg.vector_norm(weighted.flatten(1), dim=1)  # safe at tau = 0, unlike a sqrt
    return (norms.square() if squared else norms).mean()


@dataclass
class Regularizer:
    """Which unlabeled batches to penalise at each step, and how to score them."""

    sources: Sequence[UnlabeledSource]
    lam: float = 0.1
    schedule: str = "cyclic"
    batch_size: int = 4
    squared: bool = False
    shard: Shard | None = None  # (rank, world size) under data parallelism
    # What the penalty measures (Recipe.penalty_on): "features", the tangents as given; for a language model
    # "logits" (the train loop maps tangents through the fixed linear head; :func:`penalty` takes the norm over
    # the sequence axis) or "distribution" (:func:`distribution_penalty`, which also needs theta_0's logits).
    measure: str = "features"
    #: It reads inputs of the sources, drawn each step (the data-free penalty, :mod:`editkit.core.curvature`, not).
    needs_inputs = True

    def __post_init__(self) -> None:
        if self.schedule not in ROWS_PER_SOURCE:
            raise ValueError(f"unknown schedule {self.schedule!r}")
        if self.measure not in ("features", "logits", "distribution"):
            raise ValueError(f"unknown penalty measure {self.measure!r}")
        if self._sharded and self.batch_size < self.shard[1]:
            raise ConfigError(
                f"a reg batch of {self.batch_size} cannot be split over {self.shard[1]} processes; "
                f"raise reg_batch to at least {self.shard[1]}"
            )

    @property
    def lazy(self) -> bool:
        """Whether drawing a batch loads data (worth doing ahead of time)."""
        return any(getattr(source, "lazy", False) for source in self.sources)

    @property
    def _sharded(self) -> bool:
        """Whether each process keeps a slice of every reg batch. Not under ``mixed``: its batches per source
        are a row or two, fewer than the processes, so each process scores all of them (a few rows beside its
        task batch) and averaging gradients over processes gives the single-process penalty unweighted."""
        return self.shard is not None and self.shard[1] > 1 and self.schedule != "mixed"

    @property
    def _shard_weight(self) -> float:
        if not self._sharded:
            return 1.0
        start, stop = shard_bounds(self.batch_size, *self.shard)
        return (stop - start) * self.shard[1] / self.batch_size

    def _draw(self, source: UnlabeledSource, size: int) -> Any:
        return source.next_batch(size, shard=self.shard if self._sharded else None)

    @property
    def active(self) -> bool:
        return self.lam > 0 and len(self.sources) > 0

    @property
    def rows_per_step(self) -> int:
        """Reg rows a step draws, over every source and process (the same at every step of a task)."""
        if not self.active:
            return 0
        return sum(ROWS_PER_SOURCE[self.schedule](0, len(self.sources), self.batch_size))

    def _drawn_at(self, step: int) -> list[tuple[UnlabeledSource, int]]:
        """(source, rows) for each source step ``step`` draws from: one in turn (cyclic), all (strict), or the
        rows of one batch spread over all in turn (mixed); none when inactive."""
        if not self.active:
            return []
        rows = ROWS_PER_SOURCE[self.schedule](step, len(self.sources), self.batch_size)
        return [(source, count) for source, count in zip(self.sources, rows) if count]

    def batches(self, step: int) -> list[Any]:
        """The reg batches of one step, one per source drawn from (empty when inactive)."""
        return [self._draw(source, size) for source, size in self._drawn_at(step)]

    def prepare(self, steps: int) -> None:
        """Let every source prepare the inputs that steps 0..steps-1 will draw from it (see
        :meth:`UnlabeledSource.prepare`); nothing is drawn, so the draws are those of an unprepared run."""
        sizes: dict[int, list[int]] = {id(source): [] for source in self.sources}
        for step in range(steps):
            for source, size in self._drawn_at(step):
                sizes[id(source)].append(size)
        for source in self.sources:
            source.prepare(source.upcoming(sizes[id(source)]))

    def skip(self, steps: int) -> None:
        """Advance the sources past the draws of ``steps`` steps without loading anything.

        Sources are shared across a stream's experiences, so the batches a task draws depend on
        what earlier tasks drew. A resumed stream skips each banked experience's draws and its
        later tasks are penalised on the batches a run without the interruption would use.
        """
        for step in range(steps):
            for source, size in self._drawn_at(step):
                source.next_indices(size)

    @property
    def on_logits(self) -> bool:
        """Whether the tangents it scores are a language model's logits' (the head's image of the features')."""
        return self.measure != "features"

    def loss(self, tangents: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None] | None = None,
             primals: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """lam * mean over the step's sources of their penalties (of this process's slices, weighted).

        masks: one per tangent (see :func:`penalty`), or None when no output has padding.
        primals: theta_0's outputs, one per tangent; only the "distribution" measure reads them.
        """
        masks = masks if masks is not None else [None] * len(tangents)
        if self.measure == "distribution":
            if primals is None:
                raise ValueError("the distribution penalty needs theta_0's logits beside the tangents")
            values = [distribution_penalty(z, t, squared=self.squared, mask=m)
                      for z, t, m in zip(primals, tangents, masks, strict=True)]
        else:
            values = [penalty(t, squared=self.squared, mask=m, over_sequence=self.on_logits)
                      for t, m in zip(tangents, masks, strict=True)]
        value = self.lam * torch.stack(values).mean()
        weight = self._shard_weight
        return value if weight == 1.0 else value * weight

