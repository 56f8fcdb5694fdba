"""The ways a task vector is fine-tuned, and which of them may be combined.

A :class:`~enum.StrEnum`, so a mode is written to recipes, manifests and ``report.json`` as
the same plain string it always was (``"taujp"``) and compares equal to it; code
that reads a manifest written before the enum existed needs no conversion.

A vector's *family* is the space it lives in, which is what decides whether two vectors
may be summed. ``linear`` and ``taujp`` vectors live in the tangent space of theta_0 (both
are evaluated through the linearized model) and mix. ``nonlinear``, ``taujp-nonlinear`` and
``sequential`` vectors are all theta - theta_0 of the model itself, evaluated as
f(x; theta_0 + tau): the penalty, or the starting point, changed how such a vector was found,
not what it is, so they mix too. Vectors of different families never do: the same numbers
mean different models.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable

from editkit.errors import IncompatibleVectorsError


class Mode(StrEnum):
    """``nonlinear``: plain fine-tuning; ``linear``: the linearized model;
    ``taujp``: the linearized model plus the tauJp penalty on other tasks' inputs;
    ``taujp-nonlinear``: plain fine-tuning plus the same penalty, which measures the
    vector through the Jacobian at theta_0 (the paper's suggestion for models too large
    to linearize: the penalty's jvp runs on the small reg batch only);
    ``sequential``: plain fine-tuning that starts from the previous experience's weights
    (MagMax's continual recipe, Marczak et al., ECCV 2024): experience t starts at
    theta_0 + tau_{t-1} and banks tau_t = theta_t - theta_0, and the stream merges the
    vectors by MagMax, as the paper does."""

    NONLINEAR = "nonlinear"
    LINEAR = "linear"
    TAUJP = "taujp"
    TAUJP_NONLINEAR = "taujp-nonlinear"
    SEQUENTIAL = "sequential"

    @property
    def linearized(self) -> bool:
        """Trained (and evaluated) in the tangent space of theta_0."""
        return self in (Mode.LINEAR, Mode.TAUJP)

    @property
    def family(self) -> Family:
        """What decides which vectors may be combined (see the module docstring)."""
        return Family.LINEARIZED if self.linearized else Family.NONLINEAR

    @property
    def penalized(self) -> bool:
        """Fine-tuned with the tauJp penalty (when its weight lambda is positive)."""
        return self in (Mode.TAUJP, Mode.TAUJP_NONLINEAR)

    @property
    def continues(self) -> bool:
        """Each experience starts from the previous experience's weights rather than from theta_0."""
        return self is Mode.SEQUENTIAL

    @property
    def stream_merge(self) -> str:
        """The merge method (``editkit.merge.MERGE_METHODS``) a stream scores its merged model with, at alpha = 1.

        Task arithmetic for vectors trained from theta_0. Sequential vectors each already hold the
        previous tasks' updates, so their sum counts early tasks many times over; MagMax, made for
        them, keeps per entry the largest update."""
        return "magmax" if self is Mode.SEQUENTIAL else "task-arithmetic"


#: The three modes the paper compares (what ``editkit bench`` runs unless told otherwise).
PAPER_MODES: tuple[Mode, ...] = (Mode.NONLINEAR, Mode.LINEAR, Mode.TAUJP)


class Family(StrEnum):
    """The two spaces task vectors live in; vectors of one family may be summed."""

    LINEARIZED = "linearized"
    NONLINEAR = "nonlinear"

    @property
    def modes(self) -> tuple[Mode, ...]:
        """The modes whose vectors live in this space."""
        return tuple(m for m in Mode if m.family is self)

    @property
    def plain_mode(self) -> Mode:
        """The family's mode without the penalty: how a mixed combination is recorded."""
        return Mode.LINEAR if self is Family.LINEARIZED else Mode.NONLINEAR


def mode_family(mode: str) -> Family:
    """``Family.LINEARIZED`` or ``Family.NONLINEAR`` (equal to the strings ``"linearized"`` / ``"nonlinear"``)."""
    return Mode(mode).family


def families_help() -> str:
    """Which modes mix, for error messages: ``linearized: linear, taujp; nonlinear: nonlinear, taujp-nonlinear,
    sequential``."""
    return "; ".join(f"{family}: {', '.join(family.modes)}" for family in Family)


def combined_mode(modes: Iterable[str]) -> Mode:
    """The mode a combination of vectors of ``modes`` is recorded and evaluated as.

    Their mode when they share one; otherwise the plain mode of their family (``linear`` /
    ``nonlinear``): the sum lives in that family's space, and the penalty describes how each
    input was trained, which a mix of penalised and plain vectors no longer has one answer to.
    """
    modes = {Mode(m) for m in modes}
    if not modes:
        raise ValueError("no modes to combine")
    if len(modes) == 1:
        return modes.pop()
    families = {m.family for m in modes}
    if len(families) > 1:
        raise IncompatibleVectorsError(
            f"cannot combine {', '.join(sorted(modes))} vectors: one family at a time ({families_help()})")
    return families.pop().plain_mode
