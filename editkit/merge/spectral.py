"""What the structured merges (TSV-Merge, Iso-C / Iso-CTS, CART) share: layers read one at a time, weight
tensors seen as matrices, truncated SVDs and the nearest orthonormal basis.

These methods work per layer on the singular vectors of each task's weight matrix, so they read the task
vectors **one parameter at a time**: :func:`layers` yields, for each parameter name, that tensor of every
vector. Where the vectors come from a bank (``editkit add``) each tensor is read from its file when it is
asked for (:meth:`editkit.bank.store.Bank.reader`), so a merge holds its output (one model), one layer's
matrices of every task and their SVDs, whatever the number of tasks. Vectors given in memory are read as
they are.

Which tensors are matrices: every tensor with two or more dimensions, seen as (first dimension, all others
flattened) — linear weights as they are, convolution kernels as (out channels, in channels x kernel), as
they act on each input patch; the same rule as OPCM's (``editkit.merge.opcm``). The authors' code (CLIP
ViTs) treats 2-D tensors only and averages the rest, so a convolutional backbone would be averaged almost
whole; here its kernels are merged as the matrices they are. Every other tensor (biases, norms, scalars) is
averaged over the tasks, as in the authors' code. CART keeps closer to its authors' code and low-ranks only
the layers' weight matrices inside the model's blocks (:func:`editkit.merge.cart.is_layer_matrix`).

SVDs run in float32 (float64 inputs stay float64); results are cast back to the vectors' dtype.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch

from editkit.merge import Vector, checked


def layers(vectors: Mapping[str, Vector], what: str) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """(parameter name, that tensor of every vector in the mapping's order), one parameter at a time.

    Each vector is fetched once and its layout checked (names and shapes, read from a file's header where the
    vector is a bank reader); its tensors are then read one name at a time, vector 0's order.
    """
    held = list(checked(vectors.values(), what))
    for key in held[0]:
        yield key, [v[key] for v in held]


def is_matrix(t: torch.Tensor) -> bool:
    """Whether the structured merges treat ``t`` as a weight matrix (two or more dimensions)."""
    return t.dim() >= 2


def as_matrix(t: torch.Tensor) -> torch.Tensor:
    """``t`` as (first dimension, all others), in the precision its SVD runs in."""
    return t.reshape(t.shape[0], -1).to(torch.promote_types(t.dtype, torch.float32))


def mean_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The average of the tasks' tensors: what the structured merges do with a tensor that is not a matrix."""
    return (sum(t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors) / len(tensors)).to(tensors[0].dtype)


def svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reduced SVD ``U diag(S) Vh`` of ``matrix``, singular values descending.

    LAPACK's divide-and-conquer SVD (what torch runs on a CPU) can fail to converge in float32 on a matrix
    whose singular values cluster: it did on a 384 x 384 basis of gathered singular vectors that Iso-CTS
    orthonormalizes (offline-text, ``taujp-nonlinear`` vectors). The same matrix in float64 converges, so a
    float32 failure is retried there and the factors cast back."""
    try:
        return torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError:
        if matrix.dtype == torch.float64:
            raise
        u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
        return u.to(matrix.dtype), s.to(matrix.dtype), vh.to(matrix.dtype)


def orthonormalized(basis: torch.Tensor) -> torch.Tensor:
    """The orthonormal matrix nearest ``basis`` in Frobenius norm: ``P Q^T`` from ``basis = P diag(s) Q^T``.

    This is how TSV-Merge and Iso-CTS decorrelate singular vectors gathered from several tasks: directions
    that two tasks share are rotated apart symmetrically, directions already orthogonal are left alone.
    """
    p, _, qh = svd(basis)
    return p @ qh


def rank_of(matrix: torch.Tensor) -> int:
    """The number of singular values of ``matrix``: min(rows, columns)."""
    return min(matrix.shape)


def shaped_like(matrix: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``matrix`` back in the shape and dtype of the task tensor ``like``."""
    return matrix.reshape(like.shape).to(like.dtype)
