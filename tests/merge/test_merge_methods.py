"""TIES, DARE, MagMax and OPCM against reference ports and hand computations on hand-made tensors.

The reference ports are written here from the papers' pseudo-code and the authors' code, with plain
numpy and loops: TIES' ``ties_merging`` (``topk_values_mask`` / ``resolve_sign`` / ``disjoint_merge``
on the flattened vectors, as in the TIES-merging repository), DARE's drop-and-rescale, MagMax's
``merge_max_abs`` and OPCM's loop over models as FusionBench writes it (the merged model normalized
at every step, lambda_t carried along, full SVDs).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from editkit.bank.store import Bank
from editkit.cli import app
from editkit.errors import ConfigError, IncompatibleVectorsError
from editkit.merge import MERGE_METHODS, LazyVectors, method_options
from editkit.merge.dare import dare_merge
from editkit.merge.magmax import magmax_merge
from editkit.merge.opcm import opcm_merge, project_out, protected_rank
from editkit.merge.ties import ties_merge
from editkit.merge.arithmetic import merged_vector

BASE = "sha256:" + "ab" * 32


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def random_vectors(n: int, seed: int, shapes=None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"a.weight": (3, 4), "a.bias": (4,), "b.weight": (2, 3, 1, 1)}
    return [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(n)]


def flat(vector) -> np.ndarray:
    """The authors' state_dict_to_vector: parameters in sorted name order, flattened."""
    return np.concatenate([vector[k].double().numpy().reshape(-1) for k in sorted(vector)])


def unflat(values: np.ndarray, like) -> dict[str, np.ndarray]:
    out, i = {}, 0
    for k in sorted(like):
        n = like[k].numel()
        out[k] = values[i:i + n].reshape(tuple(like[k].shape))
        i += n
    return out


# --- TIES: the authors' ties_merging ----------------------------------------------------------


def authors_topk_values_mask(m: np.ndarray, K: float) -> np.ndarray:
    """topk_values_mask: per row, keep entries >= the (d - int(d * K))-th smallest magnitude."""
    if K > 1:
        K /= 100
    d = m.shape[1]
    k = d - int(d * K)
    kth = np.sort(np.abs(m), axis=1)[:, k - 1:k]  # torch.kthvalue(k): the k-th smallest, 1-indexed
    return m * (np.abs(m) >= kth)


def authors_resolve_sign(m: np.ndarray) -> np.ndarray:
    """resolve_sign: sign of the column sums, zeros set to the sign of the sum of those signs."""
    signs = np.sign(m.sum(axis=0))
    signs[signs == 0] = np.sign(signs.sum())
    return signs


