"""What a stream does with its bank between experiences: where the next fine-tuning starts, and the merged
vector it scores after each one.

Both depend on the mode (``editkit.core.modes``). Vectors trained from theta_0 start there and are scored by
their sum at alpha = 1 (task arithmetic, the paper's recipe). ``sequential`` vectors (MagMax's continual
recipe) start from the previous experience's weights, theta_0 + tau_{t-1}, and are scored by their MagMax
merge. A stream may name another merge method (:class:`StreamMerge`: a scenario's ``[merge]`` table,
``editkit stream --merge``); the merged model after each experience is then that method over every banked
vector, at alpha = 1. editkit's stream and its Avalanche plugin both ask here, so they bank and score alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from editkit.bank.store import Bank
from editkit.core.modes import Mode, combined_mode
from editkit.errors import BankError, ConfigError
from editkit.merge import MERGE_METHODS, method_options
from editkit.merge.arithmetic import merged_vector


def starting_vector(bank: Bank, mode: str, previous: str | None) -> dict[str, torch.Tensor] | None:
    """Where a fine-tuning in ``mode`` starts, as a task vector: None for theta_0, or, in a mode that continues
    (``sequential``), the banked vector ``previous`` of the experience before (None: there is none).

    Read from the bank, so a resumed stream starts where the interrupted one would have; refused when
    ``previous`` lives in another family (a linearized vector is not a point of the network itself)."""
    mode = Mode(mode)
    if not mode.continues or previous is None:
        return None
    entry = bank.get(previous)
    if entry.family != mode.family:
        raise BankError(f"a {mode} fine-tuning would start from {previous!r}'s weights, but that vector is "
                        f"{entry.mode}, which is not a point of the same model")
    return bank.load(previous, base=bank.base)


def banked_sum(bank: Bank, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
    """The sum of the banked vectors ``names`` at alpha = 1 (None for none): over the experiences before one, what
    its ``from_sum`` fine-tuning starts beside (read from the bank, so a resumed stream trains what the
    interrupted one would have); over them and its own, where that fine-tuning ended."""
    if not names:
        return None
    return merged_vector(bank, {n: 1.0 for n in names}, "task-arithmetic", {}).tensors


@dataclass(frozen=True)
class StreamMerge:
    """A merge method a stream scores its banked vectors with, and its options (defaults filled in)."""

    method: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, method: str, options: Mapping[str, Any] | Sequence[str] = ()) -> StreamMerge:
        """``method`` with ``options`` (``{key: value}`` or ``["key=value", ...]``), refused by name when the
        method or an option is unknown."""
        return cls(method, method_options(method, options))

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str) -> StreamMerge:
        """A scenario's ``[merge]`` table: ``method`` and that method's options."""
        options = dict(table)
        method = options.pop("method", None)
        if not isinstance(method, str):
            raise ConfigError(f"{where}: [merge] needs method = one of {', '.join(MERGE_METHODS)}")
        try:
            return cls.of(method, options)
        except ConfigError as exc:
            raise ConfigError(f"{where}: [merge]: {exc}") from None

    @property
    def is_sum(self) -> bool:
        """Whether the merged vector is the plain sum, which linearized streams score from cached tangents."""
        return self.method == "task-arithmetic"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "options": dict(self.options)}


def default_merge(mode: str) -> StreamMerge:
    """The mode's own stream merge (:attr:`~editkit.core.modes.Mode.stream_merge`: the sum; MagMax for
    ``sequential`` vectors)."""
    return StreamMerge.of(Mode(mode).stream_merge)


def stream_merge(bank: Bank, names: Sequence[str], merge: StreamMerge | None = None) -> dict[str, torch.Tensor]:
    """The vector a stream adds to theta_0 after banking ``names``: ``merge`` (default: their mode's stream
    merge) over them, at alpha = 1."""
    merge = merge or default_merge(combined_mode(bank.get(n).mode for n in names))
    return merged_vector(bank, {n: 1.0 for n in names}, merge.method, merge.options).tensors
