"""Baseline merges that are not plain sums: TIES-merging.

TIES-merging (Yadav et al., 2023, "Resolving Interference When Merging Models")
combines task vectors in three steps, as in the authors' code (``ties_merging``
/ ``topk_values_mask`` / ``resolve_sign`` / ``disjoint_merge``):

1. **Trim**: in each task vector keep the ``int(d * k)`` entries with the
   largest magnitude (at least one), over the *whole* vector (all d parameters
   flattened), and zero the rest; entries tied at the threshold are all kept.
   (The authors' ``kthvalue(d - int(d * k))`` keeps one entry more than that;
   one entry in millions changes nothing, and the count here is the one the
   paper states.)
2. **Elect sign**: per entry, the sign of the sum of the trimmed values across
   vectors (the sign with the larger total mass). Entries whose sum is exactly 0
   get the majority sign, ``sign(sum of the elected signs)`` over all entries.
3. **Disjoint mean**: per entry, the mean of the trimmed values whose sign agrees
   with the elected one (entries with no agreeing value stay 0).

The merged vector is then scaled by ``lam`` (the paper's default k = 20%,
lambda tuned on validation).

Memory: the trimmed vectors are held at once (one model per vector), and one
vector's magnitudes are flattened at a time to find its threshold.

Registered as the merge method ``ties`` (its coefficient is lambda).
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Sequence

import torch

from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, Vector, checked

log = logging.getLogger(__name__)

TIES_DEFAULT_K = 0.2
TIES_DEFAULT_LAMBDA = 1.0


def trim_threshold(vector: Vector, k: float) -> float:
    """Magnitude at or above which an entry of ``vector`` survives trimming to its top-``k`` fraction."""
    if not 0.0 < k <= 1.0:
        raise ConfigError(f"TIES top-k fraction must be in (0, 1], got {k}")
    flat = torch.cat([t.detach().reshape(-1).abs().float() for t in vector.values()])
    d = flat.numel()
    if d == 0:
        return 0.0
    keep = max(1, int(d * k))
    return float(flat.kthvalue(d - keep + 1).values)  # the keep-th largest magnitude


def trim(vector: Vector, k: float) -> dict[str, torch.Tensor]:
    """``vector`` with every entry below its top-``k`` magnitude threshold set to zero."""
    vector = dict(vector)  # read once: a bank's reader would read each tensor from its file twice
    threshold = trim_threshold(vector, k)
    return {key: torch.where(t.abs() >= threshold, t, torch.zeros_like(t)) for key, t in vector.items()}


def elect_signs(trimmed: Sequence[Vector]) -> dict[str, torch.Tensor]:
    """Per entry, sign of the summed trimmed values; zeros take the majority sign over all entries."""
    keys = list(trimmed[0])
    signs = {key: torch.sign(sum(v[key].double() for v in trimmed)) for key in keys}
    majority = torch.sign(sum(s.sum() for s in signs.values()))
    for s in signs.values():
        s[s == 0] = majority
    return signs


def disjoint_mean(trimmed: Sequence[Vector], signs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per entry, mean of the values agreeing with the elected sign (0 where none agrees)."""
    out = {}
    for key, sign in signs.items():
        stacked = torch.stack([v[key].double() for v in trimmed])
        agree = torch.where(sign.unsqueeze(0) > 0, stacked > 0, stacked < 0)
        selected = stacked * agree
        counts = (selected != 0).sum(dim=0).clamp(min=1)
        out[key] = (selected.sum(dim=0) / counts).to(trimmed[0][key].dtype)
    return out


def ties_merge(vectors: Iterable[Vector], *, k: float = TIES_DEFAULT_K,
               lam: float = TIES_DEFAULT_LAMBDA) -> dict[str, torch.Tensor]:
    """lam * TIES(vectors): trim to the top-k fraction, elect signs, disjoint mean (see module docstring)."""
    trimmed = [trim(v, k) for v in checked(vectors, "TIES-merging")]  # each input vector dropped once trimmed
    merged = disjoint_mean(trimmed, elect_signs(trimmed))
    kept = sum(int((t != 0).sum()) for v in trimmed for t in v.values())
    total = sum(t.numel() for v in trimmed for t in v.values())
    log.info("TIES-merged %d vectors (k=%g, %d of %d entries kept after trimming)", len(trimmed), k, kept, total)
    return {key: value * lam for key, value in merged.items()} if lam != 1.0 else merged


def _ties_method(vectors: Mapping[str, Vector], k: float = TIES_DEFAULT_K) -> dict[str, dict[str, torch.Tensor]]:
    """The one TIES-merged vector (lambda = 1: the caller scales it), read in the mapping's order."""
    return {"ties": ties_merge(vectors.values(), k=k)}


MERGE_METHODS.register("ties", Record.of(_ties_method, label="TIES-merging",
                                         help={"k": "fraction of each vector's entries kept by trimming"}))
