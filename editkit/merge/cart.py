"""CART: centered task arithmetic — the average of the tasks plus low-rank versions of what sets each apart.

CART (Choi et al., 2024, "Revisiting Weight Averaging for Model Merging"), as in the authors' code
(``_merge_weights("CART")``): the task vectors are centered on their mean ``mu = (1/T) sum_i tau_i`` and,
layer by layer, each centered matrix ``tau_i - mu`` is cut to its top ``k = max(1, int(rank_ratio * rank))``
singular triplets. The merged vector is

    ``mu + lam * sum_i LowRank_k(tau_i - mu)``.

At full rank the centered vectors sum to zero and CART is weight averaging; the truncation keeps what is
common to each task's departure from the average and drops the rest. With two tasks the centered vectors are
opposite, so their truncations cancel too: CART is the average of two tasks.

Which tensors are low-ranked (:func:`is_layer_matrix`): the weight matrices of the layers inside the model's
blocks. The authors' code low-ranks the keys of a CLIP ViT that contain ``attn`` or ``mlp`` and neither ``ln`` nor
``bias``: the attention and MLP weights of its residual blocks. Every other tensor is centered whole, so its
centered parts sum to zero and it is averaged: the patch-embedding convolution, the positional and class
embeddings, the output projection, norms and biases. editkit's vectors are named tensors of any family, so the
rule is said in terms every family's names share: a tensor of two or more dimensions whose name ends in
``weight`` and lies below a numbered block (``resblocks.3.``, ``layers.27.``, ``layer.5.``, ``blocks.12.``), and
that is not an embedding or a bias table (``embed``, ``bias`` in its name). On a CLIP ViT this is exactly the
authors' set; on a BERT or Llama block, its attention and MLP projections; on EfficientNet, the convolutions of
its MBConv blocks (the stem and head convolutions are averaged).

Settings are the authors', by the number of merged tasks (:data:`AUTHORS_SETTINGS`: their configurations for 8,
14 and 20 CLIP tasks, ``rank_ratio`` / ``lam`` 0.12 / 2.0, 0.16 / 1.5, 0.32 / 1.9); where a user does not set
them, the configuration of the nearest task count is taken (up to 11 tasks the 8-task one). The merged vector is
then scaled by alpha; alpha = 1 is CART's own data-free model and the bench's data-free row.

Registered as the merge method ``cart``. Memory: the output and one layer of every task.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, MergeMethod, Vector
from editkit.merge.spectral import as_matrix, layers, mean_of, rank_of, shaped_like, svd

log = logging.getLogger(__name__)

#: The authors' (rank_ratio, lam) by the number of tasks of their configurations.
AUTHORS_SETTINGS = {8: (0.12, 2.0), 14: (0.16, 1.5), 20: (0.32, 1.9)}
CART_DEFAULT_RANK_RATIO, CART_DEFAULT_LAMBDA = AUTHORS_SETTINGS[8]
#: Names that hold embedding tables or biases, never a layer's weight matrix.
NOT_LAYER_MATRICES = ("embed", "bias")


def authors_setting(tasks: int) -> dict[str, float]:
    """The authors' ``rank_ratio`` and ``lam`` for the configuration nearest ``tasks`` (ties: the fewer tasks)."""
    nearest = min(AUTHORS_SETTINGS, key=lambda count: (abs(count - tasks), count))
    rank_ratio, lam = AUTHORS_SETTINGS[nearest]
    return {"rank_ratio": rank_ratio, "lam": lam}


def is_layer_matrix(name: str, tensor: torch.Tensor) -> bool:
    """Whether CART low-ranks this tensor: a layer's weight matrix inside a numbered block (module docstring)."""
    parts = name.lower().split(".")
    in_block = any(part.isdigit() for part in parts[:-1])
    return (tensor.dim() >= 2 and parts[-1].endswith("weight") and in_block
            and not any(word in name.lower() for word in NOT_LAYER_MATRICES))


def low_rank(matrix: torch.Tensor, k: int) -> torch.Tensor:
    """``matrix`` cut to its top ``k`` singular triplets (its best rank-k approximation)."""
    u, s, vh = svd(matrix)
    return (u[:, :k] * s[:k]) @ vh[:k]


def cart_matrix(matrices: list[torch.Tensor], rank_ratio: float, lam: float) -> torch.Tensor:
    """CART of one layer's task matrices: their mean plus ``lam`` times the summed rank-k centered matrices."""
    mean = sum(matrices) / len(matrices)
    k = max(1, int(rank_ratio * rank_of(mean)))
    return mean + lam * sum(low_rank(m - mean, k) for m in matrices)


def cart_merge(vectors: Mapping[str, Vector], *, rank_ratio: float | None = None,
               lam: float | None = None) -> dict[str, torch.Tensor]:
    """CART of ``vectors``, layer by layer (see the module docstring); ``None``: the authors' setting for this
    many tasks."""
    setting = authors_setting(len(vectors))
    rank_ratio = setting["rank_ratio"] if rank_ratio is None else rank_ratio
    lam = setting["lam"] if lam is None else lam
    if not 0.0 < rank_ratio <= 1.0:
        raise ConfigError(f"CART rank ratio must be in (0, 1], got {rank_ratio}")
    merged = {}
    for key, tensors in layers(vectors, "CART"):
        merged[key] = (shaped_like(cart_matrix([as_matrix(t) for t in tensors], rank_ratio, lam), tensors[0])
                       if is_layer_matrix(key, tensors[0]) else mean_of(tensors))
    log.info("CART-merged %d vectors (rank ratio %g, lambda %g)", len(vectors), rank_ratio, lam)
    return merged


def _cart_method(vectors: Mapping[str, Vector], rank_ratio: float = CART_DEFAULT_RANK_RATIO,
                 lam: float = CART_DEFAULT_LAMBDA) -> dict[str, dict[str, torch.Tensor]]:
    """The one CART vector (alpha = 1: the caller scales it)."""
    return {"cart": cart_merge(vectors, rank_ratio=rank_ratio, lam=lam)}


MERGE_METHODS.register("cart", MergeMethod.of(_cart_method, label="CART", task_count_defaults=authors_setting,
                                              reference_url="https://arxiv.org/abs/2412.12153", help={
    "rank_ratio": "fraction of each layer's rank kept of every centered task matrix (default: the authors' for "
                  "the number of tasks: 0.12 for 8, 0.16 for 14, 0.32 for 20, the nearest)",
    "lam": "weight of the summed low-rank centered matrices added to the tasks' average (default: the authors' for "
           "the number of tasks: 2.0 for 8, 1.5 for 14, 1.9 for 20, the nearest)"}))
