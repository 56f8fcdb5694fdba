"""Task arithmetic: combine banked task vectors as sums of alpha_i * tau_i.

``TaskVector`` gives in-memory vectors the operators of task arithmetic
(``+``, unary ``-``, scalar ``*``, ``sum()``); ``combine`` reads a selection
from a bank through the bank's streaming merge, which refuses mixed modes or
bases. Adding is ``{name: alpha}`` for each name; negating one vector is
``{name: -alpha}``.

Registered as the merge method ``task-arithmetic``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from editkit.bank.store import Bank
from editkit.core.modes import combined_mode, mode_family
from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.merge import MERGE_METHODS, LazyVectors, MergeMethod, shapes_of


@dataclass
class TaskVector:
    """A task vector tau (parameter name -> tensor) and the mode it was fine-tuned in."""

    tensors: dict[str, torch.Tensor]
    mode: str

    def _check(self, other: "TaskVector") -> None:
        if mode_family(self.mode) != mode_family(other.mode):
            raise IncompatibleVectorsError(
                f"cannot combine a {self.mode} vector with a {other.mode} vector: non-linear and "
                "linearized task vectors live in different models"
            )
        if self.tensors.keys() != other.tensors.keys():
            raise IncompatibleVectorsError("task vectors have different parameter names")

    def __add__(self, other: "TaskVector | int") -> "TaskVector":
        if isinstance(other, int) and other == 0:  # lets sum() start from 0
            return self
        self._check(other)
        return TaskVector({k: v + other.tensors[k] for k, v in self.tensors.items()},
                          combined_mode((self.mode, other.mode)))

    __radd__ = __add__

    def __neg__(self) -> "TaskVector":
        return TaskVector({k: -v for k, v in self.tensors.items()}, self.mode)

    def __sub__(self, other: "TaskVector") -> "TaskVector":
        return self + (-other)

    def __mul__(self, alpha: float) -> "TaskVector":
        return TaskVector({k: alpha * v for k, v in self.tensors.items()}, self.mode)

    __rmul__ = __mul__


def addition_coefficients(names: Sequence[str], alpha: float | Sequence[float] = 1.0) -> dict[str, float]:
    """{name: alpha_i}: one alpha for all, or one per name."""
    if not names:
        raise ConfigError("nothing to add: name at least one vector (or --all)")
    alphas = [float(alpha)] * len(names) if isinstance(alpha, (int, float)) else [float(a) for a in alpha]
    if len(alphas) != len(names):
        raise ConfigError(f"got {len(alphas)} alphas for {len(names)} vectors")
    if len(set(names)) != len(names):
        raise ConfigError(f"a vector is named twice in {list(names)}")
    return dict(zip(names, alphas))


def negation_coefficients(name: str, alpha: float = 1.0) -> dict[str, float]:
    return {name: -float(alpha)}


def combine(bank: Bank, coefficients: Mapping[str, float], *, base: str | None = None) -> TaskVector:
    """sum_i alpha_i tau_i from the bank, streamed tensor by tensor; the mode is the selection's."""
    tensors = bank.merge(coefficients, base=base)
    return TaskVector(tensors, combined_mode(bank.get(n).mode for n in coefficients))


def _sum_of_vectors(vectors: Mapping[str, Mapping[str, torch.Tensor]]) -> Mapping[str, Mapping[str, torch.Tensor]]:
    """Task arithmetic adds every vector as it is: alpha * sum_i tau_i. The input is returned itself (nothing is
    read), so a caller holding per-vector results (cached tangents) combines them instead of a summed vector."""
    return vectors


MERGE_METHODS.register("task-arithmetic", MergeMethod.of(_sum_of_vectors, label="task arithmetic",
                                                            reference_url="https://arxiv.org/abs/2212.04089"))


class ScaledVector(Mapping[str, torch.Tensor]):
    """``alpha * vector``, each tensor scaled when it is read (the vector may read its tensors on demand)."""

    def __init__(self, vector: Mapping[str, torch.Tensor], alpha: float) -> None:
        self.vector, self.alpha = vector, alpha
        self.shapes = shapes_of(vector)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.alpha * self.vector[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.vector)

    def __len__(self) -> int:
        return len(self.vector)


def merged_vector(bank: Bank, coefficients: Mapping[str, float], method: str, options: Mapping[str, Any]) -> TaskVector:
    """What ``editkit add`` adds to theta_0 (and a stream scores after each experience): ``method`` merging the
    scaled vectors alpha_i tau_i, in selection order, each tensor read from the bank when the method asks for it.
    Task arithmetic returns its input, whose sum the bank streams tensor by tensor.
    With one alpha for all, this is alpha times the method's merged vector (every built-in method commutes with
    scaling all its inputs by one number)."""
    record = MERGE_METHODS[method]
    mode = combined_mode(bank.get(n).mode for n in coefficients)  # refuses a mix of families before any read
    bank.check_combinable(list(coefficients))  # and of adapters or bases

    def scaled(name: str) -> Mapping[str, torch.Tensor]:
        tensors, alpha = bank.reader(name, base=bank.base), coefficients[name]
        return tensors if alpha == 1.0 else ScaledVector(tensors, alpha)

    merged = record.build(LazyVectors(list(coefficients), scaled), **options)
    made = [n for n in merged if n not in coefficients]
    if not made:  # the method adds the vectors as they are (task arithmetic)
        return combine(bank, coefficients)
    tensors = {key: sum(merged[n][key] for n in made) for key in merged[made[0]]}
    return TaskVector(tensors, mode)
