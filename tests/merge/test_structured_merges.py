"""TSV-Merge, Iso-C / Iso-CTS and CART against results worked out by hand on small matrices.

Each case is built from matrices whose SVD is known (diagonal ones, rotated by orthogonal matrices), so the
expected merge follows from the method's definition on paper: truncation keeps the named singular values,
the orthonormalization of two unit vectors at angle theta puts them at theta/2 -/+ pi/4, the isotropic
spectrum is the mean of the singular values, CART's centered matrices are worked out entry by entry.
"""

from __future__ import annotations

import math

import pytest
import torch

from editkit.bank.store import Bank
from editkit.errors import ConfigError, CorruptVectorError, IncompatibleVectorsError
from editkit.merge.arithmetic import merged_vector
from editkit.merge.cart import cart_merge
from editkit.merge.isotropic import common_rank, isotropic_merge
from editkit.merge.spectral import orthonormalized, svd
from editkit.merge.tsv import tsv_merge

BASE = "sha256:" + "cd" * 32


def diag(*values: float) -> torch.Tensor:
    return torch.diag(torch.tensor(values, dtype=torch.float64))


#: A weight matrix's name inside a block, where CART low-ranks it (``w`` would be averaged: it is in no block).
LAYER = "blocks.0.mlp.weight"


def tasks(*matrices: torch.Tensor, bias=None, key: str = "w") -> dict[str, dict[str, torch.Tensor]]:
    """Task vectors by name, each a weight matrix named ``key`` (and a bias where given)."""
    out = {}
    for i, m in enumerate(matrices):
        out[f"t{i}"] = {key: m} if bias is None else {key: m, "b": torch.tensor(bias[i], dtype=torch.float64)}
    return out


def orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    return q


def unit(angle: float) -> torch.Tensor:
    return torch.tensor([math.cos(angle), math.sin(angle)], dtype=torch.float64)


# --- TSV-Merge --------------------------------------------------------------------------------------------


def test_tsv_keeps_each_tasks_top_rank_over_t_and_sums_orthogonal_tasks():
    # four dimensions, two tasks: each keeps its top 2 singular values; the 1 of task 0 on e3 is cut
    merged = tsv_merge(tasks(diag(3, 2, 1, 0), diag(0, 0, -5, 4), bias=[[1.0, 2.0], [3.0, 4.0]]))
    assert torch.allclose(merged["w"], diag(3, 2, -5, 4), atol=1e-12)
    assert torch.allclose(merged["b"], torch.tensor([2.0, 3.0], dtype=torch.float64))  # not a matrix: averaged


def test_tsv_rotates_two_shared_directions_apart_symmetrically():
    """Two rank-1 tasks in 2-D, singular vectors at angles theta (left) and phi (right): the nearest orthonormal
    pair to unit vectors at 0 and theta lies at theta/2 - pi/4 and theta/2 + pi/4."""
    theta, phi = 0.6, 1.1
    t0 = 2.0 * torch.outer(unit(0.0), unit(0.0))
    t1 = 1.0 * torch.outer(unit(theta), unit(phi))
    expected = (2.0 * torch.outer(unit(theta / 2 - math.pi / 4), unit(phi / 2 - math.pi / 4))
                + 1.0 * torch.outer(unit(theta / 2 + math.pi / 4), unit(phi / 2 + math.pi / 4)))
    assert torch.allclose(tsv_merge(tasks(t0, t1))["w"], expected, atol=1e-12)
    # -t1 = (-u) v^T: its column of the gathered basis flips, and so does its orthonormalized column
    negated = (2.0 * torch.outer(unit(theta / 2 - math.pi / 4), unit(phi / 2 - math.pi / 4))
               - 1.0 * torch.outer(unit(theta / 2 + math.pi / 4), unit(phi / 2 + math.pi / 4)))
    assert torch.allclose(tsv_merge(tasks(t0, -t1))["w"], negated, atol=1e-12)
    flipped = orthonormalized(torch.stack([unit(0.0), -unit(theta)], dim=1))
    assert torch.allclose(flipped[:, 1], -unit(theta / 2 + math.pi / 4), atol=1e-12)


