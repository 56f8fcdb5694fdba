"""What a stream does with its bank between experiences: where the next fine-tuning starts, and the merged
vector it scores after each one.

Both depend on the mode (``editkit.core.modes``). Vectors trained from theta_0 start there and are scored by
their sum at alpha = 1 (task arithmetic, the paper's recipe). ``sequential`` vectors (MagMax's continual
recipe) start from the previous experience's weights, theta_0 + tau_{t-1}, and are scored by their MagMax
merge. editkit's stream and its Avalanche plugin both ask here, so they bank and score alike.
"""

from __future__ import annotations

from typing import Sequence

import torch

from editkit.bank.store import Bank
from editkit.core.modes import Mode, combined_mode
from editkit.errors import BankError
from editkit.merge import method_options
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


def stream_merge(bank: Bank, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The vector a stream adds to theta_0 after banking ``names``: at alpha = 1, merged by their mode's stream
    merge (:attr:`~editkit.core.modes.Mode.stream_merge`: the sum; MagMax for ``sequential`` vectors)."""
    method = combined_mode(bank.get(n).mode for n in names).stream_merge
    return merged_vector(bank, {n: 1.0 for n in names}, method, method_options(method, {})).tensors
