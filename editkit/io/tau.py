"""A combination of banked vectors as one bare tensor file (``editkit add / negate --out FILE --tau-only``).

The file is safetensors: the combined delta under the backbone module's parameter names (what
``module.load_state_dict`` would add to), its mode and coefficients in the header, so a reader knows whether it is
a linearized model's delta (which only f_lin applies exactly) and what made it. Written whole or not at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from editkit.io.targets import check_file_target
from editkit.util.atomic import atomic_path


def write_tau(tensors: Mapping[str, torch.Tensor], out: Path | str, *, mode: str, coefficients: Mapping[str, float],
              force: bool = False) -> Path:
    """Write ``tensors`` to the file ``out`` (refused first as :func:`~editkit.io.targets.check_file_target` says)."""
    out = check_file_target(out, force=force)
    with atomic_path(out) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"mode": mode, "coefficients": json.dumps(dict(coefficients))})
    return out