def test_tsv_of_one_task_is_the_task_and_works_in_a_rotated_basis():
    q1, q2 = orthogonal(4, 0), orthogonal(4, 1)
    one = q1 @ diag(4, 3, 2, 1) @ q2.T
    assert torch.allclose(tsv_merge(tasks(one))["w"], one, atol=1e-12)
    rotated = tsv_merge(tasks(q1 @ diag(3, 2, 1, 0) @ q2.T, q1 @ diag(0, 0, -5, 4) @ q2.T))
    assert torch.allclose(rotated["w"], q1 @ diag(3, 2, -5, 4) @ q2.T, atol=1e-10)


def test_tsv_keeps_one_direction_per_task_when_a_layer_has_fewer_than_t():
    """Rank 2, three tasks: one triplet each, gathered U = [e1, e2, e1]. Its nearest orthonormal-rowed matrix
    is (U U^T)^(-1/2) U = [[1/sqrt2, 0, 1/sqrt2], [0, 1, 0]], and likewise for V, so the merge is
    3 * 1/2 e1 e1^T + 2 e2 e2^T + 1 * 1/2 e1 e1^T = diag(2, 2)."""
    assert torch.allclose(tsv_merge(tasks(diag(3, 0), diag(0, 2), diag(1, 0)))["w"], diag(2, 2), atol=1e-12)


# --- Iso-C and Iso-CTS -------------------------------------------------------------------------------------


def test_iso_c_flattens_the_spectrum_of_the_sum_to_its_mean():
    merged = isotropic_merge(tasks(diag(4, 0, 0), diag(0, -2, 1), bias=[[1.0], [2.0]]), None)
    assert torch.allclose(merged["w"], 7 / 3 * diag(1, -1, 1), atol=1e-12)  # singular values 4, 2, 1 -> 7/3
    assert torch.allclose(merged["b"], torch.tensor([1.5], dtype=torch.float64))
    wide = isotropic_merge(tasks(torch.tensor([[3.0, 0, 0], [0, 0, 0]], dtype=torch.float64),
                                 torch.tensor([[0.0, 0, 0], [0, 1, 0]], dtype=torch.float64)), None)
    assert torch.allclose(wide["w"], torch.tensor([[2.0, 0, 0], [0, 2, 0]], dtype=torch.float64), atol=1e-12)
    q1, q2 = orthogonal(3, 2), orthogonal(3, 3)
    rotated = isotropic_merge(tasks(q1 @ diag(4, 0, 0) @ q2.T, q1 @ diag(0, -2, 1) @ q2.T), None)
    assert torch.allclose(rotated["w"], q1 @ (7 / 3 * diag(1, -1, 1)) @ q2.T, atol=1e-10)


def test_iso_cts_takes_the_tasks_own_directions_where_the_sum_cancels_them():
    """Sum diag(5, 3, 1, 1.5): common subspace e1, e2 (half the rank); task 0's own top direction is e3 (2),
    task 1's e4 (1.5, its -1 on e3 is weaker): spectrum (5 + 3 + 2 + 1.5) / 4 = 2.875 on every direction.
    Iso-C flattens the sum's own spectrum: (5 + 3 + 1 + 1.5) / 4 = 2.625."""
    vectors = tasks(diag(5, 0, 2, 0), diag(0, 3, -1, 1.5))
    assert torch.allclose(isotropic_merge(vectors, 0.5)["w"], 2.875 * diag(1, 1, 1, 1), atol=1e-12)
    assert torch.allclose(isotropic_merge(vectors, None)["w"], 2.625 * diag(1, 1, 1, 1), atol=1e-12)
    assert torch.allclose(isotropic_merge(vectors, 1.0)["w"], isotropic_merge(vectors, None)["w"])  # no room left


def test_iso_cts_common_rank_leaves_a_multiple_of_t_to_the_tasks():
    assert common_rank(768, 8, 0.8) == 616  # int(614.4) = 614, (768 - 614) / 8 = 19.25 -> 19 each -> 152
    assert common_rank(4, 2, 0.5) == 2 and common_rank(4, 3, 0.8) == 4 and common_rank(10, 3, 0.0) == 1


# --- CART --------------------------------------------------------------------------------------------------


