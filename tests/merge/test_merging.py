"""TIES-merging against results computed by hand."""

from __future__ import annotations

import pytest
import torch

from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.merge.ties import elected_sign, trim_threshold, trimmed, ties_merge


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_trim_keeps_top_fraction_over_the_whole_vector():
    # 10 entries over two parameters; k = 0.2 keeps the 2 largest magnitudes (5 and -4),
    # wherever they are: the threshold is global, not per parameter.
    vector = {"a": t(1.0, -4.0, 0.5, 2.0), "b": t(5.0, -1.5, 0.1, 3.0, -0.2, 0.3)}
    assert trim_threshold(vector, 0.2) == 4.0
    assert torch.equal(trimmed(vector["a"], 4.0), t(0.0, -4.0, 0.0, 0.0))
    assert torch.equal(trimmed(vector["b"], 4.0), t(5.0, 0.0, 0.0, 0.0, 0.0, 0.0))


def test_trim_keeps_ties_at_the_threshold_and_k_one_keeps_everything():
    vector = {"w": t(3.0, -3.0, 1.0, 0.0)}
    # k = 0.25 -> keep int(4 * 0.25) = 1 entry, threshold = 3 -> both magnitude-3 entries survive
    assert trim_threshold(vector, 0.25) == 3.0
    assert torch.equal(trimmed(vector["w"], 3.0), t(3.0, -3.0, 0.0, 0.0))
    assert torch.equal(trimmed(vector["w"], trim_threshold(vector, 1.0)), vector["w"])


@pytest.mark.parametrize("seed", range(10))
def test_trimming_a_float64_vector_keeps_exactly_its_top_k_entries(seed):
    """The threshold is found in the vector's own precision: in float32 the boundary entry's magnitude could round
    up above its float64 self and be trimmed by its own threshold (603 kept instead of 604 in 7 of 10 seeds)."""
    g = torch.Generator().manual_seed(seed)
    vector = {"a": torch.randn(1000, generator=g, dtype=torch.float64) * 1e-3,
              "b": torch.randn(51, 41, generator=g, dtype=torch.float64) * 1e-3}
    threshold = trim_threshold(vector, 0.2)
    kept = sum(int((trimmed(t, threshold) != 0).sum()) for t in vector.values())
    assert kept == int((1000 + 51 * 41) * 0.2) == 618


def test_ties_known_answer():
    # Three vectors of 5 entries (one parameter), k = 0.6 keeps the top 3 of each.
    v1 = {"w": t(4.0, -1.0, 2.0, 0.5, -3.0)}   # keep 4, 2, -3     -> [4, 0, 2, 0, -3]
    v2 = {"w": t(-2.0, 3.0, 1.0, 0.2, 1.5)}    # keep -2, 3, 1.5   -> [-2, 3, 0, 0, 1.5]
    v3 = {"w": t(1.0, -0.1, -5.0, 6.0, 0.3)}   # keep 1, -5, 6     -> [1, 0, -5, 6, 0]
    # elected signs: sums [3, 3, -3, 6, -1.5] -> [+, +, -, +, -]
    # disjoint mean: e0 mean(4, 1) = 2.5; e1 mean(3) = 3; e2 mean(-5) = -5; e3 mean(6) = 6; e4 mean(-3) = -3
    merged = ties_merge([v1, v2, v3], k=0.6)
    assert torch.allclose(merged["w"], t(2.5, 3.0, -5.0, 6.0, -3.0))
    # lambda scales the result
    assert torch.allclose(ties_merge([v1, v2, v3], k=0.6, lam=0.5)["w"], t(1.25, 1.5, -2.5, 3.0, -1.5))


def test_ties_zero_sum_entries_take_the_majority_sign():
    # After trimming with k = 1 (keep all): entry 0 sums to 0 -> gets the majority sign of the
    # elected signs (+, since entries 1 and 2 are + and entry 3 is -), so its mean is over the
    # positive value only: 2.
    v1 = {"w": t(2.0, 1.0, 1.0, -1.0)}
    v2 = {"w": t(-2.0, 1.0, 3.0, -2.0)}
    assert torch.equal(elected_sign([v1["w"], v2["w"]]), torch.tensor([0.0, 1.0, 1.0, -1.0], dtype=torch.float64))
    assert torch.allclose(ties_merge([v1, v2], k=1.0)["w"], t(2.0, 1.0, 2.0, -1.5))


def test_ties_over_several_parameters_by_hand():
    # Two vectors, two parameters, k = 0.5 over 4 entries -> keep 2 per vector.
    v1 = {"a": t(1.0, -6.0), "b": t(0.5, 4.0)}   # keep -6, 4      -> a [0, -6], b [0, 4]
    v2 = {"a": t(2.0, 3.0), "b": t(-5.0, 0.1)}   # keep 3, -5      -> a [0, 3],  b [-5, 0]
    # signs: a [0 -> majority, -3 -> -], b [-5 -> -, 4 -> +]; elected signs (-, -, +) sum to -1,
    # so the zero entry a[0] takes '-': no value agrees, stays 0.
    merged = ties_merge([v1, v2], k=0.5)
    assert torch.allclose(merged["a"], t(0.0, -6.0))
    assert torch.allclose(merged["b"], t(-5.0, 4.0))


def test_ties_refuses_bad_input():
    with pytest.raises(ConfigError):
        ties_merge([])
    with pytest.raises(IncompatibleVectorsError):
        ties_merge([{"a": t(1.0)}, {"b": t(1.0)}])
    with pytest.raises(IncompatibleVectorsError):
        ties_merge([{"a": t(1.0)}, {"a": t(1.0, 2.0)}])
    with pytest.raises(ConfigError):
        ties_merge([{"a": t(1.0)}], k=0.0)


def test_single_vector_with_k_one_is_itself():
    v = {"a": torch.randn(3, 4), "b": torch.randn(5)}
    merged = ties_merge([v], k=1.0)
    for key in v:
        assert torch.allclose(merged[key], v[key])
