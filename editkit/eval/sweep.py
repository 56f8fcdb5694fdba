"""Many coefficient combinations of one mode's task vectors, evaluated cheaply and exactly.

:class:`TaskSplits` holds every task's validation / test labels and theta_0's
features; :class:`ModeEvaluator` answers "predictions of theta_0 + sum_k c_k tau_k
on split s" for any coefficients, memoised. For linearized vectors the model is
f_lin(x; sum c_k tau_k) = f(x; theta_0) + sum c_k J tau_k(x): the tangent is linear
in the coefficients, so theta_0's features and one tangent per vector per input
(one jvp) give every coefficient, sum and negation exactly, with no jvp repeated.
Non-linear vectors need a real forward pass per combination. This exactness is a
capability of classification scorers: their predictions are a function of the
features alone (:func:`editkit.eval.accuracy.classify`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from editkit.bank.store import Bank
from editkit.core.batching import Batching, TensorBatching
from editkit.core.prototypes import ClassHead, Prototypes, class_head
from editkit.eval.accuracy import classify
from editkit.eval.diagnostics import tangent_norms
from editkit.eval.features import outputs_over, prefix
from editkit.train.runtime import Runtime
from editkit.errors import BankError, ConfigError
from editkit.core.linearize import LinearizedModel, NonLinearModel
from editkit.core.modes import Mode
from editkit.util.progress import Progress
from editkit.settings import CLASS_HEAD_SHRINKAGE

SPLITS = ("val", "test")
CLASS_INCREMENTAL = "class-incremental"  # a memo key's tag: each input's class under each prefix's head
IN_MEMORY_LIMIT = 4 << 30  # bytes of banked vectors a mode keeps in memory; above it sums stream from the bank


class TaskSplits:
    """Every task's validation and test split, their labels and theta_0's features.

    Inputs are never all held in memory: in-memory tasks are sliced, other datasets
    (image files, parquet) are read batch by batch through a DataLoader with the
    runtime's workers, each time a model has to see them. What is kept is one
    feature (or tangent) vector per input. The derived split ``xi`` is the first
    ``xi_samples`` test inputs of each task.
    """

    def __init__(self, module: nn.Module, tasks, *, batch_size: int, xi_samples: int, progress: Progress,
                 runtime: Runtime | None = None, batching: Batching | None = None) -> None:
        self.names = [t.name for t in tasks]
        self.batch_size, self.xi_samples, self.runtime = batch_size, xi_samples, runtime or Runtime()
        self.batching = batching or TensorBatching()
        self.sets: dict[str, dict[str, Any]] = {s: {t.name: getattr(t, s) for t in tasks} for s in SPLITS}
        empty = [f"{n} ({s})" for s in SPLITS for n in self.names if len(self.sets[s][n]) == 0]
        if empty:
            raise ConfigError(f"bench needs non-empty validation and test splits; empty: {', '.join(empty)}")
        self.sets["xi"] = {n: prefix(d, xi_samples) for n, d in self.sets["test"].items()}
        self.labels: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SPLITS}
        self.f0: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SPLITS}
        batches = sum(self.batches(s, n) for s in SPLITS for n in self.names)
        with progress.task("theta_0 features", total=batches) as bar:
            for split in SPLITS:
                for name in self.names:
                    labels: list[torch.Tensor] = []
                    self.f0[split][name] = self.map(module, split, name, bar, labels=labels)
                    self.labels[split][name] = torch.cat(labels).long()
        self.f0["xi"] = {n: f[:xi_samples] for n, f in self.f0["test"].items()}
        self.labels["xi"] = {n: y[:xi_samples] for n, y in self.labels["test"].items()}

    def batches(self, split: str, name: str) -> int:
        return math.ceil(len(self.sets[split][name]) / self.batch_size)

    def map(self, fn: Callable[..., torch.Tensor], split: str, name: str, bar=None,
            labels: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``fn`` (a module, or a model's ``tangent``) over a split's inputs (:func:`outputs_over`)."""
        return outputs_over(fn, self.sets[split][name], batch_size=self.batch_size, batching=self.batching,
                            runtime=self.runtime, bar=bar, labels=labels)

    @torch.no_grad()
    def pretrained_accuracies(self, heads: Mapping[str, nn.Module], split: str) -> dict[str, float]:
        """theta_0's accuracy on each task's ``split`` under the task's head."""
        return {n: float((classify(heads[n], self.f0[split][n]) == self.labels[split][n]).double().mean())
                for n in self.names}


