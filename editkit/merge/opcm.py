"""OPCM: continual merging by orthogonal projection, one task vector at a time.

OPCM (Tang et al., 2025, "Merging Models on the Fly Without Retraining: A Sequential
Approach to Scalable Continual Model Merging") merges a stream of task vectors
tau_1, tau_2, ... in order, without revisiting earlier ones. What is implemented here
is the algorithm of the authors' FusionBench code (``OPCMForCLIP``):

1. The merged vector after the first task is tau_1 (lambda_1 = 1).
2. Task t > 1: every weight matrix of tau_t is projected away from the dominant
   singular subspace of the previous merged matrix M = U S V^T. In coordinates
   P = U^T tau_t V, the entries removed are the diagonal P_ii (every i) and the block
   P_ij with i, j < r, where r is the first index at which the cumulative share of
   singular values ``cumsum(S) / sum(S)`` exceeds ``share`` (the code's ``split_rank``;
   ``share`` is the code's ``alpha``, 0.5 by default). The cleaned matrix is
   ``U P V^T``. Every other tensor of tau_t is taken as it is.
3. The new merged vector is ``(lambda_{t-1} M_{t-1} + cleaned tau_t) / lambda_t`` with
   the adaptive ``lambda_t`` that gives it the mean norm of the task vectors so far:
   ``lambda_t = ||lambda_{t-1} M_{t-1} + cleaned tau_t|| / mean_i ||tau_i||`` (norms over
   the whole vector, every parameter flattened).

Since ``lambda_{t-1} M_{t-1}`` is the running sum S_{t-1} of the cleaned vectors and
M_{t-1} has S_{t-1}'s singular vectors and singular-value shares, this keeps only S:
the result is ``S_T * mean_i ||tau_i|| / ||S_T||``. Memory: S and one input vector.

Which tensors are weight matrices: the authors project the weights of ``nn.Linear``
layers. A task vector here is named tensors without their modules, so every tensor
with two or more dimensions is projected, viewed as the matrix (first dimension,
all others flattened): linear weights as they are, convolution kernels as
(out channels, in channels x kernel), as they act on each input patch. In a ViT this
also projects the patch-embedding convolution and the 2-D positional embedding, which
the authors' code adds whole, and projects open_clip's fused q/k/v weight as one matrix
where the authors' (Hugging Face) model has three linear layers. A matrix that
no earlier task changed (all zeros) has no singular subspace: the new vector's
matrix is added whole. Biases, norms and other 1-D tensors are added whole, as in the
authors' code. Tasks are merged in the mapping's order (the bank's stream order);
the authors shuffle their model list.

The merged vector is then scaled by alpha: at alpha = 1 it is OPCM's model.

Registered as the merge method ``opcm``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

import torch

from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, MergeMethod, Vector, checked, vector_norm

log = logging.getLogger(__name__)

OPCM_DEFAULT_SHARE = 0.5


def protected_rank(singular_values: torch.Tensor, share: float) -> int:
    """The first index at which ``cumsum(s) / sum(s)`` exceeds ``share`` (0 when none does)."""
    fraction = singular_values.cumsum(dim=0) / singular_values.sum()
    return int((fraction > share).float().argmax())


def project_out(merged: torch.Tensor, task: torch.Tensor, share: float) -> torch.Tensor:
    """``task`` without its components in ``merged``'s dominant singular directions (step 2 of the docstring).

    Computed from the reduced SVD: every removed coordinate P_ij has i, j < min(rows, cols), so
    ``U P V^T`` of the full SVD equals ``task - U_k R V_k^T`` with R the removed coordinates.
    """
    matrix = merged.reshape(merged.shape[0], -1)
    tau = task.reshape(matrix.shape).to(matrix.dtype)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    if not s.sum() > 0:
        return task
    r = protected_rank(s, share)
    coords = u.T @ tau @ vh.T
    removed = torch.diag_embed(coords.diagonal())
    removed[:r, :r] = coords[:r, :r]
    return (tau - u @ removed @ vh).reshape(task.shape).to(task.dtype)


def opcm_merge(vectors: Iterable[Vector], *, share: float = OPCM_DEFAULT_SHARE) -> dict[str, torch.Tensor]:
    """OPCM's merged vector after the last of ``vectors`` (see the module docstring)."""
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"OPCM share of singular values must be in [0, 1], got {share}")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    norms: list[float] = []
    for vector in checked(vectors, "OPCM"):
        first = not total
        norms.append(vector_norm(vector))
        for key, t in vector.items():
            if first:
                dtypes[key], total[key] = t.dtype, t.to(torch.promote_types(t.dtype, torch.float32), copy=True)
            elif t.dim() >= 2:
                total[key] += project_out(total[key], t, share)
            else:
                total[key] += t
    norm = vector_norm(total)
    scale = sum(norms) / len(norms) / norm if norm > 0 else 0.0
    log.info("OPCM-merged %d vectors (share=%g): lambda_T = %.4g", len(norms), share, 1 / scale if scale else 0.0)
    return {key: (t * scale).to(dtypes[key]) for key, t in total.items()}


def _opcm_method(vectors: Mapping[str, Vector],
                 share: float = OPCM_DEFAULT_SHARE) -> dict[str, dict[str, torch.Tensor]]:
    """The one OPCM vector (alpha = 1: the caller scales it), merged in the mapping's order."""
    return {"opcm": opcm_merge(vectors.values(), share=share)}


MERGE_METHODS.register("opcm", MergeMethod.of(_opcm_method, label="OPCM", order_dependent=True,
                                              reference_url="https://arxiv.org/abs/2501.09522", help={
    "share": "cumulative share of singular values whose directions of the merged matrix a new vector may not "
             "enter (the authors' alpha)"}))
