"""DARE: drop and rescale each task vector before merging it.

DARE (Yu et al., 2024, "Language Models are Super Mario: Absorbing Abilities from
Homologous Models as a Free Lunch") sparsifies a task vector at random: every entry
is dropped (set to 0) with probability ``p`` and every survivor is divided by
``1 - p``, so the vector's expected value is unchanged. The sparsified vectors are
then combined by another method:

- ``base = "task-arithmetic"`` (default): their sum, streamed one parameter of one vector
  at a time (memory: the sum and one parameter's tensor);
- ``base = "ties"``: TIES' sign election and disjoint mean (``editkit.merge.ties``) on
  the sparsified vectors, without TIES' magnitude trimming (DARE's random drop takes
  its place), as mergekit's ``dare_ties`` does, one parameter at a time as TIES does
  (each vector's drop is redrawn from the generator state saved where its draws began:
  the same survivors, without holding the sparsified vectors). Entries whose sign sum is
  exactly 0 take the majority sign (the TIES authors' rule; mergekit takes ``+``).

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

from editkit.errors import ConfigError
from editkit.merge import MERGE_METHODS, MergeMethod, Vector, checked, shapes_of
from editkit.merge.ties import resolve_signs

log = logging.getLogger(__name__)

DARE_DEFAULT_P = 0.9
DARE_BASES = ("task-arithmetic", "ties")


def dropped(t: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """``t`` with each entry dropped with probability ``p`` (one draw per entry) and survivors divided by ``1 - p``."""
    keep = torch.rand(t.shape, generator=generator) >= p
    return torch.where(keep.to(t.device), t / (1.0 - p), torch.zeros_like(t))


def dare_merge(vectors: Iterable[Vector], *, p: float = DARE_DEFAULT_P, seed: int = 0,
               base: str = "task-arithmetic") -> dict[str, torch.Tensor]:
    """DARE on each vector (in order), combined by ``base`` (see the module docstring)."""
    if not 0.0 <= p < 1.0:
        raise ConfigError(f"DARE drop rate p must be in [0, 1), got {p}")
    if base not in DARE_BASES:
        raise ConfigError(f"DARE base {base!r} is not one of {', '.join(DARE_BASES)}")
    generator = torch.Generator().manual_seed(int(seed))
    merged = _sum(vectors, p, generator) if base == "task-arithmetic" else _ties(vectors, p, generator)
    log.info("DARE-merged with p=%g, seed=%d, combined by %s", p, seed, base)
    return merged


def _sum(vectors: Iterable[Vector], p: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sum of the dropped vectors in float32 (float64 for float64 input), cast back to the input dtypes and in
    vector 0's order; each parameter is dropped, added and let go in the order of the draws."""
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    order: list[str] = []
    for vector in checked(vectors, "DARE"):
        order = order or list(vector)
        for key in sorted(vector):
            t = dropped(vector[key], p, generator)
            if key in total:
                total[key] += t
            else:
                dtypes[key], total[key] = t.dtype, t.to(torch.promote_types(t.dtype, torch.float32), copy=True)
    return {key: total[key].to(dtypes[key]) for key in order}


def _ties(vectors: Iterable[Vector], p: float, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Sign election and disjoint mean of the dropped vectors, one parameter at a time: the generator's state
    where each (vector, parameter) draw begins is saved in one pass of the draws, and each drop redrawn from it."""
    vectors = list(checked(vectors, "DARE"))
    states: dict[tuple[int, str], torch.Tensor] = {}
    for i, vector in enumerate(vectors):
        for key, shape in sorted(shapes_of(vector).items()):
            states[(i, key)] = generator.get_state()
            torch.rand(shape, generator=generator)

    def redrawn(i: int, key: str, t: torch.Tensor) -> torch.Tensor:
        return dropped(t, p, torch.Generator().set_state(states[(i, key)]))

    return resolve_signs(vectors, redrawn)


def _dare_method(vectors: Mapping[str, Vector], p: float = DARE_DEFAULT_P, seed: int = 0,
                 base: str = "task-arithmetic") -> dict[str, dict[str, torch.Tensor]]:
    """The one DARE-merged vector (alpha = 1: the caller scales it), read in the mapping's order."""
    return {"dare": dare_merge(vectors.values(), p=p, seed=seed, base=base)}


MERGE_METHODS.register("dare", MergeMethod.of(_dare_method, label="DARE",
                                              reference_url="https://arxiv.org/abs/2311.03099", help={
    "p": "drop rate: each entry of each vector is dropped with probability p, survivors divided by 1 - p",
    "seed": "seed of the random drop",
    "base": "how the sparsified vectors are combined: task-arithmetic (their sum) or ties (sign election, "
            "disjoint mean)"}))
