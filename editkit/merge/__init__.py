"""Combining task vectors: task arithmetic, TIES-merging, DARE, MagMax, OPCM, the structured merges
(TSV-Merge, Iso-C / Iso-CTS, CART) and the coefficient rules.

The registry ``MERGE_METHODS`` holds the methods, each a :class:`MergeMethod` that carries what a caller must
know of it besides its options (order dependence, defaults by task count, its paper); the built-in ones register
themselves in their own modules, imported below.

What the methods share lives here: the lazy mapping, the layout check every merge
makes before combining vectors, and a method's options (``editkit add --param key=value``) with its defaults
for the number of merged tasks, parsed and typed by the registry's one grammar
(:meth:`~editkit.core.registry.Record.given`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from editkit.core.registry import Record, Registry
from editkit.errors import ConfigError, IncompatibleVectorsError


@dataclass(frozen=True)
class MergeMethod(Record):
    """A merge method's record: ``build(vectors, **options)`` and the facts a caller needs about the method."""

    #: The merged vector depends on the order of the task vectors (the method folds them one after another), so a
    #: report records the order they were merged in.
    order_dependent: bool = False
    #: The defaults of its options for a number of merged tasks, where its authors' settings depend on it (CART's).
    task_count_defaults: Callable[[int], dict[str, Any]] | None = None

    def defaults_for(self, tasks: int | None) -> dict[str, Any]:
        """Its options' defaults for ``tasks`` merged vectors (None: not known, the method's own defaults)."""
        counted = self.task_count_defaults(tasks) if tasks is not None and self.task_count_defaults else {}
        return {**self.defaults(), **counted}


MERGE_METHODS: Registry[MergeMethod] = Registry("merge method", MergeMethod)
"""Method name -> record whose ``build(vectors, **options)`` takes the task vectors by name (a mapping that
may load each one only when it is read, such as :class:`LazyVectors`) and returns the vectors whose sum,
scaled by one coefficient alpha, is added to theta_0: task arithmetic returns its input unchanged, the other
methods one merged vector. An extension may register a plain :class:`~editkit.core.registry.Record`: it is a
method of no order dependence and fixed defaults."""

Vector = Mapping[str, torch.Tensor]


class LazyVectors(Mapping[str, Vector]):
    """Task vectors by name, each produced by ``load(name)`` when it is read and never kept here.

    A merge method that reads the vectors one at a time (task arithmetic in the bank, DARE,
    MagMax, OPCM) then holds one input vector at a time, whatever the number of tasks;
    ``load`` decides whether anything is cached (the bench's evaluator keeps small vectors).
    """

    def __init__(self, names: Sequence[str], load: Callable[[str], Vector]) -> None:
        self.names, self.load = list(names), load

    def __getitem__(self, name: str) -> Vector:
        if name not in self.names:
            raise KeyError(name)
        return self.load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def checked(vectors: Iterable[Vector], what: str) -> Iterator[Vector]:
    """The vectors in order, each refused unless it has vector 0's parameter names and shapes.

    Only vector 0's shapes are kept, so a method folding the vectors one by one holds no extra
    vector for the check; ``what`` names the method when there is no vector at all.
    """
    shapes: dict[str, tuple[int, ...]] | None = None
    for i, vector in enumerate(vectors):
        these = shapes_of(vector)
        if shapes is None:
            shapes = these
        elif set(these) != set(shapes):
            raise IncompatibleVectorsError(f"task vectors 0 and {i} have different parameter names")
        else:
            for key, shape in shapes.items():
                if these[key] != shape:
                    raise IncompatibleVectorsError(f"parameter {key!r} has shape {shape} in vector 0 "
                                                   f"but {these[key]} in vector {i}")
        yield vector
    if shapes is None:
        raise ConfigError(f"{what} needs at least one task vector")


def shapes_of(vector: Vector) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape; a vector that reads its tensors on demand (a bank's
    :class:`~editkit.bank.store.VectorReader`) answers from its file's header, reading no tensor."""
    shapes = getattr(vector, "shapes", None)
    return dict(shapes) if shapes is not None else {key: tuple(t.shape) for key, t in vector.items()}


def vector_norm(vector: Vector) -> float:
    """The L2 norm of the whole vector, every parameter flattened (in float64)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in vector.values()))


def method_options(method: str, given: Mapping[str, Any] | Sequence[str], tasks: int | None = None) -> dict[str, Any]:
    """A merge method's options: its defaults (for ``tasks`` merged vectors, where the method's settings depend on
    their number: :attr:`MergeMethod.task_count_defaults`) with ``{key: value}`` or ``["key=value", ...]`` (the
    command line's form) laid over them, so what was used is what a report records.

    Unknown keys are refused with the known ones listed; string values take the type of the
    option's default (``p=0.5`` is a float for DARE, ``seed=3`` an int). Range checks are the
    method's own (its ``build`` refuses what its paper does not define).
    """
    return MERGE_METHODS.options(method, given, MERGE_METHODS[method].defaults_for(tasks))


# the built-in methods register themselves
from editkit.merge import arithmetic, cart, dare, isotropic, magmax, opcm, ties, tsv  # noqa: E402,F401