def test_cart_is_the_average_plus_lambda_times_the_low_rank_centered_tasks():
    """tau_i = 3 e_i e_i^T: mean I; centered tau_0 - mean = diag(2, -1, -1), whose rank-1 part is diag(2, 0, 0);
    the three sum to 2 I, so CART = I + lam * 2 I."""
    vectors = tasks(diag(3, 0, 0), diag(0, 3, 0), diag(0, 0, 3), bias=[[3.0], [0.0], [0.0]], key=LAYER)
    merged = cart_merge(vectors, rank_ratio=1 / 3, lam=2.0)
    assert torch.allclose(merged[LAYER], 5 * diag(1, 1, 1), atol=1e-12)
    assert torch.allclose(merged["b"], torch.tensor([1.0], dtype=torch.float64))
    full = cart_merge(vectors, rank_ratio=1.0)  # nothing cut: the centered matrices sum to zero
    assert torch.allclose(full[LAYER], diag(1, 1, 1), atol=1e-12)
    outside = cart_merge(tasks(diag(3, 0, 0), diag(0, 3, 0), diag(0, 0, 3)), rank_ratio=1 / 3, lam=2.0)
    assert torch.allclose(outside["w"], diag(1, 1, 1), atol=1e-12)  # in no block: averaged, as the authors do


def test_cart_of_two_tasks_is_their_average():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    assert torch.allclose(cart_merge(tasks(a, b, key=LAYER))[LAYER], (a + b) / 2, atol=1e-12)
    with pytest.raises(ConfigError, match=r"\(0, 1\]"):
        cart_merge(tasks(a, b), rank_ratio=0.0)


def test_cart_low_ranks_a_clip_vits_attention_and_mlp_weights_only_as_its_authors_do(tiny_clip):
    """A CLIP-shaped vector (the tiny ViT's parameter names and shapes, a second resblock added): the tensors
    CART low-ranks are the authors' (keys with ``attn`` or ``mlp``, without ``ln`` or ``bias``), each merged by
    hand as mean + lam * sum of rank-k centered matrices; every other tensor (the patch-embedding convolution,
    the positional and class embeddings, the output projection, norms, biases) is the tasks' average."""
    from editkit.merge.cart import is_layer_matrix

    shapes = {n: tuple(p.shape) for n, p in tiny_clip.module.named_parameters()}
    shapes.update({n.replace("resblocks.0.", "resblocks.1."): s for n, s in shapes.items() if "resblocks.0." in n})
    g = torch.Generator().manual_seed(5)
    vectors = {f"t{i}": {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
               for i in range(4)}
    authors = {n for n in shapes if ("attn" in n or "mlp" in n) and "ln" not in n and "bias" not in n}
    assert {n for n in shapes if is_layer_matrix(n, vectors["t0"][n])} == authors
    assert {"conv1.weight", "positional_embedding", "proj", "class_embedding"}.isdisjoint(authors)
    merged = cart_merge(vectors, rank_ratio=0.25, lam=1.5)
    for name in shapes:
        values = [v[name] for v in vectors.values()]
        mean = sum(values) / 4
        if name not in authors:
            assert torch.allclose(merged[name], mean, atol=1e-12), name
            continue
        matrices = [t.reshape(t.shape[0], -1) for t in values]
        k = max(1, int(0.25 * min(matrices[0].shape)))
        low = []
        for m in matrices:
            u, sv, vh = torch.linalg.svd(m - mean.reshape(m.shape), full_matrices=False)
            low.append(u[:, :k] @ torch.diag(sv[:k]) @ vh[:k])
        hand = mean.reshape(matrices[0].shape) + 1.5 * sum(low)
        assert torch.allclose(merged[name], hand.reshape(mean.shape), atol=1e-10), name


def test_cart_takes_its_authors_setting_for_the_number_of_tasks():
    """The authors' configurations for 8, 14 and 20 tasks (rank ratio / lambda 0.12 / 2.0, 0.16 / 1.5, 0.32 / 1.9),
    the nearest one where the user sets neither; what a user sets is kept."""
    from editkit.merge import method_options
    from editkit.merge.cart import authors_setting

    setting = {n: tuple(authors_setting(n).values()) for n in (2, 4, 8, 11, 12, 14, 17, 18, 20, 40)}
    assert setting == {2: (0.12, 2.0), 4: (0.12, 2.0), 8: (0.12, 2.0), 11: (0.12, 2.0), 12: (0.16, 1.5),
                       14: (0.16, 1.5), 17: (0.16, 1.5), 18: (0.32, 1.9), 20: (0.32, 1.9), 40: (0.32, 1.9)}
    assert method_options("cart", {}, tasks=14) == {"rank_ratio": 0.16, "lam": 1.5}
    assert method_options("cart", ["lam=3"], tasks=20) == {"rank_ratio": 0.32, "lam": 3.0}
    assert method_options("cart", {}) == {"rank_ratio": 0.12, "lam": 2.0}  # no count: the 8-task setting
    g = torch.Generator().manual_seed(2)
    many = tasks(*(torch.randn(6, 6, generator=g, dtype=torch.float64) for _ in range(14)), key=LAYER)
    assert torch.equal(cart_merge(many)[LAYER], cart_merge(many, rank_ratio=0.16, lam=1.5)[LAYER])


# --- shapes, layouts and the bank ---------------------------------------------------------------------------


def test_kernels_are_merged_as_matrices_and_layouts_are_checked():
    g = torch.Generator().manual_seed(1)
    kernels = tasks(*(torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64) for _ in range(3)), key=LAYER)
    for merge in (tsv_merge, lambda v: isotropic_merge(v, None), lambda v: isotropic_merge(v, 0.8), cart_merge):
        merged = merge(kernels)[LAYER]
        assert merged.shape == (3, 2, 2, 2)
        assert not torch.allclose(merged, sum(v[LAYER] for v in kernels.values()) / 3)  # not averaged
    with pytest.raises(IncompatibleVectorsError, match="shape"):
        tsv_merge(tasks(diag(1, 2), diag(1, 2, 3)))


