"""DARE: drop and rescale each task vector before merging it.

DARE (Yu et al., 2024, "Language Models are Super Mario: Absorbing Abilities from
Homologous Models as a Free Lunch") sparsifies a task vector at random: every entry
is dropped (set to 0) with probability ``p`` and every survivor is divided by
``1 - p``, so the vector's expected value is unchanged. The sparsified vectors are
then combined by another method:

- ``base = "task-arithmetic"`` (default): their sum, streamed one vector at a time
  (memory: the sum and one input vector);
- ``base = "ties"``: TIES' sign election and disjoint mean (``editkit.merge.ties``) on
  the sparsified vectors, without TIES' magnitude trimming (DARE's random drop takes
  its place), as mergekit's ``dare_ties`` does; all sparsified vectors are held at
  once, as for TIES. Entries whose sign sum is exactly 0 take the majority sign (the
  TIES authors' rule; mergekit takes ``+``).

``p`` defaults to 0.9, the drop rate the paper's merges commonly use; ``p = 0``
keeps every entry (plain task arithmetic, or TIES without trimming).

Randomness: one ``torch.Generator`` seeded with ``seed`` draws ``u ~ U[0, 1)`` per
entry, vector by vector in the mapping's order and, within a vector, parameter by
parameter in sorted name order; an entry survives when ``u >= p``. The same seed
and order give the same survivors.

Registered as the merge method ``dare``; the merged vector is then scaled by alpha.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

import torch

from editkit.core.registry import Record
from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, Vector, checked
from editkit.merge.ties import disjoint_mean, elect_signs

log = logging.getLogger(__name__)

DARE_DEFAULT_P = 0.9
DARE_BASES = ("task-arithmetic", "ties")


def drop_and_rescale(vector: Vector, p: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``vector`` with each entry dropped with probability ``p`` and survivors divided by ``1 - p``."""
    out = {}
    for key in sorted(vector):
        t = vector[key]
        keep = torch.rand(t.shape, generator=generator) >= p
        out[key] = torch.where(keep.to(t.device), t / (1.0 - p), torch.zeros_like(t))
    return {key: out[key] for key in vector}


def dare_merge(vectors: Iterable[Vector], *, p: float = DARE_DEFAULT_P, seed: int = 0,
               base: str = "task-arithmetic") -> dict[str, torch.Tensor]:
    """DARE on each vector (in order), combined by ``base`` (see the module docstring)."""
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"DARE drop rate p must be in [0, 1), got {p}")
    if base not in DARE_BASES:
        raise ConfigError(f"DARE base {base!r} is not one of {', '.join(DARE_BASES)}")
    generator = torch.Generator().manual_seed(int(seed))
    dropped = (drop_and_rescale(v, p, generator) for v in vectors)
    merged = _sum(dropped) if base == "task-arithmetic" else _ties(dropped)
    log.info("DARE-merged with p=%g, seed=%d, combined by %s", p, seed, base)
    return merged


def _sum(vectors: Iterable[Vector]) -> dict[str, torch.Tensor]:
    """Sum in float32 (float64 for float64 input), one vector read at a time; cast back to the input dtypes."""
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for vector in checked(vectors, "DARE"):
        for key, t in vector.items():
            if key in total:
                total[key] += t
            else:
                dtypes[key], total[key] = t.dtype, t.to(torch.promote_types(t.dtype, torch.float32), copy=True)
    return {key: t.to(dtypes[key]) for key, t in total.items()}


def _ties(vectors: Iterable[Vector]) -> dict[str, torch.Tensor]:
    dropped = list(checked(vectors, "DARE"))
    return disjoint_mean(dropped, elect_signs(dropped))


def _dare_method(vectors: Mapping[str, Vector], p: float = DARE_DEFAULT_P, seed: int = 0,
                 base: str = "task-arithmetic") -> dict[str, dict[str, torch.Tensor]]:
    """The one DARE-merged vector (alpha = 1: the caller scales it), read in the mapping's order."""
    return {"dare": dare_merge(vectors.values(), p=p, seed=seed, base=base)}


MERGE_METHODS.register("dare", Record.of(_dare_method, label="DARE", help={
    "p": "drop rate: each entry of each vector is dropped with probability p, survivors divided by 1 - p",
    "seed": "seed of the random drop",
    "base": "how the sparsified vectors are combined: task-arithmetic (their sum) or ties (sign election, "
            "disjoint mean)"}))
