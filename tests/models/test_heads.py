"""Fixed heads: the linear probe against scikit-learn's own probabilities and
separable data, absent classes, the binary special case; the zero-shot head
against cosine similarity computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from editkit.models.heads import LinearHead, ZeroShotHead, fit_probe


def separable(classes: list[int], n_per_class: int = 15, dim: int = 6, seed: int = 0):
    """Gaussian clusters far apart: linearly separable with a wide margin."""
    g = torch.Generator().manual_seed(seed)
    centers = 6.0 * torch.randn(max(classes) + 1, dim, generator=g)
    xs, ys = [], []
    for c in classes:
        xs.append(centers[c] + 0.2 * torch.randn(n_per_class, dim, generator=g))
        ys.append(torch.full((n_per_class,), c, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


def sklearn_proba(x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    clf = LogisticRegression(max_iter=2000, random_state=seed).fit(x.double().numpy(), y.numpy())
    return clf.classes_, clf.predict_proba(x.double().numpy())


def test_probe_separates_and_has_the_right_shape():
    x, y = separable([0, 1, 2, 3])
    head = fit_probe(x, y, num_classes=4)
    assert isinstance(head, LinearHead)
    assert head.weight.shape == (4, 6) and head.bias.shape == (4,)
    assert list(head.parameters()) == []  # fixed: nothing for an optimizer to train
    logits = head(x)
    assert (logits.argmax(1) == y).all()  # 100% train accuracy
    # softmax of the head is scikit-learn's multinomial probability
    classes, proba = sklearn_proba(x, y)
    assert list(classes) == [0, 1, 2, 3]
    np.testing.assert_allclose(torch.softmax(logits.double(), 1).numpy(), proba, atol=1e-4)


def test_head_is_affine_by_hand():
    x, y = separable([0, 1, 2])
    head = fit_probe(x, y, num_classes=3)
    f = x[:4]
    out = head(f)
    for i in range(4):
        for c in range(3):
            expected = sum(head.weight[c, d].item() * f[i, d].item() for d in range(6)) + head.bias[c].item()
            assert out[i, c].item() == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_absent_classes_get_very_low_logits():
    present = [0, 2, 3]
    x, y = separable(present)
    head = fit_probe(x, y, num_classes=5)
    assert head.weight.shape == (5, 6)
    logits = head(x)
    assert (logits.argmax(1) == y).all()
    for absent in (1, 4):
        assert torch.count_nonzero(head.weight[absent]) == 0
        # far below every present class's logit, for every example
        assert (logits[:, absent] < logits[:, present].min(1).values - 1e3).all()
    assert (torch.softmax(logits, 1)[:, [1, 4]] == 0).all()
    classes, proba = sklearn_proba(x, y)
    assert list(classes) == present
    np.testing.assert_allclose(torch.softmax(logits.double(), 1)[:, present].numpy(), proba, atol=1e-4)


@pytest.mark.parametrize("pair", [(0, 1), (1, 3), (3, 0)])
def test_binary_case_maps_to_the_right_rows(pair):
    a, b = pair
    x, y = separable([a, b], seed=a + 10 * b)
    head = fit_probe(x, y, num_classes=4)
    logits = head(x)
    assert (logits.argmax(1) == y).all()
    others = [c for c in range(4) if c not in pair]
    for c in others:
        assert (logits[:, c] < logits[:, list(pair)].min(1).values - 1e3).all()
    # P(class) from the two rows equals scikit-learn's binary probabilities
    classes, proba = sklearn_proba(x, y)
    assert list(classes) == sorted(pair)
    got = torch.softmax(logits.double()[:, list(classes)], 1).numpy()
    np.testing.assert_allclose(got, proba, atol=1e-4)


def test_probe_is_deterministic():
    x, y = separable([0, 1, 2])
    h1, h2 = fit_probe(x, y, 3, seed=0), fit_probe(x, y, 3, seed=0)
    assert torch.equal(h1.weight, h2.weight) and torch.equal(h1.bias, h2.bias)


def test_zero_shot_head_is_scaled_cosine_by_hand():
    g = torch.Generator().manual_seed(0)
    text = torch.randn(4, 5, generator=g) * 3  # unnormalized class embeddings
    feats = torch.randn(3, 5, generator=g) * 7
    scale = 100.0
    head = ZeroShotHead(text, scale)
    assert list(head.parameters()) == []
    out = head(feats)
    assert out.shape == (3, 4)
    for i in range(3):
        fi = feats[i].tolist()
        for c in range(4):
            tc = text[c].tolist()
            dot = sum(p * q for p, q in zip(fi, tc))
            cos = dot / (math.sqrt(sum(p * p for p in fi)) * math.sqrt(sum(q * q for q in tc)))
            assert out[i, c].item() == pytest.approx(scale * cos, rel=1e-5, abs=1e-4)
    # invariant to the scale of features and of class embeddings
    torch.testing.assert_close(ZeroShotHead(text * 0.01, scale)(feats * 50), out, rtol=1e-5, atol=1e-4)
