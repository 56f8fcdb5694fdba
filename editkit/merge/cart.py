"""CART: centered task arithmetic — the average of the tasks plus low-rank versions of what sets each apart.

CART (Choi et al., 2024, "Revisiting Weight Averaging for Model Merging"), as in the authors' code
(``_merge_weights("CART")``): the task vectors are centered on their mean ``mu = (1/T) sum_i tau_i`` and,
layer by layer, each centered matrix ``tau_i - mu`` is cut to its top ``k = max(1, int(rank_ratio * rank))``
singular triplets. The merged vector is

    ``mu + lam * sum_i LowRank_k(tau_i - mu)``.

At full rank the centered vectors sum to zero and CART is weight averaging; the truncation keeps what is
common to each task's departure from the average and drops the rest. Tensors that are not matrices are
averaged (their centered parts are kept whole and sum to zero). With two tasks the centered vectors are
opposite, so their truncations cancel too: CART is the average of two tasks.

Defaults are the authors' for eight CLIP tasks (their configuration ``ViT-b-32_8_CART``): ``rank_ratio``
0.12, ``lam`` 2.0. The merged vector is then scaled by alpha; alpha = 1 is CART's own data-free model and
the bench's data-free row.

Registered as the merge method ``cart``. Memory: the output and one layer of every task.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, Vector
from editkit.merge.spectral import as_matrix, is_matrix, layers, mean_of, rank_of, shaped_like, svd

log = logging.getLogger(__name__)

CART_DEFAULT_RANK_RATIO = 0.12
CART_DEFAULT_LAMBDA = 2.0


def low_rank(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """``matrix`` cut to its top ``k`` singular triplets (its best rank-k approximation)."""
    u, s, vh = svd(matrix)
    return (u[:, :k] * s[:k]) @ vh[:k]


def cart_matrix(matrices: list[torch.Tensor], rank_ratio: float, lam: float) -> torch.Tensor:
    """CART of one layer's task matrices: their mean plus ``lam`` times the summed rank-k centered matrices."""
    mean = sum(matrices) / len(matrices)
    k = max(1, int(rank_ratio * rank_of(mean)))
    return mean + lam * sum(low_rank(m - mean, k) for m in matrices)


def cart_merge(vectors: Mapping[str, Vector], *, rank_ratio: float = CART_DEFAULT_RANK_RATIO,
               lam: float = CART_DEFAULT_LAMBDA) -> dict[str, torch.Tensor]:
    """CART of ``vectors``, layer by layer (see the module docstring)."""
    if not 0.0 < rank_ratio <= 1.0:
        raise ConfigError(f"CART rank ratio must be in (0, 1], got {rank_ratio}")
    merged = {}
    for key, tensors in layers(vectors, "CART"):
        merged[key] = (shaped_like(cart_matrix([as_matrix(t) for t in tensors], rank_ratio, lam), tensors[0])
                       if is_matrix(tensors[0]) else mean_of(tensors))
    log.info("CART-merged %d vectors (rank ratio %g, lambda %g)", len(vectors), rank_ratio, lam)
    return merged


def _cart_method(vectors: Mapping[str, Vector], rank_ratio: float = CART_DEFAULT_RANK_RATIO,
                 lam: float = CART_DEFAULT_LAMBDA) -> dict[str, dict[str, torch.Tensor]]:
    """The one CART vector (alpha = 1: the caller scales it)."""
    return {"cart": cart_merge(vectors, rank_ratio=rank_ratio, lam=lam)}


MERGE_METHODS.register("cart", Record.of(_cart_method, label="CART", help={
    "rank_ratio": "fraction of each layer's rank kept of every centered task matrix",
    "lam": "weight of the summed low-rank centered matrices added to the tasks' average"}))
