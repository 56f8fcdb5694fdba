"""Isotropic merging: the summed layer with a flat singular spectrum (Iso-C), and with task-specific
directions in place of its weakest ones (Iso-CTS).

Marczak et al., ICML 2025, "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific
Subspaces", as in the authors' code (``iso_c``, ``iso_cts``), layer by layer:

- **Iso-C**: the SVD ``U S V^T`` of the task-arithmetic sum ``M = sum_i tau_i``, with every singular value
  replaced by their mean: ``mean(S) U V^T``. The directions the sum uses are kept; the few dominant ones no
  longer drown the rest.
- **Iso-CTS**: the sum's top ``k_c`` singular triplets (the common subspace, ``common`` = k_c / rank, 0.8
  by default, rounded so that the rest divides evenly among the T tasks) plus, for each task, the top
  ``(rank - k_c) / T`` singular triplets of its matrix with the common subspace projected out
  (``tau_i - U_c U_c^T tau_i``). The gathered left and right singular vectors are each replaced by the
  nearest orthonormal matrix (:func:`~editkit.merge.spectral.orthonormalized`), and every singular value
  by the mean of the gathered ones. Where no dimension is left for the tasks (a small layer), this is Iso-C.

Tensors that are not matrices are averaged (see ``editkit.merge.spectral``). The merged vector is then
scaled by alpha. The authors tune alpha on validation data; the bench's data-free row is alpha = 1.

Registered as ``iso-c`` and ``iso-cts``. Memory: the output and one layer of every task.
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, MergeMethod, Vector
from editkit.merge.spectral import as_matrix, is_matrix, layers, mean_of, orthonormalized, rank_of, shaped_like, svd

log = logging.getLogger(__name__)

ISO_CTS_DEFAULT_COMMON = 0.8


def iso_c_matrix(matrices: list[torch.Tensor]) -> torch.Tensor:
    """Iso-C of one layer's task matrices: their sum with every singular value set to the mean."""
    u, s, vh = svd(sum(matrices))
    return s.mean() * (u @ vh)


def common_rank(rank: int, tasks: int, common: float) -> int:
    """The common subspace's size: ``int(rank * common)``, then grown so that ``rank - k_c`` divides by
    ``tasks`` (the authors' rounding of the task-specific share to a multiple of the number of tasks)."""
    k_c = int(rank * common)
    return rank - round((rank - k_c) / tasks) * tasks


def iso_cts_matrix(matrices: list[torch.Tensor], common: float) -> torch.Tensor:
    """Iso-CTS of one layer's task matrices (see the module docstring)."""
    rank, tasks = rank_of(matrices[0]), len(matrices)
    k_c = common_rank(rank, tasks, common)
    per_task = (rank - k_c) // tasks
    if per_task == 0:
        return iso_c_matrix(matrices)
    u, s, vh = svd(sum(matrices))
    us, ss, vhs = [u[:, :k_c]], [s[:k_c]], [vh[:k_c]]
    for matrix in matrices:
        ut, st, vht = svd(matrix - us[0] @ (us[0].T @ matrix))
        us.append(ut[:, :per_task])
        ss.append(st[:per_task])
        vhs.append(vht[:per_task])
    return torch.cat(ss).mean() * (orthonormalized(torch.cat(us, dim=1)) @ orthonormalized(torch.cat(vhs)))


def isotropic_merge(vectors: Mapping[str, Vector], common: float | None) -> dict[str, torch.Tensor]:
    """Iso-C (``common`` None) or Iso-CTS of ``vectors``, layer by layer; other tensors averaged."""
    label = "Iso-C" if common is None else "Iso-CTS"
    merged = {}
    for key, tensors in layers(vectors, label):
        if not is_matrix(tensors[0]):
            merged[key] = mean_of(tensors)
            continue
        matrices = [as_matrix(t) for t in tensors]
        merged[key] = shaped_like(iso_c_matrix(matrices) if common is None else iso_cts_matrix(matrices, common),
                                  tensors[0])
    log.info("%s-merged %d vectors", label, len(vectors))
    return merged


def _iso_c_method(vectors: Mapping[str, Vector]) -> dict[str, dict[str, torch.Tensor]]:
    """The one Iso-C vector (alpha = 1: the caller scales it)."""
    return {"iso-c": isotropic_merge(vectors, None)}


def _iso_cts_method(vectors: Mapping[str, Vector],
                    common: float = ISO_CTS_DEFAULT_COMMON) -> dict[str, dict[str, torch.Tensor]]:
    """The one Iso-CTS vector (alpha = 1: the caller scales it)."""
    if not 0.0 <= common <= 1.0:
        raise ConfigError(f"Iso-CTS common subspace fraction must be in [0, 1], got {common}")
    return {"iso-cts": isotropic_merge(vectors, common)}


#: Both methods' paper (Marczak et al., ICML 2025).
ISOTROPIC_PAPER = "https://arxiv.org/abs/2502.04959"
MERGE_METHODS.register("iso-c", MergeMethod.of(_iso_c_method, label="Iso-C", reference_url=ISOTROPIC_PAPER))
MERGE_METHODS.register("iso-cts", MergeMethod.of(_iso_cts_method, label="Iso-CTS", reference_url=ISOTROPIC_PAPER, help={
    "common": "fraction of each layer's rank given to the summed vectors' top directions; the rest is shared "
              "evenly among the tasks' own"}))
