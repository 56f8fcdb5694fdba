"""Task-vector algebra (``editkit.merge.arithmetic.TaskVector``) against hand-made tensors.

Every expected value below is written out by hand (small integers, exact in float32),
so a wrong sign, a dropped key or a scaled-twice term shows as a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from editkit.errors import IncompatibleVectorsError
from editkit.merge.arithmetic import TaskVector


def tv(mode: str = "taujp", **tensors: list) -> TaskVector:
    return TaskVector({k: torch.tensor(v, dtype=torch.float32) for k, v in tensors.items()}, mode)


def values(vector: TaskVector) -> dict[str, list]:
    return {k: v.tolist() for k, v in vector.tensors.items()}


A = dict(w=[[1.0, -2.0], [3.0, 0.0]], b=[0.5, 4.0])
B = dict(w=[[2.0, 2.0], [-1.0, 5.0]], b=[1.5, -4.0])
C = dict(w=[[0.0, 1.0], [1.0, 1.0]], b=[-2.0, 0.0])


def test_addition_is_elementwise_and_keeps_the_mode():
    total = tv(**A) + tv(**B)
    assert values(total) == {"w": [[3.0, 0.0], [2.0, 5.0]], "b": [2.0, 0.0]}
    assert total.mode == "taujp"


def test_negation_and_subtraction():
    assert values(-tv(**A)) == {"w": [[-1.0, 2.0], [-3.0, 0.0]], "b": [-0.5, -4.0]}
    assert values(tv(**A) - tv(**B)) == {"w": [[-1.0, -4.0], [4.0, -5.0]], "b": [-1.0, 8.0]}
    assert (-tv("nonlinear", **A)).mode == "nonlinear"


def test_scalar_multiplication_from_either_side():
    assert values(tv(**A) * 2) == {"w": [[2.0, -4.0], [6.0, 0.0]], "b": [1.0, 8.0]}
    assert values(-0.5 * tv(**B)) == {"w": [[-1.0, -1.0], [0.5, -2.5]], "b": [-0.75, 2.0]}


def test_sum_of_a_list_and_a_task_arithmetic_combination():
    assert values(sum([tv(**A), tv(**B), tv(**C)])) == {"w": [[3.0, 1.0], [3.0, 6.0]], "b": [0.0, 0.0]}
    # theta_0 + 1 * tau_A + 0.5 * tau_B - 2 * tau_C, term by term
    combo = tv(**A) + 0.5 * tv(**B) - 2 * tv(**C)
    assert values(combo) == {"w": [[2.0, -3.0], [0.5, 0.5]], "b": [5.25, 2.0]}


def test_inputs_are_not_modified():
    a, b = tv(**A), tv(**B)
    _ = -(a + b) * 3
    assert values(a) == A and values(b) == B


def test_linear_and_taujp_mix_into_the_linearized_family():
    mixed = tv("linear", **A) + tv("taujp", **B)
    assert mixed.mode == "linear" and values(mixed) == {"w": [[3.0, 0.0], [2.0, 5.0]], "b": [2.0, 0.0]}


def test_mismatched_keys_are_refused():
    with pytest.raises(IncompatibleVectorsError, match="parameter names"):
        tv(**A) + tv(w=A["w"])
    with pytest.raises(IncompatibleVectorsError, match="parameter names"):
        tv(**A) + tv(w=A["w"], b=A["b"], extra=[1.0])


def test_nonlinear_and_linearized_vectors_are_refused():
    with pytest.raises(IncompatibleVectorsError, match="nonlinear vector with a taujp"):
        tv("nonlinear", **A) + tv("taujp", **B)
    with pytest.raises(IncompatibleVectorsError):
        tv("linear", **A) - tv("nonlinear", **B)
