"""The three ways a task vector is fine-tuned, and which of them may be combined.

A :class:`~enum.StrEnum`, so a mode is written to recipes, manifests and ``report.json`` as
the same plain string it always was (``"taujp"``) and compares equal to it; code
that reads a manifest written before the enum existed needs no conversion.

``linear`` and ``taujp`` vectors live in the same tangent space of theta_0 (both are
evaluated through the linearized model), so they belong to one *family* and may be
summed; a ``nonlinear`` vector lives in weight space and never mixes with them.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """``nonlinear``: plain fine-tuning; ``linear``: the linearized model;
    ``taujp``: the linearized model plus the tauJp penalty on other tasks' inputs."""

    NONLINEAR = "nonlinear"
    LINEAR = "linear"
    TAUJP = "taujp"

    @property
    def linearized(self) -> bool:
        """Trained (and evaluated) in the tangent space of theta_0."""
        return self is not Mode.NONLINEAR

    @property
    def family(self) -> Family:
        """What decides which vectors may be combined (see the module docstring)."""
        return Family.LINEARIZED if self.linearized else Family.NONLINEAR

    @property
    def penalized(self) -> bool:
        """Fine-tuned with the tauJp penalty (when its weight lambda is positive)."""
        return self is Mode.TAUJP


class Family(StrEnum):
    """The two spaces task vectors live in; vectors of one family may be summed."""

    LINEARIZED = "linearized"
    NONLINEAR = "nonlinear"


def mode_family(mode: str) -> Family:
    """``Family.LINEARIZED`` or ``Family.NONLINEAR`` (equal to the strings ``"linearized"`` / ``"nonlinear"``)."""
    return Mode(mode).family