Combo = Mapping[str, float]


def _combo_key(combo: Combo) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((k, float(c)) for k, c in combo.items() if float(c) != 0.0))


class ModeEvaluator:
    """Predictions of theta_0 + sum_k c_k tau_k for one mode's vectors, memoised.

    Vector keys are the bank's vector names (one per task) plus in-memory extras
    (the TIES-merged vector). Linearized modes combine cached tangents (exact);
    the non-linear mode runs the network at the combined parameters. Nothing here
    opens a progress task: callers pass a ``bar`` to advance.
    """

    def __init__(self, mode: str, bank: Bank, vector_names: Mapping[str, str], data: TaskSplits,
                 heads: Mapping[str, nn.Module], base: str, models: "SharedModels", *, label: str | None = None) -> None:
        self.mode, self.bank, self.data, self.heads, self.base = mode, bank, data, heads, base
        self.label = label or mode  # how reports name these vectors (a mode, or e.g. taujp-lora)
        self.vector_names = dict(vector_names)  # task -> bank vector name
        self.models = models
        self.linearized = Mode(mode).linearized
        self.extras: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}
        self._tangents: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self._memo: dict[tuple, Any] = {}
        self._last: tuple[tuple, dict[str, torch.Tensor]] | None = None
        self._prototypes: dict[str, Prototypes | None] | None = None  # by task, read from the bank once
        self._class_heads: dict[str, list[ClassHead] | None] = {}  # by prototype set, one per prefix of the stream

    # vectors
    def vector(self, key: str) -> dict[str, torch.Tensor]:
        """A vector's tensors; banked ones are kept in memory after the first (checksummed) load
        while all of them fit in ``IN_MEMORY_LIMIT`` bytes."""
        if key in self.extras:
            return self.extras[key]
        if key in self._loaded:
            return self._loaded[key]
        tensors = dict(self.bank.reader(self.vector_names[key], base=self.base))  # a plain adapter: weight updates
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if size * len(self.vector_names) <= IN_MEMORY_LIMIT:
            self._loaded[key] = tensors
        return tensors

    def add_vector(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        if key in self.vector_names:
            raise ValueError(f"vector key {key!r} is a task name")
        self.extras[key] = tensors

    def combined(self, combo: Combo) -> dict[str, torch.Tensor]:
        """sum c_k tau_k: banked vectors through the bank's streamed merge, extras added in memory."""
        key = _combo_key(combo)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        first = next((k for k, _ in key if k not in self.extras), None)
        if first is not None and (self.vector(first) is self._loaded.get(first)):
            in_memory = [k for k, _ in key]  # every banked vector fits in memory: sum there
        else:
            in_memory = [k for k, _ in key if k in self.extras]
        banked = {self.vector_names[k]: c for k, c in key if k not in in_memory}
        tau = self.bank.merge(banked, base=self.base) if banked else {}
        for k, c in key:
            if k in in_memory:
                for name, t in self.vector(k).items():
                    tau[name] = tau[name] + c * t if name in tau else c * t
        self._last = (key, tau)
        return tau

    # tangents (linearized modes)
    def _missing(self, key: str, split: str, names: Sequence[str] | None = None) -> list[str]:
        """The tasks of ``names`` (default: every task) whose tangents of ``key`` on ``split`` are not cached."""
        held = self._tangents.get((key, split), {})
        return [n for n in (names or self.data.names) if n not in held]

    def tangent_batches(self, keys: Sequence[str], splits: Sequence[str] = SPLITS) -> int:
        return sum(self.data.batches(s, n) for s in splits for k in keys for n in self._missing(k, s))

    def compute_tangents(self, keys: Sequence[str], splits: Sequence[str] = SPLITS, bar=None,
                         names: Sequence[str] | None = None) -> None:
        """J tau_k on the inputs of ``splits`` of every task (or of ``names`` alone: a vector that only they are
        scored under), one jvp per input, cached; tasks whose tangents are cached (or adopted) are skipped."""
        for k in keys:
            todo = {s: self._missing(k, s, names) for s in splits}
            if not any(todo.values()):
                continue
            model = self.models.holding(self.vector(k), linearized=True)
            for split, missing in todo.items():
                held = self._tangents.setdefault((k, split), {})
                for n in missing:
                    held[n] = self.data.map(model.tangent, split, n, bar)

    def adopt_tangents(self, split: str, tangents: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Take tangents computed elsewhere as cached: ``{vector key: {task: J tau(x) on the task's split}}``,
        each over the same inputs in the same order as :class:`TaskSplits` holds them (a stream's scores of its
        vectors on the test splits: one jvp pass fewer per vector and task scored)."""
        for key, per_task in tangents.items():
            for name, tangent in per_task.items():
                if tangent.shape[0] != len(self.data.sets[split][name]):
                    raise ValueError(f"tangents of {key!r} on {name} ({split}) cover {tangent.shape[0]} inputs, "
                                     f"not {len(self.data.sets[split][name])}")  # a bug in the caller
                self._tangents.setdefault((key, split), {})[name] = tangent

    def discard(self, key: str) -> None:
        """Forget an in-memory vector and its tangents (the memoised predictions stay: they are small)."""
        self.extras.pop(key, None)
        for split in SPLITS:
            self._tangents.pop((key, split), None)
        self._last = None

    def tangents(self, key: str, split: str) -> dict[str, torch.Tensor]:
        if split == "xi":
            return {n: t[: self.data.xi_samples] for n, t in self.tangents(key, "test").items()}
        if (key, split) not in self._tangents:
            raise RuntimeError(f"tangents of {key!r} on {split} were not computed")  # a bug in the caller
        return self._tangents[(key, split)]

    def tangent_norm_means(self, key: str, names: Sequence[str], split: str = "test", bar=None) -> dict[str, float]:
        """Mean over each named task's inputs of ||J tau_key(x)||; for non-linear vectors computed and dropped."""
        if self.linearized:
            tangents = self.tangents(key, split)
            return {n: float(tangent_norms(tangents[n]).double().mean()) for n in names}
        model = self.models.holding(self.vector(key), linearized=True)
        out = {}
        for n in names:
            t = self.data.map(model.tangent, split, n, bar)
            out[n] = float(tangent_norms(t).double().mean())
        return out

    # predictions
    @torch.no_grad()
    def predictions(self, combo: Combo, split: str, tasks: Sequence[str]) -> dict[str, torch.Tensor]:
        """Each task's predicted classes under its own head (task-incremental); each input's class under the
        class-incremental head of every prefix of the stream, from the same features, is kept beside them
        (:meth:`class_incremental_accuracies`)."""
        key = _combo_key(combo)
        missing = [t for t in tasks if (key, split, t) not in self._memo]
        if missing:
            if not key:
                for t in missing:
                    self._remember(key, split, t, self.data.f0[split][t])
            elif self.linearized:
                for t in missing:
                    features = self.data.f0[split][t].clone()
                    for k, c in key:
                        features.add_(self.tangents(k, split)[t], alpha=c)
                    self._remember(key, split, t, features)
            else:
                model = self.models.holding(self.combined(combo), linearized=False)
                for t in missing:
                    self._remember(key, split, t, self.data.map(model, split, t))
        return {t: self._memo[(key, split, t)] for t in tasks}

    def _remember(self, key: tuple, split: str, task: str, features: torch.Tensor) -> None:
        """Memoise a task's predictions from its features, and, for a task of the stream whose bank holds every
        task's prototypes, its inputs' classes (global, in stream order) under the head of each prefix of the
        stream: the classes seen after each step (the control task, ImageNet, is no class of the stream).
        A class-incremental accuracy among any seen tasks then needs no feature again."""
        self._memo[(key, split, task)] = self._chunked(lambda f: classify(self.heads[task], f), features)
        heads = self._prefix_heads("merged" if key else "pretrained")
        if task in self.vector_names and heads is not None:
            self._memo[(key, split, task, CLASS_INCREMENTAL)] = self._chunked(
                lambda f: torch.stack([head.predict(f) for head in heads], dim=1), features)

    @staticmethod
    def _chunked(fn, features: torch.Tensor) -> Any:
        """``fn`` over 4096 inputs at a time, concatenated (column by column where it returns a tuple)."""
        pieces = [fn(features[i : i + 4096]) for i in range(0, len(features), 4096)]
        if isinstance(pieces[0], tuple):
            return tuple(torch.cat(column) for column in zip(*pieces))
        return torch.cat(pieces)

    def _banked_prototypes(self) -> dict[str, Prototypes | None]:
        """Every task's class prototypes as its vector was banked with them (None: banked without), read once."""
        if self._prototypes is None:
            self._prototypes = {t: self.bank.prototypes(name) for t, name in self.vector_names.items()}
        return self._prototypes

    def _prefix_heads(self, kind: str) -> list[ClassHead] | None:
        """The class-incremental head (:func:`~editkit.core.prototypes.class_head`) over the first k tasks of the
        stream, for k = 1..all, from their ``kind`` prototypes (theta_0's own, ``pretrained``, for theta_0
        alone; else ``merged``); None where a vector was banked without them."""
        if kind not in self._class_heads:
            banked = list(self._banked_prototypes().values())
            self._class_heads[kind] = None if any(p is None for p in banked) else [
                class_head(banked[:k], kind, CLASS_HEAD_SHRINKAGE) for k in range(1, len(banked) + 1)]
        return self._class_heads[kind]

    def class_incremental_accuracies(self, combo: Combo, split: str, tasks: Sequence[str],
                                     among: Sequence[str] | None = None) -> dict[str, float]:
        """Each task's accuracy when its ``split`` inputs, under the combination's features, are classified among
        every class of the tasks ``among`` (default: every task of the stream) without the task id, by the
        shared-covariance head over their prototypes (:class:`~editkit.core.prototypes.ClassHead`); right only
        when it is the input's own task's right class. ``among`` is the tasks seen so far: a prefix of the stream,
        in any order."""
        stream = list(self.vector_names)
        among = stream if among is None else list(among)
        self._require_prototypes(among)
        outside = [t for t in tasks if t not in among]
        if outside:
            raise ConfigError(f"task(s) {', '.join(outside)} are not among the tasks classified over "
                              f"({', '.join(among)}): their inputs could never be right")
        seen = len(among)
        if set(among) != set(stream[:seen]):
            raise ConfigError(f"class-incremental accuracy among {', '.join(among)}: the classes seen are those of "
                              f"the stream's first tasks ({', '.join(stream)}), a prefix of it")
        self.predictions(combo, split, tasks)
        key = _combo_key(combo)
        offsets = dict(zip(stream, torch.tensor([0, *[p.classes for p in self._prototypes.values()]]).cumsum(0)))
        out = {}
        for t in tasks:
            predicted = self._memo[(key, split, t, CLASS_INCREMENTAL)][:, seen - 1]
            out[t] = float((predicted == offsets[t] + self.data.labels[split][t]).double().mean())
        return out

    def _require_prototypes(self, among: Sequence[str]) -> None:
        """Refuse, naming the bank and the task, tasks that are not the stream's or were banked without their
        class prototypes of this format (and say how to fill them in)."""
        unknown = [t for t in among if t not in self.vector_names]
        if unknown or not among:
            raise ConfigError(f"class-incremental accuracy among {', '.join(among) or 'no task'}: "
                              f"the stream's tasks are {', '.join(self.vector_names)}")
        missing = [t for t in self.vector_names if self._banked_prototypes()[t] is None]
        if missing:
            entry = self.bank.get(self.vector_names[missing[0]])
            raise BankError(f"bank {self.bank.root}: task {missing[0]}'s vector {entry.name!r} was banked without "
                            f"class prototypes (or with an earlier format of them); fill them in with `editkit stream --scenario {entry.scenario or '<scenario>'} "
                            f"--mode {entry.mode} --bank {self.bank.root} --resume`")

    def accuracies(self, combo: Combo, split: str, tasks: Sequence[str]) -> dict[str, float]:
        preds = self.predictions(combo, split, tasks)
        return {t: float((preds[t] == self.data.labels[split][t]).double().mean()) for t in tasks}


class SharedModels:
    """Wrappers of theta_0 shared by every mode: one per kind (linearized or not) and set of parameters a vector
    covers (full vectors cover every parameter; an adapter's cover its factors, or, merged as weight updates,
    the adapted weights), each built the first time a vector of that kind is loaded."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._models: dict[tuple[bool, frozenset[str]], LinearizedModel | NonLinearModel] = {}

    @classmethod
    def of(cls, module: nn.Module) -> "SharedModels":
        return cls(module)

    def holding(self, vector: Mapping[str, torch.Tensor], *, linearized: bool) -> LinearizedModel | NonLinearModel:
        """The shared model of ``vector``'s parameters, at theta_0 + ``vector``."""
        key = (linearized, frozenset(vector))
        if key not in self._models:
            names = list(vector)
            model = LinearizedModel(self.module, names) if linearized else NonLinearModel(self.module, names)
            self._models[key] = model.eval()
        model = self._models[key]
        model.load_task_vector(vector)
        return model
