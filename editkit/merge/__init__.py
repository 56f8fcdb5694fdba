"""Combining task vectors: task arithmetic, TIES-merging, DARE, MagMax, OPCM, the structured merges
(TSV-Merge, Iso-C / Iso-CTS, CART) and the coefficient rules.

The registry ``MERGE_METHODS`` holds the methods; the built-in ones register themselves in
their own modules, imported below.

What the methods share lives here: the lazy mapping, the layout check every merge
makes before combining vectors, and the parsing of ``key=value`` options
(``editkit add --param``), typed by each option's default and refused by name when
the method has no such option.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from editkit.core.registry import Record, Registry
from editkit.errors import ConfigError, IncompatibleVectorsError

MERGE_METHODS: Registry[Record] = Registry("merge method")
"""Method name -> record whose ``build(vectors, **options)`` takes the task vectors by name (a mapping that
may load each one only when it is read, such as :class:`LazyVectors`) and returns the vectors whose sum,
scaled by one coefficient alpha, is added to theta_0: task arithmetic returns its input unchanged, the other
methods one merged vector."""

Vector = Mapping[str, torch.Tensor]

#: Method name -> the defaults of its options for a number of merged tasks, where its authors' settings depend on
#: it (CART's); :func:`method_options` lays them over the method's own defaults when it knows the count.
TASK_COUNT_DEFAULTS: dict[str, Callable[[int], dict[str, Any]]] = {}
#: Methods whose merged vector depends on the order of the task vectors (they fold them one after another): a
#: report records the order they were merged in.
ORDER_DEPENDENT: set[str] = set()


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
    their number: :data:`TASK_COUNT_DEFAULTS`) with ``{key: value}`` or ``["key=value", ...]`` (the command line's
    form) laid over them, so what was used is what a report records.

    Unknown keys are refused with the known ones listed; string values take the type of the
    option's default (``p=0.5`` is a float for DARE, ``seed=3`` an int). Range checks are the
    method's own (its ``build`` refuses what its paper does not define).
    """
    record = MERGE_METHODS[method]
    pairs = dict(_split(method, item) for item in given) if not isinstance(given, Mapping) else dict(given)
    where = f"merge method {method!r}"
    record.refuse_unknown(pairs, where)
    defaults = {o.name: o.default for o in record.options}
    if tasks is not None and method in TASK_COUNT_DEFAULTS:
        defaults.update(TASK_COUNT_DEFAULTS[method](tasks))
    return {**defaults, **{key: _typed(value, defaults[key], f"{where}: {key}") for key, value in pairs.items()}}


def _split(method: str, item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"merge method {method!r}: options are key=value, got {item!r}")
    return key.strip(), value.strip()


def _typed(value: Any, default: Any, what: str) -> Any:
    """``value`` as the type of ``default`` when it is a string (a value from the command line)."""
    if not isinstance(value, str) or isinstance(default, str) or default is None:
        return value
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            raise ConfigError(f"{what} must be true or false, got {value!r}")
        return value.lower() == "true"
    try:
        return type(default)(value)
    except ValueError:
        raise ConfigError(f"{what} must be {'an integer' if isinstance(default, int) else 'a number'}, "
                          f"got {value!r}") from None


# the built-in methods register themselves
from editkit.merge import arithmetic, cart, dare, isotropic, magmax, opcm, ties, tsv  # noqa: E402,F401