def authors_disjoint_mean(m: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """disjoint_merge(..., "dis-mean"): mean of the entries agreeing with the elected sign."""
    out = np.zeros(m.shape[1])
    for j in range(m.shape[1]):
        agreeing = [x for x in m[:, j] if (x > 0 if signs[j] > 0 else x < 0)]
        out[j] = sum(agreeing) / max(len(agreeing), 1)
    return out


def authors_ties_merging(flat_task_checks: np.ndarray, reset_thresh: float) -> np.ndarray:
    trimmed = authors_topk_values_mask(flat_task_checks, reset_thresh)
    return authors_disjoint_mean(trimmed, authors_resolve_sign(trimmed))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("reset_thresh", [20, 50])
def test_ties_equals_the_authors_ties_merging(seed, reset_thresh):
    vectors = random_vectors(3, seed)
    d = sum(v.numel() for v in vectors[0].values())  # 22 entries
    want = authors_ties_merging(np.stack([flat(v) for v in vectors]), reset_thresh)
    # The authors' kthvalue(d - int(d K)) keeps int(d K) + 1 entries per vector (distinct magnitudes);
    # editkit keeps int(d k): the same entries for k = (int(d K) + 1.5) / d.
    kept = int(d * reset_thresh / 100) + 1
    assert (authors_topk_values_mask(np.stack([flat(v) for v in vectors]), reset_thresh) != 0).sum(axis=1).tolist() \
        == [kept] * 3
    got = ties_merge(vectors, k=(kept + 0.5) / d)
    np.testing.assert_allclose(flat(got), want, rtol=1e-6, atol=1e-7)


def test_ties_equals_the_authors_when_an_entry_sums_to_zero():
    # entry 1: +2 and -2 cancel, so it takes the majority sign of the others (two +, one -): +
    vectors = [{"w": t(1.0, 2.0, 3.0, -1.0)}, {"w": t(2.0, -2.0, 1.0, -3.0)}]
    m = np.stack([flat(v) for v in vectors])
    want = authors_disjoint_mean(m, authors_resolve_sign(m))
    assert want.tolist() == [1.5, 2.0, 2.0, -2.0]
    np.testing.assert_allclose(flat(ties_merge(vectors, k=1.0)), want)


# --- DARE ------------------------------------------------------------------------------------------


def reference_dare(vectors, p: float, seed: int, base: str = "task-arithmetic") -> np.ndarray:
    """Drop each entry with probability p (u < p, u drawn as documented), divide survivors by 1 - p, then add
    (or elect signs and take the disjoint mean)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for vector in vectors:
        row = {}
        for key in sorted(vector):
            u = torch.rand(vector[key].shape, generator=g).double().numpy().reshape(-1)
            values = vector[key].double().numpy().reshape(-1)
            row[key] = np.array([x / (1 - p) if ui >= p else 0.0 for x, ui in zip(values, u)])
        rows.append(np.concatenate([row[k] for k in sorted(vector)]))
    m = np.stack(rows)
    return m.sum(axis=0) if base == "task-arithmetic" else authors_disjoint_mean(m, authors_resolve_sign(m))


@pytest.mark.parametrize("base", ["task-arithmetic", "ties"])
def test_dare_survivors_for_a_given_seed(base):
    vectors = random_vectors(3, 4)
    for seed in (0, 7):
        got = dare_merge(vectors, p=0.6, seed=seed, base=base)
        np.testing.assert_allclose(flat(got), reference_dare(vectors, 0.6, seed, base), rtol=1e-6, atol=1e-6)
    one = dare_merge(vectors[:1], p=0.6, seed=3)
    for key, value in one.items():
        kept = value != 0
        assert torch.equal(value[kept], vectors[0][key][kept] / 0.4)  # survivors exactly rescaled
        assert torch.equal(one[key], dare_merge(vectors[:1], p=0.6, seed=3)[key])  # the same seed, the same drop
    assert any(not torch.equal(one[k], dare_merge(vectors[:1], p=0.6, seed=4)[k]) for k in one)


def test_dare_drop_rate_and_expected_value():
    ones = {"w": torch.ones(20_000)}
    dropped = (dare_merge([ones], p=0.9, seed=0)["w"] == 0).double().mean().item()
    assert dropped == pytest.approx(0.9, abs=0.01)  # 4.7 standard errors
    tau = {"w": t(1.0, -2.0, 0.5, 3.0), "b": t(-1.0, 4.0)}
    seeds = 2000
    mean = {k: sum(dare_merge([tau], p=0.5, seed=s)[k].double() for s in range(seeds)) / seeds for k in tau}
    for key, value in tau.items():
        # each entry is 2 x or 0 with equal chance: standard error |x| / sqrt(seeds) = 0.022 |x|
        torch.testing.assert_close(mean[key], value.double(), rtol=0.12, atol=0.0)


def test_dare_without_drop_is_the_sum_or_untrimmed_ties():
    vectors = random_vectors(3, 5)
    summed = dare_merge(vectors, p=0.0)
    for key in summed:
        torch.testing.assert_close(summed[key], vectors[0][key] + vectors[1][key] + vectors[2][key])
    untrimmed = dare_merge(vectors, p=0.0, base="ties")
    m = np.stack([flat(v) for v in vectors])
    np.testing.assert_allclose(flat(untrimmed), authors_disjoint_mean(m, authors_resolve_sign(m)), rtol=1e-6)


def test_dare_refuses_what_the_paper_does_not_define():
    v = {"w": t(1.0)}
    for p in (1.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="drop rate"):
            dare_merge([v], p=p)
    with pytest.raises(ConfigError, match="task-arithmetic, ties"):
        dare_merge([v], base="mean")
    with pytest.raises(ConfigError, match="at least one"):
        dare_merge([])
    with pytest.raises(IncompatibleVectorsError):
        dare_merge([v, {"w": t(1.0, 2.0)}])


# --- MagMax ----------------------------------------------------------------------------------------


def test_magmax_keeps_the_largest_magnitude_with_its_sign_by_hand():
    v1 = {"w": t(1.0, -3.0, 2.0, 0.5)}
    v2 = {"w": t(-2.0, 1.0, -2.0, 0.1)}
    v3 = {"w": t(0.5, 2.5, 1.0, -4.0)}
    # entry 0: -2 (v2); entry 1: -3 (v1); entry 2: |2| = |-2|, the later vector wins: -2; entry 3: -4 (v3)
    assert torch.equal(magmax_merge([v1, v2, v3])["w"], t(-2.0, -3.0, -2.0, -4.0))
    assert torch.equal(magmax_merge([v2, v1, v3])["w"], t(-2.0, -3.0, 2.0, -4.0))  # now v1's 2 comes later


def test_magmax_equals_the_authors_merge_max_abs():
    vectors = random_vectors(4, 6)
    for v in vectors:  # some exact ties of magnitude across vectors
        v["a.bias"][0] = -1.5
    vectors[0]["a.bias"][0] = 1.5
    got = magmax_merge(vectors)
    for key in got:
        stack = np.stack([v[key].numpy().reshape(-1) for v in vectors])
        want = []
        for j in range(stack.shape[1]):  # merge_max_abs: fold in order, >= lets a later vector win
            best = stack[0, j]
            for x in stack[1:, j]:
                best = x if abs(x) >= abs(best) else best
            want.append(best)
        assert got[key].numpy().reshape(-1).tolist() == want


# --- OPCM ------------------------------------------------------------------------------------------


def test_protected_rank_is_the_first_index_whose_cumulative_share_exceeds_share():
    s = t(4.0, 3.0, 1.0)  # cumulative shares 0.5, 0.875, 1
    assert protected_rank(s, 0.5) == 1  # 0.5 is not > 0.5
    assert protected_rank(s, 0.4) == 0
    assert protected_rank(s, 0.9) == 2
    assert protected_rank(s, 1.0) == 0  # no share exceeds 1


def test_opcm_two_matrices_by_hand():
    tau1 = {"w": torch.diag(t(4.0, 3.0, 1.0)), "b": t(1.0, 2.0)}
    tau2 = {"w": torch.arange(1.0, 10.0).reshape(3, 3), "b": t(3.0, -1.0)}
    # share 0.9 protects 2 directions (e1, e2 on both sides): the 2 x 2 block and the diagonal go
    assert torch.equal(project_out(tau1["w"], tau2["w"], 0.9), torch.tensor([[0.0, 0, 3], [0, 0, 6], [7, 8, 0]]))
    # share 0.5 protects 1 direction: only the diagonal goes
    assert torch.equal(project_out(tau1["w"], tau2["w"], 0.5), torch.tensor([[0.0, 2, 3], [4, 0, 6], [7, 8, 0]]))
    # S = tau1 + cleaned tau2 = [[4, 0, 3], [0, 3, 6], [7, 8, 1]], b = [4, 1]; rescaled to the mean norm:
    # ||tau1||^2 = 26 + 5, ||tau2||^2 = 285 + 10, ||S||^2 = 184 + 17
    scale = (math.sqrt(31) + math.sqrt(295)) / 2 / math.sqrt(201)
    merged = opcm_merge([tau1, tau2], share=0.9)
    torch.testing.assert_close(merged["w"], scale * torch.tensor([[4.0, 0, 3], [0, 3, 6], [7, 8, 1]]))
    torch.testing.assert_close(merged["b"], scale * t(4.0, 1.0))


def test_opcm_projection_in_a_rotated_basis_and_on_convolution_kernels():
    q, _ = torch.linalg.qr(torch.tensor([[2.0, 1, 0], [1, 3, 1], [0, 1, 4]], dtype=torch.float64))
    r, _ = torch.linalg.qr(torch.tensor([[1.0, 2, 0], [0, 1, 3], [2, 0, 1]], dtype=torch.float64))
    merged = q @ torch.diag(torch.tensor([4.0, 3.0, 1.0], dtype=torch.float64)) @ r.T
    coords = torch.arange(1.0, 10.0, dtype=torch.float64).reshape(3, 3)
    kept = torch.tensor([[0.0, 0, 3], [0, 0, 6], [7, 8, 0]], dtype=torch.float64)
    torch.testing.assert_close(project_out(merged, q @ coords @ r.T, 0.9), q @ kept @ r.T)
    # a 1 x 1 convolution kernel (out, in, 1, 1) is the (out, in) matrix it applies to every pixel
    kernel = torch.tensor([[2.0, 0, 0], [0, 1, 0]]).reshape(2, 3, 1, 1)
    task = torch.arange(1.0, 7.0).reshape(2, 3, 1, 1)
    assert torch.equal(project_out(kernel, task, 0.5), torch.tensor([[0.0, 2, 3], [4, 0, 6]]).reshape(2, 3, 1, 1))
    # a matrix no earlier task changed has no protected directions: the new one is added whole
    assert torch.equal(project_out(torch.zeros(2, 3), task.reshape(2, 3), 0.5), task.reshape(2, 3))


def fusionbench_opcm(vectors, share: float) -> dict[str, np.ndarray]:
    """OPCMForCLIP.run: the merged model normalized to the mean task-vector norm at every step, lambda_t carried."""
    def norm(v):
        return math.sqrt(sum(float((x ** 2).sum()) for x in v.values()))

    vs = [{k: x.double().numpy() for k, x in v.items()} for v in vectors]
    merged, norms, previous_lambda = dict(vs[0]), [norm(vs[0])], 1.0
    for tau in vs[1:]:
        norms.append(norm(tau))
        average = float(np.mean(norms))
        new = {}
        for key, m in merged.items():
            if m.ndim >= 2:  # merge_linear_weights
                matrix, task = m.reshape(m.shape[0], -1), tau[key].reshape(m.shape[0], -1)
                u, s, vh = np.linalg.svd(matrix, full_matrices=True)
                v = vh.T
                split_rank = int(np.argmax(np.cumsum(s) / s.sum() > share))
                projected = u.T @ task @ v
                np.fill_diagonal(projected, 0)
                projected[:split_rank, :split_rank] = 0
                new[key] = previous_lambda * m + (u @ projected @ v.T).reshape(m.shape)
            else:  # merge_other_parameters
                new[key] = previous_lambda * m + tau[key]
        merged_norm = norm(new)
        previous_lambda = merged_norm / average
        merged = {k: x * average / merged_norm for k, x in new.items()}
    return merged


@pytest.mark.parametrize("share", [0.3, 0.5, 0.8])
def test_opcm_equals_fusionbench_on_three_and_five_vectors(share):
    shapes = {"a.weight": (4, 3), "b.weight": (3, 5), "conv.weight": (3, 2, 2, 2), "a.bias": (4,)}
    for n in (3, 5):
        vectors = random_vectors(n, 10 + n, shapes)
        got = opcm_merge(vectors, share=share)
        want = fusionbench_opcm(vectors, share)
        for key in shapes:
            np.testing.assert_allclose(got[key].numpy(), want[key], rtol=1e-4, atol=1e-5)
    one = random_vectors(1, 3, shapes)
    assert all(torch.equal(opcm_merge(one)[k], one[0][k]) for k in shapes)  # one task: its own vector
    with pytest.raises(ConfigError, match=r"\[0, 1\]"):
        opcm_merge(one, share=1.5)


# --- the registry, options and `editkit add` ------------------------------------------------------


def test_every_method_reads_the_vectors_lazily_and_once():
    vectors = random_vectors(3, 8)
    reads = []

    def load(name: str):
        reads.append(name)
        return vectors[int(name)]

    for method in MERGE_METHODS:
        reads.clear()
        merged = MERGE_METHODS[method].build(LazyVectors(["0", "1", "2"], load), **method_options(method, {}))
        assert list(merged) == (["0", "1", "2"] if method == "task-arithmetic" else [method])
        assert reads == ([] if method == "task-arithmetic" else ["0", "1", "2"])


def test_options_are_typed_and_unknown_keys_refused_with_the_known_ones():
    assert method_options("dare", ["p=0.5", "seed=3", "base=ties"]) == {"p": 0.5, "seed": 3, "base": "ties"}
    assert method_options("opcm", {"share": 0.25}) == {"share": 0.25}
    assert method_options("dare", ["p=0.5"]) == {"p": 0.5, "seed": 0, "base": "task-arithmetic"}  # defaults recorded
    assert method_options("magmax", []) == {}
    with pytest.raises(ConfigError, match=r"^merge method 'dare': unknown option 'q'; known: p, seed, base$"):
        method_options("dare", ["q=1"])
    with pytest.raises(ConfigError, match="known: none"):
        method_options("magmax", ["p=0.5"])
    with pytest.raises(ConfigError, match="seed must be an integer"):
        method_options("dare", ["seed=1.5"])
    with pytest.raises(ConfigError, match="key=value"):
        method_options("ties", ["0.3"])
    with pytest.raises(ConfigError, match="unknown merge method 'nope'"):
        method_options("nope", [])


def make_bank(root, modes):
    bank = Bank(root)
    for i, (name, mode) in enumerate(modes.items()):
        bank.append(name, {"w": t(1.0, -4.0, 2.0) * (i + 1) - t(0.0, 0.0, 5.0) * i, "b": t(3.0 - 4 * i)},
                    task=name, mode=mode, base=BASE, scenario="offline-vision", step=i)
    return bank


def test_add_merges_the_scaled_vectors(tmp_path):
    bank = make_bank(tmp_path / "bank", {"x": "taujp", "y": "linear"})  # x: w [1, -4, 2], b 3; y: [2, -8, -1], -1
    coefficients = {"x": 0.5, "y": -1.0}  # 0.5 x: [0.5, -2, 1], 1.5; -y: [-2, 8, 1], 1
    magmax = merged_vector(bank, coefficients, "magmax", {})
    assert magmax.mode == "linear"  # taujp and linear vectors are both linearized
    assert torch.equal(magmax.tensors["w"], t(-2.0, 8.0, 1.0)) and torch.equal(magmax.tensors["b"], t(1.5))
    summed = merged_vector(bank, coefficients, "task-arithmetic", {})
    assert torch.equal(summed.tensors["w"], t(-1.5, 6.0, 2.0)) and torch.equal(summed.tensors["b"], t(2.5))
    make_bank(tmp_path / "mixed", {"x": "nonlinear", "y": "linear"})
    with pytest.raises(IncompatibleVectorsError, match="one family at a time"):
        merged_vector(Bank(tmp_path / "mixed"), {"x": 1.0, "y": 1.0}, "opcm", {})


def test_add_refuses_unknown_methods_and_options_in_one_line(tmp_path):
    make_bank(tmp_path / "bank", {"x": "taujp", "y": "taujp"})
    runner = CliRunner()
    for args, needle in ((["--method", "dare", "--param", "q=1"], "unknown option 'q'; known: p, seed, base"),
                         (["--method", "magmaxx"], "unknown merge method 'magmaxx'"),
                         (["--method", "dare", "--param", "p=1"], "drop rate p must be in [0, 1)")):
        result = runner.invoke(app, ["add", "x", "y", "--bank", str(tmp_path / "bank"), *args])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert result.output.startswith("error:") and needle in " ".join(result.output.split())
