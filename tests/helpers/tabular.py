"""Small synthetic classification data shared by the training and tauJp tests."""

from __future__ import annotations

import torch


def blobs(n_per_class: int, centers: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_per_class`` Gaussian points (std 0.3) around each row of ``centers``; label = row index."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for k, c in enumerate(centers):
        xs.append(c + 0.3 * torch.randn(n_per_class, len(c), generator=g))
        ys.append(torch.full((n_per_class,), k))
    return torch.cat(xs), torch.cat(ys)
