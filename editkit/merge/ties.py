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

Memory: one parameter at a time. Each vector's threshold is found first (one vector's magnitudes
flattened at a time), then the sign election and the disjoint mean read every vector's tensor of one
parameter, trim it and drop it, so besides the merged vector only one parameter's tensors of every vector
are held: a model plus one layer's worth for each vector, whatever their number. The price is reading
each tensor three times (threshold, majority sign, mean): cheap for vectors in memory, a file read for a
bank's reader, and B A recomputed for a plain-LoRA vector's weight updates.

Registered as the merge method ``ties`` (its coefficient is lambda).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterable, Mapping, Sequence

import torch

from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, MergeMethod, Vector, checked, shapes_of

log = logging.getLogger(__name__)

TIES_DEFAULT_K = 0.2
TIES_DEFAULT_LAMBDA = 1.0


def trim_threshold(vector: Vector, k: float) -> float:
    """Magnitude at or above which an entry of ``vector`` survives trimming to its top-``k`` fraction."""
    if not 0.0 < k <= 1.0:
        raise ConfigError(f"TIES top-k fraction must be in (0, 1], got {k}")
    shapes = shapes_of(vector)
    d = sum(math.prod(shape) for shape in shapes.values())
    if d == 0:
        return 0.0
    flat: torch.Tensor | None = None  # filled one tensor at a time: one vector's magnitudes, no list of copies
    at = 0
    for key in shapes:
        t = vector[key].detach().reshape(-1)
        if flat is None:  # in the vector's own precision: a float32 copy of float64 magnitudes rounds some up, and
            flat = torch.empty(d, dtype=t.dtype)  # the entry at the boundary would then be trimmed by its own threshold
        flat[at : at + t.numel()] = t.abs()
        at += t.numel()
    keep = max(1, int(d * k))
    magnitudes = flat.numpy()
    magnitudes.partition(d - keep)  # in place (torch's kthvalue works on copies: 3x a vector more)
    return float(magnitudes[d - keep])  # the keep-th largest magnitude


def trimmed(t: torch.Tensor, threshold: float) -> torch.Tensor:
    """``t`` with every entry below ``threshold`` in magnitude set to zero."""
    return torch.where(t.abs() >= threshold, t, torch.zeros_like(t))


#: (index of the vector, parameter name, its tensor) -> the values the vector keeps there.
Sparsify = Callable[[int, str, torch.Tensor], torch.Tensor]


def elected_sign(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per entry, the sign of the summed values (0 where they cancel)."""
    return torch.sign(sum(v.double() for v in values))


def disjoint_mean(values: Sequence[torch.Tensor], sign: torch.Tensor) -> torch.Tensor:
    """Per entry, mean of the values agreeing with ``sign`` (0 where none agrees), summed value by value (no
    stack of all of them in float64)."""
    total = torch.zeros(sign.shape, dtype=torch.float64)
    counts = torch.zeros(sign.shape, dtype=torch.int32)
    for v in values:
        agree = torch.where(sign > 0, v > 0, v < 0)
        total += torch.where(agree, v.double(), 0.0)
        counts += agree
    return (total / counts.clamp(min=1)).to(values[0].dtype)


def resolve_signs(vectors: Sequence[Vector], sparsify: Sparsify) -> dict[str, torch.Tensor]:
    """Sign election and disjoint mean over the sparsified ``vectors``, one parameter at a time: a first pass
    finds the majority sign over all entries (the sign of entries whose values cancel), a second builds each
    parameter's mean. Only one parameter's tensors of every vector are held at once."""
    keys = list(vectors[0])

    def kept(key: str) -> list[torch.Tensor]:
        return [sparsify(i, key, vector[key]) for i, vector in enumerate(vectors)]

    majority = torch.sign(sum(elected_sign(kept(key)).sum() for key in keys))
    merged = {}
    for key in keys:
        values = kept(key)
        sign = elected_sign(values)
        sign[sign == 0] = majority
        merged[key] = disjoint_mean(values, sign)
    return merged


def ties_merge(vectors: Iterable[Vector], *, k: float = TIES_DEFAULT_K,
               lam: float = TIES_DEFAULT_LAMBDA) -> dict[str, torch.Tensor]:
    """lam * TIES(vectors): trim to the top-k fraction, elect signs, disjoint mean (see module docstring).
    ``vectors`` are read several times each (a bank's readers and LoRA weight-update views stay lazy)."""
    vectors = list(checked(vectors, "TIES-merging"))
    thresholds = [trim_threshold(v, k) for v in vectors]
    merged = resolve_signs(vectors, lambda i, key, t: trimmed(t, thresholds[i]))
    log.info("TIES-merged %d vectors (k=%g, thresholds %s)", len(vectors), k, ", ".join(f"{x:.3g}" for x in thresholds))
    return {key: value * lam for key, value in merged.items()} if lam != 1.0 else merged


def _ties_method(vectors: Mapping[str, Vector], k: float = TIES_DEFAULT_K) -> dict[str, dict[str, torch.Tensor]]:
    """The one TIES-merged vector (lambda = 1: the caller scales it), read in the mapping's order."""
    return {"ties": ties_merge(vectors.values(), k=k)}


MERGE_METHODS.register("ties", MergeMethod.of(_ties_method, label="TIES-merging",
                                              reference_url="https://arxiv.org/abs/2306.01708",
                                              help={"k": "fraction of each vector's entries kept by trimming"}))
