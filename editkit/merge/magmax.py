"""MagMax: per entry, the task-vector value of largest magnitude.

MagMax (Marczak et al., ECCV 2024, "MagMax: Leveraging Model Merging for Seamless
Continual Learning") merges task vectors by keeping, for every parameter entry, the
value (with its sign) of the vector whose entry has the largest absolute value:
``tau[j] = tau_t*[j]`` with ``t* = argmax_t |tau_t[j]|``. As in the authors' code
(``merge_max_abs``), the vectors are folded in order and a later vector wins a tie of
magnitudes (``|tau_t[j]| >= |running[j]|``).

Memory: the running selection and one input vector.

The paper scales the merged vector by 0.5 in its released scripts; here, as for every
method, the merged vector is scaled by alpha (1, or tuned on validation by the bench).
The paper's continual variant fine-tunes each task from the previous task's weights
(sequential fine-tuning) before this merge; that is a way of training the vectors, not
of merging them, so it is a mode (``sequential``, ``editkit.core.modes``), not part of this method.

Registered as the merge method ``magmax``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

import torch

from editkit.merge import MERGE_METHODS, MergeMethod, Vector, checked

log = logging.getLogger(__name__)


def magmax_merge(vectors: Iterable[Vector]) -> dict[str, torch.Tensor]:
    """Per entry, the value of largest magnitude across ``vectors`` (later vectors win ties)."""
    selected: dict[str, torch.Tensor] = {}
    count = 0
    for vector in checked(vectors, "MagMax"):
        count += 1
        for key, t in vector.items():
            running = selected.get(key)
            selected[key] = t.clone() if running is None else torch.where(t.abs() >= running.abs(), t, running)
    log.info("MagMax-merged %d vectors", count)
    return selected


def _magmax_method(vectors: Mapping[str, Vector]) -> dict[str, dict[str, torch.Tensor]]:
    """The one MagMax vector (alpha = 1: the caller scales it), read in the mapping's order."""
    return {"magmax": magmax_merge(vectors.values())}


MERGE_METHODS.register("magmax", MergeMethod.of(_magmax_method, label="MagMax", order_dependent=True,
                                                reference_url="https://arxiv.org/abs/2407.06322"))