def test_add_reads_banked_vectors_tensor_by_tensor_and_merges_them_alike(tmp_path):
    bank = Bank(tmp_path / "bank")
    vectors = tasks(diag(3, 2, 1, 0).float(), diag(0, 0, -5, 4).float(), bias=[[1.0, 2.0], [3.0, 4.0]])
    for i, (name, v) in enumerate(vectors.items()):
        bank.append(name, {k: t.float() for k, t in v.items()}, task=name, mode="taujp", base=BASE,
                    scenario="offline-vision", step=i)
    reader = bank.reader("t0", base=BASE)
    assert reader.shapes == {"b": (2,), "w": (4, 4)} and torch.equal(reader["w"], vectors["t0"]["w"].float())
    merged = merged_vector(bank, {"t0": 1.0, "t1": 0.5}, "tsv", {})
    assert merged.mode == "taujp"
    assert torch.allclose(merged.tensors["w"], diag(3, 2, -2.5, 2).float(), atol=1e-6)
    assert torch.allclose(merged.tensors["b"], torch.tensor([1.25, 2.0]))  # (1 + 1.5) / 2, (2 + 2) / 2
    (tmp_path / "bank" / "t1.safetensors").write_bytes(b"not a vector")
    with pytest.raises(CorruptVectorError, match="t1"):
        merged_vector(bank, {"t0": 1.0, "t1": 1.0}, "iso-c", {})


def test_a_float32_svd_that_fails_to_converge_is_retried_in_float64(monkeypatch):
    """LAPACK's float32 SVD failed to converge on a real Iso-CTS basis (a bench crashed on it); the float64 SVD
    of the same matrix converges. Simulated here: float32 refuses, and the result is still the known SVD
    (singular values 3 and 1 of a rotated diagonal matrix), in float32."""
    real_svd = torch.linalg.svd

    def float32_fails(matrix, full_matrices=True):
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        return real_svd(matrix, full_matrices=full_matrices)

    monkeypatch.setattr(torch.linalg, "svd", float32_fails)
    rotation = orthogonal(2, seed=3)
    u, s, vh = svd((rotation @ diag(3.0, 1.0)).float())
    assert u.dtype == s.dtype == vh.dtype == torch.float32
    assert torch.allclose(s, torch.tensor([3.0, 1.0]), atol=1e-6)
    assert torch.allclose(u.abs(), rotation.float().abs(), atol=1e-6) and torch.allclose(vh.abs(), torch.eye(2), atol=1e-6)


def test_a_float64_svd_that_fails_to_converge_is_raised(monkeypatch):
    def fails(matrix, full_matrices=True):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "svd", fails)
    with pytest.raises(torch.linalg.LinAlgError):  # nowhere further to go
        svd(diag(3.0, 1.0))
