"""TSV-Merge: each task's top singular vectors per layer, decorrelated across tasks.

TSV-Merge (Gargiulo et al., CVPR 2025, "Task Singular Vectors: Reducing Task Interference in Model
Merging"), as in the authors' code (``compute_and_sum_svd_mem_reduction``), layer by layer:

1. **Compress**: for each of the T tasks, the SVD ``tau_i = U_i S_i V_i^T`` of its matrix, kept to its top
   ``k = floor(rank / T)`` singular triplets (rank = min(rows, columns)), so the T tasks together fill at
   most the layer's rank. At least one triplet per task is kept: the authors' code keeps none — a zero
   layer — when a matrix has fewer dimensions than there are tasks.
2. **Decorrelate**: the kept left singular vectors of every task, side by side ``[U_1 .. U_T]``, are
   replaced by the orthonormal matrix nearest them (:func:`~editkit.merge.spectral.orthonormalized`), and
   so are the right ones; where two tasks use the same direction, the two copies are rotated apart.
3. **Rebuild**: ``U_perp diag(S_1 .. S_T) V_perp^T``. For tasks whose kept singular vectors are already
   orthogonal this is the sum of their compressed matrices.

Tensors that are not matrices are averaged (see ``editkit.merge.spectral``). The merged vector is then
scaled by alpha; the authors use alpha = 1, with no tuning, which is the bench's data-free row.

Registered as the merge method ``tsv``. Memory: the output and one layer of every task (module
``editkit.merge.spectral``).
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from editkit.merge import MERGE_METHODS, MergeMethod, Vector
from editkit.merge.spectral import as_matrix, is_matrix, layers, mean_of, orthonormalized, rank_of, shaped_like, svd

log = logging.getLogger(__name__)


def tsv_matrix(matrices: list[torch.Tensor]) -> torch.Tensor:
    """TSV-Merge of one layer's task matrices (steps 1-3 of the module docstring)."""
    k = max(1, rank_of(matrices[0]) // len(matrices))
    us, ss, vhs = [], [], []
    for matrix in matrices:
        u, s, vh = svd(matrix)
        us.append(u[:, :k])
        ss.append(s[:k])
        vhs.append(vh[:k])
    return orthonormalized(torch.cat(us, dim=1)) @ torch.diag(torch.cat(ss)) @ orthonormalized(torch.cat(vhs))


def tsv_merge(vectors: Mapping[str, Vector]) -> dict[str, torch.Tensor]:
    """TSV-Merge of ``vectors``, layer by layer: matrices by :func:`tsv_matrix`, other tensors averaged."""
    merged = {}
    for key, tensors in layers(vectors, "TSV-Merge"):
        merged[key] = (shaped_like(tsv_matrix([as_matrix(t) for t in tensors]), tensors[0])
                       if is_matrix(tensors[0]) else mean_of(tensors))
    log.info("TSV-merged %d vectors", len(vectors))
    return merged


def _tsv_method(vectors: Mapping[str, Vector]) -> dict[str, dict[str, torch.Tensor]]:
    """The one TSV-Merge vector (alpha = 1: the caller scales it)."""
    return {"tsv": tsv_merge(vectors)}


MERGE_METHODS.register("tsv", MergeMethod.of(_tsv_method, label="TSV-Merge",
                                            reference_url="https://arxiv.org/abs/2412.00081"))
